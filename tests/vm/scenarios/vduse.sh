# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# VDUSE on the 6.12 guest kernel (issue 36): sriovd's virtio-net as a vDPA
# device the kernel itself drives. Bound to virtio_vdpa it is a netdev of
# this guest: iperf3 runs through it to a tap (csum/TSO offloads negotiated)
# and, bridged to a real igbvf VF, through the NIC to the wire. Bound to
# vhost_vdpa it is a /dev/vhost-vdpa-N whose features and config a VMM's
# reads give back. Release, SIGKILL-then-start and SIGTERM leave no vDPA or
# VDUSE device behind.
set -u
CFG=/etc/sriovd/sriovd.yaml
PID=
# shellcheck source=../guest-lib.sh
. /guest-lib.sh
PF=0000:01:00.0
SYS=/sys/bus/pci/devices/$PF
PFN=$(ls "$SYS/net")
WIRE=$(ls /sys/bus/pci/devices/0000:02:00.0/net)
VDPA=/sys/bus/vdpa/devices

vfip link set "$PFN" up
vfip addr add 10.9.0.1/24 dev "$PFN"
mkdir -p /run/netns /etc/sriovd /var/lib/sriovd
vfip netns add w
vfip link set "$WIRE" netns w
vfip -n w link set "$WIRE" up
vfip -n w addr add 10.9.0.3/24 dev "$WIRE"
vfip -n w link set lo up
vfip netns add t
vfip -n t link set lo up
vfip netns add g
vfip -n g link set lo up
wait_for 100 test "$(cat "/sys/class/net/$PFN/carrier")" = 1 || fail "pf-link"

# write_config BIND [bridge]: vd0 on a tap (netns t); with "bridge", vb0 on VF 1.
write_config() {
  cat >"$CFG" <<CONF
version: 1
host: system
state_dir: /var/lib/sriovd
physical_functions:
  - netdev: $PFN
    num_vfs: 2
    vfs:
      - index: 1
        mac: "02:00:00:00:10:01"
CONF
  [ "$1" = none ] && return
  cat >>"$CFG" <<CONF
virtio_devices:
  - name: vd0
    type: net
    transport: vduse
    bind: $1
    mac: "02:00:00:00:20:01"
    backend: {type: tap, name: vdtap0, netns: t, offloads: [csum, tso4, tso6]}
CONF
  [ "${2:-}" = bridge ] || return
  cat >>"$CFG" <<CONF
  - name: vb0
    type: net
    transport: vduse
    backend: {type: vf, pf: $PFN, vf: 1}
CONF
}
netdev_of() {
  for n in "$VDPA/$1"/virtio*/net/*; do
    [ -e "$n" ] && { echo "${n##*/}"; return; }
  done
}
has_netdev() { [ -n "$(netdev_of "$1")" ]; }
driver_of() { basename "$(readlink "$VDPA/$1/driver" 2>/dev/null)"; }
# bit N of a virtio device's negotiated features (sysfs: one character per bit)
feature() { cut -c $(($2 + 1)) "$VDPA/$1"/virtio*/features; }
# iperf3 for 3 s from netns $2 (or here: "-") to $3, whose server runs in
# netns $1 for this one test; "-R" for the other way: the receiver's Mbit/s.
iperf_mbps() {
  local sns=$1 ns=$2 to=$3 out
  shift 3
  vfip netns exec "$sns" iperf3 -s -D -1 >/dev/null 2>&1
  sleep 0.3
  if [ "$ns" = - ]; then out=$(iperf3 -c "$to" -t 3 -J --connect-timeout 3000 "$@" 2>&1)
  else out=$(vfip netns exec "$ns" iperf3 -c "$to" -t 3 -J --connect-timeout 3000 "$@" 2>&1); fi
  echo "$out" | awk '/"sum_received"/ {r = 1} r && /"bits_per_second"/ {gsub(/[,]/, "", $2); printf "%d\n", $2 / 1e6; exit}'
}
# vd0's netdev here and its tap in netns t, addressed and up.
address_vd0() {
  ND=$(netdev_of vd0)
  vfip addr add 10.20.0.1/24 dev "$ND"
  vfip link set "$ND" up
  vfip -n t addr add 10.20.0.2/24 dev vdtap0
  vfip -n t link set vdtap0 up
}
gone() { [ ! -e "$VDPA/$1" ] && [ ! -e "/dev/vduse/$1" ]; }

write_config netdev bridge
if start_daemon --log-level debug; then pass "daemon-starts"; else fail "daemon-starts: $(tail -n 20 /tmp/sriovd.log)"; fi
expect_eq "vd0-bound-to-virtio_vdpa" "$(driver_of vd0)" virtio_vdpa
ND=$(netdev_of vd0)
if [ -n "$ND" ]; then pass "vd0-is-a-netdev ($ND)"; else fail "vd0-is-a-netdev: $(sriovctl --json devices)"; fi
expect_eq "vd0-netdev-has-the-configured-mac" "$(cat "/sys/class/net/$ND/address" 2>/dev/null)" 02:00:00:00:20:01
expect_eq "vd0-negotiated-csum" "$(feature vd0 0)" 1
expect_eq "vd0-negotiated-host-tso4" "$(feature vd0 11)" 1
expect_eq "vd0-negotiated-access-platform" "$(feature vd0 33)" 1
json=$(sriovctl --json devices)
case $json in *'"netdev": "'"$ND"'"'*) pass "devices-names-the-netdev";; *) fail "devices-names-the-netdev: $json";; esac

