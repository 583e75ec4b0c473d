#include "sriovd/host/simulated_kernel.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <net/if.h>
#include <netlink/route/link/veth.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "sriovd/pci/config_space.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/util/netlink.hpp"

namespace sriovd::host {

namespace fs = std::filesystem;

namespace {

constexpr const char* kBusDir = "devices/pci0000:00";
constexpr unsigned kFirstVfOffset = 0x10;  // routing-ID offset of VF 0 (as Intel PFs report)
constexpr unsigned kVfStride = 1;
constexpr uint16_t kPfMsixVectors = 64;

std::string hex(unsigned value, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%0*x", digits, value);
  return buf;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

void put_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::trunc | std::ios::binary);
  out << text;
}

void put_link(const fs::path& link, const std::string& target) {
  std::error_code ec;
  fs::remove(link, ec);
  fs::create_symlink(target, link);
}

uint16_t vf_device_id(uint16_t vendor, uint16_t pf_device) {
  // The VF device ID the PF's SR-IOV capability reports; known pairs as the
  // hardware has them, else the next ID.
  if (vendor == 0x8086 && pf_device == 0x1572) return 0x154c;  // X710 -> X710 VF
  if (vendor == 0x8086 && pf_device == 0x1592) return 0x1889;  // E810 -> E810 VF
  return static_cast<uint16_t>(pf_device + 1);
}

[[noreturn]] void fail(int err, const std::string& what) { throw SystemError(err, what); }

}  // namespace

SimulatedKernel::SimulatedKernel(std::string dir, const std::vector<config::SimulatedPf>& pfs)
    : real_(dir), dir_(std::move(dir)) {
  std::error_code ec;
  fs::remove_all(dir_, ec);
  make_tree();
  for (const auto& sim : pfs) {
    Device pf;
    pf.address = sim.address;
    pf.vendor = sim.vendor_id;
    pf.device = sim.device_id;
    pf.class_code = 0x020000;  // Ethernet controller
    pf.native_driver = kPfDriver;
    pf.driver = kPfDriver;
    pf.group = next_group_++;
    pf.total_vfs = sim.total_vfs;
    pf.vf_msix = sim.msix_vectors_per_vf;
    pf.vf_device = vf_device_id(sim.vendor_id, sim.device_id);
    pf.netdev = sim.netdev;
    pf.msix_vectors = kPfMsixVectors;
    devices_[pf.address] = pf;
    write_device(devices_[pf.address]);
  }
}

namespace {

// A simulated VF's veth names the process that made it in its alias: one a
// SIGKILLed daemon left is found at the next start and made anew, while a
// live daemon's, or a link that is not ours, is left alone and named.
constexpr const char* kVethAliasPrefix = "sriovd-sim pid=";
constexpr uint32_t kSimulatedVfQueues = 4;

// The pid in an alias of ours, or 0 (not ours).
pid_t veth_owner(rtnl_link* l) {
  const char* a = rtnl_link_get_ifalias(l);
  const std::string alias = a ? a : "";
  if (alias.rfind(kVethAliasPrefix, 0) != 0) return 0;
  try {
    return static_cast<pid_t>(std::stol(alias.substr(std::string(kVethAliasPrefix).size())));
  } catch (const std::exception&) {
    return 0;
  }
}

bool process_alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

void delete_link(nl_sock* sk, const std::string& name) {
  const nl::Link link(rtnl_link_alloc());
  rtnl_link_set_name(link.get(), name.c_str());
  rtnl_link_delete(sk, link.get());  // takes the peer with it
}

}  // namespace

