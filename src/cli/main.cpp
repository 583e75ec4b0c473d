// sriovctl: talks to a running sriovd over its control socket.
#include <cstdio>
#include <thread>
#include <iostream>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "sriovd/control/client.hpp"
#include "sriovd/version.hpp"
#include "table.hpp"

namespace {

using sriovd::cli::Table;
using sriovd::control::json;

constexpr int kExitFailed = 1;        // the daemon answered with an error
constexpr int kExitUnreachable = 69;  // EX_UNAVAILABLE: no daemon to ask
constexpr int kExitUsage = 64;

std::string text(const json& j) {
  if (j.is_null()) return "-";
  if (j.is_string()) return j.get<std::string>();
  if (j.is_boolean()) return j.get<bool>() ? "yes" : "no";
  return j.dump();
}

std::string field(const json& obj, const char* key) { return obj.contains(key) ? text(obj[key]) : "-"; }

void print_status(const json& r) {
  std::printf("sriovd %s, pid %s, %s\n", field(r, "version").c_str(), field(r, "pid").c_str(),
              field(r, "state").c_str());
  if (r.value("binary_replaced", false))
    std::printf("  its binary was replaced since it started (an upgrade): restart it when its VMs allow\n");
  std::printf("  host:            %s\n", field(r, "host").c_str());
  std::printf("  config:          %s\n", field(r, "config").c_str());
  std::printf("  control socket:  %s\n", field(r, "control_socket").c_str());
  std::printf("  log level:       %s\n", field(r, "log_level").c_str());
  std::printf("  uptime:          %s s\n", field(r, "uptime_s").c_str());
  std::printf("  devices:         %s PF(s), %s VF(s), %s virtio device(s)\n", field(r, "physical_functions").c_str(),
              field(r, "vfs").c_str(), field(r, "virtio_devices").c_str());
  if (r.contains("control_loop")) {
    const json& loop = r["control_loop"];
    if (loop.value("poll_us", 0) == 0)
      std::printf("  control loop:    sleeps when idle (control.poll_us: 0)\n");
    else
      std::printf("  control loop:    polls up to %s us (%s now): %s polls, %s found work\n",
                  field(loop, "poll_us").c_str(), loop.value("polling", false) ? "polling" : "not polling",
                  field(loop, "polls").c_str(), field(loop, "hits").c_str());
  }
  if (r.contains("session_threads") && r["session_threads"].is_array()) {
    std::string per;
    for (const auto& t : r["session_threads"]) per += (per.empty() ? "" : " ") + field(t, "sessions");
    std::printf("  session threads: %zu (exports on each: %s)\n", r["session_threads"].size(), per.c_str());
  }
  const json& reloads = r["reloads"];
  std::printf("  reloads:         %s ok, %s refused\n", field(reloads, "ok").c_str(), field(reloads, "failed").c_str());
  if (!reloads.value("last_error", "").empty())
    std::printf("  last refusal:    %s\n", reloads["last_error"].get<std::string>().c_str());
}

void print_devices(const json& r) {
  Table vfs({"PF", "VF", "ADDRESS", "DRIVER", "GROUP", "MAC", "VLAN", "OWNER", "EXPORT", "STATE"});
  for (const auto& pf : r["physical_functions"]) {
    if (pf.value("state", "") == "missing") {
      vfs.add({field(pf, "pf"), "-", "-", "-", "-", "-", "-", "-", "-", "PF missing"});
      continue;
    }
    for (const auto& vf : pf["vfs"])
      vfs.add({field(pf, "pf"), field(vf, "index"), field(vf, "address"),
               field(vf, "driver").empty() ? "-" : field(vf, "driver"), field(vf, "iommu_group"), field(vf, "mac"),
               field(vf, "vlan"), field(vf, "owner"), field(vf, "export"), field(vf, "state")});
  }
  std::fputs(vfs.render().c_str(), stdout);
  if (!r["virtio_devices"].empty()) {
    Table virtio({"VIRTIO", "TRANSPORT", "ENDPOINT", "QUEUES", "BACKEND", "STATE"});
    for (const auto& d : r["virtio_devices"]) {
      const json& b = d["backend"];
      std::string backend =
          b.value("type", "") == "tap" ? "tap " + field(b, "name") : "vf " + field(b, "pf") + "/" + field(b, "vf");
      // How a VF's netdev is reached, and for AF_XDP whether the driver
      // gave zero-copy or the kernel copies.
      if (b.contains("via")) backend += " " + field(b, "via");
      if (b.contains("xdp_mode")) backend += " (" + field(b, "xdp_mode") + ")";
      std::string state = d.contains("reason") ? field(d, "state") + ": " + field(d, "reason") : field(d, "state");
      // A live migration under way: the device logs every page it writes.
      if (d.contains("vhost_user") && d["vhost_user"].contains("migration") &&
          d["vhost_user"]["migration"].value("logging", false))
        state += " (migrating: dirty logging)";
      if (d.contains("vfio_user") && d["vfio_user"].contains("migration")) {
        const json& m = d["vfio_user"]["migration"];
        const std::string mig = m.value("state", "RUNNING");
        if (mig != "RUNNING")
          state += " (migration: " + mig + ")";
        else if (m.value("dma_logging", false))
          state += " (migrating: DMA logging)";
      }
      // Where its driver reaches it: a socket, or (VDUSE) what the kernel
      // made of it.
      std::string where = field(d, "socket");
      if (d.contains("vduse"))
        where =
            d["vduse"].contains("netdev") ? "netdev " + field(d["vduse"], "netdev") : field(d["vduse"], "vhost_vdpa");
      virtio.add({field(d, "name"), field(d, "transport"), where,
                  field(d, "queue_pairs") + "x" + field(d, "queue_size"), backend, state});
    }
    std::fputs("\n", stdout);
    std::fputs(virtio.render().c_str(), stdout);
  }
  if (r.contains("vfio_user_exports") && !r["vfio_user_exports"].empty()) {
    Table ex({"EXPORT", "VF", "SOCKET", "MSIX-POLICY", "STATE", "CONNECTIONS", "DELIVERED", "MASKS", "SWITCHES"});
    for (const auto& e : r["vfio_user_exports"]) {
      const bool served = e.contains("vfio_user");
      ex.add({field(e, "pf") + "/" + field(e, "vf_index"), field(e, "vf"), field(e, "socket"), field(e, "msix_policy"),
              served ? field(e, "state") : "not served: " + field(e, "reason"),
              served ? field(e["vfio_user"], "connections") : "-", served ? field(e["interrupts"], "delivered") : "-",
              served ? field(e["interrupts"], "masks") : "-", served ? field(e["interrupts"], "mode_switches") : "-"});
    }
    std::fputs("\n", stdout);
    std::fputs(ex.render().c_str(), stdout);
  }
  // VFs no export serves whose VFIO device a VMM still holds (bar_access: mmap).
  if (r.contains("held_vfs") && !r["held_vfs"].empty()) {
    Table held({"HELD-VF", "HELD-BY"});
    for (const auto& h : r["held_vfs"]) held.add({field(h, "vf"), field(h, "held_by")});
    std::fputs("\n", stdout);
    std::fputs(held.render().c_str(), stdout);
  }
}

void print_steps(const json& steps, const char* none) {
  if (steps.empty()) std::printf("%s\n", none);
  for (const auto& s : steps) std::printf("  %s\n", s.get<std::string>().c_str());
}

void print_routes(const json& r) {
  Table t({"ROUTE", "DEVICE", "VECTOR", "MODE", "MASKED", "FIRED", "DELIVERED", "PENDING", "REPLAYED", "SWITCHES"});
  for (const auto& route : r["routes"])
    t.add({field(route, "id"), field(route, "device"), field(route, "vector"), field(route, "mode"),
           field(route, "masked"), field(route, "fired"), field(route, "delivered"), field(route, "masked_pending"),
           field(route, "replayed"), field(route, "mode_switches")});
  std::fputs(t.render().c_str(), stdout);
  if (r["routes"].empty()) std::fputs("(no interrupt routes)\n", stdout);
}

// Nested objects become dotted keys, one "key value" line each.
void print_flat(const json& j, const std::string& prefix = "") {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object())
      print_flat(*it, key);
    else
      std::printf("%-32s %s\n", key.c_str(), text(*it).c_str());
  }
}

