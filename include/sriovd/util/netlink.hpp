#pragma once
// Owning handles for libnl objects and a connected rtnetlink socket, for
// the sources that speak rtnetlink through libnl-route (they link it
// themselves; nothing here is compiled into sriovd_util).

#include <netlink/cache.h>
#include <netlink/errno.h>
#include <netlink/msg.h>
#include <netlink/netlink.h>
#include <netlink/route/link.h>

#include <memory>
#include <new>
#include <stdexcept>
#include <string>

namespace sriovd::nl {

struct SockFree {
  void operator()(nl_sock* s) const { nl_socket_free(s); }
};
struct LinkPut {
  void operator()(rtnl_link* l) const { rtnl_link_put(l); }
};
struct CacheFree {
  void operator()(nl_cache* c) const { nl_cache_free(c); }
};
struct MsgFree {
  void operator()(nl_msg* m) const { nlmsg_free(m); }
};
struct AddrPut {
  void operator()(nl_addr* a) const { nl_addr_put(a); }
};
using Sock = std::unique_ptr<nl_sock, SockFree>;
using Link = std::unique_ptr<rtnl_link, LinkPut>;
using Cache = std::unique_ptr<nl_cache, CacheFree>;
using Msg = std::unique_ptr<nl_msg, MsgFree>;
using Addr = std::unique_ptr<nl_addr, AddrPut>;

// A NETLINK_ROUTE socket, connected; throws with libnl's reason.
inline Sock route_socket() {
  Sock sk(nl_socket_alloc());
  if (!sk) throw std::bad_alloc();
  if (int err = nl_connect(sk.get(), NETLINK_ROUTE); err < 0)
    throw std::runtime_error(std::string("connecting to rtnetlink: ") + nl_geterror(err));
  return sk;
}

// The kernel's current view of link `name`, or null (err set) when there is none.
inline Link get_link(nl_sock* sk, const std::string& name, int* err = nullptr) {
  rtnl_link* l = nullptr;
  const int e = rtnl_link_get_kernel(sk, 0, name.c_str(), &l);
  if (err) *err = e;
  return Link(e < 0 ? nullptr : l);
}

}  // namespace sriovd::nl
