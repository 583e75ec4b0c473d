# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# sriovd as a DRA driver on a real SR-IOV NIC driver (igb, igbvf): a claim
# sets MAC, VLAN and trust on an igb VF and binds it to vfio-pci; a stop
# keeps it (the claim's pod holds the VF); the restarted sriovd answers the
# kubelet's prepare again the same; unprepare gives the VF back exactly as
# it was. The API server is the host's stand-in, reached over QEMU's user
# network on the third igb port (tests/vm/igb_dra).
set -u
CFG=/etc/sriovd/sriovd.yaml
PID=
# shellcheck source=../guest-lib.sh
. /guest-lib.sh

PF=0000:01:00.0
SYS=/sys/bus/pci/devices/$PF
PFN=$(ls "$SYS/net")
API=$(ls /sys/bus/pci/devices/0000:03:00.0/net)
if [ -z "$PFN" ] || [ -z "$API" ]; then fail "igb netdevs: PF [$PFN] API [$API]"; exit 1; fi
vfip link set "$PFN" up
ip link set "$API" up
ip addr add 10.0.2.15/24 dev "$API"
i=0; while [ $i -lt 100 ] && [ "$(cat "/sys/class/net/$API/carrier" 2>/dev/null)" != 1 ]; do sleep 0.1; i=$((i + 1)); done
drv() { if [ -e "/sys/bus/pci/devices/$1/driver" ]; then basename "$(readlink "/sys/bus/pci/devices/$1/driver")"; else echo none; fi; }
vfaddr() { basename "$(readlink "$SYS/virtfn$1")"; }
vfline() { vfip link show "$PFN" | grep "^ *vf $1 " | sed 's/, link-state [a-z]*//'; }
REG=/var/lib/kubelet/plugins_registry
KUBECONFIG_FILE=/bin/kubeconfig

mkdir -p /etc/sriovd /var/lib/sriovd
cat >"$CFG" <<CONF
version: 1
host: system
state_dir: /var/lib/sriovd
physical_functions:
  - netdev: $PFN
    num_vfs: 2
kubernetes:
  cdi_dir: /run/cdi
  dra:
    driver: sriovd.io
    node_name: node-a
    kubeconfig: $KUBECONFIG_FILE
    registry_dir: $REG
    plugins_dir: /var/lib/kubelet/plugins
CONF

if start_daemon; then pass "daemon-starts"; else fail "daemon-starts: $(tail -n 20 /tmp/sriovd.log)"; fi
expect_eq "numvfs-2" "$(cat "$SYS/sriov_numvfs")" 2
if wait_for 100 sh -c "ls $REG | grep -q -- -reg.sock"; then pass "registration-socket"; else fail "registration-socket"; fi
# The slices on the API server (the driver published them over the user network).
if wait_for 200 sh -c "sriovctl --json status | grep -q '\"slices_published\": *true'"; then pass "slices-published"
else fail "slices-published: $(sriovctl --json status | grep -A12 '\"dra\"')"; fi
VF=$(vfaddr 1)
DEV=vf-$(echo "$VF" | tr ':.' '--')
BEFORE=$(vfline 1)
BEFORE_DRV=$(drv "$VF")
echo "before: $BEFORE ($BEFORE_DRV)"

UID_A=$(vm_dra_kubelet "$KUBECONFIG_FILE" claim default vm-a sriovd.io node-a "$DEV" \
  '{"apiVersion":"sriovd.io/v1alpha1","kind":"VfConfig","mac":"02:00:00:00:d0:01","vlan":42,"qos":1,"trust":true}' 2>&1)
echo "claim: $UID_A"
out=$(vm_dra_kubelet "$REG" prepare default vm-a "$UID_A" 2>&1); echo "$out"
case $out in *"device $DEV cdi sriovd.io/vf=$UID_A-$DEV"*ok) pass "prepare";; *) fail "prepare: $out";; esac
l=$(vfline 1); echo "$l"
case $l in *"02:00:00:00:d0:01"*"vlan 42, qos 1"*) pass "claim-mac-vlan-on-igb";; *) fail "claim-mac-vlan-on-igb: $l";; esac
case $l in *"trust on"*) pass "claim-trust-on-igb";; *) fail "claim-trust-on-igb: $l";; esac
expect_eq "claim-vf-on-vfio-pci" "$(drv "$VF")" vfio-pci
if [ -f "/run/cdi/sriovd.io-claim-$UID_A.json" ]; then pass "cdi-spec"; else fail "cdi-spec"; fi

