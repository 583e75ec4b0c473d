// MSI-X conformance, PCI Local Bus 3.0 §6.8.2. Each case cites the rule it
// checks. The emulation runs over the real routing engine: a "message" is a
// signal on the vector's sink eventfd, a pending bit is the route's.
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <functional>
#include <memory>

#include "sriovd/msix/msix.hpp"

namespace sriovd::msix {
namespace {

// The kinds of vfio-user client (msix.hpp): one that forwards the guest's
// table writes, and one that keeps the table itself (QEMU).
enum class Client { forwards_table, keeps_table };

class Device {
 public:
  explicit Device(uint16_t n = 8, Client client = Client::forwards_table) {
    irq::EngineOptions o;
    o.relay_threads = 0;  // fires come from trigger(), as from a device model
    engine = std::make_unique<irq::Engine>(o);
    std::vector<irq::RouteId> ids;
    for (unsigned v = 0; v < n; ++v) {
      ids.push_back(engine->add({"dev", v, irq::Policy::relay, nullptr}));
      UniqueFd fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
      sinks.push_back(fd.get());
      engine->set_sink(ids.back(), std::move(fd));
    }
    vectors = std::make_unique<RoutedVectors>(*engine, ids);
    state = std::make_unique<MsixState>(n, *vectors);
    // A forwarding client's guest writes the table before anything else
    // (an entry's address, to its reset value): the §6.8.2 cases below
    // are about that table.
    if (client == Client::forwards_table) w32(0, 0);
  }
  void mc(uint16_t v) { state->write_message_control(v); }
  void enable() { mc(kEnable); }
  void w32(uint64_t off, uint32_t v) { state->write_table(off, 4, v); }
  void w64(uint64_t off, uint64_t v) { state->write_table(off, 8, v); }
  uint64_t r(uint64_t off, unsigned size = 4) { return state->read_table(off, size); }
  uint64_t pba(uint64_t off = 0, unsigned size = 8) { return state->read_pba(off, size); }
  void unmask(unsigned v) { w32(v * 16 + 12, 0); }
  void mask(unsigned v) { w32(v * 16 + 12, 1); }
  void fire(unsigned v) { engine->trigger(vectors->route(v)); }
  // Messages the vector sent since the last call.
  uint64_t messages(unsigned v) {
    uint64_t n = 0;
    return ::read(sinks[v], &n, sizeof n) == sizeof n ? n : 0;
  }

