// Split and packed rings over guest memory, as a hostile guest and VMM
// drive them: the input lays out the queue, then is a program of steps -
// rewrite any byte of guest RAM (descriptors, ring indices, event areas)
// between ring operations, pop / push / rewind, IOTLB updates and
// invalidations, rewrite the inflight region and start the queue again on
// it (a back-end restart). The device writes every byte of every writable
// segment it is given and reads every readable one, so a translation that
// reaches outside what the guest shared is an ASan report.
#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "fuzz/input.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/iotlb.hpp"
#include "sriovd/virtio/dirty_log.hpp"
#include "sriovd/virtio/ring.hpp"

namespace {

using namespace sriovd::virtio;

constexpr uint64_t kGpa = 0x10000;             // guest RAM starts here
constexpr uint64_t kRam = 64 * 1024;           // and is this long
constexpr uint64_t kUser = 0x7f0000000000ULL;  // the front-end's address of it (IOTLB targets)

struct Rig {
  std::vector<uint8_t> ram = std::vector<uint8_t>(kRam);
  std::vector<uint8_t> inflight;
  GuestMemory mem;
  Iotlb iotlb;
  std::unique_ptr<Virtqueue> queue;
  std::array<Segment, 64> segs{};
  Chain last{};
  bool have_last = false;
  // A migration's dirty log (mode bit 4): the ring marks its writes at a
  // device-area address the input picks (or by host pointer), the harness
  // the buffers it writes, as the device does.
  std::vector<uint8_t> log_bits;
  std::unique_ptr<DirtyLog> log;
  RingLog ring_log;
};

uint64_t sink;  // keeps the reads of readable segments

void use_chain(const Chain& c, std::span<Segment> segs, const DirtyLog* log) {
  for (unsigned i = 0; i < c.count && i < segs.size(); ++i) {
    if (segs[i].len == 0) continue;  // an empty buffer has no address to touch
    if (segs[i].writable) {
      std::memset(segs[i].data, 0xa5, segs[i].len);
      if (log) log->mark_host(segs[i].data, segs[i].len);
    } else {
      for (uint32_t b = 0; b < segs[i].len; ++b) sink += segs[i].data[b];
    }
  }
}

void start(Rig& r, bool packed, uint16_t size, bool event_idx, const RingAddresses& a, uint32_t base) {
  r.queue.reset();
  r.have_last = false;
  try {
    uint8_t* region = r.inflight.empty() ? nullptr : r.inflight.data();
    r.queue = packed ? make_packed_queue(r.mem, size, a, event_idx, Barriers::one_way, base, region, r.ring_log)
                     : make_split_queue(r.mem, size, a, event_idx, Barriers::one_way, base, region, r.ring_log);
  } catch (const std::invalid_argument&) {
    r.queue.reset();  // refused: a bad layout or an inconsistent inflight region
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sriovd::fuzz::Input in(data, size);
  const uint8_t mode = in.byte();
  const bool packed = mode & 1U;
  const bool event_idx = mode & 2U;
  const bool with_iotlb = mode & 4U;
  const bool with_inflight = mode & 8U;
  const bool with_log = mode & 16U;
  // Split sizes are powers of two; packed ones any size.
  const uint16_t qsize =
      packed ? static_cast<uint16_t>(1 + in.byte() % 128) : static_cast<uint16_t>(1U << (in.byte() % 8));
  RingAddresses a{kGpa + (in.take<uint16_t>() % kRam), kGpa + (in.take<uint16_t>() % kRam),
                  kGpa + (in.take<uint16_t>() % kRam)};
  const uint32_t base = in.take<uint32_t>();

  Rig r;
  r.mem.add_host_region(kGpa, kRam, kUser, r.ram.data());
  if (with_iotlb) r.mem.set_iotlb(&r.iotlb);
  if (with_inflight) r.inflight.assign(inflight_queue_bytes(qsize), 0);
  if (with_log) {
    r.log_bits.assign(1 + in.byte() % 16, 0);  // often too small for guest memory: misses are counted
    r.log = std::make_unique<DirtyLog>(r.log_bits.data(), r.log_bits.size(), r.mem);
    const uint64_t area = in.take<uint64_t>();
    r.ring_log = {r.log.get(), (area & 1U) ? RingLog::kByHost : area};
  }
  start(r, packed, qsize, event_idx, a, base);

  for (unsigned step = 0; step < 256 && !in.empty(); ++step) {
    switch (in.byte() % 9) {
      case 0: {  // the guest (or VMM) rewrites guest RAM
        const uint16_t off = in.take<uint16_t>();
        const auto bytes = in.bytes(in.byte() % 32);
        for (size_t i = 0; i < bytes.size(); ++i) r.ram[(off + i) % kRam] = bytes[i];
        break;
      }
      case 1:
        if (r.queue && !r.queue->broken()) {
          Chain c;
          if (r.queue->pop(c, r.segs)) {
            use_chain(c, r.segs, r.log.get());
            r.last = c;
            r.have_last = true;
          }
        }
        break;
      case 2:
        if (r.queue && r.have_last) {
          r.queue->push(r.last, std::min<uint32_t>(in.take<uint16_t>(), r.last.writable_bytes));
          r.have_last = false;
        }
        break;
      case 3:
        if (r.queue && r.have_last) {
          r.queue->rewind(r.last);
          r.have_last = false;
        }
        break;
      case 4:
        if (r.queue) {
          (void)r.queue->enable_kicks();
          (void)r.queue->should_notify();
          (void)r.queue->base();
        }
        break;
      case 5: {  // an IOTLB update: any IOVA onto any front-end address
        const IotlbEntry e{in.take<uint32_t>(), in.take<uint16_t>() + 1ULL, kUser + in.take<uint16_t>() - 0x100,
                           static_cast<uint8_t>(in.byte() % 4)};
        try {
          r.iotlb.update(e);
        } catch (const std::invalid_argument&) {
        }
        r.iotlb.publish();
        break;
      }
      case 6: {
        const uint64_t iova = in.take<uint32_t>();
        r.iotlb.invalidate(iova, in.take<uint16_t>() + 1ULL);
        r.iotlb.publish();
        break;
      }
      case 7:  // the front-end rewrites the inflight region, mid-run
        if (!r.inflight.empty()) {
          const uint16_t off = in.take<uint16_t>();
          const auto bytes = in.bytes(in.byte() % 16);
          for (size_t i = 0; i < bytes.size(); ++i) r.inflight[(off + i) % r.inflight.size()] = bytes[i];
        }
        break;
      case 8:  // the back-end restarts on what the region holds
        start(r, packed, qsize, event_idx, a, in.take<uint32_t>());
        break;
    }
    // A queue restarted, or the IOTLB changed: the old tables may go once
    // no pop is running (here: between steps).
    r.iotlb.reclaim();
  }
  return 0;
}
