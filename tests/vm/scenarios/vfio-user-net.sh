# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# A Linux guest under QEMU 11 with virtio-net-pci over sriovd's vfio-user
# socket (QEMU's own vfio-user client), bridged by sriovd to a VF's netdev:
# MSI-X interrupts reach the guest (it pings and runs iperf3 both ways to
# the wire), with two queue pairs traffic goes through every queue. Then
# it runs a longer iperf3 (the host reloads sriovd meanwhile) and waits:
# the host resets it, kills QEMU or quits it - every boot runs the same
# checks, and the host reads the "VMTEST" lines of each.
set -u
# shellcheck source=../guest-lib.sh
. /guest-lib.sh
# shellcheck disable=SC2034  # read by guest_net_up
GUEST_MAC=02:5a:00:00:07:01  # sriovd's virtio-net-pci (the config's MAC)
guest_net_up 10.77.0.2/24
drv=$(basename "$(readlink "/sys/class/net/$dev/device/driver")" 2>/dev/null)
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
# The VF exports (simulated 8086:154c VFs, one per MSI-X policy): each
# one's capability list, as the guest reads it through QEMU, reaches MSI-X;
# the guest (no driver: busybox, as a driver would) programs entry 0 with
# vector 0xfa - x86's thermal vector, which nothing raises in a QEMU guest
# and whose handler acknowledges and counts in /proc/interrupts' TRM line
# (0xff, the spurious vector, would never be acknowledged) - enables MSI-X
# and unmasks the entry. The host then makes each VF raise vector 0; each
# must arrive once.
vf_irq_count() { awk '/TRM:/ {n = 0; for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) n += $i; print n}' /proc/interrupts; }
cfg_byte() { od -An -tu1 -j "$2" -N 1 "$1/config" | tr -d ' '; }
cfg_write_byte() {
  # shellcheck disable=SC2059  # the format is the byte itself, as an octal escape
  printf "\\$(printf %o "$3")" | dd of="$1/config" bs=1 seek="$2" count=1 conv=notrunc 2>/dev/null; }
armed=0
for d in /sys/bus/pci/devices/*; do
  case "$(cat "$d/vendor"):$(cat "$d/device")" in 0x8086:0x154c) ;; *) continue ;; esac
  at=$(cfg_byte "$d" 52)
  found=
  hops=0
  while [ "$at" -ne 0 ] && [ $hops -lt 48 ]; do
    [ "$(cfg_byte "$d" "$at")" -eq 17 ] && found=$at
    at=$(cfg_byte "$d" $((at + 1)))
    hops=$((hops + 1))
  done
  if [ -z "$found" ]; then
    echo "VMTEST FAIL vf-msix-capability $(basename "$d"): none in the list"
    continue
  fi
  echo "VMTEST PASS vf-msix-capability $(basename "$d") at $found"
  table=$(( $(cfg_byte "$d" $((found + 4))) | ($(cfg_byte "$d" $((found + 5))) << 8) | ($(cfg_byte "$d" $((found + 6))) << 16) | ($(cfg_byte "$d" $((found + 7))) << 24) ))
  bir=$((table & 7))
  base=$(sed -n "$((bir + 1))p" "$d/resource" | cut -d' ' -f1)
  entry=$((base + (table & ~7)))
  cfg_write_byte "$d" 4 6  # memory space and bus master
  devmem $entry 32 0xfee00000
  devmem $((entry + 4)) 32 0
  devmem $((entry + 8)) 32 0xfa
  cfg_write_byte "$d" $((found + 3)) $(( $(cfg_byte "$d" $((found + 3))) | 128 ))  # MSI-X Enable
  devmem $((entry + 12)) 32 0  # entry 0 unmasked
  armed=$((armed + 1))
  vfs="${vfs:-} $base:$entry"
done
base=$(vf_irq_count)
echo "VMTEST PHASE vf-armed $armed count $base"
seen=$base
i=0
while [ $i -lt 600 ] && [ "$seen" -lt $((base + armed)) ]; do
  now=$(vf_irq_count)
  [ "$now" != "$seen" ] && echo "VMTEST VFIRQ $((now - base))" && seen=$now
  sleep 0.1
  i=$((i + 1))
done
echo "VMTEST PHASE vf-irqs-done $((seen - base))"
# GUEST_VHOST_NET=SUBNET: a second NIC, QEMU's virtio-net-pci on sriovd's
# vhost-user socket (MAC 02:5a:00:00:08:01), carries iperf3 to SUBNET.1 at
# the same time.
vhost=
if [ -n "${GUEST_VHOST_NET:-}" ]; then
  for n in /sys/class/net/*; do [ "$(cat "$n/address")" = 02:5a:00:00:08:01 ] && vhost=${n##*/}; done
  if [ -n "$vhost" ]; then
    ip link set "$vhost" up
    ip addr add "$GUEST_VHOST_NET.2/24" dev "$vhost"
    wait_for 50 ping -c 1 -W 1 "$GUEST_VHOST_NET.1" || echo "VMTEST FAIL guest-pings-vhost-user-wire"
  else
    echo "VMTEST FAIL guest-has-vhost-user-nic: no NIC with MAC 02:5a:00:00:08:01"
  fi
