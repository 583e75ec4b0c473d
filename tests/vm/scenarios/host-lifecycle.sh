# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# The host layer on a real kernel: sriovd creates VFs, binds them to
# vfio-pci, checks their IOMMU groups, and gives the host back exactly;
# failures roll back, a SIGKILL mid-apply is recovered at the next start.
set -u
CFG=/etc/sriovd/sriovd.yaml
STATE=/var/lib/sriovd/state.json
PID=

# shellcheck source=../guest-lib.sh
. /guest-lib.sh

PF=$(for d in /sys/bus/pci/devices/*; do [ -e "$d/sriov_totalvfs" ] && basename "$d"; done | head -n 1)
SYS=/sys/bus/pci/devices/$PF
[ -n "$PF" ] || { fail "no SR-IOV PF in the VM"; exit 1; }

drv() {
  if [ -e "/sys/bus/pci/devices/$1/driver" ]; then basename "$(readlink "/sys/bus/pci/devices/$1/driver")"; else echo none; fi
}
vfs() { for v in "$SYS"/virtfn*; do [ -e "$v" ] && basename "$(readlink "$v")"; done; }
# Everything sriovd may touch, in one line.
state() {
  s="numvfs=$(cat "$SYS/sriov_numvfs") autoprobe=$(cat "$SYS/sriov_drivers_autoprobe") pf=$(drv "$PF")"
  for v in $(vfs); do s="$s $v:$(drv "$v"):$(cat "/sys/bus/pci/devices/$v/driver_override")"; done
  echo "$s"
}

mkdir -p /etc/sriovd /var/lib/sriovd
cat >"$CFG" <<CONF
version: 1
host: system
state_dir: /var/lib/sriovd
physical_functions:
  - address: "$PF"
    num_vfs: 2
    vfs:
      - index: 0
        assign: {owner: vm-a, export: none}
      - index: 1
        assign: {owner: vm-b, export: none}
CONF


ORIG=$(state)
echo "original: $ORIG"

# 1. Apply: 2 VFs on vfio-pci, each in a viable group with its /dev/vfio node.
if start_daemon; then pass "daemon-starts"; else fail "daemon-starts: $(tail -n 20 /tmp/sriovd.log)"; fi
expect_eq "numvfs-2" "$(cat "$SYS/sriov_numvfs")" 2
expect_eq "autoprobe-off-while-managed" "$(cat "$SYS/sriov_drivers_autoprobe")" 0
for v in $(vfs); do
  expect_eq "vf-$v-on-vfio-pci" "$(drv "$v")" vfio-pci
  g=$(basename "$(readlink "/sys/bus/pci/devices/$v/iommu_group")")
  if [ -c "/dev/vfio/$g" ]; then pass "vf-$v-group-$g-node"; else fail "vf-$v-group-$g-node missing"; fi
done
json=$(sriovctl --json devices)
expect_eq "both-groups-viable" "$(echo "$json" | grep -c '"group_viable": true')" 2
expect_eq "both-assigned" "$(echo "$json" | grep -c '"state": "assigned"')" 2
if echo "$json" | grep -q '"msix_vectors": [1-9]'; then pass "libpci-reads-vf-msix"; else fail "libpci-reads-vf-msix: $json"; fi

# 2. SIGTERM releases everything: the host is as it was.
stop_daemon
expect_eq "sigterm-exit-0" "$?" 0
expect_eq "release-restores-host" "$(state)" "$ORIG"

# 3. VFs an operator made, one bound by hand to pci-stub: sriovd takes both,
#    and release gives VF 1 back to pci-stub, with no override left behind.
echo 0 >"$SYS/sriov_drivers_autoprobe"
echo 2 >"$SYS/sriov_numvfs"
VF1=$(basename "$(readlink "$SYS/virtfn1")")
echo pci-stub >"/sys/bus/pci/devices/$VF1/driver_override"
echo "$VF1" >/sys/bus/pci/drivers_probe
echo >"/sys/bus/pci/devices/$VF1/driver_override"
HAND=$(state)
echo "hand-made: $HAND"
expect_eq "hand-bound-to-pci-stub" "$(drv "$VF1")" pci-stub
start_daemon || fail "daemon-starts-on-existing-vfs"
expect_eq "takes-hand-bound-vf" "$(drv "$VF1")" vfio-pci
stop_daemon
expect_eq "release-of-hand-made-exit-0" "$?" 0
expect_eq "release-restores-hand-made-state" "$(state)" "$HAND"
echo "$VF1" >/sys/bus/pci/drivers/pci-stub/unbind
echo 0 >"$SYS/sriov_numvfs"
echo 1 >"$SYS/sriov_drivers_autoprobe"
expect_eq "manual-cleanup" "$(state)" "$ORIG"

# 4. A failure mid-apply (vfio-pci is not loaded, so probing binds nothing):
#    sriovd exits non-zero, and everything it did is undone.
rmmod vfio_pci
sriovd --config "$CFG" --foreground >/tmp/fail.log 2>&1
rc=$?
if [ $rc -ne 0 ]; then pass "apply-failure-exits-non-zero"; else fail "apply-failure-exits-non-zero"; fi
if grep -q "is the vfio-pci module loaded" /tmp/fail.log; then pass "apply-failure-names-cause"; else
  fail "apply-failure-names-cause: $(tail -n 5 /tmp/fail.log)"; fi
expect_eq "apply-failure-rolls-back" "$(state)" "$ORIG"
insmod /modules/vfio-pci.ko

# 5. SIGKILL mid-apply (stopped before step 3: VF 0 bound, VF 1 not):
#    the journal holds the transaction, and the next start puts the host
#    back, then converges to the config.
sriovd --config "$CFG" --foreground --test-stop-before-step 3 >>/tmp/sriovd.log 2>&1 &
PID=$!
i=0
while [ $i -lt 300 ] && ! grep -q '^State:.*T' "/proc/$PID/status" 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
if grep -q '^State:.*T' "/proc/$PID/status"; then pass "stopped-mid-apply"; else fail "stopped-mid-apply"; fi
kill -KILL "$PID"
wait "$PID" 2>/dev/null
MID=$(state)
echo "killed with: $MID"
if [ "$MID" != "$ORIG" ]; then pass "host-left-in-between"; else fail "host-left-in-between: nothing was done"; fi
if grep -q '"txn": {' "$STATE" && grep -q '"status": "done"' "$STATE"; then pass "journal-holds-transaction"; else
  fail "journal-holds-transaction: $(cat $STATE)"; fi
start_daemon || fail "restart-after-sigkill"
if grep -q "recovered: undid" /tmp/sriovd.log; then pass "restart-recovers-journal"; else fail "restart-recovers-journal"; fi
for v in $(vfs); do expect_eq "recovered-then-converged-$v" "$(drv "$v")" vfio-pci; done
stop_daemon
expect_eq "recovered-run-releases" "$(state)" "$ORIG"

# 6. The PF itself on vfio-pci (multi-vector MSI-X), and back to nvme.
out=$(vm_host_probe bind "$PF" vfio-pci 2>&1)
if [ "$(drv "$PF")" = vfio-pci ]; then pass "pf-on-vfio-pci"; else fail "pf-on-vfio-pci: got [$(drv "$PF")] ($out)"; fi
if vm_host_probe group "$PF" >/dev/null; then pass "pf-group-viable"; else fail "pf-group-viable"; fi
g=$(basename "$(readlink "$SYS/iommu_group")")
if [ -c "/dev/vfio/$g" ]; then pass "pf-vfio-node"; else fail "pf-vfio-node"; fi
# libpci's MSI-X table size against the config space read here byte by byte
# (capability list from 0x34, MSI-X is ID 0x11, Message Control at +2).
cfgbyte() { od -An -tu1 -j "$2" -N 1 "/sys/bus/pci/devices/$1/config" | tr -d ' '; }
msix_size() {
  p=$(cfgbyte "$1" 52)
  while [ "$p" -ne 0 ]; do
    if [ "$(cfgbyte "$1" "$p")" -eq 17 ]; then
      echo $((($(cfgbyte "$1" $((p + 3))) * 256 + $(cfgbyte "$1" $((p + 2)))) % 2048 + 1))
      return
    fi
    p=$(cfgbyte "$1" $((p + 1)))
  done
  echo 0
}
want=$(msix_size "$PF")
echo "PF MSI-X table size from config space: $want"
if [ "$want" -gt 1 ]; then pass "pf-is-multi-vector"; else fail "pf-is-multi-vector: $want"; fi
expect_eq "pf-msix-vectors-libpci" "$(vm_host_probe scan | grep "\"$PF\"" | sed 's/.*"msix_vectors":\([0-9]*\).*/\1/')" "$want"
vm_host_probe bind "$PF" nvme >/dev/null 2>&1
expect_eq "pf-back-on-nvme" "$(drv "$PF")" nvme
expect_eq "pf-no-override-left" "$(cat "$SYS/driver_override")" "(null)"
expect_eq "host-as-found" "$(state)" "$ORIG"