SimulatedKernel::SimulatedKernel(std::string dir, const std::string& saved) : real_(dir), dir_(std::move(dir)) {
  try {
    const nlohmann::json j = nlohmann::json::parse(saved);
    const auto address = [](const nlohmann::json& v) {
      const auto a = PciAddress::parse(v.get<std::string>());
      if (!a) throw std::invalid_argument("a PCI address '" + v.get<std::string>() + "'");
      return *a;
    };
    for (const auto& d : j.at("devices")) {
      Device x;
      x.address = address(d.at("address"));
      x.vendor = d.at("vendor").get<uint16_t>();
      x.device = d.at("device").get<uint16_t>();
      x.class_code = d.at("class_code").get<uint32_t>();
      x.driver = d.at("driver").get<std::string>();
      x.native_driver = d.at("native_driver").get<std::string>();
      x.override = d.at("override").get<std::string>();
      x.group = d.at("group").get<int>();
      x.busy = d.at("busy").get<bool>();
      x.total_vfs = d.at("total_vfs").get<uint16_t>();
      x.num_vfs = d.at("num_vfs").get<uint16_t>();
      x.autoprobe = d.at("autoprobe").get<bool>();
      x.vf_msix = d.at("vf_msix").get<uint16_t>();
      x.vf_device = d.at("vf_device").get<uint16_t>();
      x.netdev = d.at("netdev").get<std::string>();
      x.igb_rules = d.at("igb_rules").get<bool>();
      x.vf_driver = d.at("vf_driver").get<std::string>();
      x.link_up = d.at("link_up").get<bool>();
      x.settle = std::chrono::milliseconds(d.at("settle_ms").get<int64_t>());
      x.numvfs_changed_at = std::chrono::steady_clock::now();
      if (d.contains("physfn")) x.physfn = address(d["physfn"]);
      x.vf_index = d.at("vf_index").get<unsigned>();
      x.msix_vectors = d.at("msix_vectors").get<uint16_t>();
      x.materialized = d.at("materialized").get<bool>();
      x.mtu = d.value("mtu", kDefaultMtu);
      devices_[x.address] = x;
    }
    for (const auto& v : j.at("vf_settings"))
      vf_settings_[{address(v.at("pf")), v.at("vf").get<unsigned>()}] = VfSettings::from_json(v.at("settings"));
    for (const auto& u : j.at("unloaded")) unloaded_.insert(u.get<std::string>());
    veths_ = j.at("veths").get<std::vector<std::string>>();
    next_group_ = j.at("next_group").get<int>();
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("the handed simulated kernel: ") + e.what());
  }
  // The tree as the devices say (the predecessor's, or written again).
  make_tree();
  for (const auto& [addr, d] : devices_)
    if (d.materialized) write_device(d);
}

void SimulatedKernel::make_tree() {
  for (const char* d : {kBusDir, "bus/pci/devices", "bus/pci/drivers", "kernel/iommu_groups", "class/net"})
    fs::create_directories(fs::path(dir_) / d);
  put_file(fs::path(dir_) / "bus/pci/drivers_probe", "");
  for (const char* drv : {kPfDriver, kVfDriver, "vfio-pci", "pci-stub"}) {
    const fs::path p = fs::path(dir_) / "bus/pci/drivers" / drv;
    fs::create_directories(p);
    put_file(p / "bind", "");
    put_file(p / "unbind", "");
  }
}

std::string SimulatedKernel::save() const {
  std::lock_guard lock(mutex_);
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& [addr, d] : devices_) {
    nlohmann::json x = {{"address", d.address.to_string()},
                        {"vendor", d.vendor},
                        {"device", d.device},
                        {"class_code", d.class_code},
                        {"driver", d.driver},
                        {"native_driver", d.native_driver},
                        {"override", d.override},
                        {"group", d.group},
                        {"busy", d.busy},
                        {"total_vfs", d.total_vfs},
                        {"num_vfs", d.num_vfs},
                        {"autoprobe", d.autoprobe},
                        {"vf_msix", d.vf_msix},
                        {"vf_device", d.vf_device},
                        {"netdev", d.netdev},
                        {"igb_rules", d.igb_rules},
                        {"vf_driver", d.vf_driver},
                        {"link_up", d.link_up},
                        {"settle_ms", d.settle.count()},
                        {"vf_index", d.vf_index},
                        {"msix_vectors", d.msix_vectors},
                        {"materialized", d.materialized},
                        {"mtu", d.mtu}};
    if (d.physfn) x["physfn"] = d.physfn->to_string();
    devices.push_back(std::move(x));
  }
  nlohmann::json settings = nlohmann::json::array();
  for (const auto& [key, v] : vf_settings_)
    settings.push_back({{"pf", key.first.to_string()}, {"vf", key.second}, {"settings", v.to_json()}});
  return nlohmann::json{{"devices", devices},
                        {"vf_settings", settings},
                        {"unloaded", unloaded_},
                        {"veths", veths_},
                        {"next_group", next_group_}}
      .dump();
}

SimulatedKernel::~SimulatedKernel() {
  if (keep_) return;  // the successor's
  std::error_code ec;
  fs::remove_all(dir_, ec);
  if (veths_.empty()) return;
  try {
    const nl::Sock sk = nl::route_socket();
    for (const auto& name : veths_) delete_link(sk.get(), name);
  } catch (const std::exception&) {
  }
}

