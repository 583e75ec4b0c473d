#include "sriovd/vduse/backend.hpp"

#include <fcntl.h>
#include <linux/vdpa.h>
#include <linux/vduse.h>
#include <netlink/genl/ctrl.h>
#include <netlink/genl/genl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <mutex>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "sriovd/util/error.hpp"

namespace sriovd::vduse {

namespace fs = std::filesystem;

namespace {

constexpr const char* kControl = "/dev/vduse/control";
constexpr const char* kBus = "/sys/bus/vdpa";
constexpr uint32_t kVirtioVendor = 0x1af4;
constexpr uint32_t kVqAlign = 4096;
constexpr uint8_t kStatusDriverOk = 4;
// What one device may make this process map of the kernel's DMA domain (the
// bounce buffer is 64 MiB by default, the rings a few pages each).
constexpr size_t kMaxMappings = 256;
constexpr uint64_t kMaxMappedBytes = 1ULL << 30U;

std::string errno_text(int err) { return std::strerror(err); }

// The vdpa generic netlink family: DEV_NEW on the "vduse" management
// device, or DEV_DEL. Throws naming the device and the kernel's answer;
// `missing_ok`: a device already gone is no error.
void vdpa_command(uint8_t cmd, const std::string& name, bool missing_ok = false) {
  std::unique_ptr<nl_sock, void (*)(nl_sock*)> sk(nl_socket_alloc(), nl_socket_free);
  if (!sk) throw std::bad_alloc();
  const char* what = cmd == VDPA_CMD_DEV_NEW ? "adding" : "removing";
  if (int err = genl_connect(sk.get()); err < 0)
    throw std::runtime_error(std::string("generic netlink: ") + nl_geterror(err));
  const int family = genl_ctrl_resolve(sk.get(), VDPA_GENL_NAME);
  if (family < 0)
    throw std::runtime_error(std::string(what) + " vDPA device " + name +
                             ": the kernel has no vDPA bus (load the vdpa module)");
  std::unique_ptr<nl_msg, void (*)(nl_msg*)> msg(nlmsg_alloc(), nlmsg_free);
  if (!msg) throw std::bad_alloc();
  if (!genlmsg_put(msg.get(), NL_AUTO_PORT, NL_AUTO_SEQ, family, 0, NLM_F_REQUEST | NLM_F_ACK, cmd, VDPA_GENL_VERSION))
    throw std::runtime_error("vdpa netlink: cannot build the message");
  if (cmd == VDPA_CMD_DEV_NEW) nla_put_string(msg.get(), VDPA_ATTR_MGMTDEV_DEV_NAME, "vduse");
  nla_put_string(msg.get(), VDPA_ATTR_DEV_NAME, name.c_str());
  const int err = nl_send_sync(sk.get(), msg.release());  // frees the message
  if (err == 0) return;
  if (missing_ok && err == -NLE_NODEV) return;
  throw std::runtime_error(std::string(what) + " vDPA device " + name + " on the bus: " + nl_geterror(err));
}

void write_sysfs(const std::string& path, const std::string& value) {
  const UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) throw_errno("opening " + path);
  if (::write(fd.get(), value.data(), value.size()) != static_cast<ssize_t>(value.size()))
    throw_errno("writing '" + value + "' to " + path);
}

std::string bound_driver(const std::string& name) {
  std::error_code ec;
  const fs::path link = fs::read_symlink(fs::path(kBus) / "devices" / name / "driver", ec);
  return ec ? std::string() : link.filename().string();
}

void write_journal(const std::string& path, const std::vector<std::string>& names) {
  const std::string tmp = path + ".tmp";
  {
    const UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) throw_errno("writing " + tmp);
    std::string text;
    for (const auto& n : names) text += n + "\n";
    if (::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()) || ::fsync(fd.get()) != 0)
      throw_errno("writing " + tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw_errno("renaming " + tmp + " to " + path);
}

// Journal writes come from session threads and from background removals.
std::mutex& journal_mutex() {
  static std::mutex m;
  return m;
}

void journal_add(const std::string& path, const std::string& name) {
  const std::lock_guard lock(journal_mutex());
  auto names = read_journal(path);
  if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  write_journal(path, names);
}

void journal_remove(const std::string& path, const std::string& name) {
  const std::lock_guard lock(journal_mutex());
  auto names = read_journal(path);
  std::erase(names, name);
  write_journal(path, names);
}

// A helper thread runs `op` while `serve` is called on this one until it
// is done; what `op` threw is rethrown here.
void run_serving(const std::function<void()>& op, const std::function<void(int timeout_ms)>& serve) {
  std::atomic<bool> done{false};
  std::exception_ptr failed;
  std::thread helper([&] {
    try {
      op();
    } catch (...) {
      failed = std::current_exception();
    }
    done.store(true, std::memory_order_release);
  });
  while (!done.load(std::memory_order_acquire)) serve(20);
  helper.join();
  serve(0);  // what the operation's last steps asked
  if (failed) std::rethrow_exception(failed);
}

// Answers every request on a device fd nobody serves (a crashed run's
// device being removed): OK, a queue at its start.
void answer_blank(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return;
  vduse_dev_request req{};
  while (::read(fd, &req, sizeof req) == static_cast<ssize_t>(sizeof req)) {
    vduse_dev_response resp{};
    resp.request_id = req.request_id;
    resp.result = VDUSE_REQ_RESULT_OK;
    if (req.type == VDUSE_GET_VQ_STATE) resp.vq_state.index = req.vq_state.index;
    (void)!::write(fd, &resp, sizeof resp);
  }
}

// The processes that have `path` open ("PID (COMM)"), from /proc/*/fd.
std::vector<std::string> holders_of(const std::string& path) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& p : fs::directory_iterator("/proc", ec)) {
    const std::string pid = p.path().filename().string();
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::error_code fd_ec;
    for (const auto& fd : fs::directory_iterator(p.path() / "fd", fd_ec)) {
      std::error_code link_ec;
      if (fs::read_symlink(fd.path(), link_ec) != path) continue;
      std::ifstream comm(p.path() / "comm");
      std::string name;
      std::getline(comm, name);
      out.push_back(pid + " (" + name + ")");
      break;
    }
  }
  return out;
}

