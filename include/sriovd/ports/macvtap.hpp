#pragma once
// The VF-to-virtio bridge through a macvtap link instead of AF_PACKET: a
// macvtap in passthru mode on the VF's netdev takes every frame the VF
// receives, and its character device is a tap (virtio-net header, kernel
// offloads through TUNSETOFFLOAD, one fd per queue, TUNSETQUEUE steering).
//
// The link is host state that outlives the process, so it carries its
// owner in its alias (IFLA_IFALIAS "sriovd:<owner>", where the owner is
// "<instance> <device>"): a link left by a daemon that crashed is found by
// that alias and deleted - when the device is served again, or by
// remove_left_over() at start for devices no longer configured.

#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/ports/tap.hpp"

namespace sriovd::ports {

class Macvtap : public Tap {
 public:
  // Creates the macvtap link on `lower` (passthru, named "svt<lower's
  // ifindex>", alias "sriovd:<instance> <device>"), opens its character
  // device once per queue and brings it up. A macvtap of the same instance
  // on `lower` is deleted first; one of another sriovd instance, or a
  // passthru link the kernel refuses next to another macvlan/macvtap, is an
  // error naming that link. On failure nothing is left behind.
  Macvtap(const std::string& lower, const std::string& instance, const std::string& device, unsigned queues);
  // The queue fds of macvtap `name` on `lower` another sriovd handed over
  // (an upgrade in place: the link stays). Throws std::runtime_error when
  // an fd is not a queue of that link.
  static std::unique_ptr<Macvtap> adopt(const std::string& lower, const std::string& name, std::vector<UniqueFd> fds);
  // Closes the queues and deletes the link (unless the successor has it):
  // the VF's netdev is as it was.
  ~Macvtap() override;
  void keep_for_successor() override { keep_link_ = true; }

  [[nodiscard]] const std::string& lower() const { return lower_; }
  [[nodiscard]] const std::string& netdev() const override { return lower_; }
  [[nodiscard]] std::vector<virtio::PortFact> describe() const override { return {{"macvtap", name()}}; }
  // The link's IFF_UP and IFF_RUNNING (a macvtap follows its lower
  // device's carrier): a VF whose link goes down.
  [[nodiscard]] bool link_up() const override;

  // Deletes every macvtap whose alias says `instance` made it and whose
  // device is not in `keep`; returns "name (alias)" of each one deleted.
  static std::vector<std::string> remove_left_over(const std::string& instance,
                                                   const std::vector<std::string>& keep = {});

  // The alias a link of (instance, device) carries.
  static std::string alias_of(const std::string& instance, const std::string& device);

 private:
  struct Opened;
  Macvtap(Opened&& opened, std::string lower);
  static Opened create_link(const std::string& lower, const std::string& instance, const std::string& device,
                            unsigned queues);

  std::string lower_;
  UniqueFd control_;  // for SIOCGIFFLAGS
  bool keep_link_ = false;
};

}  // namespace sriovd::ports
