// The virtio-net control queue (virtio 1.2 §5.1.6.5) as a hostile driver
// uses it: a real NetDevice with four queue pairs and its own control
// queue, served by its worker, commands posted as split-ring chains whose
// header, data and ack byte are cut across descriptors any way, with any
// negotiated subset of CTRL_RX, CTRL_MAC_ADDR, MQ and GUEST_ANNOUNCE. After every command:
//  - it is answered (a used element within a second - a hang is a
//    finding) with VIRTIO_NET_OK or VIRTIO_NET_ERR in its ack byte;
//  - the spec's commands do what they say, and only when negotiated:
//    MQ_VQ_PAIRS_SET of 1..max pairs is OK and sets the pairs in use,
//    anything else leaves them; MAC_ADDR_SET of six bytes sets the MAC;
//    a command of a class not offered is ERR;
//  - the device is not broken by a well-formed chain.
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include <spdlog/spdlog.h>

#include "fuzz/input.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/guest/virtqueue.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/net.hpp"

namespace {

using namespace sriovd;
using namespace sriovd::virtio;
using namespace sriovd::guest;

void check(bool ok) {
  if (!ok) std::abort();
}

constexpr uint64_t kRam = 1 << 20;
constexpr uint16_t kQueue = 64;
constexpr unsigned kPairs = 4;
constexpr uint64_t kRings = 0;          // four rings' worth, 16 KiB apart
constexpr uint64_t kBuffers = 0x40000;  // command bytes from here
constexpr uint8_t kOk = 0, kErr = 1;

class NullPort : public PacketPort {
 public:
  NullPort() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned queues() const override { return kPairs; }
  [[nodiscard]] int fd(unsigned) const override { return fd_.get(); }
  ssize_t send(unsigned, const iovec*, int) override { return 60; }
  ssize_t recv(unsigned, uint8_t*, size_t) override { return -1; }
  void set_offloads(unsigned) override {}
  void set_active_queues(unsigned n) override { active = n; }
  unsigned active = 0;