// What the command line asked for, beyond the subcommand's name.
struct Args {
  std::string socket = sriovd::control::kDefaultSocket;
  bool as_json = false;
  double timeout_s = 10.0;
  std::string release_pf, release_device;
  int release_vf = -1;
  std::string fault_path;
  int fault_errno = 5, fault_skip = 0, fault_times = 1;
  std::string irq_device;
  unsigned irq_vector = 0;
  std::string udev_action, udev_device, udev_pf;
  bool udev_env = false;
  std::string link_pf, link_state;
  std::string upgrade_binary;
  bool upgrade_force = false;
};

// `upgrade`: the daemon replies (or its connection ends with the exec),
// then the successor - the same PID - answers `status` with what it took
// over from that PID.
int run_upgrade(const json& request, const Args& a) {
  const auto timeout = std::chrono::milliseconds(static_cast<long>(a.timeout_s * 1000));
  int pid = 0;
  json reply;
  try {
    sriovd::control::Client client(a.socket, timeout);
    pid = client.request({{"cmd", "status"}})["result"].value("pid", 0);
    reply = client.request(request);
  } catch (const std::exception& e) {
    if (pid == 0) {
      std::fprintf(stderr, "sriovctl: %s\n", e.what());
      return kExitUnreachable;
    }
    reply = json::object();  // the exec closed the connection before the reply came
  }
  if (reply.contains("ok") && !reply.value("ok", false)) {
    std::fprintf(stderr, "sriovctl: upgrade: %s\n", field(reply["error"], "message").c_str());
    return kExitFailed;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    json status;
    try {
      sriovd::control::Client client(a.socket, timeout);
      status = client.request({{"cmd", "status"}})["result"];
    } catch (const std::exception&) {
      continue;  // the successor is not listening yet
    }
    const json& h = status["handover"];
    if (!h.is_object() || h.value("from_pid", 0) != pid || status.value("pid", 0) != pid) {
      if (status.value("pid", 0) != pid) {
        std::fprintf(stderr, "sriovctl: upgrade: another sriovd (pid %d) answers now\n", status.value("pid", 0));
        return kExitFailed;
      }
      continue;
    }
    if (a.as_json) {
      std::printf("%s\n", status.dump(2).c_str());
    } else {
      const json none = json::array();
      const json& vfs = h.contains("vf_exports") ? h["vf_exports"] : none;
      std::printf("upgraded in place: sriovd %s, pid %d; took over %zu virtio device(s) and %zu VF export(s)\n",
                  field(status, "version").c_str(), pid, h["virtio_devices"].size(), vfs.size());
      for (const auto& n : h["virtio_devices"]) std::printf("  %s\n", n.get<std::string>().c_str());
      for (const auto& n : vfs) std::printf("  VF %s\n", n.get<std::string>().c_str());
      if (reply.contains("result"))
        for (const auto& n : reply["result"]["served_afresh"])
          std::printf("  served afresh: %s\n", n.get<std::string>().c_str());
    }
    return 0;
  }
  std::fprintf(stderr, "sriovctl: upgrade: no answer from the upgraded sriovd (pid %d) within 60 s\n", pid);
  return kExitFailed;
}