fi
# GUEST_VF_STORM=RATE: while the host reloads (or upgrades) sriovd, the
# first VF's generator storms vector 0 at RATE/s at CPU 0, and the other
# VFs, their entry 0 pointed at CPU 1, each raise one interrupt (a write
# to their cause register, BAR0 0x1000) and the guest waits for it before
# the next: one outstanding at a time, so none may merge with another -
# each must arrive exactly once (CPU 1's TRM count), whenever it was
# raised. The storm's own count can only be bounded: MSI-X lets a vector
# raised again before its first was taken arrive once (the host's eventfd,
# QEMU's and the local APIC's pending bit all merge).
# trm: CPU 0's and CPU 1's thermal interrupts so far, in $trm0 and $trm1.
trm() {
  read -r trm0 trm1 <<EOF
$(awk '/TRM:/ {print $2, $3}' /proc/interrupts)
EOF
}
now_cs() { read -r up _ </proc/uptime; echo "${up%.*}${up#*.}"; }  # centiseconds
storm_vf=''
pingpong_vfs=
if [ -n "${GUEST_VF_STORM:-}" ]; then
  for v in $vfs; do
    if [ -z "$storm_vf" ]; then storm_vf=${v%:*}; continue; fi
    e=${v#*:}
    devmem $((e + 12)) 32 1  # masked while it moves
    devmem "$e" 32 0xfee01000  # to CPU 1 (APIC ID 1)
    devmem $((e + 12)) 32 0
    pingpong_vfs="$pingpong_vfs ${v%:*}"
  done
  echo 1 >/proc/sys/kernel/printk  # the thermal handler's "unexpected" line, per interrupt, off the console
  trm
  storm_from=$trm0
  storm_gen0=$(devmem $((storm_vf + 0x1018)) 32)
  devmem $((storm_vf + 0x1014)) 32 "$GUEST_VF_STORM"
  devmem $((storm_vf + 0x1010)) 32 1
  (
    trm
    want=$trm1 sent=0 worst=0 storm_seen=$trm0 storm_at=$(now_cs) storm_gap=0 bad=
    while [ ! -e /tmp/stop-pingpong ] && [ -z "$bad" ]; do
      for b in $pingpong_vfs; do
        devmem $((b + 0x1000)) 32 1
        sent=$((sent + 1))
        want=$((want + 1))
        t0=$(now_cs)
        while :; do
          trm
          t=$(now_cs)
          if [ "$trm0" != "$storm_seen" ]; then
            [ $((t - storm_at)) -gt "$storm_gap" ] && storm_gap=$((t - storm_at))
            storm_seen=$trm0 storm_at=$t
          fi
          [ "$trm1" -ge "$want" ] && break
          if [ $((t - t0)) -gt 2000 ]; then
            bad="interrupt $sent (VF BAR0 $b) not delivered in 20 s (CPU 1 counts $trm1, $want expected)"
            break
          fi
          sleep 0.01
        done
        [ -n "$bad" ] && break
        [ "$trm1" -gt "$want" ] && bad="interrupt $sent (VF BAR0 $b) delivered $((trm1 - want + 1)) times" && break
        [ $((t - t0)) -gt "$worst" ] && worst=$((t - t0))
      done
    done
    echo "$sent ${worst}0 ${storm_gap}0 $bad" >/tmp/pingpong.result
  ) &
  pingpong=$!
fi
# Under traffic: the host reloads sriovd when it sees this line.
echo "VMTEST PHASE traffic-for-reload"
if [ -n "$vhost" ]; then
  iperf3 -c "$GUEST_VHOST_NET.1" -t "${GUEST_RELOAD_SECONDS:-8}" --connect-timeout 3000 >/tmp/vhost-iperf.log 2>&1 &
  vhost_iperf=$!
fi
if out=$(iperf3 -c 10.77.0.1 -t "${GUEST_RELOAD_SECONDS:-8}" -P 2 --connect-timeout 3000 2>&1); then
  echo "VMTEST BENCH iperf3-during-reload $(echo "$out" | grep -E 'SUM.*receiver' | tail -n 1)"
  echo "VMTEST PASS guest-iperf3-during-reload"
else
  echo "VMTEST FAIL guest-iperf3-during-reload: $(echo "$out" | tail -n 2 | tr '\n' ' ')"
fi
if [ -n "$vhost" ]; then
  if wait "$vhost_iperf"; then
    echo "VMTEST BENCH iperf3-vhost-user-during-reload $(grep receiver /tmp/vhost-iperf.log | tail -n 1)"
    echo "VMTEST PASS guest-iperf3-vhost-user-during-reload"
  else
    echo "VMTEST FAIL guest-iperf3-vhost-user-during-reload: $(tail -n 2 /tmp/vhost-iperf.log | tr '\n' ' ')"
  fi
fi
if [ -n "$storm_vf" ]; then
  touch /tmp/stop-pingpong
  wait "$pingpong"
  devmem $((storm_vf + 0x1010)) 32 0
  sleep 1
  trm
  delivered=$((trm0 - storm_from))
  generated=$(($(devmem $((storm_vf + 0x1018)) 32) - storm_gen0))
  read -r sent worst gap bad </tmp/pingpong.result
  echo "VMTEST BENCH vf-storm generated $generated delivered $delivered longest-gap ${gap}ms; one-at-a-time $sent, slowest ${worst}ms"
  if [ -n "$bad" ]; then
    echo "VMTEST FAIL vf-one-at-a-time: $bad"
  elif [ "$sent" -gt 0 ]; then
    echo "VMTEST PASS vf-one-at-a-time $sent"
  else
    echo "VMTEST FAIL vf-one-at-a-time: none raised"
  fi
  if [ "$delivered" -gt 0 ] && [ "$delivered" -le "$generated" ]; then
    echo "VMTEST PASS vf-storm $delivered of $generated"
  else
    echo "VMTEST FAIL vf-storm: $delivered delivered of $generated generated"
  fi
  rm -f /tmp/stop-pingpong
fi
echo "VMTEST PHASE boot-done"
# The host decides what comes next (reset, SIGKILL, quit).
while :; do sleep 1; done
