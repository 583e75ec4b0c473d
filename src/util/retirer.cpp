#include "sriovd/util/retirer.hpp"

#include <pthread.h>

namespace sriovd {

Retirer::Retirer(const std::string& thread_name) {
  thread_ = std::thread([this] { run(); });
  pthread_setname_np(thread_.native_handle(), thread_name.substr(0, 15).c_str());
}

Retirer::~Retirer() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

void Retirer::set_on_gone(OnGone on_gone) {
  std::lock_guard lock(mutex_);
  on_gone_ = std::move(on_gone);
}

void Retirer::retire(const std::string& key, std::shared_ptr<void> what) {
  if (!what) return;
  {
    std::lock_guard lock(mutex_);
    queue_.emplace_back(key, std::move(what));
    ++pending_[key];
  }
  work_cv_.notify_one();
}

bool Retirer::any_pending(const std::string& key, bool prefix) const {
  if (key.empty()) return !pending_.empty();
  if (!prefix) return pending_.count(key) != 0;
  const auto it = pending_.lower_bound(key);
  return it != pending_.end() && it->first.compare(0, key.size(), key) == 0;
}

bool Retirer::wait_gone(const std::string& key, std::chrono::milliseconds limit, bool prefix) {
  std::unique_lock lock(mutex_);
  return gone_cv_.wait_for(lock, limit, [&] { return !any_pending(key, prefix); });
}

uint64_t Retirer::retired() const {
  std::lock_guard lock(mutex_);
  return retired_;
}

// Everything queued is destroyed, also after stop: what was retired is
// never leaked (a tap's netdev, an XDP program on a VF).
void Retirer::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, nothing left
    auto [key, what] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    what.reset();  // the destructor: the slow part, off the lock
    lock.lock();
    ++retired_;
    bool gone = false;
    if (auto it = pending_.find(key); it != pending_.end() && --it->second == 0) {
      pending_.erase(it);
      gone = true;
    }
    gone_cv_.notify_all();
    if (gone && on_gone_) {
      const OnGone notify = on_gone_;
      lock.unlock();
      notify(key);
      lock.lock();
    }
  }
}

}  // namespace sriovd
