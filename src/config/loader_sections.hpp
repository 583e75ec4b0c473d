#pragma once
// The config loader, one reader of one file: the top level and the
// control-plane sections (loader.cpp), physical functions and their VFs
// (physical_functions.cpp), virtio devices and their backends
// (virtio_devices.cpp). Internal to the config module.

#include <optional>
#include <string>

#include "reader.hpp"

namespace sriovd::config {

class Loader {
 public:
  explicit Loader(std::string file) : ctx_(file) { cfg_.path = std::move(file); }
  Config run(const YAML::Node& root);

 private:
  // loader.cpp
  void read_simulated(const YAML::Node& node);
  void read_control(const YAML::Node& node);
  void read_interrupts(const YAML::Node& node);
  void read_peer_limits(const YAML::Node& node);
  void read_metrics(const YAML::Node& node);
  // access: {user, group, mode, allowed_uids} of a socket a VMM connects to.
  SocketAccess read_access(const YAML::Node& node, const std::string& path);
  // Every socket the daemon binds must be distinct.
  void check_sockets();
  // Two devices with one MAC on a host is a misconfiguration nobody wants.
  void link_bridged_macs();
  void check_macs();

  // physical_functions.cpp
  // Resolves a PF named by address or netdev; in simulated mode it must be
  // one of the simulated PFs and comes back by address.
  const SimulatedPf* find_simulated(const PfRef& ref) const;
  void read_pf(const YAML::Node& node, const std::string& path);
  void read_vf(const YAML::Node& node, const std::string& path, PfConfig& pf, const SimulatedPf* sim);
  std::optional<VfAssign> read_assign(const YAML::Node& node, const std::string& path, const SimulatedPf* sim);

  // kubernetes.cpp
  void read_kubernetes(const YAML::Node& node);
  void read_pool(const YAML::Node& node, const std::string& path);
  void read_pool_vfs(const YAML::Node& n, const std::string& p, ResourcePool& pool);
  void check_pool_members();
  void read_dra(const YAML::Node& node);

  // virtio_devices.cpp
  void read_virtio(const YAML::Node& node, const std::string& path);
  std::optional<std::string> read_device_name(Mapping& m);
  void read_queues(Mapping& m, VirtioDevice& dev);
  bool read_backend(const YAML::Node& node, const std::string& path, VirtioDevice& dev);
  void only_for(Mapping& m, const char* key, const char* kind_name);  // a key of the other backend type
  bool read_tap_backend(Mapping& m, VirtioDevice& dev);
  void read_tap_offloads(Mapping& m, TapBackend& tap);
  bool read_vf_backend(Mapping& m, VirtioDevice& dev);
  const PfConfig* find_pf(Mapping& m, const std::string& pf_name);

  Context ctx_;
  Config cfg_;
  SourceLocation control_socket_where_;
};

}  // namespace sriovd::config