  std::unique_ptr<irq::Engine> engine;
  std::vector<int> sinks;
  std::unique_ptr<RoutedVectors> vectors;
  std::unique_ptr<MsixState> state;
};

struct Case {
  const char* name;
  const char* rule;
  std::function<void(Device&)> body;
};
std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

// clang-format off
const Case kCases[] = {
  // --- Message Control (§6.8.2.3) ---
  {"TableSizeReadsNMinus1", "§6.8.2.3 Table Size: N-1, read-only",
   [](Device& d) { EXPECT_EQ(d.state->read_message_control() & kTableSizeMask, 7); }},
  {"TableSizeIgnoresWrites", "§6.8.2.3 Table Size is RO",
   [](Device& d) { d.mc(0x03ff); EXPECT_EQ(d.state->read_message_control() & kTableSizeMask, 7); }},
  {"ReservedControlBitsReadZero", "§6.8.2.3 bits 13:11 reserved",
   [](Device& d) { d.mc(0x3800); EXPECT_EQ(d.state->read_message_control() & 0x3800, 0); }},
  {"EnableIsReadWrite", "§6.8.2.3 MSI-X Enable RW",
   [](Device& d) { d.enable(); EXPECT_TRUE(d.state->read_message_control() & kEnable); d.mc(0); EXPECT_FALSE(d.state->read_message_control() & kEnable); }},
  {"FunctionMaskIsReadWrite", "§6.8.2.3 Function Mask RW",
   [](Device& d) { d.mc(kFunctionMask); EXPECT_TRUE(d.state->read_message_control() & kFunctionMask); }},
  {"ControlIsZeroAfterReset", "§6.8.2.3 Enable and Function Mask default 0",
   [](Device& d) { d.mc(kEnable | kFunctionMask); d.state->reset(); EXPECT_EQ(d.state->read_message_control(), 7); }},

  // --- Table entries (§6.8.2.4 - §6.8.2.9) ---
  {"EveryVectorMaskedAfterReset", "§6.8.2.9 Mask Bit: 1 after reset",
   [](Device& d) { for (unsigned v = 0; v < 8; ++v) EXPECT_EQ(d.r(v * 16 + 12), 1U); }},
  {"ResetMasksUnmaskedVectors", "§6.8.2.9 Mask Bit: 1 after reset",
   [](Device& d) { d.unmask(3); d.state->reset(); EXPECT_EQ(d.r(3 * 16 + 12), 1U); }},
  {"AddressLowBitsReadZero", "§6.8.2.4 Message Address bits 1:0 are 0 (DWORD aligned)",
   [](Device& d) { d.w32(0, 0xfee00003); EXPECT_EQ(d.r(0), 0xfee00000U); }},
  {"UpperAddressIsReadWrite", "§6.8.2.5 Message Upper Address RW",
   [](Device& d) { d.w32(4, 0x12345678); EXPECT_EQ(d.r(4), 0x12345678U); }},
  {"MessageDataIsReadWrite", "§6.8.2.6 Message Data RW",
   [](Device& d) { d.w32(8, 0x4021); EXPECT_EQ(d.r(8), 0x4021U); }},
  {"VectorControlReservedBitsReadZero", "§6.8.2.9 bits 31:1 reserved",
   [](Device& d) { d.w32(12, 0xfffffffe); EXPECT_EQ(d.r(12), 0U); }},
  {"QwordWriteSetsWholeAddress", "§6.8.2 aligned QWORD access",
   [](Device& d) { d.w64(16, 0x00000001fee01000ULL); EXPECT_EQ(d.r(16), 0xfee01000U); EXPECT_EQ(d.r(20), 1U); }},
  {"QwordWriteSetsDataAndControl", "§6.8.2 aligned QWORD access to Data and Vector Control",
   [](Device& d) { d.w64(8, 0x0000000000004025ULL); EXPECT_EQ(d.r(8), 0x4025U); EXPECT_EQ(d.r(12), 0U); }},
  {"QwordReadReturnsBothDwords", "§6.8.2 aligned QWORD access",
   [](Device& d) { d.w32(32, 0xfee02000); d.w32(36, 7); EXPECT_EQ(d.r(32, 8), 0x00000007fee02000ULL); }},
  {"EntriesAreIndependent", "§6.8.2 one entry per vector",
   [](Device& d) { d.w32(0, 0xfee00000); d.w32(16, 0xfee01000); EXPECT_EQ(d.r(0), 0xfee00000U); EXPECT_EQ(d.r(16), 0xfee01000U); }},
  {"MisalignedDwordWriteIgnored", "§6.8.2 accesses must be aligned DWORD or QWORD",
   [](Device& d) { d.w32(2, 0xffffffff); EXPECT_EQ(d.r(0), 0U); EXPECT_EQ(d.state->stats().invalid, 1U); }},
  {"SubDwordWriteIgnored", "§6.8.2 accesses must be full DWORD or QWORD",
   [](Device& d) { d.state->write_table(12, 1, 0); EXPECT_EQ(d.r(12), 1U); EXPECT_EQ(d.state->stats().invalid, 1U); }},
  {"MisalignedQwordIgnored", "§6.8.2 QWORD accesses must be QWORD aligned",
   [](Device& d) { d.w64(4, ~0ULL); EXPECT_EQ(d.r(4), 0U); EXPECT_EQ(d.r(8), 0U); EXPECT_EQ(d.state->stats().invalid, 1U); }},
  {"WriteBeyondTableIgnored", "§6.8.2 the table has N entries",
   [](Device& d) { d.w32(8 * 16, 0); EXPECT_EQ(d.state->stats().invalid, 1U); }},
  {"ReadBeyondTableIsAllOnes", "§6.8.2 the table has N entries (no data there)",
   [](Device& d) { EXPECT_EQ(d.r(8 * 16), 0xffffffffU); }},
  {"ByteReadOfAField", "§6.8.2 reads have no side effects",
   [](Device& d) { d.w32(8, 0x11223344); EXPECT_EQ(d.r(9, 1), 0x33U); EXPECT_EQ(d.r(10, 2), 0x1122U); }},

  // --- Pending Bit Array (§6.8.2.10) ---
  {"PbaIsReadOnly", "§6.8.2.10 Pending Bits are RO",
   [](Device& d) { d.enable(); d.fire(0); d.state->write_pba(0, 8, 0); EXPECT_EQ(d.pba(), 1U); EXPECT_EQ(d.state->stats().pba_writes, 1U); }},
  {"PbaEmptyAfterReset", "§6.8.2.10 Pending Bits default 0",
   [](Device& d) { EXPECT_EQ(d.pba(), 0U); }},
  {"MaskedFireSetsPendingBit", "§6.8.2.9/10 a masked vector's message is held pending",
   [](Device& d) { d.enable(); d.fire(2); EXPECT_EQ(d.pba(), 1U << 2U); }},
  {"MaskedFireSendsNoMessage", "§6.8.2.9 the function is prohibited from sending a masked vector's message",
   [](Device& d) { d.enable(); d.fire(2); EXPECT_EQ(d.messages(2), 0U); }},
  {"PbaBitPositionIsTheVector", "§6.8.2.10 bit k of QWORD k/64 is vector k",
   [](Device& d) { d.enable(); d.fire(7); d.fire(1); EXPECT_EQ(d.pba(), (1U << 7U) | (1U << 1U)); }},
  {"PbaDwordReads", "§6.8.2 DWORD access to the PBA",
   [](Device& d) { d.enable(); d.fire(5); EXPECT_EQ(d.pba(0, 4), 1U << 5U); EXPECT_EQ(d.pba(4, 4), 0U); }},
  {"PbaSecondQword", "§6.8.2.10 vectors 64..127 in the second QWORD",
   [](Device&) { Device big(70); big.enable(); big.fire(65); EXPECT_EQ(big.pba(8, 8), 1U << 1U); EXPECT_EQ(big.pba(0, 8), 0U); EXPECT_EQ(big.state->pba_bytes(), 16U); }},
  {"PbaMisalignedReadIsInvalid", "§6.8.2 aligned accesses only",
   [](Device& d) { (void)d.pba(2, 4); EXPECT_EQ(d.state->stats().invalid, 1U); }},

  // --- Per-vector masking (§6.8.2.9) ---
  {"UnmaskedVectorSendsAtOnce", "§6.8.2.9 Mask Bit 0: the function may send the message",
   [](Device& d) { d.enable(); d.unmask(0); d.fire(0); EXPECT_EQ(d.messages(0), 1U); EXPECT_EQ(d.pba(), 0U); }},
  {"UnmaskSendsThePendingMessage", "§6.8.2.9 clearing Mask Bit with Pending set sends the message",
   [](Device& d) { d.enable(); d.fire(4); d.unmask(4); EXPECT_EQ(d.messages(4), 1U); }},
  {"UnmaskClearsThePendingBit", "§6.8.2.10 the pending bit clears once the message is sent",
   [](Device& d) { d.enable(); d.fire(4); d.unmask(4); EXPECT_EQ(d.pba(), 0U); }},
  {"UnmaskWithNothingPendingSendsNothing", "§6.8.2.9 no pending message, nothing to send",
   [](Device& d) { d.enable(); d.unmask(4); EXPECT_EQ(d.messages(4), 0U); }},
  {"FiresWhileMaskedCoalesce", "§6.8.2.10 one pending bit per vector",
   [](Device& d) { d.enable(); d.fire(3); d.fire(3); d.fire(3); d.unmask(3); EXPECT_EQ(d.messages(3), 1U); }},
  {"MaskingOneVectorLeavesOthers", "§6.8.2.9 the Mask Bit masks only its vector",
   [](Device& d) { d.enable(); d.unmask(0); d.unmask(1); d.mask(0); d.fire(0); d.fire(1); EXPECT_EQ(d.messages(0), 0U); EXPECT_EQ(d.messages(1), 1U); }},
  {"RemaskingWithoutFiresSendsNothing", "§6.8.2.9 mask/unmask alone generates no message",
   [](Device& d) { d.enable(); for (int i = 0; i < 5; ++i) { d.unmask(6); d.mask(6); } d.unmask(6); EXPECT_EQ(d.messages(6), 0U); }},
  {"QwordUnmaskSendsPending", "§6.8.2.9 a QWORD write of Data + Vector Control unmasks",
   [](Device& d) { d.enable(); d.fire(1); d.w64(16 + 8, 0x0000000000004001ULL); EXPECT_EQ(d.messages(1), 1U); }},

  // --- Function Mask (§6.8.2.3) ---
  {"FunctionMaskMasksEveryVector", "§6.8.2.3 Function Mask: all vectors masked regardless of their Mask Bits",
   [](Device& d) { d.mc(kEnable | kFunctionMask); d.unmask(0); d.fire(0); EXPECT_EQ(d.messages(0), 0U); }},
  {"FunctionMaskLatchesPending", "§6.8.2.3 messages under Function Mask are held pending",
   [](Device& d) { d.mc(kEnable | kFunctionMask); d.unmask(0); d.fire(0); EXPECT_EQ(d.pba(), 1U); }},
  {"FunctionMaskClearSendsPending", "§6.8.2.3 clearing Function Mask sends pending messages of unmasked vectors",
   [](Device& d) { d.mc(kEnable | kFunctionMask); d.unmask(0); d.fire(0); d.enable(); EXPECT_EQ(d.messages(0), 1U); EXPECT_EQ(d.pba(), 0U); }},
  {"FunctionMaskClearKeepsMaskedVectorsPending", "§6.8.2.3 + §6.8.2.9 a vector's own Mask Bit still holds it",
   [](Device& d) { d.mc(kEnable | kFunctionMask); d.fire(0); d.enable(); EXPECT_EQ(d.messages(0), 0U); EXPECT_EQ(d.pba(), 1U); }},
  {"FunctionMaskLeavesMaskBitsAlone", "§6.8.2.3 Function Mask does not change the per-vector Mask Bits",
   [](Device& d) { d.unmask(2); d.mc(kEnable | kFunctionMask); EXPECT_EQ(d.r(2 * 16 + 12), 0U); EXPECT_EQ(d.r(3 * 16 + 12), 1U); }},

  // --- MSI-X Enable (§6.8.2.3) ---
  {"DisabledFunctionSendsNothing", "§6.8.2.3 with MSI-X Enable 0 the function may not use MSI-X",
   [](Device& d) { d.unmask(0); d.fire(0); EXPECT_EQ(d.messages(0), 0U); }},
  {"EnableDropsWhatFiredWhileDisabled", "§6.8.2.3 nothing is owed for the time MSI-X was disabled",
   [](Device& d) { d.unmask(0); d.fire(0); d.enable(); EXPECT_EQ(d.messages(0), 0U); EXPECT_EQ(d.pba(), 0U); }},
  {"DisablingMasksEverything", "§6.8.2.3 clearing MSI-X Enable stops messages",
   [](Device& d) { d.enable(); d.unmask(0); d.mc(0); d.fire(0); EXPECT_EQ(d.messages(0), 0U); }},

  // --- Reset and the vfio-user mask channel ---
  {"ResetClearsPendingBits", "§6.8.2.10 Pending Bits default 0 after reset",
   [](Device& d) { d.enable(); d.fire(0); d.state->reset(); EXPECT_EQ(d.pba(), 0U); d.enable(); d.unmask(0); EXPECT_EQ(d.messages(0), 0U); }},
  {"SetIrqsMaskHoldsWithoutTouchingTheTable", "vfio-user SET_IRQS MASK (linux/vfio.h ACTION_MASK): a mask of its own",
   [](Device& d) { d.enable(); d.unmask(5); d.state->set_vector_mask(5, true); EXPECT_EQ(d.r(5 * 16 + 12), 0U); d.fire(5); EXPECT_EQ(d.messages(5), 0U); EXPECT_EQ(d.pba(), 1U << 5U); }},
  {"SetIrqsUnmaskSendsPending", "vfio-user SET_IRQS UNMASK + §6.8.2.9",
   [](Device& d) { d.enable(); d.unmask(5); d.state->set_vector_mask(5, true); d.fire(5); d.state->set_vector_mask(5, false); EXPECT_EQ(d.messages(5), 1U); EXPECT_EQ(d.pba(), 0U); }},
  {"SetIrqsUnmaskDoesNotOverrideTheMaskBit", "the guest's Mask Bit still holds after SET_IRQS UNMASK",
   [](Device& d) { d.enable(); d.state->set_vector_mask(5, true); d.state->set_vector_mask(5, false); EXPECT_EQ(d.r(5 * 16 + 12), 1U); d.fire(5); EXPECT_EQ(d.messages(5), 0U); }},
  {"TableUnmaskDoesNotOverrideSetIrqsMask", "SET_IRQS MASK holds after the guest clears its Mask Bit",
   [](Device& d) { d.enable(); d.state->set_vector_mask(5, true); d.unmask(5); d.fire(5); EXPECT_EQ(d.messages(5), 0U); d.state->set_vector_mask(5, false); EXPECT_EQ(d.messages(5), 1U); }},
  {"ResetClearsSetIrqsMasks", "DEVICE_RESET: a function reset drops SET_IRQS masks",
   [](Device& d) { d.state->set_vector_mask(1, true); d.state->reset(); EXPECT_FALSE(d.state->irq_masked(1)); }},
  {"TableSizeLimits", "§6.8.2.3 Table Size encodes 1..2048 vectors",
   [](Device& d) {
     EXPECT_THROW(MsixState(0, *d.vectors), std::invalid_argument);
     EXPECT_THROW(MsixState(2049, *d.vectors), std::invalid_argument);
   }},
};
// clang-format on

// A client that keeps the table itself (QEMU's vfio-user client): it never
// writes the table, wires vectors with SET_IRQS TRIGGER, and forwards
// Message Control and PBA reads.
// clang-format off
const Case kTableKeepingCases[] = {
  {"VectorIsLiveOnceEnabled", "linux/vfio.h: a TRIGGER eventfd is signalled unless masked",
   [](Device& d) { d.enable(); d.fire(3); EXPECT_EQ(d.messages(3), 1U); EXPECT_FALSE(d.state->table_forwarded()); }},
  {"NothingBeforeEnable", "§6.8.2.3 no MSI-X message while Enable is 0",
   [](Device& d) { d.fire(3); d.enable(); EXPECT_EQ(d.messages(3), 0U); }},
  {"FunctionMaskHoldsAndReplays", "§6.8.2.3 Function Mask, forwarded in config space",
   [](Device& d) { d.mc(kEnable | kFunctionMask); d.fire(3); EXPECT_EQ(d.messages(3), 0U); EXPECT_EQ(d.pba(), 1U << 3U); d.mc(kEnable); EXPECT_EQ(d.messages(3), 1U); EXPECT_EQ(d.pba(), 0U); }},
  {"SetIrqsMaskHoldsAndUnmaskReplays", "vfio-user SET_IRQS MASK/UNMASK",
   [](Device& d) { d.enable(); d.state->set_vector_mask(3, true); d.fire(3); EXPECT_EQ(d.messages(3), 0U); d.state->set_vector_mask(3, false); EXPECT_EQ(d.messages(3), 1U); }},
  {"PbaShowsOnlyWhatTheServerHolds", "the server's PBA: bits it latched (the client keeps its own)",
   [](Device& d) { d.enable(); d.fire(3); EXPECT_EQ(d.pba(), 0U); EXPECT_EQ(d.messages(3), 1U); }},
  {"FirstTableWriteMakesMaskBitsCount", "a table write marks a forwarding client: §6.8.2.9 Mask Bits apply",
   [](Device& d) { d.enable(); d.w32(2 * 16, 0xfee00000); EXPECT_TRUE(d.state->table_forwarded()); d.fire(2); EXPECT_EQ(d.messages(2), 0U); d.unmask(2); EXPECT_EQ(d.messages(2), 1U); }},
  {"FirstTableWriteIsOneTransition", "a live vector the first table write unmasks is never masked on the way (an adaptive route counts masks)",
   [](Device& d) {
     d.enable();
     const uint64_t masks = d.engine->stats(d.vectors->route(2)).masks;
     d.unmask(2);
     EXPECT_EQ(d.engine->stats(d.vectors->route(2)).masks, masks);
     d.fire(2);
     EXPECT_EQ(d.messages(2), 1U);
     d.fire(3);
     EXPECT_EQ(d.messages(3), 0U);  // its Mask Bit counts now
   }},
  {"ResetForgetsTheForwardedTable", "after DEVICE_RESET the next client may be of either kind",
   [](Device& d) { d.w32(0, 0); d.state->reset(); EXPECT_FALSE(d.state->table_forwarded()); d.enable(); d.fire(1); EXPECT_EQ(d.messages(1), 1U); }},
};
// clang-format on

class Conformance : public ::testing::TestWithParam<Case> {};
class TableKeepingClient : public ::testing::TestWithParam<Case> {};

TEST_P(TableKeepingClient, Rule) {
  const Case& c = GetParam();
  SCOPED_TRACE(c.rule);
  Device d(8, Client::keeps_table);
  c.body(d);
}

INSTANTIATE_TEST_SUITE_P(Msix, TableKeepingClient, ::testing::ValuesIn(kTableKeepingCases),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

TEST_P(Conformance, Rule) {
  const Case& c = GetParam();
  SCOPED_TRACE(c.rule);
  Device d;
  c.body(d);
}

INSTANTIATE_TEST_SUITE_P(Msix, Conformance, ::testing::ValuesIn(kCases),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

TEST(ConformanceTable, HasAtLeastFortyCases) { EXPECT_GE(std::size(kCases), 40U); }

}  // namespace
}  // namespace sriovd::msix
