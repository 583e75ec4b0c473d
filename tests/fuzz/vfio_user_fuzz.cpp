// The vfio-user server as a hostile VMM meets it, in front of both kinds of
// export: a simulated VF behind the VF proxy (virtual config space, BARs,
// MSI-X table and PBA emulated, routes in the engine) and virtio-net-pci
// (the virtio PCI transport, its MSI-X, a NetDevice behind it). Each input
// is one connection to one of them: VERSION first (most of the time, so
// the fuzzer gets past it), then messages of any command, flags and
// payload, with the fds a command carries (a memfd of guest RAM, which the
// input may also rewrite between messages, eventfds, now and then a pipe).
// Live migration's messages (DEVICE_FEATURE, MIG_DATA_READ/WRITE) are
// mostly well formed, so the state machine and the DMA log are walked.
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "fuzz/input.hpp"
#include "fuzz/socket_peer.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vfio/simulated.hpp"
#include "sriovd/vfio_user/protocol.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/vf_proxy.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "sriovd/virtio/net.hpp"

namespace {

using namespace sriovd;
using namespace sriovd::vfio_user;

constexpr size_t kRam = 1 << 20;

class NullPort : public virtio::PacketPort {
 public:
  NullPort() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned queues() const override { return 1; }
  [[nodiscard]] int fd(unsigned) const override { return fd_.get(); }
  ssize_t send(unsigned, const iovec*, int) override { return 60; }
  ssize_t recv(unsigned, uint8_t*, size_t) override { return -1; }
  void set_offloads(unsigned) override {}