// The vhost-vdpa character device the driver made of `name`, if any.
std::string vhost_vdpa_node(const std::string& name) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(kBus) / "devices" / name, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("vhost-vdpa-", 0) == 0) return "/dev/" + n;
  }
  return {};
}

// VDUSE_DESTROY_DEV, once the kernel has let go of the device (a moment
// after its fd closed: EBUSY until then). Throws naming the kernel's answer.
void destroy_vduse(const std::string& name) {
  const UniqueFd control(::open(kControl, O_RDWR | O_CLOEXEC));
  if (!control) throw_errno(std::string("opening ") + kControl);
  uint64_t version = VDUSE_API_VERSION;
  (void)::ioctl(control.get(), VDUSE_SET_API_VERSION, &version);
  int err = 0;
  for (int i = 0; i < 50; ++i) {
    err = ::ioctl(control.get(), VDUSE_DESTROY_DEV, name.c_str()) == 0 ? 0 : errno;
    if (err != EBUSY) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (err != 0 && err != ENOENT) throw std::runtime_error("destroying VDUSE device " + name + ": " + errno_text(err));
}

// Off the bus (its requests answered blank meanwhile: `dev`, if open),
// destroyed, out of the journal. Throws naming what failed.
void remove_device(const std::string& name, UniqueFd dev, const std::string& journal) {
  if (dev) {
    run_serving([&] { vdpa_command(VDPA_CMD_DEV_DEL, name, true); },
                [&](int timeout_ms) { answer_blank(dev.get(), timeout_ms); });
    dev.reset();  // the kernel lets go of the device a moment after its fd closes
  } else {
    vdpa_command(VDPA_CMD_DEV_DEL, name, true);
  }
  destroy_vduse(name);
  journal_remove(journal, name);
}

// A vhost-vdpa device a process still holds leaves the bus only when it is
// closed (the kernel waits for that): its removal goes on in the
// background, with nothing of the daemon waiting for it; true when that is
// how it goes.
bool remove_when_let_go(const std::string& name, UniqueFd& dev, const std::string& journal) {
  const std::string node = vhost_vdpa_node(name);
  if (node.empty()) return false;
  const std::vector<std::string> holders = holders_of(node);
  if (holders.empty()) return false;
  std::string who;
  for (const auto& h : holders) who += (who.empty() ? "" : ", ") + h;
  spdlog::error("vduse: {}: {} is still open by {}: the device leaves the vDPA bus when they close it", name, node,
                who);
  std::thread([name, dev = std::move(dev), journal]() mutable {
    try {
      remove_device(name, std::move(dev), journal);
      spdlog::info("vduse: {} left the vDPA bus once its holder let go", name);
    } catch (const std::exception& e) {
      spdlog::error("vduse: {}", e.what());
    }
  }).detach();
  return true;
}

}  // namespace

