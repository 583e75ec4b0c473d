// Live migration of virtio-net-pci over vfio-user: the protocol's
// DEVICE_FEATURE (MIGRATION, MIG_DEVICE_STATE, DMA_LOGGING_*) and
// MIG_DATA_READ/WRITE, driven as a VMM drives them (QEMU's kernel-VFIO
// migration, the one vfio-user's follows) by sriovd's own client, with
// sriovd's user-space guest driver receiving a known stream the whole time.
// Two servers stand for two hosts; the copy of guest RAM is made from the
// DMA log, and what the device alone wrote is what the guest reads on the
// destination: a write the log missed is a stale page the guest sees.
#include <gtest/gtest.h>
#include <linux/vfio.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <future>
#include <thread>

#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/guest/virtio_net_driver.hpp"
#include "sriovd/vfio_user/migration.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/process.hpp"
#include "support/stream_port.hpp"
#include "support/temp_dir.hpp"
#include "vfio_user/harness.hpp"

namespace sriovd::vfio_user {
namespace {

using namespace std::chrono_literals;
using sriovd::test::StreamPort;

constexpr uint32_t kRunning = 2, kStop = 1, kStopCopy = 3, kResuming = 4;
constexpr uint64_t kPage = 4096;

// One host's sriovd: a virtio-net device exported over vfio-user, its wire
// a StreamPort.
struct Host {
  Host(const std::string& socket, const std::string& name)
      : port(new StreamPort()), e(socket, config(name), std::unique_ptr<virtio::PacketPort>(port)) {}
  static virtio::NetConfig config(const std::string& name) {
    virtio::NetConfig nc;
    nc.name = name;
    nc.mac = MacAddress::parse("02:5a:00:00:07:01");
    nc.offloads = false;
    return nc;
  }
  template <typename F>
  auto on_io(F fn) {
    return e.on_io(fn);
  }
  MigrationStats migration() {
    return on_io([this] { return server.migration()->stats(); });
  }
  uint32_t state() {
    return on_io([this] { return static_cast<uint32_t>(server.migration()->state()); });
  }

  StreamPort* port;  // the device's
  test::Exported e;
  virtio::NetDevice& net = e.net;
  Server& server = e.server;
};

// The errno a refused request came back with (0: done).
int refused(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return 0;
}

class VfioUserMigration : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    a = std::make_unique<Host>(dir.file("a.sock"), "vnet-a");
    ca = std::make_unique<guest::VfioUserClient>(dir.file("a.sock"));
    d = std::make_unique<guest::VirtioNetDriver>(
        *ca, guest::VirtioNetDriverOptions{.queue_size = 64, .packed = GetParam(), .offloads = false});
    d->bring_up();
    ASSERT_EQ(d->packed(), GetParam());
  }
  void TearDown() override {
    d.reset();
    cb.reset();
    ca.reset();
    b.reset();
    a.reset();
  }

  // The guest takes `n` packets, each checked (test::StreamCheck).
  bool receive(unsigned n) {
    return stream.take([&](uint8_t* out, size_t size, int ms) { return d->receive(out, size, ms); }, n);
  }
  // One round of the copy: the pages the device wrote since the last
  // report, copied to the destination's memory.
  unsigned sync_round(guest::VfioUserClient& c) {
    const auto ram = d->ram();
    const std::vector<uint64_t> bits = c.dma_logging_report(d->ram_iova(), ram.size(), kPage);
    unsigned pages = 0;
    for (uint64_t page = 0; page < ram.size() / kPage; ++page) {
      if (!(bits[page / 64] & (1ULL << (page % 64)))) continue;
      std::memcpy(dest.data() + page * kPage, ram.data() + page * kPage, kPage);
      ++pages;
    }
    return pages;
  }
  // Where the copy differs from the source in what only the device
  // writes; then the copy becomes the guest's memory there (the
  // destination's RAM is the copy: the guest reads it from now on).
  uint64_t differing_device_bytes_then_switch() {
    const auto ram = d->ram();
    uint64_t differ = 0;
    for (const auto& area : d->device_only_areas()) {
      for (uint64_t i = 0; i < area.size; ++i) differ += ram[area.offset + i] != dest[area.offset + i];
      std::memcpy(ram.data() + area.offset, dest.data() + area.offset, area.size);
    }
    return differ;
  }

