// sriovd-guest: plays the VMM and the guest driver against a vfio-user
// export, with no VM: shares memory, reads config space, programs MSI-X,
// gives eventfds, and masks/unmasks the way guests do - including the
// guest that masks its vector on every interrupt (msix-storm).
#include <linux/vfio.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <functional>
#include <thread>
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "sriovd/pci/config_space.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/guest/virtio_net_driver.hpp"
#include "sriovd/vfio_user/protocol.hpp"
#include "sriovd/ports/tap.hpp"
#include "sriovd/version.hpp"

namespace {

using nlohmann::json;
using sriovd::UniqueFd;
using sriovd::guest::VfioUserClient;

constexpr uint32_t kConfig = VFIO_PCI_CONFIG_REGION_INDEX;
constexpr uint32_t kMsix = VFIO_PCI_MSIX_IRQ_INDEX;

std::vector<uint8_t> read_config(VfioUserClient& c) {
  const auto r = c.region(kConfig);
  std::vector<uint8_t> bytes(std::min<uint64_t>(r.info.size, 4096));
  c.read(kConfig, 0, bytes);
  return bytes;
}

// `keep`: the region fds the export passed (bar_access: mmap passes the VF's
// VFIO device fd) are kept there instead of closed.
json info(VfioUserClient& c, std::vector<UniqueFd>* keep = nullptr) {
  json out;
  out["protocol"] = {{"minor", c.minor()}, {"server", c.server_capabilities()}};
  const auto d = c.device_info();
  out["device"] = {{"flags", d.flags},
                   {"regions", d.num_regions},
                   {"irqs", d.num_irqs},
                   {"pci", (d.flags & VFIO_DEVICE_FLAGS_PCI) != 0},
                   {"reset", (d.flags & VFIO_DEVICE_FLAGS_RESET) != 0}};
  json regions = json::array();
  for (uint32_t i = 0; i < d.num_regions; ++i) {
    const auto r = c.region(i);
    if (r.info.size == 0) continue;
    json areas = json::array();
    for (const auto& a : r.sparse) areas.push_back({{"offset", a.offset}, {"size", a.size}});
    regions.push_back({{"index", i},
                       {"size", r.info.size},
                       {"flags", r.info.flags},
                       {"mmap", (r.info.flags & VFIO_REGION_INFO_FLAG_MMAP) != 0},
                       {"fd", r.fd.valid()},
                       {"sparse", areas}});
    if (keep && r.fd.valid()) keep->emplace_back(::dup(r.fd.get()));
  }
  out["regions"] = regions;
  json irqs = json::array();
  for (uint32_t i = 0; i < d.num_irqs; ++i) {
    const auto q = c.irq_info(i);
    irqs.push_back({{"index", i}, {"count", q.count}, {"flags", q.flags}});
  }
  out["irqs"] = irqs;
  const auto cfg = read_config(c);
  uint16_t vendor, device;
  std::memcpy(&vendor, cfg.data(), 2);
  std::memcpy(&device, cfg.data() + 2, 2);
  out["config"] = {{"vendor", vendor}, {"device", device}, {"size", cfg.size()}};
  if (auto m = sriovd::pci::find_msix(cfg))
    out["msix"] = {{"vectors", m->vectors},
                   {"table_bar", m->table_bir},
                   {"table_offset", m->table_offset},
                   {"pba_bar", m->pba_bir},
                   {"pba_offset", m->pba_offset}};
  return out;
}

void print_info(const json& j) {
  std::printf("device: %04x:%04x, %u regions, %u irq types%s\n", j["config"]["vendor"].get<unsigned>(),
              j["config"]["device"].get<unsigned>(), j["device"]["regions"].get<unsigned>(),
              j["device"]["irqs"].get<unsigned>(), j["device"]["reset"].get<bool>() ? ", resettable" : "");
  for (const auto& r : j["regions"]) {
    std::printf("  region %u: %llu bytes%s", r["index"].get<unsigned>(),
                static_cast<unsigned long long>(r["size"].get<uint64_t>()),
                r["mmap"].get<bool>() ? ", mappable" : ", through messages");
    for (const auto& a : r["sparse"])
      std::printf(" [0x%llx +0x%llx]", static_cast<unsigned long long>(a["offset"].get<uint64_t>()),
                  static_cast<unsigned long long>(a["size"].get<uint64_t>()));
    std::printf("\n");
  }
  if (j.contains("msix"))
    std::printf("  MSI-X: %u vectors, table in BAR%u at 0x%x, PBA in BAR%u at 0x%x\n",
                j["msix"]["vectors"].get<unsigned>(), j["msix"]["table_bar"].get<unsigned>(),
                j["msix"]["table_offset"].get<unsigned>(), j["msix"]["pba_bar"].get<unsigned>(),
                j["msix"]["pba_offset"].get<unsigned>());
}

std::atomic<bool> g_stop{false};
extern "C" void on_signal(int) { g_stop.store(true); }

struct StormOptions {
  std::string socket;
  unsigned vector = 0;
  double seconds = 2;
  unsigned rate = 0;  // generator interrupts/s, 0: flat out
  std::string source = "generator";
  std::string mask_via = "table";
  bool mask_every = true;
};

// The guest the 2010 measurements were about: on every interrupt it masks
// the vector, handles it, and unmasks it again.
json storm(const StormOptions& o) {
  VfioUserClient c(o.socket);
  const auto cfg = read_config(c);
  const auto layout = sriovd::pci::find_msix(cfg);
  if (!layout) throw std::runtime_error(o.socket + ": the device has no MSI-X capability");
  if (o.vector >= layout->vectors)
    throw std::runtime_error("vector " + std::to_string(o.vector) + " of " + std::to_string(layout->vectors));
  // Guest RAM, shared as a VMM shares it.
  UniqueFd ram(::memfd_create("sriovd-guest-ram", MFD_CLOEXEC));
  constexpr uint64_t kRam = 2 << 20;
  if (!ram || ::ftruncate(ram.get(), kRam) != 0) sriovd::throw_errno("guest RAM memfd");
  c.dma_map(0, kRam, ram.get(), 0);

  const uint32_t bar = layout->table_bir;
  const uint64_t entry = layout->table_offset + 16ULL * o.vector;
  c.write32(bar, entry + 0, 0xfee00000);
  c.write32(bar, entry + 4, 0);
  c.write32(bar, entry + 8, 0x40 + o.vector);
  UniqueFd irq(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  const int fds[1] = {irq.get()};
  c.set_irq_eventfds(kMsix, o.vector, fds);
  const uint32_t dw0 = c.read32(kConfig, layout->cap_offset);
  c.write32(kConfig, layout->cap_offset, (dw0 & 0x3fffffffU) | 0x80000000U);  // MSI-X Enable
  c.write32(bar, entry + 12, 0);                                              // unmask
  auto mask = [&](bool m) {
    if (o.mask_via == "table")
      c.write32(bar, entry + 12, m ? 1 : 0);
    else
      c.mask(kMsix, o.vector, m);
  };
  const bool generator = o.source == "generator";
  if (generator) {
    // The simulated VF's generator registers (see vfio/simulated.hpp).
    c.write32(0, 0x1014, o.rate);
    c.write32(0, 0x1010, 1U << o.vector);
  }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // --seconds 0: until SIGTERM or SIGINT.
  const auto end = o.seconds > 0
                       ? start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.seconds))
                       : Clock::time_point::max();
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  uint64_t handled = 0, signals = 0, masks = 0;
  while (Clock::now() < end && !g_stop.load()) {
    if (!generator) c.trigger(kMsix, o.vector);
    pollfd p{irq.get(), POLLIN, 0};
    if (::poll(&p, 1, 100) != 1) continue;
    uint64_t n = 0;
    if (::read(irq.get(), &n, sizeof n) != sizeof n) continue;
    ++handled;
    signals += n;
    if (o.mask_every) {
      mask(true);
      mask(false);
      masks += 2;
    }
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  uint64_t generated = 0;
  if (generator) {
    c.write32(0, 0x1010, 0);
    uint64_t g = 0;
    c.read(0, 0x1018, {reinterpret_cast<uint8_t*>(&g), 8});
    generated = g;
    // What was raised before the generator stopped and not read yet.
    for (pollfd p{irq.get(), POLLIN, 0}; ::poll(&p, 1, 200) == 1;) {
      uint64_t n = 0;
      if (::read(irq.get(), &n, sizeof n) != sizeof n) break;
      ++handled;
      signals += n;
    }
  }
  c.write32(bar, entry + 12, 1);
  c.disable_irqs(kMsix);
  return {{"socket", o.socket},
          {"vector", o.vector},
          {"seconds", elapsed},
          {"source", o.source},
          {"mask_via", o.mask_via},
          {"handled", handled},
          {"handled_per_sec", handled / elapsed},
          {"signals", signals},
          {"masks_and_unmasks", masks},
          {"generated", generated}};
}

struct NetOptions {
  std::string socket;
  std::string vhost_user;
  std::string tap = "sriovd-guest0";
  std::string netns;
  uint16_t queue_size = 256;
  uint16_t queues = 1;
  bool packed = false;
  bool no_offloads = false;
  bool iommu = false;
  uint32_t iommu_page = 4096;
  bool dirty_log = false;
  double seconds = 0;
  bool mask_every_interrupt = false;
  bool posted_writes = false;
  std::string migrate_to;
  double migrate_after = 3;
};

// Live migration as a VMM makes it (virtio-pci over vfio-user), the guest's
// RAM shared by both hosts' devices (one machine): on the source, DMA
// logging on and a few pre-copy rounds while the guest runs, then the
// guest paused (its driver's bridge stops, as vCPUs do), STOP, STOP_COPY,
// the state read, the last round; on the destination the same device
// wired (DMA_MAP, SET_IRQS, doorbells), RESUMING, the state written,
// RUNNING; the source's connection closed (its VMM exits). `pause` stops
// the guest and returns once it has stopped. What it took, in JSON.
json migrate(std::unique_ptr<VfioUserClient>& source, std::unique_ptr<VfioUserClient>& dest,
             sriovd::guest::VirtioNetDriver& d, const std::string& to, const std::function<void()>& pause) {
  using Clock = std::chrono::steady_clock;
  const auto ms = [](Clock::duration t) { return std::chrono::duration<double, std::milli>(t).count(); };
  const auto pages = [](const std::vector<uint64_t>& bits) {
    uint64_t n = 0;
    for (const uint64_t w : bits) n += static_cast<uint64_t>(__builtin_popcountll(w));
    return n;
  };
  if (!(source->migration_flags() & sriovd::vfio_user::kMigrationStopCopy))
    throw std::runtime_error("the source device does not migrate (no VFIO_MIGRATION_STOP_COPY)");
  const sriovd::vfio_user::DmaRange ram{d.ram_iova(), d.ram().size()};
  const auto t0 = Clock::now();
  source->dma_logging_start(4096, {&ram, 1});
  uint64_t precopy = 0;
  constexpr int kRounds = 5;
  for (int r = 0; r < kRounds; ++r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    precopy += pages(source->dma_logging_report(ram.iova, ram.length, 4096));
  }
  const auto t_pause = Clock::now();
  pause();
  const auto t_paused = Clock::now();
  constexpr uint32_t kStop = 1, kRunning = 2, kStopCopy = 3, kResuming = 4;
  source->set_mig_state(kStop);
  source->set_mig_state(kStopCopy);
  const std::vector<uint8_t> state = source->mig_read_all();
  const uint64_t last = pages(source->dma_logging_report(ram.iova, ram.length, 4096));
  source->dma_logging_stop();
  dest = std::make_unique<VfioUserClient>(to);
  d.moved_to(*dest);
  dest->set_mig_state(kResuming);
  dest->mig_write_all(state);
  dest->set_mig_state(kRunning);
  const auto t_resumed = Clock::now();
  source.reset();  // the source's VMM exits: that device is reset for its next client
  std::fprintf(stderr,
               "sriovd-guest: migrated to %s: %.1f ms in all, the guest paused %.1f ms (the device's part %.1f ms), "
               "%zu bytes of device state, %llu pages logged before the pause and %llu after\n",
               to.c_str(), ms(t_resumed - t0), ms(t_resumed - t_pause), ms(t_resumed - t_paused), state.size(),
               static_cast<unsigned long long>(precopy), static_cast<unsigned long long>(last));
  return {{"to", to},
          {"total_ms", ms(t_resumed - t0)},
          {"downtime_ms", ms(t_resumed - t_pause)},
          {"device_downtime_ms", ms(t_resumed - t_paused)},
          {"state_bytes", state.size()},
          {"precopy_rounds", kRounds},
          {"precopy_pages", precopy},
          {"final_pages", last}};
}

// The guest's virtio-net driver, bridged to a tap: what the guest kernel
// would send goes out through the device, and what the device delivers
// comes up on the tap. Runs until SIGINT/SIGTERM or --seconds.
json virtio_net(const NetOptions& o) {
  if (o.socket.empty() && o.vhost_user.empty())
    throw std::invalid_argument("virtio-net: give --socket (vfio-user) or --vhost-user");
  std::unique_ptr<VfioUserClient> c;
  std::unique_ptr<VfioUserClient> dest;  // --migrate-to: the destination's connection (the driver's once it moved)
  std::unique_ptr<sriovd::guest::VirtioNetDriver> drv;
  sriovd::guest::VirtioNetDriverOptions opts;
  opts.queue_size = o.queue_size;
  opts.queue_pairs = o.queues;
  opts.packed = o.packed;
  opts.offloads = !o.no_offloads;
  opts.iommu = o.iommu;
  opts.iommu_page = o.iommu_page;
  opts.dirty_log = o.dirty_log;
  opts.mask_every_interrupt = o.mask_every_interrupt;
  opts.posted_mask_writes = o.posted_writes;
  if (o.posted_writes && !o.mask_every_interrupt)
    throw std::invalid_argument("virtio-net: --posted-writes is for --mask-every-interrupt's Vector Control writes");
  if (o.mask_every_interrupt && !o.vhost_user.empty())
    throw std::invalid_argument("virtio-net: --mask-every-interrupt is for --socket (virtio-pci's MSI-X)");
  if (o.iommu && o.vhost_user.empty()) throw std::invalid_argument("virtio-net: --iommu is for --vhost-user");
  if (!o.migrate_to.empty() && o.socket.empty())
    throw std::invalid_argument("virtio-net: --migrate-to is for --socket (virtio-net-pci over vfio-user)");
  if (!o.migrate_to.empty() && o.dirty_log)
    throw std::invalid_argument("virtio-net: --migrate-to makes its own DMA log; --dirty-log is not for it");
  if (!o.vhost_user.empty()) {
    drv = std::make_unique<sriovd::guest::VirtioNetDriver>(o.vhost_user, opts);
  } else {
    c = std::make_unique<VfioUserClient>(o.socket);
    drv = std::make_unique<sriovd::guest::VirtioNetDriver>(*c, opts);
  }
  auto& d = *drv;
  d.bring_up();
  // One tap queue per queue pair: the kernel spreads the flows it sends
  // over them as it would over a guest NIC's TX queues.
  sriovd::ports::Tap tap(o.tap, d.queue_pairs(), o.netns);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  const std::string where = o.vhost_user.empty() ? o.socket : o.vhost_user + " (vhost-user)";
  std::fprintf(stderr,
               "sriovd-guest: %s up: virtio-net %s, %u queue pair(s), %s ring, features 0x%llx, bridged to tap %s%s\n",
               where.c_str(), d.mac().c_str(), d.queue_pairs(), d.packed() ? "packed" : "split",
               static_cast<unsigned long long>(d.features()), o.tap.c_str(),
               o.netns.empty() ? "" : (" in netns " + o.netns).c_str());
  std::thread timer;
  if (o.seconds > 0)
    timer = std::thread([&] {
      const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.seconds);
      while (!g_stop.load() && std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      g_stop.store(true);
    });
  json migration;
  if (o.migrate_to.empty()) {
    d.bridge(tap, g_stop);
  } else {
    // The guest runs on the source until --migrate-after, moves, and runs on.
    std::atomic<bool> paused{false};
    std::thread vcpu([&] { d.bridge(tap, paused); });
    const auto at = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.migrate_after);
    while (!g_stop.load() && std::chrono::steady_clock::now() < at)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    auto pause = [&] {
      paused.store(true);
      if (vcpu.joinable()) vcpu.join();
    };
    if (!g_stop.load()) {
      try {
        migration = migrate(c, dest, d, o.migrate_to, pause);
      } catch (...) {
        pause();
        throw;
      }
      d.bridge(tap, g_stop);
    }
    pause();
  }
  if (timer.joinable()) timer.join();
  const auto& st = d.stats();
  return {{"socket", o.vhost_user.empty() ? o.socket : o.vhost_user},
          {"transport", o.vhost_user.empty() ? "vfio-user" : "vhost-user"},
          {"tap", o.tap},
          {"mac", d.mac()},
          {"packed", d.packed()},
          {"queue_pairs", d.queue_pairs()},
          {"features", d.features()},
          {"tx_packets", st.tx_packets.load()},
          {"tx_bytes", st.tx_bytes.load()},
          {"rx_packets", st.rx_packets.load()},
          {"rx_bytes", st.rx_bytes.load()},
          {"interrupts", st.interrupts.load()},
          {"kicks", st.kicks.load()},
          {"mask_writes", st.mask_writes.load()},
          {"posted_writes", o.posted_writes},
          {"mask_write_us", st.mask_writes.load() ? static_cast<double>(st.mask_ns.load()) / 1e3 /
                                                        static_cast<double>(st.mask_writes.load())
                                                  : 0.0},
          {"iommu", o.iommu},
          {"iotlb_misses", st.iotlb_misses.load()},
          {"iotlb_updates", st.iotlb_updates.load()},
          {"iotlb_faults", st.iotlb_faults.load()},
          {"dirty_log", o.dirty_log},
          {"dirty_pages", st.dirty_pages.load()},
          {"migration", migration}};
}