void add_commands(CLI::App& app, Args& a) {
  app.require_subcommand(1);
  app.fallthrough();  // the global options below are taken after the subcommand too
  app.add_option("-s,--socket", a.socket, "control socket of the daemon")->capture_default_str();
  app.add_flag("-j,--json", a.as_json, "print the daemon's JSON reply");
  app.add_option("-t,--timeout", a.timeout_s, "seconds to wait for a reply")->capture_default_str();
  static const std::pair<const char*, const char*> plain[] = {
      {"status", "daemon state, configuration and uptime"},
      {"devices", "PFs, VFs and virtio devices with their drivers, owners and state"},
      {"routes", "interrupt routes with their counters"},
      {"stats", "counters of the control API, reloads and routes"},
      {"reload", "re-read the configuration file and apply the difference (a bad file changes nothing)"},
      {"plan", "show what a reload of the file on disk would change on the host, without acting"},
      {"claims", "the Kubernetes DRA claims prepared on this node, their VFs and settings"},
      {"version", "daemon and client versions"}};
  for (const auto& [name, help] : plain) app.add_subcommand(name, help);
  auto* release = app.add_subcommand(
      "release", "give a VF, or every assigned VF of a PF, back to the host (until the next reload)");
  release->add_option("pf", a.release_pf, "PF address or netdev");
  release->add_option("vf", a.release_vf, "VF index (left out: every VF of the PF the config assigns)");
  release->add_option("--device", a.release_device, "the VF's own PCI address instead of PF and index");
  auto* fault = app.add_subcommand("simulate-fault", "simulated host only: make a sysfs write or VF setting fail");
  fault->add_option("path", a.fault_path, "substring of the sysfs path, or netlink/<pf>/vf<N>")->required();
  fault->add_option("--errno", a.fault_errno, "error to fail with (default EIO)");
  fault->add_option("--skip", a.fault_skip, "matching operations to let through first");
  fault->add_option("--times", a.fault_times, "how many to fail");
  auto* irq = app.add_subcommand("simulate-interrupt", "simulated host only: an exported VF raises an MSI-X vector");
  irq->add_option("device", a.irq_device, "the VF's PCI address")->required();
  irq->add_option("vector", a.irq_vector, "the MSI-X vector")->required();
  auto* link = app.add_subcommand("simulate-link", "simulated host only: a PF's link goes down or comes back");
  link->add_option("pf", a.link_pf, "the PF's address")->required();
  link->add_option("state", a.link_state, "up or down")->required()->check(CLI::IsMember({"up", "down"}));
  auto* upgrade =
      app.add_subcommand("upgrade",
                         "restart sriovd in place (the same PID) from its binary on disk, handing every VM's devices "
                         "(vhost-user, vfio-user, VF exports) to it without them noticing; refused, with the running "
                         "one going on, when it cannot");
  upgrade->add_option("--binary", a.upgrade_binary, "the binary to exec (default: the daemon's own path)");
  upgrade->add_flag("--force", a.upgrade_force,
                    "upgrade even if a device cannot be handed over now (a live migration): it is served afresh, "
                    "its client's connection ends");
  auto* udev = app.add_subcommand("udev-event", "tell the daemon a VF appeared or went (used by udev rules)");
  udev->add_option("action", a.udev_action, "add, remove, change, bind or unbind")->required();
  udev->add_option("device", a.udev_device, "PCI address of the VF (udev's %k)")->required();
  udev->add_option("--pf", a.udev_pf, "the VF's PF, when sysfs no longer shows it");
  udev->add_flag("--udev-env", a.udev_env, "print KEY=VALUE lines for udev's IMPORT{program}");
}