const char* driver_name(Bind b) { return b == Bind::netdev ? "virtio_vdpa" : "vhost_vdpa"; }

bool available(Bind bind, std::string& why) {
  if (::access(kControl, R_OK | W_OK) != 0) {
    why = std::string(kControl) + ": " + errno_text(errno) +
          " (this kernel has no VDUSE loaded: modprobe vduse, CONFIG_VDPA_USER)";
    return false;
  }
  const fs::path driver = fs::path(kBus) / "drivers" / driver_name(bind);
  std::error_code ec;
  if (!fs::exists(driver, ec)) {
    why = std::string("the vDPA driver ") + driver_name(bind) + " is not loaded (modprobe " + driver_name(bind) + ")";
    return false;
  }
  return true;
}

std::vector<std::string> read_journal(const std::string& path) {
  std::vector<std::string> names;
  std::ifstream in(path);
  if (!in) {
    if (errno == ENOENT) return names;
    throw_errno("reading " + path);
  }
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) names.push_back(line);
  return names;
}

Backend::Backend(asio::io_context& io, std::string name, virtio::Device& device, irq::Engine& engine, Bind bind,
                 std::string journal)
    : io_(io), name_(std::move(name)), device_(device), engine_(engine), bind_(bind), journal_(std::move(journal)) {
  if (name_.empty() || name_.size() >= VDUSE_NAME_MAX)
    throw std::runtime_error("VDUSE device name '" + name_ + "' is empty or too long");
  std::string why;
  if (!available(bind_, why)) throw std::runtime_error(why);
  try {
    create();
    watch_requests();
    watch_misses();
    serve_while([this] { vdpa_command(VDPA_CMD_DEV_NEW, name_); });
    on_bus_ = true;
    bind_driver();
    find_kernel_device();
  } catch (...) {
    destroy();
    throw;
  }
  spdlog::info("vduse: {} on the vDPA bus, bound to {} ({})", name_, driver_name(bind_), kernel_device_);
}

Backend::~Backend() { destroy(); }