std::string SimulatedKernel::realize_vf_netdev(const PciAddress& vf_addr) {
  std::lock_guard lock(mutex_);
  Device* vf = find(vf_addr);
  if (!vf || !vf->physfn) throw std::runtime_error(vf_addr.to_string() + " is not a VF of the simulated host");
  if (vf->driver != vf->native_driver)
    throw std::runtime_error("VF " + vf_addr.to_string() + " has no netdev: it is bound to " +
                             (vf->driver.empty() ? std::string("no driver") : vf->driver) + ", not " +
                             vf->native_driver);
  std::string name = vf_netdev(*vf);
  const nl::Sock sk = nl::route_socket();
  if (auto it = std::find(veths_.begin(), veths_.end(), name); it != veths_.end()) {
    if (nl::get_link(sk.get(), name)) return name;
    veths_.erase(it);  // gone (as a rebound VF driver's old netdev): a new one, as the driver makes
  }
  if (const nl::Link old = nl::get_link(sk.get(), name)) {
    const pid_t owner = veth_owner(old.get());
    if (owner == 0)
      throw std::runtime_error("simulated VF netdev " + name + ": a link of that name exists and is not sriovd's");
    if (owner != ::getpid() && process_alive(owner))
      throw std::runtime_error("simulated VF netdev " + name + " belongs to sriovd pid " + std::to_string(owner) +
                               ", which is running");
    delete_link(sk.get(), name);  // a crashed run's
  }
  // Four queues each way, as a VF's netdev has several (RSS): what the
  // AF_XDP port binds a socket to, each.
  const nl::Link veth(rtnl_link_veth_alloc());
  if (!veth) throw std::runtime_error("creating the veth for simulated VF netdev " + name + ": out of memory");
  rtnl_link* peer = rtnl_link_veth_get_peer(veth.get());
  rtnl_link_set_name(veth.get(), name.c_str());
  rtnl_link_set_name(peer, (name + "p").c_str());
  for (rtnl_link* end : {veth.get(), peer}) {
    rtnl_link_set_num_tx_queues(end, kSimulatedVfQueues);
    rtnl_link_set_num_rx_queues(end, kSimulatedVfQueues);
  }
  int err = rtnl_link_add(sk.get(), veth.get(), NLM_F_CREATE | NLM_F_EXCL);
  rtnl_link_put(peer);  // rtnl_link_veth_get_peer took a reference
  if (err < 0) throw std::runtime_error("creating the veth for simulated VF netdev " + name + ": " + nl_geterror(err));
  veths_.push_back(name);
  const std::string alias = kVethAliasPrefix + std::to_string(::getpid());
  for (const std::string& n : {name, name + "p"}) {
    const nl::Link orig = nl::get_link(sk.get(), n);
    if (!orig) continue;
    const nl::Link change(rtnl_link_alloc());
    rtnl_link_set_flags(change.get(), IFF_UP);
    rtnl_link_set_ifalias(change.get(), alias.c_str());
    if (err = rtnl_link_change(sk.get(), orig.get(), change.get(), 0); err < 0)
      throw std::runtime_error("simulated VF netdev " + n +
                               ": setting its owner and bringing it up: " + nl_geterror(err));
  }
  return name;
}

// --- reads: the materialised tree, after letting late VFs appear ---

std::optional<std::string> SimulatedKernel::read(const std::string& path) {
  std::lock_guard lock(mutex_);
  materialize_due();
  return real_.read(path);
}

std::optional<std::string> SimulatedKernel::link_name(const std::string& path) {
  std::lock_guard lock(mutex_);
  materialize_due();
  return real_.link_name(path);
}

std::vector<std::string> SimulatedKernel::list(const std::string& dir) {
  std::lock_guard lock(mutex_);
  materialize_due();
  return real_.list(dir);
}

bool SimulatedKernel::exists(const std::string& path) {
  std::lock_guard lock(mutex_);
  materialize_due();
  return real_.exists(path);
}

// --- writes: the kernel's reactions ---

void SimulatedKernel::check_fault(const std::string& op) {
  const unsigned n = operations_++;
  if (nth_fault_ && nth_fault_->first == n) {
    const int err = nth_fault_->second;
    nth_fault_.reset();
    fail(err, "injected fault at operation " + std::to_string(n) + " (" + op + ")");
  }
  for (auto& f : faults_) {
    if (f.times == 0 || op.find(f.path_contains) == std::string::npos) continue;
    if (f.skip > 0) {
      --f.skip;
      continue;
    }
    --f.times;
    fail(f.error, "injected fault on " + op);
  }
}

SimulatedKernel::Device& SimulatedKernel::device_at(const std::string& addr_text, const std::string& path) {
  auto addr = PciAddress::parse(addr_text);
  Device* d = addr ? find(*addr) : nullptr;
  if (!d || !d->materialized) fail(ENODEV, "write to " + path + ": no device " + addr_text);
  return *d;
}

