// vm_nvme_virt: makes the VFs of the VM's NVMe PF working controllers.
// An SR-IOV NVMe VF is a secondary controller: it starts only once the
// primary (the PF, on the kernel's nvme driver) has given it queue (VQ) and
// interrupt (VI) resources and brought it online - the Virtualization
// Management command of NVMe 1.4 §5.22 (opcode 1Ch), issued through the
// nvme driver's admin passthrough. Identify CNS 15h lists the secondary
// controllers.
//
//   vm_nvme_virt assign /dev/nvme0 VFS   # before sriov_numvfs: the PF's flexible
//                                        # resources released, VFS secondaries given 2 VQ + 1 VI
//   vm_nvme_virt online /dev/nvme0 VFS   # after the VFs exist: each secondary online
//   vm_nvme_virt list /dev/nvme0         # the secondary controller list, one line each
//
// Exits non-zero with the command and status that failed.
#include <fcntl.h>
#include <linux/nvme_ioctl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr uint8_t kIdentify = 0x06;
constexpr uint8_t kVirtMgmt = 0x1c;
constexpr uint32_t kCnsController = 0x01;
constexpr uint32_t kCnsSecondaryList = 0x15;
// Virtualization Management actions and resource types (§5.22).
constexpr uint32_t kPrimaryFlexible = 0x1, kSecondaryAssign = 0x8, kSecondaryOnline = 0x9;
constexpr uint32_t kVq = 0, kVi = 1;

struct Secondary {
  uint16_t scid;  // its controller id
  uint8_t online;
  uint16_t vfn;  // its VF number (1-based)
  uint16_t vq, vi;
};

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "vm_nvme_virt: %s\n", what.c_str());
  std::exit(1);
}

uint32_t admin(int fd, uint8_t opcode, uint32_t cdw10, uint32_t cdw11, void* data, uint32_t len, const char* what) {
  nvme_admin_cmd c{};
  c.opcode = opcode;
  c.addr = reinterpret_cast<uintptr_t>(data);
  c.data_len = len;
  c.cdw10 = cdw10;
  c.cdw11 = cdw11;
  c.timeout_ms = 10000;
  const int rc = ::ioctl(fd, NVME_IOCTL_ADMIN_CMD, &c);
  if (rc < 0) die(std::string(what) + ": " + std::strerror(errno));
  if (rc > 0) die(std::string(what) + ": NVMe status 0x" + std::to_string(rc));
  return c.result;
}

uint16_t own_cntlid(int fd) {
  std::vector<uint8_t> id(4096);
  admin(fd, kIdentify, kCnsController, 0, id.data(), 4096, "Identify Controller");
  uint16_t cntlid;
  std::memcpy(&cntlid, id.data() + 78, 2);  // CNTLID, bytes 79:78
  return cntlid;
}

std::vector<Secondary> secondaries(int fd) {
  std::vector<uint8_t> list(4096);
  admin(fd, kIdentify, kCnsSecondaryList, 0, list.data(), 4096, "Identify Secondary Controller List");
  std::vector<Secondary> out;
  const unsigned n = list[0];
  for (unsigned i = 0; i < n && i < 127; ++i) {
    const uint8_t* e = list.data() + 32 + 32 * i;  // 32-byte entries after the 32-byte header
    Secondary s{};
    std::memcpy(&s.scid, e + 0, 2);
    s.online = e[4] & 1U;
    std::memcpy(&s.vfn, e + 8, 2);
    std::memcpy(&s.vq, e + 10, 2);
    std::memcpy(&s.vi, e + 12, 2);
    out.push_back(s);
  }
  return out;
}

void virt_mgmt(int fd, uint16_t cntlid, uint32_t action, uint32_t type, uint16_t count, const std::string& what) {
  admin(fd, kVirtMgmt, action | (type << 8U) | (static_cast<uint32_t>(cntlid) << 16U), count, nullptr, 0, what.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) die("usage: vm_nvme_virt assign|online|list /dev/nvmeN [VFS]");
  const std::string verb = argv[1];
  const unsigned vfs = argc > 3 ? static_cast<unsigned>(std::stoul(argv[3])) : 0;
  const int fd = ::open(argv[2], O_RDWR | O_CLOEXEC);
  if (fd < 0) die(std::string("opening ") + argv[2] + ": " + std::strerror(errno));
  const auto list = secondaries(fd);
  if (verb == "list") {
    for (const auto& s : list)
      std::printf("scid %u vfn %u online %u vq %u vi %u\n", s.scid, s.vfn, s.online, s.vq, s.vi);
    return 0;
  }
  if (list.size() < vfs)
    die("the PF has " + std::to_string(list.size()) + " secondary controllers, " + std::to_string(vfs) + " asked for");
  if (verb == "assign") {
    // The primary keeps none of the flexible resources (takes effect at its
    // next reset), so that the secondaries can have them.
    const uint16_t pf = own_cntlid(fd);
    virt_mgmt(fd, pf, kPrimaryFlexible, kVq, 0, "releasing the PF's flexible VQ resources");
    virt_mgmt(fd, pf, kPrimaryFlexible, kVi, 0, "releasing the PF's flexible VI resources");
    if (::ioctl(fd, NVME_IOCTL_RESET) < 0) die(std::string("resetting the PF controller: ") + std::strerror(errno));
    for (unsigned i = 0; i < vfs; ++i) {
      const std::string who = "secondary controller " + std::to_string(list[i].scid);
      virt_mgmt(fd, list[i].scid, kSecondaryAssign, kVq, 2,
                "giving " + who + " 2 VQ resources");  // admin + one I/O queue
      virt_mgmt(fd, list[i].scid, kSecondaryAssign, kVi, 1, "giving " + who + " 1 VI resource");
    }
    return 0;
  }
  if (verb == "online") {
    for (unsigned i = 0; i < vfs; ++i)
      virt_mgmt(fd, list[i].scid, kSecondaryOnline, 0, 0,
                "bringing secondary controller " + std::to_string(list[i].scid) + " online");
    for (const auto& s : secondaries(fd))
      if (s.vfn >= 1 && s.vfn <= vfs && !s.online)
        die("secondary controller " + std::to_string(s.scid) + " is still offline");
    return 0;
  }
  die("unknown verb " + verb);
}
