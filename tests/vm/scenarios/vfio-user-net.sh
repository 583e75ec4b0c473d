# A Linux guest under QEMU 11 with virtio-net-pci over sriovd's vfio-user
# socket (QEMU's own vfio-user client), bridged by sriovd to a VF's netdev:
# MSI-X interrupts reach the guest (it pings and runs iperf3 both ways to
# the wire), with two queue pairs traffic goes through every queue. Then
# it runs a longer iperf3 (the host reloads sriovd meanwhile) and waits:
# the host resets it, kills QEMU or quits it - every boot runs the same
# checks, and the host reads the "VMTEST" lines of each.
set -u
. /guest-lib.sh
guest_net_up 10.77.0.2/24
drv=$(basename "$(readlink /sys/class/net/$dev/device/driver)" 2>/dev/null)
echo "VMTEST INFO driver of $dev: $drv"
msix=$(grep -c 'virtio.*-input\|virtio.*-output\|virtio.*-config' /proc/interrupts)
if [ "$msix" -gt 0 ]; then
  echo "VMTEST PASS guest-uses-msix $msix vectors"
else
  echo "VMTEST FAIL guest-uses-msix: $(grep -i virtio /proc/interrupts | tr -s ' ' | head -n 4 | tr '\n' '|')"
fi
if ping -c 5 -i 0.3 -W 3 10.77.0.1 >/tmp/ping.log 2>&1; then
  echo "VMTEST PASS guest-pings-wire"
else
  echo "VMTEST FAIL guest-pings-wire: $(tail -n 3 /tmp/ping.log | tr '\n' ' ')"
  grep -i virtio /proc/interrupts
fi
secs=${GUEST_IPERF_SECONDS:-3}
if command -v iperf3 >/dev/null; then
  for dir in tx rx; do
    flag=
    [ $dir = rx ] && flag=-R
    if out=$(iperf3 -c 10.77.0.1 -t "$secs" -P 4 $flag --connect-timeout 3000 2>&1); then
      echo "VMTEST BENCH iperf3-$dir $(echo "$out" | grep -E 'SUM.*receiver' | tail -n 1)"
      echo "VMTEST PASS guest-iperf3-$dir"
    else
      echo "VMTEST FAIL guest-iperf3-$dir: $(echo "$out" | tail -n 2 | tr '\n' ' ')"
    fi
  done
fi
# Every queue's interrupts moved (the guest's own count per vector).
grep -E 'virtio[0-9]+-(input|output)' /proc/interrupts | while read -r line; do
  n=0
  for f in $line; do case $f in *[!0-9]*) ;; *) n=$((n + f)) ;; esac; done
  name=$(echo "$line" | awk '{print $NF}')
  echo "VMTEST QUEUE $name $n"
done
# The VF export (a simulated 8086:154c VF): its capability list, as the
# guest reads it through QEMU, reaches an MSI-X capability.
vf=
for d in /sys/bus/pci/devices/*; do
  [ "$(cat "$d/vendor")" = 0x8086 ] && [ "$(cat "$d/device")" = 0x154c ] && vf=$d
done
if [ -z "$vf" ]; then
  echo "VMTEST FAIL vf-msix-capability: no 8086:154c device in the guest"
else
  set -- $(od -An -tu1 -v -N 256 "$vf/config")
  cfg="$*"
  byte() { echo "$cfg" | cut -d' ' -f$(($1 + 1)); }
  at=$(byte 52)
  found=
  hops=0
  while [ "$at" -ne 0 ] && [ $hops -lt 48 ]; do
    [ "$(byte "$at")" -eq 17 ] && found=$at
    at=$(byte $((at + 1)))
    hops=$((hops + 1))
  done
  if [ -n "$found" ]; then
    echo "VMTEST PASS vf-msix-capability at $found, $(( ($(byte $((found + 2))) | ($(byte $((found + 3))) << 8)) & 2047 )) + 1 vectors"
  else
    echo "VMTEST FAIL vf-msix-capability: none in the list from $(byte 52)"
  fi
fi
# Under traffic: the host reloads sriovd when it sees this line.
echo "VMTEST PHASE traffic-for-reload"
if out=$(iperf3 -c 10.77.0.1 -t "${GUEST_RELOAD_SECONDS:-8}" -P 2 --connect-timeout 3000 2>&1); then
  echo "VMTEST BENCH iperf3-during-reload $(echo "$out" | grep -E 'SUM.*receiver' | tail -n 1)"
  echo "VMTEST PASS guest-iperf3-during-reload"
else
  echo "VMTEST FAIL guest-iperf3-during-reload: $(echo "$out" | tail -n 2 | tr '\n' ' ')"
fi
echo "VMTEST PHASE boot-done"
# The host decides what comes next (reset, SIGKILL, quit).
while :; do sleep 1; done