SimulatedKernel::Device* SimulatedKernel::find(const PciAddress& a) {
  auto it = devices_.find(a);
  return it == devices_.end() ? nullptr : &it->second;
}

SimulatedKernel::Device* SimulatedKernel::find_pf_by_netdev(const std::string& netdev) {
  for (auto& [addr, d] : devices_)
    if (d.total_vfs > 0 && d.netdev == netdev) return &d;
  return nullptr;
}

void SimulatedKernel::write(const std::string& path, const std::string& raw) {
  std::lock_guard lock(mutex_);
  materialize_due();
  const std::string value = trim(raw);
  check_fault(path);
  const fs::path p(path);
  const std::string leaf = p.filename().string();
  const std::string parent = p.parent_path().filename().string();
  const std::string grandparent = p.parent_path().parent_path().string();

  if (path == "bus/pci/drivers_probe") {
    probe(device_at(value, path));
    return;
  }
  if (grandparent == "bus/pci/drivers" && (leaf == "bind" || leaf == "unbind")) {
    if (unloaded_.count(parent)) fail(ENOENT, "open " + path + ": no such driver (module not loaded)");
    Device& d = device_at(value, path);
    if (leaf == "unbind") {
      if (d.driver != parent) fail(ENODEV, "unbind " + value + " from " + parent + ": not bound to it");
      if (d.busy) fail(EBUSY, "unbind " + value + " from " + parent + ": device busy");
      unbind(d);
    } else {
      if (!d.driver.empty()) fail(EBUSY, "bind " + value + " to " + parent + ": already bound to " + d.driver);
      if (!d.override.empty() && d.override != parent)
        fail(ENODEV, "bind " + value + " to " + parent + ": driver_override is " + d.override);
      if (parent != "vfio-pci" && parent != "pci-stub" && parent != d.native_driver)
        fail(ENODEV, "bind " + value + " to " + parent + ": driver does not match the device");
      bind(d, parent);
    }
    return;
  }
  if (grandparent == "bus/pci/devices") {
    Device& d = device_at(parent, path);
    if (leaf == "driver_override") {
      d.override = value == "(null)" ? "" : value;
      write_device(d);
      return;
    }
    if (leaf == "sriov_numvfs" && d.total_vfs > 0) {
      unsigned n = 0;
      try {
        n = static_cast<unsigned>(std::stoul(value));
      } catch (const std::exception&) {
        fail(EINVAL, "write '" + value + "' to " + path);
      }
      set_numvfs(d, n, path);
      return;
    }
    if (leaf == "sriov_drivers_autoprobe" && d.total_vfs > 0) {
      if (value != "0" && value != "1") fail(EINVAL, "write '" + value + "' to " + path);
      d.autoprobe = value == "1";
      write_device(d);
      return;
    }
  }
  if (path.size() > 13 && path.compare(path.size() - 13, 13, "driver/unbind") == 0) {
    // devices/<addr>/driver/unbind: the driver link followed.
    const std::string addr = p.parent_path().parent_path().filename().string();
    Device& d = device_at(addr, path);
    if (d.driver.empty()) fail(ENOENT, "write to " + path + ": device has no driver");
    if (d.busy) fail(EBUSY, "unbind " + addr + ": device busy");
    unbind(d);
    return;
  }
  if (leaf == "mtu" && p.parent_path().parent_path().filename() == "net") {
    // devices/<addr>/net/<netdev>/mtu: the netdev's MTU, as its driver
    // takes it (igbvf: 68 to 9216).
    const std::string addr = p.parent_path().parent_path().parent_path().filename().string();
    Device& d = device_at(addr, path);
    if (d.driver.empty() || d.driver != d.native_driver) fail(ENOENT, "write to " + path + ": no such netdev");
    unsigned long n = 0;
    try {
      n = std::stoul(value);
    } catch (const std::exception&) {
      fail(EINVAL, "write '" + value + "' to " + path);
    }
    if (n < 68 || n > kMaxMtu)
      fail(EINVAL, "write '" + value + "' to " + path + ": MTU out of range 68 to " + std::to_string(kMaxMtu));
    d.mtu = static_cast<uint16_t>(n);
    write_device(d);
    return;
  }
  fail(EACCES, "write to " + path + ": not a writable attribute in the simulated kernel");
}