  test::TempDir dir;
  std::unique_ptr<Host> a, b;
  std::unique_ptr<guest::VfioUserClient> ca, cb;
  std::unique_ptr<guest::VirtioNetDriver> d;
  std::vector<uint8_t> dest;
  test::StreamCheck stream;
};

// The whole of it: the source logs while the stream flows into the guest
// and the copy is made round after round; the VM stops (the guest, then
// the device: STOP, STOP_COPY, the state read, the last round); the
// destination - another host, the copy as the guest's memory - takes the
// state (RESUMING, the state written, STOP, RUNNING) and the guest goes on
// reading: first what the source wrote before it stopped, then the
// destination's wire, every packet in order and intact.
TEST_P(VfioUserMigration, EveryPageTheDeviceWritesReachesTheDestinationAndTheGuestGoesOn) {
  a->port->flow(true);
  ASSERT_TRUE(receive(200));
  EXPECT_EQ(ca->migration_flags() & kMigrationStopCopy, kMigrationStopCopy);
  EXPECT_EQ(ca->mig_state(), kRunning);

  const DmaRange ram{d->ram_iova(), d->ram().size()};
  EXPECT_EQ(ca->dma_logging_start(kPage, {&ram, 1}), kPage);
  dest.assign(d->ram().begin(), d->ram().end());  // the bulk copy, the device writing on
  unsigned logged = 0;
  for (int round = 0; round < 6; ++round) {
    ASSERT_TRUE(receive(100)) << "round " << round;
    logged += sync_round(*ca);
  }
  EXPECT_GT(logged, 0U) << "the device wrote packets into the guest: pages were marked";
  // The VM stops: the guest first (it leaves what came last unread), then
  // the device.
  std::this_thread::sleep_for(50ms);
  a->port->flow(false);
  EXPECT_EQ(ca->set_mig_state(kStop), kStop);
  EXPECT_FALSE(a->net.running()) << "STOP: no worker writes guest memory";
  EXPECT_EQ(ca->set_mig_state(kStopCopy), kStopCopy);
  const std::vector<uint8_t> state = ca->mig_read_all(512);  // in several reads
  EXPECT_GT(state.size(), 1024U);
  sync_round(*ca);
  ca->dma_logging_stop();
  EXPECT_EQ(differing_device_bytes_then_switch(), 0U) << "bytes the device wrote that the log did not bring over";
  const MigrationStats sa = a->migration();
  EXPECT_EQ(sa.saved_bytes, state.size());
  EXPECT_EQ(sa.dma_log_reports, 7U);
  const uint32_t generated = a->port->generated();

  // The destination host: its own sriovd and wire, the guest's memory
  // mapped as the copy left it, the state loaded.
  b = std::make_unique<Host>(dir.file("b.sock"), "vnet-b");
  b->port->start_at(generated);
  cb = std::make_unique<guest::VfioUserClient>(dir.file("b.sock"));
  d->moved_to(*cb);  // DMA_MAP, the vectors' eventfds, the doorbells (as the VMM wires them)
  EXPECT_EQ(cb->set_mig_state(kResuming), kResuming);
  cb->mig_write_all(state, 1000);
  EXPECT_EQ(cb->set_mig_state(kStop), kStop);
  EXPECT_FALSE(b->net.running()) << "loaded, stopped until RUNNING";
  EXPECT_EQ(b->migration().loaded_bytes, state.size());
  b->port->flow(true);
  EXPECT_EQ(cb->set_mig_state(kRunning), kRunning);
  ASSERT_TRUE(b->net.running());
  ASSERT_TRUE(receive(300)) << "the destination's rings go on from the source's state";
  EXPECT_EQ(stream.corrupt, 0U) << "no repeat, nothing out of order, every byte as sent";
  EXPECT_LE(stream.gaps, 1U) << "at most the packet the source had in hand is lost";
  // The guest is somewhere else now: the destination announces it (a
  // RARP for its MAC: the driver did not take GUEST_ANNOUNCE).
  ASSERT_TRUE(test::wait_until([&] { return !b->port->sent().empty(); }, 2s));
  const std::vector<uint8_t> rarp = b->port->sent().front();
  ASSERT_EQ(rarp.size(), 12U + 60U);
  EXPECT_EQ(rarp[12 + 12], 0x80);
  EXPECT_EQ(rarp[12 + 13], 0x35);
  EXPECT_EQ(std::vector<uint8_t>(rarp.begin() + 12 + 6, rarp.begin() + 12 + 12),
            (std::vector<uint8_t>{0x02, 0x5a, 0x00, 0x00, 0x07, 0x01}));
  // The source's VMM exits: its server is ready for the next client.
  ca.reset();
  ASSERT_TRUE(test::wait_until([&] { return !a->on_io([&] { return a->server.connected(); }); }, 2s));
  EXPECT_EQ(a->state(), kRunning);
}