CLI::App* add_storm_command(CLI::App& app, StormOptions& so, bool& no_mask) {
  auto* storm_cmd = app.add_subcommand("msix-storm", "a guest that masks its vector on every interrupt: handled/s");
  storm_cmd->add_option("--socket", so.socket, "the export's vfio-user socket")->required();
  storm_cmd->add_option("--vector", so.vector, "MSI-X vector")->capture_default_str();
  storm_cmd->add_option("--seconds", so.seconds, "how long (0: until SIGTERM or SIGINT)")->capture_default_str();
  storm_cmd->add_option("--rate", so.rate, "generator interrupts/s (0: as fast as it can)")->capture_default_str();
  storm_cmd
      ->add_option("--source", so.source,
                   "generator: the simulated VF's interrupt generator; loopback: the client triggers each interrupt "
                   "(SET_IRQS TRIGGER), for any device")
      ->check(CLI::IsMember({"generator", "loopback"}))
      ->capture_default_str();
  storm_cmd->add_option("--mask-via", so.mask_via, "table: Vector Control writes; set-irqs: SET_IRQS MASK/UNMASK")
      ->check(CLI::IsMember({"table", "set-irqs"}))
      ->capture_default_str();
  storm_cmd->add_flag("--no-mask", no_mask, "a guest that does not mask per interrupt");
  return storm_cmd;
}

