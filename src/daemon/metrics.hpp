#pragma once
// The Prometheus endpoint (config `metrics:`): GET /metrics over HTTP/1.1,
// served on the control thread (asio) in the text exposition format
// (prometheus-cpp's serializer). A scrape takes a snapshot there (the
// counters that exist, read as the control views read them); nothing is
// counted per packet or per interrupt for it. Names follow Prometheus'
// conventions: sriovd_ prefix, _total for counters, base units, labels pf,
// vf, device, queue, vector.
//
// Any local user can connect, so no client may hold the endpoint: a
// request must arrive whole within kRequestDeadline and in kMaxRequest
// bytes, an answer be taken within kAnswerDeadline, and of kMaxConnections
// open at once a new one pushes out the oldest that has not sent its
// request, taken from the address that holds the most of those (a local
// flood pushes out its own connections, not a scraper's). Every close for
// one of these reasons is counted (sriovd_metrics_connections_closed_total).

#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/metric_family.h>

#include "sriovd/util/counters.hpp"

#include "sriovd/util/asio.hpp"

namespace sriovd::daemon {

class MetricsServer {
 public:
  using Snapshot = std::function<std::vector<prometheus::MetricFamily>()>;
  static constexpr std::chrono::seconds kRequestDeadline{2};
  static constexpr std::chrono::seconds kAnswerDeadline{5};
  static constexpr size_t kMaxRequest = 8192;
  static constexpr size_t kMaxConnections = 64;

  // Listens on `listen` ("127.0.0.1:9808"); `snapshot` runs on `io`'s
  // thread, as everything here does. Throws naming the address when it
  // cannot listen.
  MetricsServer(asio::io_context& io, const std::string& listen, Snapshot snapshot);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  [[nodiscard]] const std::string& listen() const { return listen_; }
  [[nodiscard]] int port() const;  // the port bound (for ":0" in tests)

  struct Closed {  // connections closed by the limits above, by reason
    uint64_t request_deadline = 0, too_large = 0, bad_request = 0, pushed_out = 0, answer_deadline = 0;
  };
  [[nodiscard]] const Closed& closed() const { return closed_; }

 private:
  class Connection;
  void accept_next();
  void admit(asio::ip::tcp::socket socket);
  void forget(Connection* c);
  std::string answer(const std::string& request_line);

  std::string listen_;
  Snapshot snapshot_;
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer retry_;                            // an accept again after a failed one
  std::list<std::shared_ptr<Connection>> connections_;  // oldest first
  Closed closed_;
};

// A family of one type; add() appends one sample with its labels.
struct Family {
  prometheus::MetricFamily f;
  Family(std::string name, std::string help, prometheus::MetricType type);
  Family& add(const std::vector<std::pair<std::string, std::string>>& labels, double value);
};

// A family per counter of a stats struct's table (util/counters.hpp),
// named PREFIX_NAME_total, each sample read from the struct by its field.
template <typename T, size_t N>
class TypedCounters {
 public:
  TypedCounters(const std::string& prefix, const Counter<T> (&table)[N]) : table_(table) {
    for (const Counter<T>& c : table)
      families_.emplace_back(prefix + "_" + c.name + "_total", c.help, prometheus::MetricType::Counter);
  }
  void add(const std::vector<std::pair<std::string, std::string>>& labels, const T& value) {
    for (size_t i = 0; i < N; ++i) families_[i].add(labels, static_cast<double>(value.*table_[i].field));
  }
  void into(std::vector<prometheus::MetricFamily>& out) {
    for (auto& fam : families_) out.push_back(std::move(fam.f));
  }

 private:
  const Counter<T> (&table_)[N];
  std::vector<Family> families_;
};

}  // namespace sriovd::daemon
