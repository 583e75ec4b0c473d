#pragma once
// Destroys what the control thread lets go of on a thread of its own.
//
// Closing a tap, a macvtap or a socket bound to a netdev waits in the
// kernel for RCU grace periods (tun_chr_close: synchronize_net, then
// rcu_barrier when the tap's last queue goes and the netdev is
// unregistered). On a loaded machine that took 1-4.6 s here, and done on the
// control thread it held every control request, every vfio-user and
// vhost-user message of every other device, for as long. Handed to the
// Retirer, it costs the control thread a queue push.
//
// Each thing retired carries a key (the netdev it holds): whoever is about
// to take that netdev again waits for it to be gone, or asks to be told
// when it is.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace sriovd {

class Retirer {
 public:
  // Called on the retirer's thread after the last thing under `key` is
  // destroyed (a daemon posts its retry to its io_context from here).
  using OnGone = std::function<void(const std::string& key)>;

  explicit Retirer(const std::string& thread_name = "sriovd-retire");
  // Destroys everything still queued, then ends the thread.
  ~Retirer();
  Retirer(const Retirer&) = delete;
  Retirer& operator=(const Retirer&) = delete;

  void set_on_gone(OnGone on_gone);
  // Queues `what` for destruction (a unique_ptr converts: its deleter
  // comes along). Destructors run one at a time, in the order retired.
  void retire(const std::string& key, std::shared_ptr<void> what);
  // Waits until nothing under `key` (every key when `key` is empty; those
  // that start with it when `prefix`) is left, at most `limit`; true when
  // none is.
  bool wait_gone(const std::string& key, std::chrono::milliseconds limit, bool prefix = false);
  [[nodiscard]] uint64_t retired() const;

 private:
  void run();
  [[nodiscard]] bool any_pending(const std::string& key, bool prefix) const;  // under mutex_

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;  // something queued, or stop
  std::condition_variable gone_cv_;  // something destroyed
  std::deque<std::pair<std::string, std::shared_ptr<void>>> queue_;
  std::map<std::string, unsigned> pending_;  // key -> queued or being destroyed
  OnGone on_gone_;
  uint64_t retired_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace sriovd
