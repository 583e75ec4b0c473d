#pragma once
// The Prometheus endpoint (config `metrics:`), served by prometheus-cpp's
// exposer on its own threads. A scrape asks the control thread for a
// snapshot (the counters that exist, read as the control views read them)
// and waits for it at most kScrapeDeadline; nothing is counted per packet
// or per interrupt for it. Names follow Prometheus' conventions: sriovd_
// prefix, _total for counters, base units, labels pf, vf, device, queue,
// vector.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/metric_family.h>

#include "sriovd/util/asio.hpp"

namespace prometheus {
class Exposer;
}

namespace sriovd::daemon {

class MetricsServer {
 public:
  using Snapshot = std::function<std::vector<prometheus::MetricFamily>()>;
  static constexpr std::chrono::seconds kScrapeDeadline{2};
  // Listens on `listen` ("127.0.0.1:9808"); `snapshot` runs
  // on `io`'s thread. Throws naming the address when it cannot listen.
  MetricsServer(asio::io_context& io, const std::string& listen, Snapshot snapshot);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  [[nodiscard]] const std::string& listen() const { return listen_; }
  [[nodiscard]] int port() const;  // the port bound (for ":0" in tests)

 private:
  class Collector;
  std::string listen_;
  std::shared_ptr<Collector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

// A family of one type; add() appends one sample with its labels.
struct Family {
  prometheus::MetricFamily f;
  Family(std::string name, std::string help, prometheus::MetricType type);
  Family& add(std::vector<std::pair<std::string, std::string>> labels, double value);
};

}  // namespace sriovd::daemon