void SimulatedKernel::set_numvfs(Device& pf, unsigned n, const std::string& path) {
  if (n > pf.total_vfs) fail(ERANGE, "write " + std::to_string(n) + " to " + path + ": above sriov_totalvfs");
  if (n == pf.num_vfs) return;
  // The kernel refuses to change a non-zero VF count except through 0.
  if (n != 0 && pf.num_vfs != 0) fail(EBUSY, "write " + std::to_string(n) + " to " + path + ": VFs already enabled");
  if (n == 0) {
    for (auto& [addr, d] : devices_)
      if (d.physfn == pf.address && d.busy) fail(EBUSY, "write 0 to " + path + ": VF " + addr.to_string() + " busy");
    for (auto it = devices_.begin(); it != devices_.end();) {
      if (it->second.physfn == pf.address) {
        remove_device_files(it->second);
        vf_settings_.erase({pf.address, it->second.vf_index});
        it = devices_.erase(it);
      } else {
        ++it;
      }
    }
    pf.num_vfs = 0;
    write_device(pf);
    return;
  }
  const unsigned pf_rid = (pf.address.bus << 8U) | (pf.address.device << 3U) | pf.address.function;
  const bool late = vf_delay_.count() > 0;
  for (unsigned i = 0; i < n; ++i) {
    const unsigned rid = pf_rid + kFirstVfOffset + i * kVfStride;
    Device vf;
    vf.address = {pf.address.domain, static_cast<uint8_t>(rid >> 8U), static_cast<uint8_t>((rid >> 3U) & 0x1fU),
                  static_cast<uint8_t>(rid & 7U)};
    vf.vendor = pf.vendor;
    vf.device = pf.vf_device;
    vf.class_code = pf.class_code;
    vf.native_driver = pf.vf_driver;
    vf.group = next_group_++;
    vf.physfn = pf.address;
    vf.vf_index = i;
    vf.msix_vectors = pf.vf_msix;
    vf.materialized = !late;
    devices_[vf.address] = vf;
  }
  pf.num_vfs = static_cast<uint16_t>(n);
  pf.numvfs_changed_at = std::chrono::steady_clock::now();
  if (late) materialize_at_ = std::chrono::steady_clock::now() + vf_delay_;
  write_device(pf);
  for (auto& [addr, d] : devices_)
    if (d.physfn == pf.address) {
      if (d.materialized) write_device(d);
      if (pf.autoprobe && !late) probe(d);
    }
}

void SimulatedKernel::materialize_due() {
  if (!materialize_at_ || std::chrono::steady_clock::now() < *materialize_at_) return;
  materialize_at_.reset();
  for (auto& [addr, d] : devices_)
    if (!d.materialized) {
      d.materialized = true;
      write_device(d);
      if (Device* pf = find(*d.physfn); pf && pf->autoprobe) probe(d);
      write_device(*find(*d.physfn));
    }
}

void SimulatedKernel::probe(Device& d) {
  if (!d.driver.empty()) return;
  // pci_device_can_probe(): a VF of a PF with sriov_drivers_autoprobe off
  // is probed only for the driver its driver_override names.
  if (d.physfn && d.override.empty())
    if (const Device* pf = find(*d.physfn); pf && !pf->autoprobe) return;
  // driver_override wins; a name no loaded driver answers to leaves it
  // unbound, and drivers_probe still "succeeds" - the trap sriovd must verify.
  const std::string driver = d.override.empty() ? d.native_driver : d.override;
  if (unloaded_.count(driver)) return;
  if (driver == "vfio-pci" || driver == "pci-stub" || driver == d.native_driver) bind(d, driver);
}

void SimulatedKernel::set_driver_loaded(const std::string& driver, bool loaded) {
  std::lock_guard lock(mutex_);
  const fs::path p = fs::path(dir_) / "bus/pci/drivers" / driver;
  if (loaded) {
    unloaded_.erase(driver);
    fs::create_directories(p);
    put_file(p / "bind", "");
    put_file(p / "unbind", "");
  } else {
    unloaded_.insert(driver);
    std::error_code ec;
    fs::remove_all(p, ec);
  }
}

void SimulatedKernel::bind(Device& d, const std::string& driver) {
  d.driver = driver;
  if (d.physfn && driver == d.native_driver) d.mtu = kDefaultMtu;  // a new netdev
  write_device(d);
}

void SimulatedKernel::unbind(Device& d) {
  link_driver(d, false);
  d.driver.clear();
  write_device(d);
}

std::string SimulatedKernel::modalias(const Device& d) {
  char text[64];
  std::snprintf(text, sizeof text, "pci:v%08Xd%08Xsv%08Xsd%08Xbc%02Xsc%02Xi%02X", d.vendor, d.device, d.vendor, 0U,
                (d.class_code >> 16U) & 0xffU, (d.class_code >> 8U) & 0xffU, d.class_code & 0xffU);
  return text;
}