// A migration cancelled after the source stopped and gave its state: back
// to RUNNING (through STOP), the device goes on where it stood, nothing
// lost (the wire waits while it is stopped), nothing logged any more.
TEST_P(VfioUserMigration, CancelledAfterStopCopyTheSourceGoesOnWhereItStood) {
  a->port->flow(true);
  ASSERT_TRUE(receive(100));
  const DmaRange ram{d->ram_iova(), d->ram().size()};
  ca->dma_logging_start(kPage, {&ram, 1});
  ASSERT_TRUE(receive(100));
  EXPECT_EQ(ca->set_mig_state(kStopCopy), kStopCopy) << "RUNNING -> STOP_COPY goes through STOP";
  EXPECT_FALSE(a->net.running());
  EXPECT_FALSE(ca->mig_read_all().empty());
  EXPECT_EQ(ca->set_mig_state(kRunning), kRunning);
  ca->dma_logging_stop();
  EXPECT_TRUE(a->net.running());
  ASSERT_TRUE(receive(300));
  EXPECT_EQ(stream.corrupt, 0U);
  EXPECT_EQ(stream.gaps, 0U);
  EXPECT_EQ(refused([&] { (void)ca->dma_logging_report(ram.iova, ram.length, kPage); }), EINVAL)
      << "no log once it is stopped";
  EXPECT_TRUE(a->port->sent().empty()) << "the guest did not move: no announcement";
  EXPECT_EQ(a->migration().transitions, 4U) << "RUNNING STOP STOP_COPY STOP RUNNING";
}

// The state machine refuses what it does not serve with an errno and
// changes nothing; a state that does not load fails its arc and leaves
// RESUMING; DEVICE_RESET ends everything. The connection stays through all
// of it.
TEST_P(VfioUserMigration, WhatTheStateMachineRefusesChangesNothing) {
  for (uint32_t s : {0U, 5U, 6U, 7U, 99U}) EXPECT_EQ(refused([&] { ca->set_mig_state(s); }), EINVAL) << "state " << s;
  EXPECT_EQ(ca->mig_state(), kRunning);
  EXPECT_TRUE(a->net.running());
  EXPECT_EQ(refused([&] { (void)ca->mig_read_all(); }), EINVAL) << "no data to read in RUNNING";
  const std::vector<uint8_t> junk(100, 0x5a);
  EXPECT_EQ(refused([&] { ca->mig_write_all(junk); }), EINVAL) << "nothing to write in RUNNING";
  // A stream that is not a state: RESUMING -> STOP fails, the state stays.
  EXPECT_EQ(ca->set_mig_state(kResuming), kResuming);
  EXPECT_FALSE(a->net.running());
  ca->mig_write_all(junk);
  EXPECT_EQ(refused([&] { ca->set_mig_state(kRunning); }), EINVAL);
  EXPECT_EQ(ca->mig_state(), kResuming);
  EXPECT_EQ(a->migration().refused_loads, 1U);
  // DEVICE_RESET: RUNNING, the stream gone (the device reset with it).
  ca->reset();
  EXPECT_EQ(ca->mig_state(), kRunning);
  // A real state (a reset device's), cut short by a byte: refused too.
  EXPECT_EQ(ca->set_mig_state(kStopCopy), kStopCopy);
  std::vector<uint8_t> state = ca->mig_read_all();
  state.pop_back();
  EXPECT_EQ(ca->set_mig_state(kResuming), kResuming);
  ca->mig_write_all(state);
  EXPECT_EQ(refused([&] { ca->set_mig_state(kStop); }), EINVAL);
  EXPECT_EQ(ca->mig_state(), kResuming);
  // More than any state: refused at the write that passes the limit.
  const std::vector<uint8_t> mib(1 << 20, 0);
  int err = 0;
  for (size_t i = 0; i <= Migration::kMaxStream / mib.size() && err == 0; ++i)
    err = refused([&] { ca->mig_write_all(mib, 1 << 20); });
  EXPECT_EQ(err, EFBIG);
  ca->reset();
  EXPECT_TRUE(a->on_io([&] { return a->server.connected(); }));
  EXPECT_EQ(a->on_io([&] { return a->server.stats().protocol_errors; }), 0U);
}