void Backend::create() {
  control_ = UniqueFd(::open(kControl, O_RDWR | O_CLOEXEC));
  if (!control_) throw_errno(std::string("opening ") + kControl);
  uint64_t version = VDUSE_API_VERSION;
  if (::ioctl(control_.get(), VDUSE_SET_API_VERSION, &version) != 0) throw_errno("VDUSE_SET_API_VERSION 0");

  // The device as the kernel sees it: what the device offers, with
  // ACCESS_PLATFORM (the kernel's DMA domain is its IOMMU) - the rest is
  // the device's to decide (a network device without a control queue
  // offers none: the kernel takes none from VDUSE).
  features_ = device_.offered_features() | virtio::kAccessPlatform;
  const size_t config_size = device_.config_size();
  std::vector<uint8_t> buf(sizeof(vduse_dev_config) + config_size);
  auto* cfg = reinterpret_cast<vduse_dev_config*>(buf.data());
  std::strncpy(cfg->name, name_.c_str(), VDUSE_NAME_MAX - 1);
  cfg->vendor_id = kVirtioVendor;
  cfg->device_id = device_.device_id();
  cfg->features = features_;
  cfg->vq_num = device_.num_queues();
  cfg->vq_align = kVqAlign;
  cfg->config_size = static_cast<uint32_t>(config_size);
  device_.read_config(0, cfg->config, config_size);

  // Recorded before the kernel has it: a crash from here on is cleaned up.
  journal_add(journal_, name_);
  if (::ioctl(control_.get(), VDUSE_CREATE_DEV, cfg) != 0) {
    const int err = errno;
    journal_remove(journal_, name_);
    if (err == EEXIST)
      throw std::runtime_error("a VDUSE device named " + name_ +
                               " exists already (another sriovd instance's, or not sriovd's)");
    throw std::runtime_error("creating VDUSE device " + name_ + ": " + errno_text(err) +
                             (err == EINVAL ? " (the kernel refused its type, features or config)" : ""));
  }
  created_ = true;

  const std::string node = "/dev/vduse/" + name_;
  dev_ = UniqueFd(::open(node.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC));
  if (!dev_) throw_errno("opening " + node);

  kicks_.resize(device_.num_queues());
  calls_.resize(device_.num_queues());
  call_watch_.resize(device_.num_queues());
  for (unsigned q = 0; q < device_.num_queues(); ++q) {
    vduse_vq_config vq{};
    vq.index = q;
    vq.max_size = device_.max_queue_size();
    if (::ioctl(dev_.get(), VDUSE_VQ_SETUP, &vq) != 0) throw_errno(node + ": VDUSE_VQ_SETUP " + std::to_string(q));
    kicks_[q] = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    calls_[q] = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!kicks_[q] || !calls_[q]) throw_errno("eventfd");
    // The queue's interrupt: a route of the engine whose sink is ours,
    // read here and injected (VDUSE has no irqfd).
    routes_.push_back(engine_.add({device_.name(), q, irq::Policy::relay, nullptr}));
    engine_.set_sink(routes_.back(), UniqueFd(::dup(calls_[q].get())));
    engine_.unmask(routes_.back());
    call_watch_[q] = std::make_unique<asio::posix::stream_descriptor>(io_, ::dup(calls_[q].get()));
    watch_call(q);
  }
  memory_.set_iotlb(&iotlb_);
}

// The driver the config names, instead of whichever vDPA driver probed it.
void Backend::bind_driver() {
  const std::string want = driver_name(bind_);
  const std::string current = bound_driver(name_);
  if (current == want) return;
  const std::string dev_dir = std::string(kBus) + "/devices/" + name_;
  serve_while([&] {
    if (fs::exists(dev_dir + "/driver_override")) write_sysfs(dev_dir + "/driver_override", want);
    if (!current.empty()) write_sysfs(std::string(kBus) + "/drivers/" + current + "/unbind", name_);
    write_sysfs(std::string(kBus) + "/drivers/" + want + "/bind", name_);
  });
  if (bound_driver(name_) != want)
    throw std::runtime_error("vDPA device " + name_ + " did not bind to " + want + " (bound: " +
                             (bound_driver(name_).empty() ? std::string("none") : bound_driver(name_)) + ")");
}

void Backend::find_kernel_device() {
  const fs::path dir = fs::path(kBus) / "devices" / name_;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string n = entry.path().filename().string();
    if (bind_ == Bind::vhost_vdpa && n.rfind("vhost-vdpa-", 0) == 0) {
      kernel_device_ = "/dev/" + n;
      return;
    }
    if (bind_ == Bind::netdev && n.rfind("virtio", 0) == 0) {
      for (const auto& net : fs::directory_iterator(entry.path() / "net", ec)) {
        kernel_device_ = net.path().filename().string();
        return;
      }
    }
  }
  throw std::runtime_error("vDPA device " + name_ + " is bound to " + driver_name(bind_) + " but made no " +
                           (bind_ == Bind::netdev ? "netdev" : "vhost-vdpa device") +
                           " (the driver refused it: see the kernel log)");
}