// modules.alias as the model's drivers would fill it: the native driver of
// every device with the same vendor and device ID.
std::vector<std::string> SimulatedKernel::modules_for(const std::string& alias) {
  std::lock_guard lock(mutex_);
  std::vector<std::string> out;
  if (aliases_hidden_) return out;
  for (const auto& [addr, d] : devices_) {
    const std::string mine = modalias(d);
    if (!d.native_driver.empty() && alias.compare(0, 22, mine, 0, 22) == 0 &&
        std::find(out.begin(), out.end(), d.native_driver) == out.end())
      out.push_back(d.native_driver);
  }
  return out;
}

// --- VF settings over "netlink" ---

VfSettings SimulatedKernel::effective_settings(const PciAddress& pf, unsigned vf) const {
  VfSettings s;
  if (auto it = vf_settings_.find({pf, vf}); it != vf_settings_.end()) s = it->second;
  // What a PF driver reports for a fresh VF.
  if (!s.mac) s.mac = MacAddress{};
  if (!s.vlan) s.vlan = 0;
  if (!s.qos) s.qos = 0;
  if (!s.trust) s.trust = false;
  if (!s.spoofchk) s.spoofchk = true;
  if (!s.link_state) s.link_state = "auto";
  if (!s.max_tx_rate) s.max_tx_rate = 0;
  if (!s.min_tx_rate) s.min_tx_rate = 0;
  return s;
}

VfSettings SimulatedKernel::get(const std::string& pf_netdev, unsigned vf) {
  std::lock_guard lock(mutex_);
  Device* pf = find_pf_by_netdev(pf_netdev);
  if (!pf) fail(ENODEV, "PF " + pf_netdev + ": no such netdev");
  if (vf >= pf->num_vfs) fail(EINVAL, "PF " + pf_netdev + ": no VF " + std::to_string(vf));
  return effective_settings(pf->address, vf);
}

void SimulatedKernel::set(const std::string& pf_netdev, unsigned vf, const VfSettings& settings) {
  std::lock_guard lock(mutex_);
  Device* pf = find_pf_by_netdev(pf_netdev);
  if (!pf) fail(ENODEV, "PF " + pf_netdev + ": no such netdev");
  if (vf >= pf->num_vfs) fail(EINVAL, "PF " + pf_netdev + ": no VF " + std::to_string(vf));
  check_fault("netlink/" + pf_netdev + "/vf" + std::to_string(vf));
  // One request per setting, in NetlinkVfLink's order: a refused one stops
  // there, with what went before already applied.
  VfSettings& s = vf_settings_[{pf->address, vf}];
  const std::string where = "PF " + pf_netdev + ": cannot set ";
  const std::string of_vf = " of VF " + std::to_string(vf);
  if (settings.mac) s.mac = settings.mac;
  if (settings.vlan) s.vlan = settings.vlan;
  if (settings.qos) s.qos = settings.qos;
  if (settings.trust) s.trust = settings.trust;
  if (settings.spoofchk) s.spoofchk = settings.spoofchk;
  if (settings.link_state) {
    if (pf->igb_rules)
      throw VfSettingRefused("link_state", EOPNOTSUPP,
                             where + "link_state " + *settings.link_state + of_vf + ": Operation not supported");
    s.link_state = settings.link_state;
  }
  if (settings.max_tx_rate || settings.min_tx_rate) {
    if (pf->igb_rules && (settings.min_tx_rate.value_or(0) != 0 || !pf->link_up ||
                          std::chrono::steady_clock::now() < pf->numvfs_changed_at + pf->settle))
      throw VfSettingRefused("rate", EINVAL, where + "tx rate" + of_vf + ": Invalid input data or parameter");
    if (settings.max_tx_rate) s.max_tx_rate = settings.max_tx_rate;
    if (settings.min_tx_rate) s.min_tx_rate = settings.min_tx_rate;
  }
}

void SimulatedKernel::behave_like_igb(const PciAddress& pf, std::chrono::milliseconds settle) {
  set_driver_loaded("igb", true);
  set_driver_loaded("igbvf", true);
  std::lock_guard lock(mutex_);
  Device* d = find(pf);
  if (!d) fail(ENODEV, "behave_like_igb: no device " + pf.to_string());
  d->igb_rules = true;
  d->settle = settle;
  if (d->driver == d->native_driver) {
    link_driver(*d, false);
    d->driver = "igb";
  }
  d->native_driver = "igb";
  d->vf_driver = "igbvf";
  write_device(*d);
}

void SimulatedKernel::set_pf_link(const PciAddress& pf, bool up) {
  std::lock_guard lock(mutex_);
  Device* d = find(pf);
  if (!d) fail(ENODEV, "set_pf_link: no device " + pf.to_string());
  d->link_up = up;
  write_device(*d);
}