// Issue 39, item 6: a saved state's two parts must name the same rings. A
// state whose device part puts a running queue's rings elsewhere than its
// transport registers say (the guest's driver sees those) was taken; now
// it is refused naming the queue, and the true state loads after it.
TEST_P(VfioUserMigration, AStateWhoseTransportAndDeviceDisagreeIsRefused) {
  EXPECT_EQ(ca->set_mig_state(kStopCopy), kStopCopy);
  const std::vector<uint8_t> saved = ca->mig_read_all();
  virtio::DeviceState state = virtio::DeviceState::parse(saved, "the saved state");
  ASSERT_FALSE(state.queues.empty());
  ASSERT_TRUE(state.queues[0].rings_set);
  state.queues[0].rings.desc += 0x1000;
  const std::vector<uint8_t> tampered = state.serialize();
  b = std::make_unique<Host>(dir.file("b.sock"), "vnet-b");
  cb = std::make_unique<guest::VfioUserClient>(dir.file("b.sock"));
  EXPECT_EQ(cb->set_mig_state(kResuming), kResuming);
  cb->mig_write_all(tampered);
  EXPECT_EQ(refused([&] { cb->set_mig_state(kStop); }), EINVAL);
  EXPECT_EQ(b->migration().refused_loads, 1U);
  const std::string why = b->on_io([&] { return b->server.stats().last_error; });
  EXPECT_NE(why.find("queue 0: rings at"), std::string::npos) << why;
  cb->reset();  // RUNNING, nothing loaded
  EXPECT_EQ(cb->set_mig_state(kResuming), kResuming);
  cb->mig_write_all(saved);
  EXPECT_EQ(cb->set_mig_state(kStop), kStop) << "the true state did not load";
}

// A driver that starts the device while a migration has it stopped
// (DRIVER_OK in STOP) gets a started device at RUNNING, not before.
TEST_P(VfioUserMigration, ADriverStartedWhileStoppedRunsAtRunning) {
  const uint64_t iova = d->ram_iova(), size = d->ram().size();
  EXPECT_EQ(ca->set_mig_state(kStop), kStop);
  d.reset();  // the driver resets the device as it goes: at RUNNING there is nothing to go on with
  ca->dma_unmap(iova, size);
  EXPECT_EQ(ca->set_mig_state(kRunning), kRunning);
  EXPECT_FALSE(a->net.running()) << "a device its driver reset does not start by itself";
  EXPECT_EQ(ca->set_mig_state(kStop), kStop);
  d = std::make_unique<guest::VirtioNetDriver>(
      *ca, guest::VirtioNetDriverOptions{.queue_size = 64, .packed = GetParam(), .offloads = false});
  d->bring_up();  // DRIVER_OK taken
  a->port->flow(true);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(a->net.running()) << "stopped for the migration";
  EXPECT_EQ(ca->set_mig_state(kRunning), kRunning);
  EXPECT_TRUE(a->net.running());
  ASSERT_TRUE(receive(100));
  EXPECT_EQ(stream.corrupt, 0U);
}

