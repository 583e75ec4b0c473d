#include "sriovd/vfio/holders.hpp"

#include <pthread.h>

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <fstream>

#include "sriovd/util/printable.hpp"

namespace sriovd::vfio {

namespace {

constexpr const char* kDeviceInode = "anon_inode:[vfio-device]";

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') out.emplace_back(e->d_name);
  ::closedir(d);
  return out;
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string link_of(const std::string& path) {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink(path.c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The fdinfo's device, or "" when the kernel does not print it.
std::string syspath_of(const std::string& fdinfo) {
  std::ifstream in(fdinfo);
  static const std::string key = "vfio-device-syspath:";
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key, 0) != 0) continue;
    std::string path = line.substr(key.size());
    path.erase(0, path.find_first_not_of(" \t"));
    while (!path.empty() && (path.back() == ' ' || path.back() == '/')) path.pop_back();
    return path;
  }
  return {};
}

}  // namespace

std::vector<Holder> device_holders(const std::string& device, std::span<const pid_t> given_to,
                                   const std::string& proc) {
  std::vector<Holder> out;
  const pid_t self = ::getpid();
  for (const std::string& p : entries(proc)) {
    if (!all_digits(p)) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(p));
    if (pid == self) continue;
    const bool given = std::find(given_to.begin(), given_to.end(), pid) != given_to.end();
    const std::string base = proc + "/" + p;
    std::string comm;
    auto add = [&](std::string what) {
      if (comm.empty()) comm = first_line(base + "/comm");
      out.push_back({pid, comm, std::move(what)});
    };
    for (const std::string& fd : entries(base + "/fd")) {
      if (link_of(base + "/fd/" + fd) != kDeviceInode) continue;
      const std::string sys = syspath_of(base + "/fdinfo/" + fd);
      if (!sys.empty()) {
        // The syspath ends with the device's address.
        const size_t slash = sys.rfind('/');
        if (sys.substr(slash == std::string::npos ? 0 : slash + 1) == device) add("fd " + fd);
      } else if (given) {
        add("fd " + fd + " (a VFIO device fd; the kernel does not say which)");
      }
    }
    if (!given) continue;
    std::ifstream maps(base + "/maps");
    for (std::string line; std::getline(maps, line);) {
      if (line.find("[vfio-device]") == std::string::npos) continue;
      add("a BAR mapping");
      break;
    }
  }
  // By pid, as a reader expects (a directory lists in no order).
  std::stable_sort(out.begin(), out.end(), [](const Holder& a, const Holder& b) { return a.pid < b.pid; });
  return out;
}

std::string describe(const std::vector<Holder>& holders) {
  std::string s;
  for (const Holder& h : holders) {
    if (!s.empty()) s += ", ";
    // A process names itself (prctl): escaped, it cannot forge a log line.
    s += "pid " + std::to_string(h.pid) + " (" + (h.comm.empty() ? "?" : printable(h.comm, 16)) + ") " + h.what;
  }
  return s;
}

HolderSurvey::HolderSurvey(std::chrono::milliseconds interval, Walk walk)
    : interval_(interval),
      walk_(walk ? std::move(walk)
                 : Walk([](const std::string& d, std::span<const pid_t> g) { return device_holders(d, g); })) {
  thread_ = std::thread([this] { run(); });
  pthread_setname_np(thread_.native_handle(), "sriovd-holders");
}

HolderSurvey::~HolderSurvey() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void HolderSurvey::watch(std::map<std::string, std::vector<pid_t>> devices) {
  std::lock_guard lock(mu_);
  devices_ = std::move(devices);
  std::erase_if(seen_, [&](const auto& s) { return !devices_.contains(s.first); });
}

HolderSurvey::Seen HolderSurvey::seen(const std::string& device) {
  std::lock_guard lock(mu_);
  if (!asked_) {
    asked_ = true;
    cv_.notify_all();
  }
  const auto it = seen_.find(device);
  return it == seen_.end() ? Seen{} : it->second;
}

uint64_t HolderSurvey::surveys() const {
  std::lock_guard lock(mu_);
  return surveys_;
}

void HolderSurvey::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (asked_ && !devices_.empty()); });
    if (stop_) return;
    asked_ = false;
    const auto devices = devices_;
    lock.unlock();
    std::map<std::string, Seen> fresh;
    for (const auto& [device, given] : devices)
      fresh[device] = {walk_(device, given), std::chrono::steady_clock::now()};
    lock.lock();
    for (auto& [device, s] : fresh)
      if (devices_.contains(device)) seen_[device] = std::move(s);
    ++surveys_;
    // At most one survey per interval, however often a status is asked for.
    if (cv_.wait_for(lock, interval_, [&] { return stop_; })) return;
  }
}

}  // namespace sriovd::vfio