// The request line for `cmd`; nullopt (after saying why) when the
// arguments do not make one.
std::optional<json> request_for(const std::string& cmd, const Args& a) {
  json request = {{"cmd", cmd}};
  if (cmd == "release") {
    if (!a.release_device.empty()) {
      request["device"] = a.release_device;
    } else if (!a.release_pf.empty()) {
      request["pf"] = a.release_pf;
      if (a.release_vf >= 0) request["vf"] = a.release_vf;
    } else {
      std::fprintf(stderr, "sriovctl: release: give a PF (and a VF index), or --device ADDRESS\n");
      return std::nullopt;
    }
  }
  if (cmd == "simulate-fault") {
    request["path"] = a.fault_path;
    request["errno"] = a.fault_errno;
    request["skip"] = a.fault_skip;
    request["times"] = a.fault_times;
  }
  if (cmd == "simulate-interrupt") {
    request["device"] = a.irq_device;
    request["vector"] = a.irq_vector;
  }
  if (cmd == "simulate-link") {
    request["pf"] = a.link_pf;
    request["up"] = a.link_state == "up";
  }
  if (cmd == "upgrade") {
    if (!a.upgrade_binary.empty()) request["binary"] = a.upgrade_binary;
    request["force"] = a.upgrade_force;
  }
  if (cmd == "udev-event") {
    request["action"] = a.udev_action;
    request["device"] = a.udev_device;
    if (!a.udev_pf.empty()) request["pf"] = a.udev_pf;
  }
  return request;
}