# Through the tap: this guest's stack -> virtio_net -> VDUSE -> sriovd -> tap.
address_vd0
if wait_for 30 ping -c 1 -W 1 10.20.0.2; then pass "ping-through-vduse-to-tap"; else
  fail "ping-through-vduse-to-tap: $(sriovctl --json devices | grep -A12 '"vduse"') $(grep -i vduse /tmp/sriovd.log | tail -n 40) $(dmesg | tail -n 15)"; fi
mbps=$(iperf_mbps t - 10.20.0.2)
echo "iperf3 vduse->tap: ${mbps:-none} Mbit/s"
if [ "${mbps:-0}" -gt 0 ]; then pass "iperf3-vduse-to-tap (${mbps} Mbit/s)"; else fail "iperf3-vduse-to-tap"; fi
mbps=$(iperf_mbps t - 10.20.0.2 -R)
echo "iperf3 tap->vduse: ${mbps:-none} Mbit/s"
if [ "${mbps:-0}" -gt 0 ]; then pass "iperf3-tap-to-vduse (${mbps} Mbit/s)"; else fail "iperf3-tap-to-vduse"; fi

# Bridged to a real VF: the netdev in netns g speaks through igbvf, the
# NIC's switch and the wire.
NB=$(netdev_of vb0)
if [ -n "$NB" ]; then pass "vb0-is-a-netdev ($NB)"; else fail "vb0-is-a-netdev"; fi
expect_eq "vb0-takes-the-vfs-mac" "$(cat "/sys/class/net/$NB/address" 2>/dev/null)" 02:00:00:00:10:01
vfip link set "$NB" netns g
vfip -n g addr add 10.9.0.2/24 dev "$NB"
vfip -n g link set "$NB" up
ping_from_g() { vfip netns exec g ping -c 1 -W 1 "$1"; }
if wait_for 100 ping_from_g 10.9.0.1; then pass "vduse-bridge-reaches-pf"; else fail "vduse-bridge-reaches-pf"; fi
if wait_for 100 ping_from_g 10.9.0.3; then pass "vduse-bridge-reaches-wire"; else fail "vduse-bridge-reaches-wire"; fi
mbps=$(iperf_mbps w g 10.9.0.3)
echo "iperf3 vduse->vf->wire: ${mbps:-none} Mbit/s"
if [ "${mbps:-0}" -gt 0 ]; then pass "iperf3-vduse-bridge-to-wire (${mbps} Mbit/s)"; else fail "iperf3-vduse-bridge-to-wire"; fi
mbps=$(iperf_mbps w g 10.9.0.3 -R)
echo "iperf3 wire->vf->vduse: ${mbps:-none} Mbit/s"
if [ "${mbps:-0}" -gt 0 ]; then pass "iperf3-wire-to-vduse-bridge (${mbps} Mbit/s)"; else fail "iperf3-wire-to-vduse-bridge"; fi

# The other ways to a VF's netdev behind VDUSE: a macvtap, AF_XDP (generic
# XDP on igbvf). vb0 restarts on each (a new netdev in the root namespace).
for via in macvtap af_xdp; do
  sed -i "s/backend: {type: vf, pf: $PFN, vf: 1.*}/backend: {type: vf, pf: $PFN, vf: 1, via: $via}/" "$CFG"
  out=$(sriovctl reload 2>&1) || fail "reload-vb0-$via: $out"
  wait_for 50 has_netdev vb0
  NB=$(netdev_of vb0)
  if [ -z "$NB" ]; then fail "vb0-over-$via: $(sriovctl --json devices | grep -B3 -A12 '"vduse"')"; continue; fi
  vfip link set "$NB" netns g
  vfip -n g addr add 10.9.0.2/24 dev "$NB"
  vfip -n g link set "$NB" up
  if wait_for 100 ping_from_g 10.9.0.3; then pass "vduse-bridge-over-$via-reaches-wire"; else
    fail "vduse-bridge-over-$via-reaches-wire: $(grep -i 'vb0' /tmp/sriovd.log | tail -n 5)"; fi
done

# A name another instance holds: its device is not served, saying why, and
# the holder's is untouched.
mkdir -p /var/lib/sriovd2
cat >/etc/sriovd/second.yaml <<CONF
version: 1
host: system
state_dir: /var/lib/sriovd2
control: {socket: /run/sriovd2/control.sock}
virtio_devices:
  - {name: vd0, type: net, transport: vduse, backend: {type: tap, name: vdtap9}}