 private:
  std::string name_ = "ctrl0";
  UniqueFd fd_;
};

struct World {
  World() {
    spdlog::set_level(spdlog::level::off);
    irq::EngineOptions o;
    o.relay_threads = 0;
    engine = std::make_unique<irq::Engine>(o);
    NetConfig nc;
    nc.name = "vnet-ctrl";
    nc.queue_pairs = kPairs;
    nc.control_queue = true;
    nc.offloads = false;
    nc.mac = MacAddress::parse("02:00:00:00:00:01");
    auto p = std::make_unique<NullPort>();
    port = p.get();
    device = std::make_unique<NetDevice>(nc, *engine, std::move(p));
    ram = static_cast<uint8_t*>(std::aligned_alloc(4096, kRam));
    memory.add_host_region(0, kRam, 0, ram);
  }
  std::unique_ptr<irq::Engine> engine;
  NullPort* port = nullptr;
  std::unique_ptr<NetDevice> device;
  uint8_t* ram = nullptr;
  GuestMemory memory;
};

World& world() {
  static World w;
  return w;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& w = world();
  NetDevice& dev = *w.device;
  fuzz::Input in(data, size);
  dev.reset();
  std::memset(w.ram, 0, kRam);
  const uint8_t pick = in.byte();
  const uint64_t features = kVersion1 | kNetCtrlVq | ((pick & 1U) ? kNetCtrlRx : 0) |
                            ((pick & 2U) ? kNetCtrlMacAddr : 0) | ((pick & 4U) ? kNetMq : 0) |
                            ((pick & 8U) ? kNetGuestAnnounce : 0);
  dev.set_features(features & dev.offered_features());
  const uint64_t negotiated = dev.features();
  dev.set_memory(&w.memory);
  // Pair 0 (its worker serves the control queue) and the control queue.
  std::unique_ptr<SplitDriver> drivers[3];
  UniqueFd kicks[3];
  const unsigned queues[3] = {0, 1, dev.control_queue_index()};
  for (unsigned i = 0; i < 3; ++i) {
    const uint64_t gpa = kRings + 0x4000ULL * i;
    drivers[i] = std::make_unique<SplitDriver>(w.ram + gpa, gpa, kQueue);
    dev.set_queue_size(queues[i], kQueue);
    dev.set_queue_rings(queues[i], drivers[i]->addresses());
    kicks[i].reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    dev.set_queue_kick(queues[i], UniqueFd(::dup(kicks[i].get())));
    dev.set_queue_enabled(queues[i], true);
  }
  dev.start();
  check(dev.running());
  SplitDriver& ctrl = *drivers[2];

  uint64_t next = kBuffers;
  for (int commands = 0; commands < 8 && !in.empty(); ++commands) {
    // The command: class, command, then data; cut into 1..4 readable parts.
    const uint8_t cls = in.byte() % 6U;  // RX 0, MAC 1, VLAN 2, ANNOUNCE 3, MQ 4, and one past
    const uint8_t cmd = in.byte() % 3U;
    std::vector<uint8_t> body = {cls, cmd};
    const auto tail = in.bytes(in.byte() % 40U);
    body.insert(body.end(), tail.begin(), tail.end());
    const unsigned parts = 1U + in.byte() % 4U;
    std::vector<Buffer> chain;
    size_t at = 0;
    for (unsigned p = 0; p < parts && at < body.size(); ++p) {
      const size_t n = p + 1 == parts ? body.size() - at : std::min<size_t>(body.size() - at, 1U + in.byte() % 8U);
      std::memcpy(w.ram + next, body.data() + at, n);
      chain.push_back({next, static_cast<uint32_t>(n), false});
      next += (n + 15U) & ~15ULL;
      at += n;
    }
    const bool with_ack = in.byte() % 8U != 0;  // now and then a chain with nowhere to answer
    const uint64_t ack_at = next;
    w.ram[ack_at] = 0xee;
    if (with_ack) chain.push_back({ack_at, 1U + in.byte() % 2U, true});
    next += 16;
    if (next > kRam - 512) break;
    const unsigned pairs_before = dev.active_pairs();
    const uint64_t mac_before = w.device->rx_filter().mac.load();
    if (ctrl.add(chain) < 0) break;
    ctrl.publish();
    const uint64_t one = 1;
    check(::write(kicks[2].get(), &one, sizeof one) == sizeof one);
    uint32_t id = 0, len = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (!ctrl.take_used(id, len)) check(std::chrono::steady_clock::now() < deadline);  // a hang is a finding
    check(!dev.broken());
    if (!with_ack) {
      check(len == 0);
      continue;
    }
    check(len == 1);
    const uint8_t ack = w.ram[ack_at];
    check(ack == kOk || ack == kErr);
    const size_t data_len = body.size() - 2;
    const uint8_t* d = body.data() + 2;
    if (cls == 4 && cmd == 0) {  // MQ_VQ_PAIRS_SET
      uint16_t pairs = 0;
      if (data_len >= 2) std::memcpy(&pairs, d, 2);
      const bool valid = (negotiated & kNetMq) && data_len == 2 && pairs >= 1 && pairs <= kPairs;
      check(ack == (valid ? kOk : kErr));
      check(dev.active_pairs() == (valid ? pairs : pairs_before));
      if (valid) check(w.port->active == pairs);
    } else {
      check(dev.active_pairs() == pairs_before);
    }
    if (cls == 1 && cmd == 1) {  // MAC_ADDR_SET
      const bool valid = (negotiated & kNetCtrlMacAddr) && data_len == 6;
      check(ack == (valid ? kOk : kErr));
      if (valid) {
        const MacAddress m = dev.mac();
        check(std::memcmp(m.octets, d, 6) == 0);
      }
    } else {
      check(w.device->rx_filter().mac.load() == mac_before);  // only MAC_ADDR_SET sets the MAC
    }
    if (cls == 3) {  // ANNOUNCE_ACK (§5.1.6.5.4): no data, only when negotiated
      const bool valid = cmd == 0 && (negotiated & kNetGuestAnnounce) && data_len == 0;
      check(ack == (valid ? kOk : kErr));
    }
    if (cls == 2 || cls == 5) check(ack == kErr);  // VLAN, unknown: not offered
    if (cls == 0 && !(negotiated & kNetCtrlRx)) check(ack == kErr);
  }
  dev.stop();
  return 0;
}