void Backend::destroy() noexcept {
  if (on_bus_ && bind_ == Bind::vhost_vdpa) {
    try {
      UniqueFd dev(::dup(dev_.get()));
      if (remove_when_let_go(name_, dev, journal_)) {
        on_bus_ = false;
        created_ = false;  // the background removal destroys it
      }
    } catch (const std::exception& e) {
      spdlog::error("vduse: {}: {}", name_, e.what());
    }
  }
  if (on_bus_) {
    try {
      serve_while([this] { vdpa_command(VDPA_CMD_DEV_DEL, name_, true); });
    } catch (const std::exception& e) {
      spdlog::error("vduse: {}", e.what());
    }
    on_bus_ = false;
  }
  boost::system::error_code ignored;
  if (dev_watch_) dev_watch_->cancel(ignored);
  if (miss_watch_) miss_watch_->cancel(ignored);
  for (auto& w : call_watch_)
    if (w) w->cancel(ignored);
  device_.stop();
  device_.wait_for_workers();  // the mappings are ours, unmapped below
  device_.reset();
  device_.set_memory(nullptr);
  for (unsigned q = 0; q < routes_.size(); ++q) device_.set_queue_interrupt(q, std::nullopt);
  for (const irq::RouteId id : routes_) engine_.remove(id);
  routes_.clear();
  dev_watch_.reset();
  miss_watch_.reset();
  call_watch_.clear();
  dev_.reset();
  unmap_all();
  if (created_) {
    try {
      destroy_vduse(name_);
      journal_remove(journal_, name_);
    } catch (const std::exception& e) {
      spdlog::error("vduse: {} (left in the journal for the next start)", e.what());
    }
    created_ = false;
  }
}

void Backend::serve_while(const std::function<void()>& op) {
  spdlog::debug("vduse: {}: serving while the host changes", name_);
  run_serving(op, [this](int timeout_ms) {
    pollfd p{dev_.get(), POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) > 0) drain_requests();
  });
}

bool Backend::driver_ok() const { return (status_ & kStatusDriverOk) != 0; }

void Backend::watch_requests() {
  if (!dev_watch_) dev_watch_ = std::make_unique<asio::posix::stream_descriptor>(io_, ::dup(dev_.get()));
  dev_watch_->async_wait(asio::posix::stream_descriptor::wait_read, [this](boost::system::error_code ec) {
    if (ec) return;
    drain_requests();
    watch_requests();
  });
}

void Backend::drain_requests() {
  vduse_dev_request req{};
  for (;;) {
    const ssize_t n = ::read(dev_.get(), &req, sizeof req);
    if (n < 0) {
      if (errno != EAGAIN && errno != EINTR) stats_.last_error = "reading requests: " + errno_text(errno);
      return;
    }
    if (n != static_cast<ssize_t>(sizeof req)) {
      stats_.last_error = "a request of " + std::to_string(n) + " bytes";
      return;
    }
    vduse_dev_response resp{};
    resp.request_id = req.request_id;
    resp.result = VDUSE_REQ_RESULT_OK;
    spdlog::debug("vduse: {}: request {} type {} (status 0x{:x}, queue {})", name_, req.request_id, req.type,
                  req.s.status, req.vq_state.index);
    try {
      answer(req, resp);
    } catch (const std::exception& e) {
      // The device cannot do what the kernel asked: the kernel is told
      // (and fails its driver's step), the daemon goes on.
      resp.result = VDUSE_REQ_RESULT_FAILED;
      ++stats_.failed_requests;
      stats_.last_error = e.what();
      spdlog::warn("vduse: {}: request {} failed: {}", name_, req.type, e.what());
    }
    ++stats_.requests;
    if (::write(dev_.get(), &resp, sizeof resp) != static_cast<ssize_t>(sizeof resp))
      stats_.last_error = "answering the kernel: " + errno_text(errno);
    // What the status asked for, once the kernel has its answer: the
    // driver may hold the RTNL lock while it waits (virtio_net sets
    // DRIVER_OK under it), and a port's setup takes that lock.
    const Deferred what = std::exchange(deferred_, Deferred::none);
    try {
      if (what == Deferred::start) start_device();
      if (what == Deferred::reset) finish_reset();
    } catch (const std::exception& e) {
      ++stats_.failed_requests;
      stats_.last_error = e.what();
      spdlog::error("vduse: {}: {}", name_, e.what());
    }
  }
}