// A VMM that leaves mid-migration (QEMU killed): the next one finds the
// device RUNNING and nothing logged.
TEST_P(VfioUserMigration, AClientGoneMidMigrationLeavesNothingBehind) {
  const DmaRange ram{d->ram_iova(), d->ram().size()};
  ca->dma_logging_start(kPage, {&ram, 1});
  EXPECT_EQ(ca->set_mig_state(kStopCopy), kStopCopy);
  d.reset();
  ca.reset();
  ASSERT_TRUE(test::wait_until([&] { return !a->on_io([&] { return a->server.connected(); }); }, 2s));
  EXPECT_EQ(a->state(), kRunning);
  EXPECT_EQ(a->on_io([&] { return a->server.migration()->dma_log() != nullptr; }), false);
  guest::VfioUserClient next(dir.file("a.sock"));
  EXPECT_EQ(next.mig_state(), kRunning);
  EXPECT_EQ(refused([&] { (void)next.dma_logging_report(ram.iova, ram.length, kPage); }), EINVAL);
}

// DMA logging refuses what it cannot track, each with EINVAL (or EBUSY,
// E2BIG) and the session intact; while it runs, a writable window it does
// not cover cannot be mapped.
TEST_P(VfioUserMigration, DmaLoggingRefusesWhatItCannotTrack) {
  const uint64_t base = d->ram_iova(), size = d->ram().size();
  EXPECT_EQ(refused([&] { (void)ca->dma_logging_report(base, size, kPage); }), EINVAL) << "not started";
  struct Bad {
    const char* what;
    uint64_t page;
    std::vector<DmaRange> ranges;
  } bad[] = {
      {"page size 3", 3, {{base, size}}},
      {"unaligned", kPage, {{base + 1, size}}},
      {"empty", kPage, {{base, 0}}},
      {"wrapping", kPage, {{~0ULL - kPage + 1, 2 * kPage}}},
      {"overlapping", kPage, {{base, size}, {base + kPage, kPage}}},
      {"spanning past 8 TiB", kPage, {{0, kPage}, {1ULL << 44U, kPage}}},
  };
  for (const Bad& c : bad) EXPECT_EQ(refused([&] { (void)ca->dma_logging_start(c.page, c.ranges); }), EINVAL) << c.what;
  // Any power of two is taken; the device logs by 4 KiB pages and says so.
  const DmaRange ram{base, size};
  EXPECT_EQ(ca->dma_logging_start(65536, {&ram, 1}), kPage);
  EXPECT_EQ(refused([&] { (void)ca->dma_logging_start(kPage, {&ram, 1}); }), EBUSY) << "one at a time";
  EXPECT_EQ(refused([&] { (void)ca->dma_logging_report(base + size, kPage, kPage); }), EINVAL) << "outside";
  EXPECT_EQ(refused([&] { (void)ca->dma_logging_report(base + 512, kPage, kPage); }), EINVAL) << "unaligned";
  EXPECT_EQ(refused([&] { (void)ca->dma_logging_report(base, size, 3000); }), EINVAL) << "page size";
  EXPECT_EQ(refused([&] { (void)ca->dma_logging_report(base, 1ULL << 40U, kPage); }), E2BIG) << "a bitmap too big";
  // A reply buffer (argsz) too small for the bitmap.
  const DmaLoggingReport q{base, size, kPage};
  std::vector<uint8_t> payload(sizeof(DeviceFeature) + sizeof q);
  const DeviceFeature f{static_cast<uint32_t>(payload.size()), kFeatureDmaLoggingReport | kFeatureGet};
  std::memcpy(payload.data(), &f, sizeof f);
  std::memcpy(payload.data() + sizeof f, &q, sizeof q);
  const auto r = ca->request(kDeviceFeature, payload);
  EXPECT_TRUE(r.hdr.flags & kError);
  EXPECT_EQ(r.hdr.error, static_cast<uint32_t>(EINVAL));
  // A writable window outside the log is refused while it runs.
  UniqueFd mem(::memfd_create("more", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(mem.get(), 1 << 20), 0);
  EXPECT_EQ(refused([&] { ca->dma_map(0x40000000, 1 << 20, mem.get(), 0); }), EBUSY);
  ca->dma_logging_stop();
  ca->dma_map(0x40000000, 1 << 20, mem.get(), 0);
  // No ranges: every write, over the windows mapped now.
  const DmaRange none[1] = {};
  EXPECT_EQ(ca->dma_logging_start(kPage, std::span<const DmaRange>(none, 0)), kPage);
  EXPECT_NO_THROW((void)ca->dma_logging_report(0x40000000, 1 << 20, kPage));
  EXPECT_NO_THROW((void)ca->dma_logging_report(base, size, kPage));
  EXPECT_EQ(refused([&] { ca->dma_map(0x80000000, 1 << 20, mem.get(), 0); }), EBUSY);
  ca->dma_logging_stop();
  EXPECT_EQ(a->on_io([&] { return a->server.stats().protocol_errors; }), 0U);
}

INSTANTIATE_TEST_SUITE_P(Rings, VfioUserMigration, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "packed" : "split"; });

