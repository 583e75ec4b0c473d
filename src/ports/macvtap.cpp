#include "sriovd/ports/macvtap.hpp"

#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_link.h>
#include <linux/if_tun.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>

#include <netlink/route/link/macvtap.h>
#include <spdlog/spdlog.h>

#include "sriovd/ports/netdev.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/util/netlink.hpp"

namespace sriovd::ports {

namespace {

constexpr const char* kAliasPrefix = "sriovd:";

using nl::Cache;
using nl::Link;
using nl::route_socket;

Cache link_cache(nl_sock* sk) {
  nl_cache* c = nullptr;
  if (int err = rtnl_link_alloc_cache(sk, AF_UNSPEC, &c); err < 0)
    throw std::runtime_error(std::string("listing links: ") + nl_geterror(err));
  return Cache(c);
}

bool is_macvlan_kind(rtnl_link* l) {
  const char* type = rtnl_link_get_type(l);
  return type && (std::strcmp(type, "macvtap") == 0 || std::strcmp(type, "macvlan") == 0);
}

std::string alias_of_link(rtnl_link* l) {
  const char* a = rtnl_link_get_ifalias(l);
  return a ? a : "";
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

void delete_link(nl_sock* sk, const std::string& name) {
  Link l(rtnl_link_alloc());
  rtnl_link_set_name(l.get(), name.c_str());
  if (int err = rtnl_link_delete(sk, l.get()); err < 0 && err != -NLE_NODEV && err != -NLE_OBJ_NOTFOUND)
    throw std::runtime_error("deleting link " + name + ": " + nl_geterror(err));
}

// The character device of macvtap `name`: sysfs gives its number, devtmpfs
// usually the node /dev/tap<ifindex>. Without that node (no devtmpfs, or a
// name taken in another network namespace: the node is named by an ifindex,
// which is per namespace) a private node is made, opened and unlinked.
UniqueFd open_char_device(const std::string& name, int ifindex) {
  const std::string sys = "/sys/class/net/" + name + "/macvtap/tap" + std::to_string(ifindex) + "/dev";
  std::ifstream in(sys);
  unsigned major_no = 0, minor_no = 0;
  char colon = 0;
  if (!(in >> major_no >> colon >> minor_no) || colon != ':')
    throw std::runtime_error("macvtap " + name + ": cannot read its device number from " + sys +
                             " (is /sys mounted for this network namespace?)");
  const dev_t want = makedev(major_no, minor_no);
  const std::string node = "/dev/tap" + std::to_string(ifindex);
  UniqueFd fd(::open(node.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC));
  struct stat st {};
  if (fd && ::fstat(fd.get(), &st) == 0 && S_ISCHR(st.st_mode) && st.st_rdev == want) return fd;
  fd.reset();
  char dir[] = "/tmp/sriovd-macvtap-XXXXXX";
  if (!::mkdtemp(dir)) throw_errno("macvtap " + name + ": making a directory for its device node");
  const std::string own = std::string(dir) + "/tap";
  if (::mknod(own.c_str(), S_IFCHR | 0600, want) == 0) fd.reset(::open(own.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC));
  const int saved = errno;
  ::unlink(own.c_str());
  ::rmdir(dir);
  if (!fd) {
    errno = saved;
    throw_errno("macvtap " + name + ": opening its character device " + std::to_string(major_no) + ":" +
                std::to_string(minor_no) + " (" + node + " is missing or another device)");
  }
  return fd;
}

}  // namespace

struct Macvtap::Opened {
  std::string name;
  std::vector<UniqueFd> fds;
};

std::string Macvtap::alias_of(const std::string& instance, const std::string& device) {
  return kAliasPrefix + instance + " " + device;
}

Macvtap::Opened Macvtap::create_link(const std::string& lower, const std::string& instance, const std::string& device,
                                     unsigned queues) {
  if (queues == 0) queues = 1;
  const std::string alias = alias_of(instance, device);
  if (alias.size() >= 256) throw std::invalid_argument("macvtap alias '" + alias + "' is longer than 255 bytes");
  nl::Sock sk = route_socket();
  int err = 0;
  const Link lower_link = nl::get_link(sk.get(), lower, &err);
  if (!lower_link) throw std::runtime_error("macvtap on " + lower + ": no such netdev (" + nl_geterror(err) + ")");
  const int lower_index = rtnl_link_get_ifindex(lower_link.get());

  // What already sits on the lower device: ours from a crash goes; another
  // sriovd's is a conflict; anything else is named if the kernel refuses.
  std::string others;
  {
    Cache cache = link_cache(sk.get());
    for (nl_object* o = nl_cache_get_first(cache.get()); o; o = nl_cache_get_next(o)) {
      auto* l = reinterpret_cast<rtnl_link*>(o);
      if (rtnl_link_get_link(l) != lower_index || !is_macvlan_kind(l)) continue;
      const std::string name = rtnl_link_get_name(l);
      const std::string a = alias_of_link(l);
      if (starts_with(a, kAliasPrefix + instance + " ")) {
        delete_link(sk.get(), name);
      } else if (starts_with(a, kAliasPrefix)) {
        throw std::runtime_error("macvtap on " + lower + ": " + name + " there belongs to another sriovd ('" + a +
                                 "')");
      } else {
        others += (others.empty() ? "" : ", ") + name;
      }
    }
  }

  Opened out;
  out.name = "svt" + std::to_string(lower_index);
  {
    Link want(rtnl_link_macvtap_alloc());
    if (!want) throw std::bad_alloc();
    rtnl_link_set_link(want.get(), lower_index);
    rtnl_link_set_name(want.get(), out.name.c_str());
    rtnl_link_macvtap_set_mode(want.get(), MACVLAN_MODE_PASSTHRU);
    if (err = rtnl_link_add(sk.get(), want.get(), NLM_F_CREATE | NLM_F_EXCL); err < 0) {
      std::string why = "creating macvtap " + out.name + " on " + lower + ": " + nl_geterror(err);
      if (!others.empty()) why += " (" + lower + " already carries " + others + ")";
      throw std::runtime_error(why);
    }
  }
  // From here on the link exists: any failure deletes it again.
  try {
    // The alias (ownership) and IFF_UP in one change; the kernel applies
    // no alias given with the creation itself.
    const Link cur = nl::get_link(sk.get(), out.name, &err);
    if (!cur) throw std::runtime_error("macvtap " + out.name + " vanished after creation: " + nl_geterror(err));
    Link change(rtnl_link_alloc());
    rtnl_link_set_ifalias(change.get(), alias.c_str());
    rtnl_link_set_flags(change.get(), IFF_UP);
    if (err = rtnl_link_change(sk.get(), cur.get(), change.get(), 0); err < 0)
      throw std::runtime_error("macvtap " + out.name + ": setting its alias and bringing it up: " + nl_geterror(err));
    const int index = rtnl_link_get_ifindex(cur.get());
    for (unsigned q = 0; q < queues; ++q) {
      UniqueFd fd = open_char_device(out.name, index);
      // Every open is one more queue of the macvtap; the ioctl keeps the
      // tap flags with the virtio-net header on (the device's default).
      ifreq ifr{};
      ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR | (queues > 1 ? IFF_MULTI_QUEUE : 0);
      if (::ioctl(fd.get(), TUNSETIFF, &ifr) != 0) throw_errno("TUNSETIFF on macvtap " + out.name);
      out.fds.push_back(std::move(fd));
    }
  } catch (...) {
    out.fds.clear();
    try {
      delete_link(sk.get(), out.name);
    } catch (const std::exception&) {
    }
    throw;
  }
  return out;
}

Macvtap::Macvtap(const std::string& lower, const std::string& instance, const std::string& device, unsigned queues)
    : Macvtap(create_link(lower, instance, device, queues), lower) {}

Macvtap::Macvtap(Opened&& opened, std::string lower) try
    : Tap(opened.name, std::move(opened.fds)), lower_(std::move(lower)) {
  control_.reset(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!control_) throw_errno("macvtap " + name() + ": control socket");
} catch (...) {
  // Tap's setup failed (or ours): the queues are closed; the link goes.
  try {
    delete_link(route_socket().get(), opened.name);
  } catch (const std::exception&) {
  }
}

std::unique_ptr<Macvtap> Macvtap::adopt(const std::string& lower, const std::string& name, std::vector<UniqueFd> fds) {
  if (fds.empty()) throw std::runtime_error("macvtap " + name + ": no queue fds handed over");
  for (const UniqueFd& fd : fds) {
    ifreq ifr{};
    if (::ioctl(fd.get(), TUNGETIFF, &ifr) != 0 || name != ifr.ifr_name)
      throw std::runtime_error("macvtap " + name + ": a handed-over fd is not one of its queues");
  }
  Opened opened{name, std::move(fds)};
  return std::unique_ptr<Macvtap>(new Macvtap(std::move(opened), lower));
}

Macvtap::~Macvtap() {
  const std::string link = name();
  close_queues();
  if (keep_link_) return;  // the successor's
  try {
    delete_link(route_socket().get(), link);
  } catch (const std::exception& e) {
    // The next start finds it by its alias (remove_left_over).
    spdlog::warn("macvtap {} on {} not deleted: {}", link, lower_, e.what());
  }
}

bool Macvtap::link_up() const { return netdev_running(control_.get(), name()); }

std::vector<std::string> Macvtap::remove_left_over(const std::string& instance, const std::vector<std::string>& keep) {
  std::vector<std::string> removed;
  nl::Sock sk = route_socket();
  Cache cache = link_cache(sk.get());
  const std::string prefix = kAliasPrefix + instance + " ";
  for (nl_object* o = nl_cache_get_first(cache.get()); o; o = nl_cache_get_next(o)) {
    auto* l = reinterpret_cast<rtnl_link*>(o);
    const std::string a = alias_of_link(l);
    if (!is_macvlan_kind(l) || !starts_with(a, prefix)) continue;
    const std::string device = a.substr(prefix.size());
    bool kept = false;
    for (const auto& k : keep) kept |= k == device;
    if (kept) continue;
    const std::string name = rtnl_link_get_name(l);
    delete_link(sk.get(), name);
    removed.push_back(name + " ('" + a + "')");
  }
  return removed;
}

}  // namespace sriovd::ports
