// A device state from elsewhere (live migration brings it from another
// host, through a VMM that is not trusted): the bytes parsed, restored into
// a fresh virtio-pci transport with a virtio-net device behind it, and the
// device resumed on guest memory. Every input is either refused with
// std::invalid_argument before anything changed, or restored; a restored
// state saved again parses, restores into another fresh transport and saves
// to the same bytes (nothing is taken that the device would not keep).
// Whatever ring addresses it names, resuming the device never crashes.
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <vector>

#include <spdlog/spdlog.h>

#include "sriovd/irq/engine.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "sriovd/virtio/net.hpp"

namespace {

using namespace sriovd;

void check(bool ok) {
  if (!ok) std::abort();
}

constexpr uint64_t kRam = 1 << 20;

class NullPort : public virtio::PacketPort {
 public:
  NullPort() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned queues() const override { return 2; }
  [[nodiscard]] int fd(unsigned) const override { return fd_.get(); }
  ssize_t send(unsigned, const iovec*, int) override { return 60; }
  ssize_t recv(unsigned, uint8_t*, size_t) override { return -1; }
  void set_offloads(unsigned) override {}

 private:
  std::string name_ = "state0";
  UniqueFd fd_;
};

// A fresh device and transport (two pairs and the control queue).
struct Target {
  explicit Target(irq::Engine& engine)
      : device(config(), engine, std::make_unique<NullPort>()), pci(device, engine, "fuzz-state") {}
  static virtio::NetConfig config() {
    virtio::NetConfig nc;
    nc.name = "fuzz-state";
    nc.queue_pairs = 2;
    nc.control_queue = true;
    nc.max_queue_size = 256;
    return nc;
  }
  virtio::NetDevice device;
  vfio_user::VirtioPci pci;
};

struct World {
  World() {
    spdlog::set_level(spdlog::level::off);
    irq::EngineOptions o;
    o.relay_threads = 0;
    engine = std::make_unique<irq::Engine>(o);
    ram.resize(kRam);
  }
  std::unique_ptr<irq::Engine> engine;
  std::vector<uint8_t> ram;
};

World& world() {
  static World* w = new World();
  return *w;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& w = world();
  virtio::DeviceState state;
  // A version-2 state's last 4 bytes are its checksum: made right here, so
  // that the fuzzer's changes reach the fields behind it (the checksum's
  // own refusals are unit-tested).
  std::vector<uint8_t> bytes(data, data + size);
  if (size >= 12 && data[4] == 2 && data[5] == 0 && data[6] == 0 && data[7] == 0) {
    const uint32_t crc = virtio::DeviceState::checksum(std::span(bytes).first(size - 4));
    for (unsigned i = 0; i < 4; ++i) bytes[size - 4 + i] = static_cast<uint8_t>(crc >> (8U * i));
  }
  try {
    state = virtio::DeviceState::parse(bytes, "fuzz");
  } catch (const std::invalid_argument&) {
    return 0;
  }
  check(virtio::DeviceState::parse(state.serialize(), "again") == state);
  Target a(*w.engine);
  const std::vector<uint8_t> fresh = a.pci.save_state().serialize();
  try {
    a.pci.restore_state(state);
  } catch (const std::invalid_argument&) {
    check(a.pci.save_state().serialize() == fresh);  // refused: nothing changed
    return 0;
  }
  const std::vector<uint8_t> saved = a.pci.save_state().serialize();
  {
    Target b(*w.engine);
    b.pci.restore_state(virtio::DeviceState::parse(saved, "saved"));
    check(b.pci.save_state().serialize() == saved);
  }
  // Guest memory mapped: a device restored as started resumes on it, with
  // whatever ring addresses the state names (zeroed memory behind them).
  std::fill(w.ram.begin(), w.ram.end(), 0);
  vfio_user::DmaWindow window{0, kRam, w.ram.data(), true, true, nullptr};
  a.pci.dma_mapped(window);
  a.device.kick_all();
  a.device.stop();
  a.pci.dma_unmapped(window);
  return 0;
}