CLI::App* add_net_command(CLI::App& app, NetOptions& no) {
  auto* net_cmd = app.add_subcommand("virtio-net",
                                     "drive a virtio-net device as a guest would (virtio-net-pci over vfio-user, or as "
                                     "a vhost-user front-end) and bridge it to a tap");
  auto* net_sock = net_cmd->add_option("--socket", no.socket, "the export's vfio-user socket");
  auto* net_vu =
      net_cmd->add_option("--vhost-user", no.vhost_user, "a vhost-user back-end's socket (be its front-end instead)");
  net_sock->excludes(net_vu);
  net_cmd->add_option("--tap", no.tap, "the tap to bridge to (created)")->capture_default_str();
  net_cmd->add_option("--netns", no.netns, "network namespace to put the tap in");
  net_cmd->add_option("--queue-size", no.queue_size, "descriptors per queue")->capture_default_str();
  net_cmd->add_option("--queues", no.queues, "queue pairs (virtio-net-pci: more than one negotiates MQ)")
      ->capture_default_str()
      ->check(CLI::Range(1, 8));
  net_cmd->add_flag("--packed", no.packed, "use the packed ring layout (when the device offers it)");
  net_cmd->add_flag("--no-offloads", no.no_offloads, "negotiate no checksum or TSO offloads");
  net_cmd->add_flag("--iommu", no.iommu,
                    "vhost-user: a guest behind an IOMMU (ACCESS_PLATFORM; IOVAs, IOTLB misses answered with updates)");
  net_cmd->add_option("--iommu-page", no.iommu_page, "bytes each IOTLB update maps")->capture_default_str();
  net_cmd->add_flag("--dirty-log", no.dirty_log,
                    "a VMM migrating the guest: vhost-user, a dirty log given and LOG_ALL on; virtio-pci, the "
                    "device's DMA logging on; the marked pages taken every 10 ms");
  net_cmd->add_option("--seconds", no.seconds, "stop after this long (0: at SIGINT/SIGTERM)")->capture_default_str();
  net_cmd->add_option("--migrate-to", no.migrate_to,
                      "virtio-pci: live-migrate the device, as a VMM does, to this vfio-user socket (another "
                      "sriovd's export of the same device) after --migrate-after seconds, and go on there");
  net_cmd->add_option("--migrate-after", no.migrate_after, "seconds on the source before --migrate-to")
      ->capture_default_str();
  net_cmd->add_flag("--mask-every-interrupt", no.mask_every_interrupt,
                    "virtio-pci: mask each queue vector (MSI-X Vector Control) on its interrupt, unmask once served");
  net_cmd->add_flag("--posted-writes", no.posted_writes,
                    "with --mask-every-interrupt: send the Vector Control writes posted (No_reply), as QEMU does");
  return net_cmd;
}