 private:
  std::string name_ = "fuzz0";
  UniqueFd fd_;
};

struct World {
  World() {
    spdlog::set_level(spdlog::level::off);  // a log line per refused message would be most of the time
    dir = fuzz::socket_dir("vfu");
    irq::EngineOptions o;
    o.relay_threads = 0;
    engine = std::make_unique<irq::Engine>(o);
    proxy = std::make_unique<VfProxy>(std::make_unique<vfio::SimulatedDevice>("0000:3b:02.0", 0x8086, 0x154c, 8),
                                      *engine, irq::Policy::adaptive, "0000:3b:02.0");
    vf_socket = (dir / "vf.sock").string();
    vf_server = std::make_unique<Server>(io, vf_socket, *proxy);
    virtio::NetConfig nc;
    nc.name = "fuzz-pci";
    nc.control_queue = true;
    device = std::make_unique<virtio::NetDevice>(nc, *engine, std::make_unique<NullPort>());
    pci = std::make_unique<VirtioPci>(*device, *engine, "fuzz-pci");
    pci_socket = (dir / "pci.sock").string();
    pci_server = std::make_unique<Server>(io, pci_socket, *pci);
    ram.reset(::memfd_create("fuzz-ram", MFD_CLOEXEC));
    (void)::ftruncate(ram.get(), kRam);
    host = static_cast<uint8_t*>(::mmap(nullptr, kRam, PROT_READ | PROT_WRITE, MAP_SHARED, ram.get(), 0));
  }
  std::filesystem::path dir;
  asio::io_context io;
  std::unique_ptr<irq::Engine> engine;
  std::unique_ptr<VfProxy> proxy;
  std::string vf_socket;
  std::unique_ptr<Server> vf_server;
  std::unique_ptr<virtio::NetDevice> device;
  std::unique_ptr<VirtioPci> pci;
  std::string pci_socket;
  std::unique_ptr<Server> pci_server;
  UniqueFd ram;
  uint8_t* host = nullptr;
};

World& world() {
  static World* w = new World();  // lives for the process: the fuzzer may stop anywhere
  return *w;
}

void send_message(int sock, uint16_t id, uint16_t command, uint32_t flags, std::span<const uint8_t> payload,
                  std::span<const int> fds) {
  Header h{id, command, static_cast<uint32_t>(sizeof(Header) + payload.size()), flags, 0};
  const iovec iov[2] = {{&h, sizeof h}, {const_cast<uint8_t*>(payload.data()), payload.size()}};
  (void)send_with_fds(sock, std::span<const iovec>(iov, payload.empty() ? 1 : 2), fds);
}

// Mostly the size a command takes, so the fuzzer gets past the shape check.
size_t usual_size(uint16_t command, uint16_t pick) {
  switch (command) {
    case kVersion: return 4 + pick % 64;
    case kDmaMap: return sizeof(DmaMap);
    case kDmaUnmap: return sizeof(DmaUnmap);
    case kDeviceGetInfo: return sizeof(DeviceInfo);
    case kDeviceGetRegionInfo: return sizeof(RegionInfo);
    case kDeviceGetRegionIoFds: return sizeof(RegionIoFds);
    case kDeviceGetIrqInfo: return sizeof(IrqInfo);
    case kDeviceSetIrqs: return sizeof(IrqSet) + pick % 16;
    case kRegionRead: return sizeof(RegionAccess);
    case kRegionWrite: return sizeof(RegionAccess) + 1 + pick % 8;
    case kRegionWriteMulti: return sizeof(uint64_t) + (pick % 4) * sizeof(WriteOne);
    case kDeviceFeature: return sizeof(DeviceFeature) + (pick % 5) * 8;
    case kMigDataRead: return sizeof(MigData);
    case kMigDataWrite: return sizeof(MigData) + pick % 64;
    default: return 0;
  }
}

std::vector<UniqueFd> fds_for(World& w, uint16_t command, fuzz::Input& in) {
  std::vector<UniqueFd> fds;
  const unsigned n = command == kDeviceSetIrqs ? in.byte() % 9 : in.byte() % 2;
  for (unsigned i = 0; i < n; ++i) {
    if (command == kDmaMap || command == kDmaUnmap) {
      fds.emplace_back(::dup(w.ram.get()));
    } else if ((in.byte() & 7U) == 0) {
      int p[2];
      if (::pipe2(p, O_CLOEXEC) == 0) {
        fds.emplace_back(p[1]);
        ::close(p[0]);
      }
    } else {
      fds.emplace_back(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    }
  }
  return fds;
}

// A migration message most of the time well formed, so the fuzzer walks
// the state machine and the DMA log rather than the shape checks: a
// feature with one operation and its data (a state, a range over the
// fuzzer's RAM window, a report), MIG_DATA_WRITE's size what it carries.
std::vector<uint8_t> migration_message(uint16_t command, fuzz::Input& in) {
  std::vector<uint8_t> p;
  const auto put = [&p](const auto& v) {
    const auto* b = reinterpret_cast<const uint8_t*>(&v);
    p.insert(p.end(), b, b + sizeof v);
  };
  if (command == kMigDataRead) {
    const uint32_t size = in.take<uint16_t>();
    put(MigData{static_cast<uint32_t>(sizeof(MigData) + size), size});
    return p;
  }
  if (command == kMigDataWrite) {
    const auto data = in.bytes(in.byte() % 128);
    put(MigData{static_cast<uint32_t>(sizeof(MigData) + data.size()), static_cast<uint32_t>(data.size())});
    p.insert(p.end(), data.begin(), data.end());
    return p;
  }
  const uint8_t pick = in.byte();
  const uint32_t feature = 1 + pick % 8;
  const uint32_t op = (pick & 0x80U) ? kFeatureProbe : ((pick & 0x40U) ? kFeatureSet : kFeatureGet);
  put(DeviceFeature{in.byte() % 8 == 0 ? in.take<uint32_t>() : 1U << 20U, feature | op});
  const uint64_t iova = static_cast<uint64_t>(in.byte() % 4U) * 0x100000;
  const uint64_t length = static_cast<uint64_t>(in.byte() % 17U) * 0x10000;
  switch (feature) {
    case kFeatureMigDeviceState:
      if (op == kFeatureSet) put(MigDeviceState{in.byte() % 6U, -1});
      break;
    case kFeatureDmaLoggingStart: {
      const uint32_t ranges = in.byte() % 3;
      put(DmaLoggingControl{in.byte() % 4 == 0 ? in.take<uint64_t>() : 4096, ranges, 0});
      for (uint32_t i = 0; i < ranges; ++i) put(DmaRange{iova + i * 0x200000, length});
      break;
    }
    case kFeatureDmaLoggingReport: put(DmaLoggingReport{iova, length, uint64_t{1} << (in.byte() % 24)}); break;
    default: break;
  }
  return p;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& w = world();
  fuzz::Input in(data, size);
  const uint8_t mode = in.byte();
  UniqueFd sock;
  try {
    sock = connect_unix((mode & 1U) ? w.pci_socket : w.vf_socket, "fuzz", true);
  } catch (const std::exception&) {
    return 0;
  }
  fuzz::settle(w.io, sock.get());
  if (!(mode & 2U)) {
    // Bare, or with the capabilities QEMU 11's client proposes.
    std::vector<uint8_t> version(4);
    const uint16_t v[2] = {kMajor, kMinor};
    std::memcpy(version.data(), v, sizeof v);
    if (mode & 4U) {
      const std::string caps =
          R"({"capabilities":{"max_msg_fds":16,"max_data_xfer_size":1048576,"max_dma_maps":65535,)"
          R"("pgsizes":4096,"migration":{"pgsize":4096,"max_bitmap_size":1048576},"write_multiple":true}})";
      version.insert(version.end(), caps.begin(), caps.end());
      version.push_back(0);
    }
    send_message(sock.get(), 0, kVersion, 0, version, {});
    fuzz::settle(w.io, sock.get());
  }
  for (unsigned step = 0; step < 64 && !in.empty(); ++step) {
    const uint8_t op = in.byte();
    if (op % 8 == 7) {  // guest RAM rewritten under the device
      const uint32_t off = in.take<uint32_t>() % kRam;
      const auto bytes = in.bytes(in.byte() % 64);
      std::memcpy(w.host + off, bytes.data(), std::min<size_t>(bytes.size(), kRam - off));
      continue;
    }
    const uint16_t command = static_cast<uint16_t>(1 + in.byte() % 18);  // 14 (DIRTY_PAGES) is not served
    const uint32_t flags = in.byte() & (kTypeMask | kNoReply | kError);
    const uint16_t id = in.take<uint16_t>();
    const uint16_t pick = in.take<uint16_t>();
    const bool migration = command >= kDeviceFeature && (pick & 0x4000U) == 0;
    std::vector<uint8_t> payload;
    if (migration) {
      payload = migration_message(command, in);
    } else {
      const auto b = in.bytes((pick & 0x8000U) ? pick % 1024 : usual_size(command, pick));
      payload.assign(b.begin(), b.end());
    }
    std::vector<UniqueFd> fds = fds_for(w, command, in);
    std::vector<int> raw;
    for (const auto& f : fds) raw.push_back(f.get());
    send_message(sock.get(), id, command, flags, payload, raw);
    fuzz::settle(w.io, sock.get());
  }
  sock.reset();
  fuzz::settle(w.io, -1);
  return 0;
}
