# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# The host layer on a real SR-IOV NIC driver (QEMU 10's igb, the guest's igb
# and igbvf): VF settings read back from the driver, bindings both ways,
# reload, release by PF, SIGTERM and SIGKILL restore - with VFs an operator
# made by hand before sriovd started.
set -u
CFG=/etc/sriovd/sriovd.yaml
PID=
# shellcheck source=../guest-lib.sh
. /guest-lib.sh

PF=0000:01:00.0
SYS=/sys/bus/pci/devices/$PF
PFN=$(ls "$SYS/net")
[ -n "$PFN" ] || { fail "no igb netdev"; exit 1; }
vfip link set "$PFN" up
for n in /sys/class/net/*; do vfip link set "$(basename "$n")" up; done
# The link comes up over the emulated wire (both ports on one QEMU hub).
i=0; while [ $i -lt 100 ] && [ "$(cat "/sys/class/net/$PFN/carrier" 2>/dev/null)" != 1 ]; do sleep 0.1; i=$((i + 1)); done
expect_eq "pf-link-up" "$(cat "/sys/class/net/$PFN/carrier")" 1

drv() { if [ -e "/sys/bus/pci/devices/$1/driver" ]; then basename "$(readlink "/sys/bus/pci/devices/$1/driver")"; else echo none; fi; }
vfs() { for v in "$SYS"/virtfn*; do [ -e "$v" ] && basename "$(readlink "$v")"; done; }
vfaddr() { basename "$(readlink "$SYS/virtfn$1")"; }
# Everything sriovd may touch, in one line per item: sysfs, then the
# driver's own view of each VF (ip link's "vf N ..." lines).
state() {
  echo "numvfs=$(cat "$SYS/sriov_numvfs") autoprobe=$(cat "$SYS/sriov_drivers_autoprobe") pf=$(drv "$PF")"
  for v in $(vfs); do echo "$v:$(drv "$v"):$(cat "/sys/bus/pci/devices/$v/driver_override")"; done
  vfip link show "$PFN" | grep '^ *vf ' | sed 's/, link-state [a-z]*//'
}
vfline() { vfip link show "$PFN" | grep "^ *vf $1 "; }


# 0. VFs made by hand: 2, with igbvf, their own MAC, VLAN, trust and rate.
echo 2 >"$SYS/sriov_numvfs"
sleep 0.5
vfip link set "$PFN" vf 0 mac 02:00:00:00:aa:00 vlan 7 trust on
vfip link set "$PFN" vf 1 max_tx_rate 50
HAND=$(state)
echo "hand-made:"; echo "$HAND"

mkdir -p /etc/sriovd /var/lib/sriovd
cat >"$CFG" <<CONF
version: 1
host: system
state_dir: /var/lib/sriovd
physical_functions:
  - netdev: $PFN
    num_vfs: 4
    vfs:
      - index: 0
        mac: "02:00:00:00:10:00"
        vlan: 100
        qos: 3
        trust: false
        spoofchk: true
        max_tx_rate: 200
        assign: {owner: web-vm, export: none}
      - index: 1
        mac: "02:00:00:00:10:01"
        assign: {owner: db-vm, export: none}
      - index: 3
        mac: "02:00:00:00:10:03"
        trust: true
CONF

# 1. Apply: num_vfs 2 -> 4 on a PF with VFs; each setting read back.
if start_daemon; then pass "daemon-starts"; else fail "daemon-starts: $(tail -n 20 /tmp/sriovd.log)"; fi
expect_eq "numvfs-4" "$(cat "$SYS/sriov_numvfs")" 4
expect_eq "vf0-vfio" "$(drv "$(vfaddr 0)")" vfio-pci
expect_eq "vf1-vfio" "$(drv "$(vfaddr 1)")" vfio-pci
expect_eq "vf2-own-driver" "$(drv "$(vfaddr 2)")" igbvf
expect_eq "vf3-own-driver" "$(drv "$(vfaddr 3)")" igbvf
l=$(vfline 0); echo "$l"
case $l in *"02:00:00:00:10:00"*"vlan 100, qos 3"*"spoof checking on"*) pass "vf0-mac-vlan-qos-spoofchk";; *) fail "vf0-mac-vlan-qos-spoofchk: $l";; esac
case $l in *"max_tx_rate 200Mbps"*) pass "vf0-max-tx-rate";; *) fail "vf0-max-tx-rate: $l";; esac
case $l in *"trust off"*) pass "vf0-trust-off";; *) fail "vf0-trust-off: $l";; esac
l=$(vfline 3); echo "$l"
case $l in *"02:00:00:00:10:03"*"trust on"*) pass "vf3-mac-trust";; *) fail "vf3-mac-trust: $l";; esac
# The MAC the driver holds is the one the VF's netdev has (igbvf bound).
n3=$(ls "/sys/bus/pci/devices/$(vfaddr 3)/net" 2>/dev/null)
expect_eq "vf3-netdev-mac" "$(cat "/sys/class/net/$n3/address" 2>/dev/null)" 02:00:00:00:10:03
plan=$(sriovctl plan 2>&1)
case $plan in *"no change"*|*"nothing"*) pass "plan-empty-when-converged";; *) fail "plan-empty-when-converged: $plan";; esac