void Backend::answer(const vduse_dev_request& req, vduse_dev_response& resp) {
  switch (req.type) {
    case VDUSE_GET_VQ_STATE: {
      const unsigned q = req.vq_state.index;
      if (q >= device_.num_queues()) throw std::runtime_error("GET_VQ_STATE for queue " + std::to_string(q));
      // Where the queue stands, stopped (vhost_vdpa asks when its VMM
      // stops the ring: GET_VRING_BASE).
      const uint32_t base = device_.stop_queue(q);
      resp.vq_state.index = q;
      if (device_.features() & virtio::kRingPacked) {
        resp.vq_state.packed.last_avail_idx = static_cast<uint16_t>(base & 0x7fffU);
        resp.vq_state.packed.last_avail_counter = static_cast<uint16_t>((base >> 15U) & 1U);
        resp.vq_state.packed.last_used_idx = resp.vq_state.packed.last_avail_idx;
        resp.vq_state.packed.last_used_counter = resp.vq_state.packed.last_avail_counter;
      } else {
        resp.vq_state.split.avail_index = static_cast<uint16_t>(base);
      }
      return;
    }
    case VDUSE_SET_STATUS: set_status(req.s.status); return;
    case VDUSE_UPDATE_IOTLB: invalidate(req.iova.start, req.iova.last); return;
    default: throw std::runtime_error("request type " + std::to_string(req.type));
  }
}

void Backend::set_status(uint8_t status) {
  ++stats_.status_changes;
  const uint8_t before = status_;
  status_ = status;
  if (status == 0) {
    // The rings are let go before the kernel hears the device is reset;
    // the rest once it has.
    ++stats_.resets;
    device_.stop();
    if (device_.wedged() && !device_.reap()) throw std::runtime_error("the device's worker did not stop for the reset");
    deferred_ = Deferred::reset;
    return;
  }
  if ((status & kStatusDriverOk) && !(before & kStatusDriverOk)) {
    ++stats_.starts;
    deferred_ = Deferred::start;
  }
}

void Backend::start_device() {
  uint64_t features = 0;
  if (::ioctl(dev_.get(), VDUSE_DEV_GET_FEATURES, &features) != 0) throw_errno("VDUSE_DEV_GET_FEATURES");
  device_.stop();
  device_.set_features(features & features_);
  device_.set_memory(&memory_);
  for (unsigned q = 0; q < device_.num_queues(); ++q) {
    vduse_vq_info info{};
    info.index = q;
    if (::ioctl(dev_.get(), VDUSE_VQ_GET_INFO, &info) != 0) throw_errno("VDUSE_VQ_GET_INFO " + std::to_string(q));
    device_.set_queue_interrupt(q, routes_[q]);
    // A reset drops the kernel's kick eventfd: given again at each start
    // (a kick the driver made meanwhile is signalled then).
    vduse_vq_eventfd kick{};
    kick.index = q;
    kick.fd = kicks_[q].get();
    if (::ioctl(dev_.get(), VDUSE_VQ_SETUP_KICKFD, &kick) != 0)
      throw_errno("VDUSE_VQ_SETUP_KICKFD " + std::to_string(q));
    device_.set_queue_kick(q, UniqueFd(::dup(kicks_[q].get())));
    if (!info.ready) {
      device_.set_queue_enabled(q, false);
      continue;
    }
    device_.set_queue_size(q, static_cast<uint16_t>(std::min<uint32_t>(info.num, 0xffff)));
    device_.set_queue_rings(q, {info.desc_addr, info.driver_addr, info.device_addr});
    const uint32_t base = (features & virtio::kRingPacked) ? (info.packed.last_avail_idx & 0x7fffU) |
                                                                 (uint32_t{info.packed.last_avail_counter} << 15U)
                                                           : info.split.avail_index;
    device_.set_queue_base(q, base);
    device_.set_queue_enabled(q, true);
  }
  device_.start();
  spdlog::info("vduse: {}: driver ready (features 0x{:x})", name_, features);
}

