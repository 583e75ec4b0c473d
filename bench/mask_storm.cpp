// scripts/bench mask-storm: a guest that masks its vector on every
// interrupt (mask in the handler, unmask at its end), three ways in one run:
//   naive    - policy direct: every mask/unmask retargets the vector with
//              SET_IRQS, as QEMU did before its lazy release;
//   lazy     - policy relay: mask/unmask are flag flips, fires while masked
//              latch the PBA bit, unmask replays;
//   adaptive - starts direct, falls back to relay after the first mask.
// The device raises its vector with VFIO's loopback trigger (a real
// vfio-pci device with --device, run inside the VM harness), or the
// simulated VF with --simulated. Prints one JSON object.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "sriovd/msix/msix.hpp"
#include "sriovd/vfio/kernel.hpp"
#include "sriovd/vfio/simulated.hpp"

using namespace sriovd;
using Clock = std::chrono::steady_clock;

namespace {

struct Result {
  double per_sec = 0;
  uint64_t interrupts = 0;
  uint64_t timeouts = 0;
  uint64_t mode_switches = 0;
};

Result storm(vfio::Device& dev, unsigned vector, irq::Policy policy, double seconds, bool busy_poll) {
  vfio::MsixVectors vectors(dev);
  vectors.reserve(vector + 1);
  irq::EngineOptions o;
  o.relay_threads = 1;
  o.busy_poll = busy_poll;
  irq::Engine engine(o);
  const irq::RouteId id = engine.add({dev.name(), vector, policy, &vectors});
  UniqueFd sink_owner(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  const int sink = sink_owner.get();
  engine.set_sink(id, std::move(sink_owner));
  msix::RoutedVectors routed(engine, {id});
  msix::MsixState table(1, routed);
  table.write_message_control(msix::kEnable);
  table.write_table(12, 4, 0);  // the guest unmasks its vector

  Result r;
  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  auto next_housekeeping = t0;
  while (Clock::now() < end) {
    if (Clock::now() >= next_housekeeping) {  // as the daemon's timer does
      engine.housekeeping();
      next_housekeeping += std::chrono::milliseconds(50);
    }
    dev.trigger(vfio::kMsixIrq, vector);
    pollfd p{sink, POLLIN, 0};
    if (::poll(&p, 1, 1000) != 1) {
      ++r.timeouts;
      continue;
    }
    uint64_t n;
    (void)::read(sink, &n, sizeof n);
    table.write_table(12, 4, 1);  // the guest's handler masks...
    table.write_table(12, 4, 0);  // ...and unmasks when done
    ++r.interrupts;
  }
  r.per_sec = static_cast<double>(r.interrupts) / std::chrono::duration<double>(Clock::now() - t0).count();
  r.mode_switches = engine.stats(id).mode_switches;
  vectors.disable();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device;
  bool simulated = false;
  double seconds = 2.0;
  unsigned vector = 0;
  bool busy_poll = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc)
      device = argv[++i];
    else if (a == "--simulated")
      simulated = true;
    else if (a == "--seconds" && i + 1 < argc)
      seconds = std::stod(argv[++i]);
    else if (a == "--vector" && i + 1 < argc)
      vector = static_cast<unsigned>(std::stoul(argv[++i]));
    else if (a == "--busy-poll")
      busy_poll = true;
    else {
      std::fprintf(stderr,
                   "usage: sriovd-bench-mask-storm (--device PCI-ADDRESS | --simulated) [--seconds S] [--vector V] "
                   "[--busy-poll]\n");
      return 64;
    }
  }
  if (device.empty() == !simulated) {
    std::fprintf(stderr, "mask-storm: give --device ADDRESS (a vfio-pci device) or --simulated\n");
    return 64;
  }
  try {
    std::unique_ptr<vfio::Device> dev;
    if (simulated) {
      dev = std::make_unique<vfio::SimulatedDevice>("simulated-vf", 0x8086, 0x154c, 4);
    } else {
      auto addr = PciAddress::parse(device);
      if (!addr) throw std::runtime_error("not a PCI address: " + device);
      dev = vfio::KernelDevice::open(*addr);
    }
    utsname u{};
    ::uname(&u);
    nlohmann::json j = {{"device", simulated ? "simulated" : device},
                        {"kernel", simulated ? "simulated" : u.release},
                        {"seconds", seconds},
                        {"vector", vector},
                        {"relay_busy_poll", busy_poll}};
    for (auto [name, policy] : {std::pair{"naive", irq::Policy::direct}, std::pair{"lazy", irq::Policy::relay},
                                std::pair{"adaptive", irq::Policy::adaptive}}) {
      std::fprintf(stderr, "mask-storm: %s...\n", name);
      const Result r = storm(*dev, vector, policy, seconds, busy_poll);
      j[std::string(name) + "_per_sec"] = r.per_sec;
      j[std::string(name) + "_timeouts"] = r.timeouts;
      j[std::string(name) + "_mode_switches"] = r.mode_switches;
    }
    const double naive = j["naive_per_sec"].get<double>();
    j["lazy_vs_naive"] = naive > 0 ? j["lazy_per_sec"].get<double>() / naive : 0.0;
    j["adaptive_vs_naive"] = naive > 0 ? j["adaptive_per_sec"].get<double>() / naive : 0.0;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mask-storm: %s\n", e.what());
    return 1;
  }
}
