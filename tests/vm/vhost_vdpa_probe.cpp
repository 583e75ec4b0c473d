// What a VMM reads from a vhost-vdpa device before it drives it
// (linux/vhost.h): the device id, the features, the config space, the
// queue count. Prints them as one JSON object; exit 1 naming the ioctl that
// failed.
//   vm_vhost_vdpa_probe /dev/vhost-vdpa-N CONFIG_BYTES

#include <fcntl.h>
// linux/virtio_ring.h (through vhost.h) has legacy C helpers C++ refuses.
#define VIRTIO_RING_NO_LEGACY
#include <linux/vhost.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s /dev/vhost-vdpa-N CONFIG_BYTES\n", argv[0]);
    return 2;
  }
  const int fd = ::open(argv[1], O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    std::fprintf(stderr, "%s: %s\n", argv[1], std::strerror(errno));
    return 1;
  }
  const auto fail = [](const char* what) {
    std::fprintf(stderr, "%s: %s\n", what, std::strerror(errno));
    return 1;
  };
  uint32_t device_id = 0;
  if (::ioctl(fd, VHOST_VDPA_GET_DEVICE_ID, &device_id) != 0) return fail("VHOST_VDPA_GET_DEVICE_ID");
  uint64_t features = 0;
  if (::ioctl(fd, VHOST_GET_FEATURES, &features) != 0) return fail("VHOST_GET_FEATURES");
  uint32_t vq_num = 0;
  if (::ioctl(fd, VHOST_VDPA_GET_VRING_NUM, &vq_num) != 0) return fail("VHOST_VDPA_GET_VRING_NUM");
  const auto size = static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10));
  std::vector<uint8_t> buf(sizeof(vhost_vdpa_config) + size);
  auto* cfg = reinterpret_cast<vhost_vdpa_config*>(buf.data());
  cfg->off = 0;
  cfg->len = size;
  if (::ioctl(fd, VHOST_VDPA_GET_CONFIG, cfg) != 0) return fail("VHOST_VDPA_GET_CONFIG");
  std::printf("{\"device_id\": %u, \"features\": \"0x%llx\", \"max_queue_size\": %u, \"config\": \"", device_id,
              static_cast<unsigned long long>(features), vq_num);
  for (uint32_t i = 0; i < size; ++i) std::printf("%02x", cfg->buf[i]);
  std::printf("\"}\n");
  ::close(fd);
  return 0;
}