void Backend::finish_reset() {
  device_.reset();
  device_.set_memory(nullptr);
  iotlb_.clear();
  iotlb_.publish();
  iotlb_.reclaim();
  memory_.clear();
  unmap_all();
}

// The kernel changed [first, last] of its DMA domain: no translation of it
// is used once this returns (the workers stop meanwhile).
void Backend::invalidate(uint64_t first, uint64_t last) {
  ++stats_.invalidations;
  if (last < first) throw std::runtime_error("UPDATE_IOTLB with an empty range");
  const bool was_running = device_.running();
  device_.stop();
  if (device_.wedged() && !device_.reap()) throw std::runtime_error("the device's worker did not stop");
  iotlb_.invalidate(first, last - first + 1);
  iotlb_.publish();
  iotlb_.reclaim();
  std::erase_if(mappings_, [&](const Mapping& m) {
    if (m.iova > last || m.iova + m.size - 1 < first) return false;
    memory_.remove_region(m.iova, m.size);
    ::munmap(m.host, m.size);
    return true;
  });
  if (was_running) device_.start();
}

void Backend::watch_misses() {
  if (!miss_watch_) miss_watch_ = std::make_unique<asio::posix::stream_descriptor>(io_, ::dup(iotlb_.miss_fd()));
  miss_watch_->async_wait(asio::posix::stream_descriptor::wait_read, [this](boost::system::error_code ec) {
    if (ec) return;
    map_miss();
    watch_misses();
  });
}

// A worker met an address no translation covers: the kernel's entry for it
// is mapped (its DMA domain's file, the range the kernel gives), and the
// queues are retried.
void Backend::map_miss() {
  uint64_t iova = 0;
  uint8_t perm = 0;
  if (!iotlb_.take_miss(iova, perm)) return;
  vduse_iotlb_entry entry{};
  entry.start = iova;
  entry.last = iova;
  const int fd = ::ioctl(dev_.get(), VDUSE_IOTLB_GET_FD, &entry);
  if (fd < 0) {
    // Not mapped in the domain: the driver gave a bad address; its ring
    // fails as any bad address fails it.
    stats_.last_error = "no mapping for IOVA 0x" + fmt::format("{:x}", iova) + " (" + errno_text(errno) + ")";
    spdlog::warn("vduse: {}: {}", name_, stats_.last_error);
    return;
  }
  const UniqueFd owned(fd);
  spdlog::debug("vduse: {}: IOVA 0x{:x} is [0x{:x}, 0x{:x}] at offset 0x{:x}, perm {}", name_, iova, entry.start,
                entry.last, entry.offset, entry.perm);
  const uint64_t size = entry.last - entry.start + 1;
  uint64_t mapped = size;
  for (const Mapping& m : mappings_) mapped += m.size;
  if (entry.last < entry.start || mappings_.size() >= kMaxMappings || mapped > kMaxMappedBytes) {
    stats_.last_error =
        "the kernel's DMA domain needs more than " + std::to_string(kMaxMappings) + " mappings or 1 GiB mapped";
    spdlog::error("vduse: {}: {}", name_, stats_.last_error);
    return;
  }
  const uint8_t kperm = (entry.perm & VDUSE_ACCESS_RO ? virtio::kIotlbRead : 0) |
                        (entry.perm & VDUSE_ACCESS_WO ? virtio::kIotlbWrite : 0);
  const int prot = PROT_READ | ((kperm & virtio::kIotlbWrite) ? PROT_WRITE : 0);
  void* host = ::mmap(nullptr, size, prot, MAP_SHARED, fd, static_cast<off_t>(entry.offset));
  if (host == MAP_FAILED) {
    stats_.last_error =
        "mapping the kernel's DMA domain at 0x" + fmt::format("{:x}", entry.start) + ": " + errno_text(errno);
    spdlog::error("vduse: {}: {}", name_, stats_.last_error);
    return;
  }
  // Workers read the memory map: they stop while it grows.
  const bool was_running = device_.running();
  device_.stop();
  if (device_.wedged() && !device_.reap()) {
    ::munmap(host, size);
    return;
  }
  try {
    memory_.add_host_region(entry.start, size, reinterpret_cast<uint64_t>(host), host, kperm);
    iotlb_.update({entry.start, size, reinterpret_cast<uint64_t>(host), kperm});
  } catch (const std::exception& e) {
    ::munmap(host, size);
    stats_.last_error = e.what();
    if (was_running) device_.start();
    return;
  }
  mappings_.push_back({entry.start, size, host});
  ++stats_.mappings;
  iotlb_.publish();
  iotlb_.reclaim();
  if (was_running || device_.waiting_for_translations() || driver_ok()) device_.start();
}