// --- controls ---

void SimulatedKernel::inject(const Fault& fault) {
  std::lock_guard lock(mutex_);
  faults_.push_back(fault);
}

void SimulatedKernel::fail_nth_operation(unsigned n, int error) {
  std::lock_guard lock(mutex_);
  nth_fault_ = {operations_ + n, error};
}

void SimulatedKernel::clear_faults() {
  std::lock_guard lock(mutex_);
  faults_.clear();
  nth_fault_.reset();
}

unsigned SimulatedKernel::operations() const {
  std::lock_guard lock(mutex_);
  return operations_;
}

void SimulatedKernel::delay_vf_appearance(std::chrono::milliseconds delay) {
  std::lock_guard lock(mutex_);
  vf_delay_ = delay;
}

void SimulatedKernel::set_busy(const PciAddress& dev, bool busy) {
  std::lock_guard lock(mutex_);
  if (Device* d = find(dev)) d->busy = busy;
}

void SimulatedKernel::bind_by_hand(const PciAddress& dev, const std::string& driver) {
  std::lock_guard lock(mutex_);
  Device* d = find(dev);
  if (!d) fail(ENODEV, "bind_by_hand: no device " + dev.to_string());
  if (!d->driver.empty()) unbind(*d);
  bind(*d, driver);
}

void SimulatedKernel::add_device(const PciAddress& dev, uint16_t vendor, uint16_t device, uint32_t class_code,
                                 const std::string& driver, int iommu_group) {
  std::lock_guard lock(mutex_);
  Device d;
  d.address = dev;
  d.vendor = vendor;
  d.device = device;
  d.class_code = class_code;
  d.native_driver = driver;
  d.driver = driver;
  d.group = iommu_group >= 0 ? iommu_group : next_group_++;
  devices_[dev] = d;
  write_device(devices_[dev]);
}

int SimulatedKernel::iommu_group_of(const PciAddress& dev) const {
  std::lock_guard lock(mutex_);
  auto it = devices_.find(dev);
  return it == devices_.end() ? -1 : it->second.group;
}

std::string SimulatedKernel::snapshot() const {
  std::lock_guard lock(mutex_);
  std::ostringstream s;
  for (const auto& [addr, d] : devices_) {
    s << addr.to_string() << " driver=" << (d.driver.empty() ? "-" : d.driver)
      << " override=" << (d.override.empty() ? "-" : d.override);
    if (d.total_vfs > 0) s << " numvfs=" << d.num_vfs << " autoprobe=" << d.autoprobe;
    if (d.physfn && !d.driver.empty() && d.driver == d.native_driver) s << " mtu=" << d.mtu;
    s << "\n";
  }
  for (const auto& [addr, d] : devices_)
    if (d.physfn)
      s << d.physfn->to_string() << "/vf" << d.vf_index << " "
        << effective_settings(*d.physfn, d.vf_index).to_json().dump() << "\n";
  return s.str();
}

// --- the tree ---

std::string SimulatedKernel::vf_netdev(const Device& vf) const {
  auto it = devices_.find(*vf.physfn);
  return it->second.netdev + "v" + std::to_string(vf.vf_index);
}

std::vector<uint8_t> SimulatedKernel::config_space(const Device& d) {
  pci::EndpointSpec spec;
  spec.vendor = d.vendor;
  spec.device = d.device;
  spec.class_code = d.class_code;
  spec.msix_vectors = d.msix_vectors;  // table in BAR3 at 0, PBA at 0x2000
  spec.total_vfs = d.total_vfs;
  spec.num_vfs = d.num_vfs;
  spec.first_vf_offset = kFirstVfOffset;
  spec.vf_stride = kVfStride;
  spec.vf_device = d.vf_device;
  return pci::make_endpoint_config(spec);
}

void SimulatedKernel::link_driver(const Device& d, bool present) {
  if (d.driver.empty()) return;
  const fs::path drv = fs::path(dir_) / "bus/pci/drivers" / d.driver;
  const fs::path link = drv / d.address.to_string();
  std::error_code ec;
  fs::remove(link, ec);
  if (present && !fs::exists(drv)) {
    fs::create_directories(drv);
    put_file(drv / "bind", "");
    put_file(drv / "unbind", "");
  }
  if (present) fs::create_symlink("../../../../" + std::string(kBusDir) + "/" + d.address.to_string(), link);
}