CONF
sriovd --config /etc/sriovd/second.yaml --foreground >/tmp/sriovd2.log 2>&1 &
PID2=$!
wait_for 100 sriovctl -s /run/sriovd2/control.sock version >/dev/null 2>&1
json=$(sriovctl -s /run/sriovd2/control.sock --json devices 2>&1)
case $json in *'exists already'*) pass "name-taken-is-explained";; *) fail "name-taken-is-explained: $json";; esac
kill -TERM "$PID2"
wait "$PID2" 2>/dev/null
expect_eq "the-holders-device-untouched" "$(driver_of vd0)" virtio_vdpa
expect_eq "second-instance-journal-empty" "$(cat /var/lib/sriovd2/vduse-devices 2>/dev/null)" ""

# vhost_vdpa, and vb0 released by the reload.
write_config vhost-vdpa
out=$(sriovctl reload 2>&1) || fail "reload-vhost-vdpa: $out"
if wait_for 50 gone vb0; then pass "released-device-leaves-the-bus"; else fail "released-device-leaves-the-bus: $(ls $VDPA)"; fi
expect_eq "vd0-bound-to-vhost_vdpa" "$(driver_of vd0)" vhost_vdpa
VH=
for v in "$VDPA"/vd0/vhost-vdpa-*; do [ -e "$v" ] && VH=/dev/${v##*/}; done
probe=$(vm_vhost_vdpa_probe "$VH" 12 2>&1); echo "$probe"
case $probe in *'"device_id": 1,'*) pass "vhost-vdpa-device-id-is-net";; *) fail "vhost-vdpa-device-id-is-net: $probe";; esac
case $probe in *'"config": "020000002001'*) pass "vhost-vdpa-config-has-the-mac";; *) fail "vhost-vdpa-config-has-the-mac: $probe";; esac
feat=$(echo "$probe" | sed -n 's/.*"features": "\(0x[0-9a-f]*\)".*/\1/p')
if [ $((feat >> 33 & 1)) -eq 1 ] && [ $((feat & 1)) -eq 1 ] && [ $((feat >> 32 & 1)) -eq 1 ]; then pass "vhost-vdpa-features-read-back ($feat)"; else fail "vhost-vdpa-features-read-back: $feat"; fi
if [ $((feat >> 17 & 1)) -eq 0 ]; then pass "no-control-queue-offered"; else fail "no-control-queue-offered: $feat"; fi

# Released while a VMM holds /dev/vhost-vdpa-N: the kernel waits for it to
# close; the daemon does not (the reload returns), says who holds it, and
# the device goes once it is let go.
sleep 600 3<>"$VH" &
HOLDER=$!
write_config none
t0=$(date +%s)
out=$(sriovctl reload 2>&1) || fail "reload-while-held: $out"
t1=$(date +%s)
if [ $((t1 - t0)) -lt 15 ]; then pass "reload-does-not-wait-for-the-holder ($((t1 - t0)) s)"; else
  fail "reload-does-not-wait-for-the-holder: $((t1 - t0)) s"; fi
if grep -q "still open by $HOLDER" /tmp/sriovd.log; then pass "holder-is-named"; else
  fail "holder-is-named: $(grep -i vduse /tmp/sriovd.log | tail -n 5)"; fi
# (its bus entry goes at once; the VDUSE device stays until the removal ends)
if [ -e /dev/vduse/vd0 ]; then pass "held-device-stays-until-let-go"; else fail "held-device-stays-until-let-go"; fi
kill "$HOLDER"
wait "$HOLDER" 2>/dev/null
if wait_for 100 gone vd0; then pass "held-device-goes-once-let-go"; else fail "held-device-goes-once-let-go: $(ls $VDPA)"; fi
expect_eq "journal-empty-after-the-holder" "$(cat /var/lib/sriovd/vduse-devices 2>/dev/null)" ""

# A crash leaves the device on the bus; the next start removes it, even
# with the device gone from the config.
write_config netdev
sriovctl reload >/dev/null 2>&1
kill -KILL "$PID"
wait "$PID" 2>/dev/null
if [ -e "$VDPA/vd0" ]; then pass "killed-daemon-left-vd0"; else fail "killed-daemon-left-vd0 (nothing to clean up: not a crash test)"; fi
write_config none
if start_daemon; then pass "daemon-restarts"; else fail "daemon-restarts: $(tail -n 20 /tmp/sriovd.log)"; fi
if wait_for 50 gone vd0; then pass "left-over-vduse-removed-at-start"; else fail "left-over-vduse-removed-at-start: $(ls $VDPA /dev/vduse)"; fi
expect_eq "journal-empty" "$(cat /var/lib/sriovd/vduse-devices 2>/dev/null)" ""

# Served again, then SIGTERM: nothing left.
write_config netdev
out=$(sriovctl reload 2>&1) || fail "reload-netdev: $out"
address_vd0  # the tap went with the killed daemon: the new one is addressed again
if wait_for 30 ping -c 1 -W 1 10.20.0.2; then pass "served-again-after-the-crash"; else
  fail "served-again-after-the-crash: $(sriovctl --json devices | grep -A12 '"vduse"')"; fi
if stop_daemon; then pass "daemon-stops"; else fail "daemon-stops"; fi
if gone vd0; then pass "sigterm-leaves-no-vduse-device"; else fail "sigterm-leaves-no-vduse-device: $(ls $VDPA /dev/vduse)"; fi