// The DRA claims prepared: one line per device.
void print_claims(const json& r) {
  const json claims = r.value("claims", json::array());
  if (claims.empty()) std::printf("(no claims prepared for %s)\n", field(r, "driver").c_str());
  for (const json& c : claims)
    for (const json& d : c.value("devices", json::array())) {
      std::string settings;
      if (d.contains("config") && d["config"].is_object())
        for (auto it = d["config"].begin(); it != d["config"].end(); ++it)
          if (it.key() != "apiVersion" && it.key() != "kind" && it.key() != "driver")
            settings += (settings.empty() ? "" : " ") + it.key() + "=" + text(it.value());
      std::printf("%s/%s %s: %s (PF %s VF %s) %s%s%s\n", field(c, "namespace").c_str(), field(c, "name").c_str(),
                  field(c, "uid").c_str(), field(d, "device").c_str(), field(d, "pf").c_str(), field(d, "vf").c_str(),
                  field(d, "driver").c_str(), settings.empty() ? "" : " ", settings.c_str());
    }
}

// A successful reply's result, as text for a person (or udev).
void print_result(const std::string& cmd, const json& result, const Args& a) {
  if (cmd == "status") {
    print_status(result);
  } else if (cmd == "devices") {
    print_devices(result);
  } else if (cmd == "routes") {
    print_routes(result);
  } else if (cmd == "claims") {
    print_claims(result);
  } else if (cmd == "version") {
    std::printf("sriovd %s (config schema %s), sriovctl %s\n", field(result, "version").c_str(),
                field(result, "config_schema").c_str(), sriovd::kVersion);
  } else if (cmd == "reload") {
    std::printf("reloaded: %s\n", field(result, "summary").c_str());
    print_steps(result["changes"], "  (no host changes)");
  } else if (cmd == "plan") {
    std::printf("plan for %s:\n", field(result, "config").c_str());
    print_steps(result["steps"], "  (nothing to change)");
  } else if (cmd == "release") {
    std::printf("released %s:\n", field(result, "released").c_str());
    print_steps(result["changes"], "  (no host changes)");
  } else if (cmd == "udev-event" && a.udev_env) {
    std::printf("SRIOVD_MANAGED=%d\n", result.value("managed", false) ? 1 : 0);
    if (result.contains("pf")) std::printf("SRIOVD_PF=%s\n", result["pf"].get<std::string>().c_str());
    if (result.contains("vf_index")) std::printf("SRIOVD_VF_INDEX=%s\n", field(result, "vf_index").c_str());
  } else {
    print_flat(result);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sriovctl - query and steer a running sriovd"};
  Args a;
  add_commands(app, a);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kExitUsage;
  }
  const std::string cmd = app.get_subcommands().front()->get_name();
  const std::optional<json> request = request_for(cmd, a);
  if (!request) return kExitUsage;
  if (cmd == "upgrade") return run_upgrade(*request, a);

  json reply;
  try {
    sriovd::control::Client client(a.socket, std::chrono::milliseconds(static_cast<long>(a.timeout_s * 1000)));
    reply = client.request(*request);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sriovctl: %s\n", e.what());
    return kExitUnreachable;
  }
  if (!reply.value("ok", false)) {
    if (a.as_json)
      std::printf("%s\n", reply.dump(2).c_str());
    else
      std::fprintf(stderr, "sriovctl: %s: %s\n", cmd.c_str(), field(reply["error"], "message").c_str());
    return kExitFailed;
  }
  const json& result = reply["result"];
  if (a.as_json)
    std::printf("%s\n", result.dump(2).c_str());
  else
    print_result(cmd, result, a);
  return 0;
}