# driver: netdev: the VF on igbvf with the claim's MAC, its netdev's MTU set.
VF0=$(vfaddr 0)
DEV0=vf-$(echo "$VF0" | tr ':.' '--')
NET0=$(ls "/sys/bus/pci/devices/$VF0/net" 2>/dev/null)
MTU0=$(cat "/sys/class/net/$NET0/mtu" 2>/dev/null)
UID_N=$(vm_dra_kubelet "$KUBECONFIG_FILE" claim default pod-n sriovd.io node-a "$DEV0" \
  '{"apiVersion":"sriovd.io/v1alpha1","kind":"VfConfig","driver":"netdev","mac":"02:00:00:00:d0:00","mtu":9000}' 2>&1)
out=$(vm_dra_kubelet "$REG" prepare default pod-n "$UID_N" 2>&1); echo "$out"
case $out in *ok) pass "prepare-netdev";; *) fail "prepare-netdev: $out";; esac
expect_eq "netdev-claim-on-igbvf" "$(drv "$VF0")" igbvf
NET0=$(ls "/sys/bus/pci/devices/$VF0/net" 2>/dev/null)
expect_eq "netdev-claim-mtu" "$(cat "/sys/class/net/$NET0/mtu" 2>/dev/null)" 9000
expect_eq "netdev-claim-mac" "$(cat "/sys/class/net/$NET0/address" 2>/dev/null)" 02:00:00:00:d0:00
out=$(vm_dra_kubelet "$REG" unprepare default pod-n "$UID_N" 2>&1)
expect_eq "unprepare-netdev" "$out" ok
NET0=$(ls "/sys/bus/pci/devices/$VF0/net" 2>/dev/null)
expect_eq "unprepare-restores-mtu" "$(cat "/sys/class/net/$NET0/mtu" 2>/dev/null)" "$MTU0"

# A stop keeps the claim: the VF, its settings and its driver stay.
stop_daemon
expect_eq "sigterm-exit-0" "$?" 0
expect_eq "stop-keeps-numvfs" "$(cat "$SYS/sriov_numvfs")" 2
expect_eq "stop-keeps-claim-settings" "$(vfline 1)" "$l"
expect_eq "stop-keeps-vfio-pci" "$(drv "$VF")" vfio-pci

if start_daemon; then pass "daemon-restarts"; else fail "daemon-restarts: $(tail -n 20 /tmp/sriovd.log)"; fi
wait_for 100 sh -c "ls $REG | grep -q -- -reg.sock" || true
out=$(vm_dra_kubelet "$REG" prepare default vm-a "$UID_A" 2>&1); echo "$out"
case $out in *"device $DEV"*ok) pass "prepare-again-after-restart";; *) fail "prepare-again-after-restart: $out";; esac
expect_eq "restart-changed-nothing" "$(vfline 1)" "$l"

# Unprepare: the VF as it was before the claim.
out=$(vm_dra_kubelet "$REG" unprepare default vm-a "$UID_A" 2>&1); echo "$out"
expect_eq "unprepare" "$out" ok
expect_eq "unprepare-restores-settings" "$(vfline 1)" "$BEFORE"
expect_eq "unprepare-restores-driver" "$(drv "$VF")" "$BEFORE_DRV"
if [ -f "/run/cdi/sriovd.io-claim-$UID_A.json" ]; then fail "cdi-spec-removed"; else pass "cdi-spec-removed"; fi
stop_daemon
expect_eq "final-stop-restores-numvfs" "$(cat "$SYS/sriov_numvfs")" 0
grep -E 'error|warn|dra' /tmp/sriovd.log | head -n 40
