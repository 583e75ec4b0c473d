# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# scripts/bench mmio, the guest's side: one NIC, sriovd's vhost-user
# virtio-net, as virtio-net-pci (q35) or as a virtio-mmio device (microvm),
# whichever this boot was given; a request/response benchmark over it
# (sockperf ping-pong over TCP, one transaction in flight: netperf's
# TCP_RR), N runs of S seconds. Prints "VMTEST BENCH <transport> rr
# <transactions/s> <average latency us>".
#   kernel command line: sriovd.runs=N sriovd.seconds=S
set -u
arg() { sed -n "s/.*sriovd\.$1=\([0-9]*\).*/\1/p" /proc/cmdline; }
runs=$(arg runs)
secs=$(arg seconds)
runs=${runs:-3}
secs=${secs:-5}
ip link set lo up
nics() { for n in /sys/class/net/*; do [ "${n##*/}" = lo ] || echo "${n##*/}"; done; }
i=0
while [ $i -lt 100 ] && [ -z "$(nics)" ]; do sleep 0.1; i=$((i + 1)); done
dev=$(nics | head -n 1)
[ -n "$dev" ] || { echo "VMTEST FAIL bench-mmio: no NIC"; exit 1; }
driver=$(basename "$(readlink "/sys/class/net/$dev/device/driver")")
bus=$(basename "$(readlink "/sys/class/net/$dev/device/../subsystem" 2>/dev/null)")
case $bus in
  pci) transport=pci ;;
  platform) transport=mmio ;;
  *) echo "VMTEST FAIL bench-mmio: $dev is on bus '$bus'"; exit 1 ;;
esac
irqs=$(grep -c -E 'virtio|vring' /proc/interrupts)
echo "VMTEST INFO $dev: $driver on $bus ($transport), $irqs interrupt lines"
ip link set "$dev" up
ip addr add 10.84.0.2/24 dev "$dev"
ping -c 2 -W 5 10.84.0.1 >/dev/null 2>&1 || { echo "VMTEST FAIL bench-mmio: no answer to ping"; exit 1; }
before=$(awk '/virtio|vring/ {for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i} END {print s + 0}' /proc/interrupts)
r=0
while [ $r -lt "$runs" ]; do
  out=$(sockperf ping-pong --tcp -i 10.84.0.1 -p 11111 -t "$secs" -m 64 2>&1)
  # "[Valid Duration] RunTime=4.990 sec; SentMessages=12345; ReceivedMessages=12345"
  line=$(echo "$out" | grep 'Valid Duration' | tail -n 1)
  rt=$(echo "$line" | sed -n 's/.*RunTime=\([0-9.]*\).*/\1/p')
  rx=$(echo "$line" | sed -n 's/.*ReceivedMessages=\([0-9]*\).*/\1/p')
  lat=$(echo "$out" | sed -n 's/.*Summary: Latency is \([0-9.]*\) usec.*/\1/p' | tail -n 1)
  if [ -n "$rt" ] && [ -n "$rx" ]; then
    echo "VMTEST BENCH $transport rr $(awk -v n="$rx" -v t="$rt" 'BEGIN {printf "%.1f", n / t}') ${lat:-0}"
  else
    echo "VMTEST FAIL bench-mmio: sockperf: $(echo "$out" | tail -n 3 | tr '\n' ' ')"
  fi
  r=$((r + 1))
done
after=$(awk '/virtio|vring/ {for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i} END {print s + 0}' /proc/interrupts)
echo "VMTEST BENCH $transport interrupts $((after - before))"
echo "VMTEST PASS bench-mmio"