void Backend::unmap_all() {
  for (const Mapping& m : mappings_) ::munmap(m.host, m.size);
  mappings_.clear();
}

// A queue's interrupt, as the engine delivered it: injected.
void Backend::watch_call(unsigned q) {
  call_watch_[q]->async_wait(asio::posix::stream_descriptor::wait_read, [this, q](boost::system::error_code ec) {
    if (ec) return;
    uint64_t count = 0;
    if (::read(calls_[q].get(), &count, sizeof count) == static_cast<ssize_t>(sizeof count) && driver_ok()) {
      uint32_t index = q;
      if (::ioctl(dev_.get(), VDUSE_VQ_INJECT_IRQ, &index) == 0) ++stats_.interrupts;
    }
    watch_call(q);
  });
}

void Backend::config_changed() {
  const size_t size = device_.config_size();
  std::vector<uint8_t> buf(sizeof(vduse_config_data) + size);
  auto* data = reinterpret_cast<vduse_config_data*>(buf.data());
  data->offset = 0;
  data->length = static_cast<uint32_t>(size);
  device_.read_config(0, data->buffer, size);
  if (::ioctl(dev_.get(), VDUSE_DEV_SET_CONFIG, data) != 0 ||
      (driver_ok() && ::ioctl(dev_.get(), VDUSE_DEV_INJECT_CONFIG_IRQ) != 0))
    spdlog::warn("vduse: {}: cannot update the config space: {}", name_, errno_text(errno));
}

std::vector<std::string> Backend::remove_left_over(const std::string& journal, const std::vector<std::string>& keep) {
  std::vector<std::string> removed;
  // A kernel without VDUSE now (another boot, the module unloaded) has
  // none of the devices the journal names: they are forgotten.
  const bool no_vduse = ::access(kControl, F_OK) != 0 && errno == ENOENT;
  for (const std::string& name : read_journal(journal)) {
    if (std::find(keep.begin(), keep.end(), name) != keep.end()) continue;
    if (no_vduse) {
      journal_remove(journal, name);
      removed.push_back(name);
      continue;
    }
    // Its requests answered here while it leaves the bus (nobody else
    // would: the run that served it is gone).
    UniqueFd dev(::open(("/dev/vduse/" + name).c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC));
    try {
      if (remove_when_let_go(name, dev, journal)) continue;
      remove_device(name, std::move(dev), journal);
    } catch (const std::exception& e) {
      spdlog::error("vduse: {} left by an earlier run: {}", name, e.what());
      continue;
    }
    removed.push_back(name);
  }
  return removed;
}

}  // namespace sriovd::vduse