void print_net(const json& j) {
  if (!j["migration"].is_null())
    std::printf("virtio-net: migrated to %s: downtime %.1f ms (the device's part %.1f ms), %llu bytes of state\n",
                j["migration"]["to"].get<std::string>().c_str(), j["migration"]["downtime_ms"].get<double>(),
                j["migration"]["device_downtime_ms"].get<double>(),
                static_cast<unsigned long long>(j["migration"]["state_bytes"].get<uint64_t>()));
  if (j["dirty_log"].get<bool>())
    std::printf("virtio-net: %llu dirty pages taken from the log\n",
                static_cast<unsigned long long>(j["dirty_pages"].get<uint64_t>()));
  std::printf("virtio-net: %llu packets out, %llu in, %llu interrupts, %llu mask writes, %llu IOTLB updates\n",
              static_cast<unsigned long long>(j["tx_packets"].get<uint64_t>()),
              static_cast<unsigned long long>(j["rx_packets"].get<uint64_t>()),
              static_cast<unsigned long long>(j["interrupts"].get<uint64_t>()),
              static_cast<unsigned long long>(j["mask_writes"].get<uint64_t>()),
              static_cast<unsigned long long>(j["iotlb_updates"].get<uint64_t>()));
}

void print_storm(const StormOptions& so, const json& j) {
  std::printf("%s vector %u: %llu interrupts handled in %.2f s (%.0f/s), %llu mask+unmask writes\n", so.socket.c_str(),
              so.vector, static_cast<unsigned long long>(j["handled"].get<uint64_t>()), j["seconds"].get<double>(),
              j["handled_per_sec"].get<double>(),
              static_cast<unsigned long long>(j["masks_and_unmasks"].get<uint64_t>()));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sriovd-guest: a vfio-user client that plays the VMM and the guest driver"};
  app.set_version_flag("--version", std::string(sriovd::kVersion));
  app.require_subcommand(1);
  app.fallthrough();
  bool as_json = false;
  app.add_flag("--json", as_json, "print JSON");
  std::string info_socket;
  auto* info_cmd = app.add_subcommand("info", "what the export offers: regions, sparse areas, interrupts, MSI-X");
  info_cmd->add_option("--socket", info_socket, "the export's vfio-user socket")->required();
  unsigned hold_seconds = 0;
  info_cmd->add_option("--hold", hold_seconds,
                       "then keep the connection and every fd the export passed (a VMM holding the VF's device fd) "
                       "for this many seconds");
  StormOptions so;
  bool no_mask = false;
  auto* storm_cmd = add_storm_command(app, so, no_mask);
  NetOptions no;
  auto* net_cmd = add_net_command(app, no);
  CLI11_PARSE(app, argc, argv);
  try {
    json j;
    if (*info_cmd) {
      VfioUserClient c(info_socket);
      std::vector<UniqueFd> kept;
      j = info(c, &kept);
      if (!as_json) print_info(j);
      if (hold_seconds) {
        std::fflush(stdout);
        std::this_thread::sleep_for(std::chrono::seconds(hold_seconds));
      }
    } else if (*net_cmd) {
      j = virtio_net(no);
      if (!as_json) print_net(j);
    } else if (*storm_cmd) {
      so.mask_every = !no_mask;
      j = storm(so);
      if (!as_json) print_storm(so, j);
    }
    if (as_json) std::cout << (*info_cmd ? j.dump(2) : j.dump()) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sriovd-guest: %s\n", e.what());
    return 1;
  }
  return 0;
}