// The bitmap: marks at 4 KiB, reported at any power of two (several
// pages to a bit, or a page to several bits), cleared as reported, never
// a bit outside the range asked for.
TEST(DmaLog, ReportsAtAnyPageSizeAndClearsWhatItReports) {
  virtio::GuestMemory memory;
  const DmaRange ranges[] = {{0x100000, 0x100000}, {0x400000, 0x40000}};
  DmaLog log(ranges, memory);
  EXPECT_TRUE(log.tracks(0x100000, 0x100000));
  EXPECT_FALSE(log.tracks(0x1ff000, 0x2000)) << "past the first range";
  log.log().mark_gpa(0x100000 + 3 * kPage + 100, 10);  // page 3
  log.log().mark_gpa(0x100000 + 8 * kPage - 1, 2);     // pages 7 and 8
  log.log().mark_gpa(0x400000 + 0x3f000, 0x1000);      // the second range's last page
  auto report = [&](uint64_t iova, uint64_t len, uint64_t ps) {
    std::vector<uint64_t> bits(DmaLog::report_words(len, ps), 0);
    log.report(iova, len, ps, bits);
    return bits;
  };
  EXPECT_EQ(report(0x100000, 0x100000, 8192), std::vector<uint64_t>({(1ULL << 1U) | (1ULL << 3U) | (1ULL << 4U), 0}))
      << "pages 3, 7, 8 by 8 KiB: units 1, 3, 4";
  EXPECT_EQ(report(0x100000, 0x100000, kPage), std::vector<uint64_t>(4, 0)) << "cleared as reported";
  log.log().mark_gpa(0x100000 + 2 * kPage, 1);
  EXPECT_EQ(report(0x100000, 4 * kPage, 1024), std::vector<uint64_t>({0xfULL << 8U})) << "a page is 4 units of 1 KiB";
  EXPECT_EQ(report(0x400000 + 0x3f000, kPage, kPage), std::vector<uint64_t>({1}));
  EXPECT_EQ(log.log().missed(), 0U);
  log.log().mark_gpa(0x0ff000, 1);  // before the first range
  EXPECT_EQ(log.log().missed(), 1U);
}

// Issue 39, c1: a client that logs 8 TiB at a huge page size and asks for
// the whole range in a loop held the control thread 0.4 s a report (every
// bitmap byte read): another tenant waited 25 s, the watchdog 40 s. A
// report now reads only the bitmap pages a mark touched.
TEST(DmaLog, AReportCostsWhatTheDeviceWroteNotTheRangeClaimed) {
  virtio::GuestMemory memory;
  const DmaRange ranges[] = {{0, DmaLog::kMaxSpan}};
  DmaLog log(ranges, memory);
  const uint64_t gib = 1ULL << 30U;
  auto report = [&] {
    std::vector<uint64_t> bits(DmaLog::report_words(DmaLog::kMaxSpan, gib), 0);
    log.report(0, DmaLog::kMaxSpan, gib, bits);
    return bits;
  };
  for (int i = 0; i < 3; ++i) EXPECT_EQ(report(), std::vector<uint64_t>(128, 0));
  EXPECT_EQ(log.scanned_bytes(), 0U) << "a log nothing was written to was read";
  log.log().mark_gpa(5ULL << 40U, 1);  // one page, at 5 TiB
  std::vector<uint64_t> want(128, 0);
  want[5120 / 64] = 1ULL << (5120 % 64);
  EXPECT_EQ(report(), want);
  EXPECT_EQ(log.scanned_bytes(), 4096U) << "more than the one bitmap page written was read";
  EXPECT_EQ(report(), std::vector<uint64_t>(128, 0)) << "cleared as reported";
}
}  // namespace
}  // namespace sriovd::vfio_user
