# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# scripts/bench qemu, the guest's side: three NICs in one guest - QEMU's own
# virtio-net on a tap, sriovd's vhost-user device and sriovd's virtio-net-pci
# over vfio-user - told apart by their MACs (..:01, ..:02, ..:03), each in a
# subnet of its own with an iperf3 server behind it. iperf3 over each in
# turn, both ways, the order rotated every run so no path always goes
# first. Prints "VMTEST BENCH <path> <tx|rx> <bits/s>".
#   kernel command line: sriovd.runs=N sriovd.seconds=S
set -u
arg() { sed -n "s/.*sriovd\.$1=\([0-9]*\).*/\1/p" /proc/cmdline; }
runs=$(arg runs)
secs=$(arg seconds)
runs=${runs:-3}
secs=${secs:-5}
ip link set lo up
want=3
i=0
nics() { for n in /sys/class/net/*; do [ "${n##*/}" = lo ] || echo "${n##*/}"; done; }
while [ $i -lt 100 ] && [ "$(nics | wc -l)" -lt $want ]; do sleep 0.1; i=$((i + 1)); done
for d in $(nics); do
  mac=$(cat "/sys/class/net/$d/address")
  case $mac in
    *:01) path=qemu_tap net=81 ;;
    *:02) path=vhost_user net=82 ;;
    *:03) path=vfio_user net=83 ;;
    *) continue ;;
  esac
  ip link set "$d" up
  ip addr add "10.$net.0.2/24" dev "$d"
  eval "net_$path=$net"
  echo "VMTEST INFO $path is $d ($mac, $(basename "$(readlink "/sys/class/net/$d/device/driver")"))"
done
for p in qemu_tap vhost_user vfio_user; do
  eval "n=\${net_$p:-}"
  [ -n "$n" ] || { echo "VMTEST FAIL bench-qemu: no NIC for $p"; exit 1; }
  ping -c 2 -W 3 "10.$n.0.1" >/dev/null 2>&1 || echo "VMTEST FAIL bench-qemu: $p does not answer ping"
done
order="qemu_tap vhost_user vfio_user"
r=0
while [ $r -lt "$runs" ]; do
  for p in $order; do
    eval "n=\$net_$p"
    for dir in tx rx; do
      flag=
      [ $dir = rx ] && flag=-R
      out=$(iperf3 -c "10.$n.0.1" -t "$secs" ${flag:+"$flag"} -J --connect-timeout 3000 2>&1)
      bps=$(echo "$out" | tr -d '\n' | sed -n 's/.*"sum_received":[^}]*"bits_per_second":[[:space:]]*\([0-9.e+]*\).*/\1/p')
      if [ -n "$bps" ]; then
        echo "VMTEST BENCH $p $dir $bps"
      else
        echo "VMTEST FAIL bench-qemu: $p $dir: $(echo "$out" | tail -n 3 | tr '\n' ' ')"
      fi
    done
  done
  # Rotate: the first path goes last next run.
  # shellcheck disable=SC2086  # split on purpose: three names
  set -- $order
  order="$2 $3 $1"
  r=$((r + 1))
done
echo "VMTEST PASS bench-qemu"