# 2. Reload: max_tx_rate dropped, VLAN changed, VF 1 no longer assigned.
sed -i 's/        max_tx_rate: 200//; s/vlan: 100/vlan: 101/' "$CFG"
sed -i 's/        assign: {owner: db-vm, export: none}//' "$CFG"
out=$(sriovctl reload 2>&1); echo "$out"
l=$(vfline 0); echo "$l"
case $l in *"vlan 101, qos 3"*) pass "reload-vlan";; *) fail "reload-vlan: $l";; esac
case $l in *"max_tx_rate"*) fail "reload-drops-rate: $l";; *) pass "reload-drops-rate";; esac
expect_eq "reload-vf1-own-driver" "$(drv "$(vfaddr 1)")" igbvf
plan=$(sriovctl plan 2>&1)
case $plan in *"no change"*|*"nothing"*) pass "plan-empty-after-reload";; *) fail "plan-empty-after-reload: $plan";; esac

# 3. Release by PF (address and netdev).
out=$(sriovctl release "$PF" 2>&1); rc=$?; echo "$out"
expect_eq "release-by-pf-address" "$rc" 0
expect_eq "released-vf0-own-driver" "$(drv "$(vfaddr 0)")" igbvf
# Nothing assigned now: the VFs sriovd made for the host keep their driver.
expect_eq "released-pf-vf2-keeps-igbvf" "$(drv "$(vfaddr 2)")" igbvf
expect_eq "released-pf-vf3-keeps-igbvf" "$(drv "$(vfaddr 3)")" igbvf
sriovctl reload >/dev/null 2>&1
expect_eq "reload-takes-back-vf0" "$(drv "$(vfaddr 0)")" vfio-pci
out=$(sriovctl release "$PFN" 2>&1); rc=$?; echo "$out"
expect_eq "release-by-pf-netdev" "$rc" 0
sriovctl reload >/dev/null 2>&1

# 4. SIGTERM: the host as the operator left it, byte for byte.
stop_daemon
expect_eq "sigterm-exit-0" "$?" 0
NOW=$(state)
if [ "$NOW" = "$HAND" ]; then pass "sigterm-restores-hand-made"; else fail "sigterm-restores-hand-made"; echo "now:"; echo "$NOW"; fi

# 5. SIGKILL at several points of the apply, then a start converges and a
#    stop restores.
for k in 2 5 9; do
  sriovd --config "$CFG" --foreground --test-stop-before-step $k >>/tmp/sriovd.log 2>&1 &
  PID=$!
  i=0
  while [ $i -lt 300 ] && ! grep -q '^State:.*T' "/proc/$PID/status" 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
  kill -KILL "$PID"; wait "$PID" 2>/dev/null
  if start_daemon; then pass "restart-after-sigkill-at-$k"; else fail "restart-after-sigkill-at-$k: $(tail -n 5 /tmp/sriovd.log)"; fi
  expect_eq "converged-after-kill-at-$k" "$(drv "$(vfaddr 0)")" vfio-pci
  stop_daemon
  NOW=$(state)
  if [ "$NOW" = "$HAND" ]; then pass "restored-after-kill-at-$k"; else fail "restored-after-kill-at-$k"; echo "$NOW"; fi
done
grep -E 'error|warn' /tmp/sriovd.log | head -n 30

# 6. --check-config on this host: a setting igb refuses is named before
#    anything changes; the shipped example config applies as it is.
cat >/tmp/refused.yaml <<CONF
version: 1
host: system
state_dir: /var/lib/sriovd
physical_functions:
  - netdev: $PFN
    num_vfs: 2
    vfs:
      - {index: 1, link_state: enable}
CONF
out=$(sriovd --check-config /tmp/refused.yaml 2>&1); rc=$?
expect_eq "check-config-refused-exit" "$rc" 78
case $out in *"VF 1: link_state enable: the igb driver takes no VF link state"*) pass "check-config-names-refused-setting";;
  *) fail "check-config-names-refused-setting: $out";; esac
expect_eq "check-config-changed-nothing" "$(state)" "$HAND"
WIRE=0000:02:00.0
sed -e "s/enp59s0f0/$PFN/; s/0000:5e:00.1/$WIRE/" /bin/sriovd.yaml >/tmp/example.yaml
out=$(sriovd --check-config /tmp/example.yaml 2>&1); rc=$?
if [ $rc -eq 0 ]; then pass "example-config-checks-on-igb"; else fail "example-config-checks-on-igb: $out"; fi
cp /tmp/example.yaml "$CFG"
if start_daemon; then pass "example-config-applies-on-igb"; else fail "example-config-applies-on-igb: $(tail -n 5 /tmp/sriovd.log)"; fi
json=$(sriovctl --json devices)
if echo "$json" | grep -q '"not served'; then fail "example-devices-served: $json"; else pass "example-devices-served"; fi
stop_daemon
NOW=$(state)
if [ "$NOW" = "$HAND" ]; then pass "example-config-restored"; else fail "example-config-restored"; echo "$NOW"; fi
echo 0 >/sys/bus/pci/devices/$WIRE/sriov_numvfs 2>/dev/null