void SimulatedKernel::remove_device_files(const Device& d) {
  const std::string a = d.address.to_string();
  std::error_code ec;
  link_driver(d, false);
  if (d.physfn && !d.native_driver.empty()) fs::remove(fs::path(dir_) / "class/net" / vf_netdev(d), ec);
  fs::remove_all(fs::path(dir_) / kBusDir / a, ec);
  fs::remove(fs::path(dir_) / "bus/pci/devices" / a, ec);
  const fs::path group = fs::path(dir_) / "kernel/iommu_groups" / std::to_string(d.group);
  fs::remove(group / "devices" / a, ec);
  if (fs::is_empty(group / "devices", ec)) fs::remove_all(group, ec);
  if (d.physfn)
    if (auto it = devices_.find(*d.physfn); it != devices_.end())
      fs::remove(fs::path(dir_) / kBusDir / d.physfn->to_string() / ("virtfn" + std::to_string(d.vf_index)), ec);
}

void SimulatedKernel::write_device(const Device& d) {
  if (!d.materialized) return;
  const std::string a = d.address.to_string();
  const fs::path dev = fs::path(dir_) / kBusDir / a;
  fs::create_directories(dev);
  put_link(fs::path(dir_) / "bus/pci/devices" / a, "../../../" + std::string(kBusDir) + "/" + a);
  put_file(dev / "vendor", hex(d.vendor, 4) + "\n");
  put_file(dev / "device", hex(d.device, 4) + "\n");
  put_file(dev / "class", hex(d.class_code, 6) + "\n");
  put_file(dev / "subsystem_vendor", hex(d.vendor, 4) + "\n");
  put_file(dev / "subsystem_device", hex(0, 4) + "\n");
  put_file(dev / "revision", "0x02\n");
  put_file(dev / "irq", "0\n");
  put_file(dev / "numa_node", "0\n");
  put_file(dev / "resource", std::string(7, '\n'));
  put_file(dev / "driver_override", (d.override.empty() ? "(null)" : d.override) + "\n");
  put_file(dev / "modalias", modalias(d) + "\n");
  const auto cfg = config_space(d);
  put_file(dev / "config", std::string(cfg.begin(), cfg.end()));
  const fs::path group = fs::path(dir_) / "kernel/iommu_groups" / std::to_string(d.group) / "devices";
  fs::create_directories(group);
  put_link(group / a, "../../../../" + std::string(kBusDir) + "/" + a);
  put_link(dev / "iommu_group", "../../../kernel/iommu_groups/" + std::to_string(d.group));
  std::error_code ec;
  fs::remove(dev / "driver", ec);
  if (!d.driver.empty()) {
    put_link(dev / "driver", "../../../bus/pci/drivers/" + d.driver);
    link_driver(d, true);
  }
  // A netdev exists while the device's own network driver holds it.
  std::string netdev;
  if (d.total_vfs > 0) netdev = d.netdev;
  if (d.physfn && d.driver == d.native_driver) netdev = vf_netdev(d);
  fs::remove_all(dev / "net", ec);
  if (d.physfn) fs::remove(fs::path(dir_) / "class/net" / vf_netdev(d), ec);
  if (!netdev.empty() && d.driver == d.native_driver) {
    fs::create_directories(dev / "net" / netdev);
    put_file(dev / "net" / netdev / "carrier", std::string(d.link_up ? "1" : "0") + "\n");
    put_file(dev / "net" / netdev / "mtu", std::to_string(d.mtu) + "\n");
    put_link(dev / "net" / netdev / "device", "../../../" + a);
    put_link(fs::path(dir_) / "class/net" / netdev, "../../" + std::string(kBusDir) + "/" + a + "/net/" + netdev);
  }
  if (d.total_vfs > 0) {
    put_file(dev / "sriov_totalvfs", std::to_string(d.total_vfs) + "\n");
    put_file(dev / "sriov_numvfs", std::to_string(d.num_vfs) + "\n");
    put_file(dev / "sriov_drivers_autoprobe", std::string(d.autoprobe ? "1" : "0") + "\n");
    put_file(dev / "sriov_offset", std::to_string(kFirstVfOffset) + "\n");
    put_file(dev / "sriov_stride", std::to_string(kVfStride) + "\n");
    put_file(dev / "sriov_vf_device", hex(d.vf_device, 4).substr(2) + "\n");
    for (const auto& entry : fs::directory_iterator(dev))
      if (entry.path().filename().string().rfind("virtfn", 0) == 0) fs::remove(entry.path(), ec);
    for (const auto& [addr, vf] : devices_)
      if (vf.physfn == d.address && vf.materialized)
        put_link(dev / ("virtfn" + std::to_string(vf.vf_index)), "../" + addr.to_string());
  }
  if (d.physfn) put_link(dev / "physfn", "../" + d.physfn->to_string());
}

}  // namespace sriovd::host
