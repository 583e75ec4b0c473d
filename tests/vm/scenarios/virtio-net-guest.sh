# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# A Linux guest (QEMU 7.2, virtio-net-pci on sriovd's vhost-user socket):
# the guest's own virtio-net driver against sriovd. Pings the host-side tap
# and, when iperf3 is in the initramfs, sends TCP to it.
set -u
# shellcheck source=../guest-lib.sh
. /guest-lib.sh
guest_net_up 10.88.0.2/24
if ping -c 5 -W 3 10.88.0.1 >/tmp/ping.log 2>&1; then
  echo "VMTEST PASS guest-pings-host-tap"
else
  echo "VMTEST FAIL guest-pings-host-tap: $(tail -n 3 /tmp/ping.log | tr "\n" " ")"; cat "/sys/class/net/$dev/statistics/tx_packets" "/sys/class/net/$dev/statistics/rx_packets"; grep -i virtio /proc/interrupts
fi
if command -v iperf3 >/dev/null; then
  if out=$(iperf3 -c 10.88.0.1 -t "${GUEST_IPERF_SECONDS:-5}" --connect-timeout 3000 2>&1); then
    echo "$out" | tail -n 4
    rate=$(echo "$out" | grep receiver | tail -n 1)
    echo "VMTEST BENCH iperf3-guest-to-host $rate"
    echo "VMTEST PASS guest-iperf3"
  else
    echo "VMTEST FAIL guest-iperf3: $(echo "$out" | tail -n 2)"
  fi
fi
