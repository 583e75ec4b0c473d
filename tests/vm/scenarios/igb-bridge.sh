# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# The VF bridge on a real VF (QEMU 10's igb, igbvf): a virtio-net device over
# vhost-user bridged to an igbvf netdev carries a guest front-end's traffic
# to the PF (through the NIC's switch) and to the wire; the VF netdev down
# spins no worker; a rebound VF driver is followed; AF_XDP runs on generic
# XDP; the PF's link down makes the VF unhealthy for the device plugin.
set -u
CFG=/etc/sriovd/sriovd.yaml
PID=
GPID=
# shellcheck source=../guest-lib.sh
. /guest-lib.sh
PF=0000:01:00.0
SYS=/sys/bus/pci/devices/$PF
PFN=$(ls "$SYS/net")
WIRE=$(ls /sys/bus/pci/devices/0000:02:00.0/net)
vfaddr() { basename "$(readlink "$SYS/virtfn$1")"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

vfip link set "$PFN" up
vfip addr add 10.9.0.1/24 dev "$PFN"
mkdir -p /run/netns /etc/sriovd /var/lib/sriovd
vfip netns add w
vfip link set "$WIRE" netns w
vfip -n w link set "$WIRE" up
vfip -n w addr add 10.9.0.3/24 dev "$WIRE"
vfip -n w link set lo up
wait_for 100 test "$(cat "/sys/class/net/$PFN/carrier")" = 1 || fail "pf-link"

write_config() {  # via
  cat >"$CFG" <<CONF
version: 1
host: system
state_dir: /var/lib/sriovd
physical_functions:
  - netdev: $PFN
    num_vfs: 2
    vfs:
      - index: 0
        assign: {owner: pod-a, export: none}
      - index: 1
        mac: "02:00:00:00:10:01"
        spoofchk: true
virtio_devices:
  - name: br0
    type: net
    transport: vhost-user
    socket: /run/sriovd/br0.sock
    backend: {type: vf, pf: $PFN, vf: 1, via: $1}
kubernetes:
  device_plugin_dir: /var/lib/kubelet/device-plugins
  cdi_dir: /run/cdi
  pools:
    - name: example.com/igbvf
      vfs: [{pf: $PFN, indexes: [0]}]
CONF
}
write_config af_packet
mkdir -p /var/lib/kubelet/device-plugins /run/cdi
if start_daemon; then pass "daemon-starts"; else fail "daemon-starts: $(tail -n 20 /tmp/sriovd.log)"; fi
VF1=$(vfaddr 1)
VFN=$(ls "/sys/bus/pci/devices/$VF1/net" 2>/dev/null)
expect_eq "vf-netdev-mac-is-the-configured-one" "$(cat "/sys/class/net/$VFN/address" 2>/dev/null)" 02:00:00:00:10:01
if wait_for 50 grep -q up "/sys/class/net/$VFN/operstate"; then pass "vf-netdev-brought-up"; else
  fail "vf-netdev-brought-up: $(cat "/sys/class/net/$VFN/operstate")"; fi
json=$(sriovctl --json devices)
case $json in *'"mac": "02:00:00:00:10:01"'*) pass "device-takes-the-vfs-mac";; *) fail "device-takes-the-vfs-mac: $json";; esac

# The guest: sriovd-guest as the vhost-user front-end, its tap in netns g
# with the device's MAC (the VF's), as a guest's virtio-net driver has.
start_guest() {
  sriovd-guest virtio-net --vhost-user /run/sriovd/br0.sock --tap g0 --netns g >/tmp/guest.log 2>&1 &
  GPID=$!
  wait_for 100 vfip -n g link show g0 || { fail "guest-tap: $(cat /tmp/guest.log)"; return 1; }
  vfip -n g link set g0 address 02:00:00:00:10:01
  vfip -n g addr add 10.9.0.2/24 dev g0 2>/dev/null
  vfip -n g link set g0 up
  vfip -n g link set lo up
}
vfip netns add g
start_guest
ping_from_g() { vfip netns exec g ping -c 1 -W 1 "$1"; }
if wait_for 100 ping_from_g 10.9.0.1; then pass "guest-reaches-pf-through-the-nic"; else fail "guest-reaches-pf-through-the-nic"; fi
if wait_for 100 ping_from_g 10.9.0.3; then pass "guest-reaches-the-wire"; else fail "guest-reaches-the-wire"; fi
if vfip netns exec w ping -c 2 -W 2 10.9.0.2 >/dev/null; then pass "wire-reaches-guest"; else fail "wire-reaches-guest"; fi

# The VF netdev down while the guest sends: nothing spins, and traffic
# flows again once it is up (the worker's CPU over 2 s of idle).
vfip link set "$VFN" down
vfip netns exec g ping -c 3 -W 1 10.9.0.3 >/dev/null 2>&1
vfip link set "$VFN" up
sleep 0.5
t0=$(cpu_ticks "$PID"); sleep 2; t1=$(cpu_ticks "$PID")
echo "sriovd cpu ticks over 2 s after the down/up: $((t1 - t0))"
if [ $((t1 - t0)) -lt 50 ]; then pass "no-spin-after-netdev-down ($((t1 - t0)) ticks in 2 s)"; else fail "no-spin-after-netdev-down: $((t1 - t0)) ticks in 2 s"; fi
if wait_for 100 ping_from_g 10.9.0.3; then pass "traffic-after-netdev-up"; else fail "traffic-after-netdev-up"; fi

# The VF's driver rebound (a new netdev, a new ifindex): the device follows.
ifi=$(cat "/sys/class/net/$VFN/ifindex")
echo "$VF1" >/sys/bus/pci/drivers/igbvf/unbind
echo igbvf >"/sys/bus/pci/devices/$VF1/driver_override"
echo "$VF1" >/sys/bus/pci/drivers_probe
echo >"/sys/bus/pci/devices/$VF1/driver_override"
followed() { sriovctl --json devices | grep '"ifindex"' | grep -qv "\"ifindex\": $ifi\b"; }
if wait_for 100 followed; then pass "device-follows-rebound-vf-netdev"; else fail "device-follows-rebound-vf-netdev: $(grep -i 'virtio br0' /tmp/sriovd.log | tail -n 3)"; fi
kill "$GPID"; wait "$GPID" 2>/dev/null
start_guest
if wait_for 150 ping_from_g 10.9.0.3; then pass "traffic-after-rebind"; else fail "traffic-after-rebind"; fi

# AF_XDP on igbvf: no native XDP, so generic XDP.
kill "$GPID"; wait "$GPID" 2>/dev/null
write_config af_xdp
out=$(sriovctl reload 2>&1) || fail "reload-af-xdp: $out"
json=$(sriovctl --json devices)
case $json in *'"xdp_attach": "generic"'*) pass "af-xdp-generic-on-igbvf";; *) fail "af-xdp-generic-on-igbvf: $json";; esac
start_guest
if wait_for 150 ping_from_g 10.9.0.3; then pass "traffic-over-af-xdp"; else fail "traffic-over-af-xdp: $(tail -n 5 /tmp/sriovd.log)"; fi
kill "$GPID"; wait "$GPID" 2>/dev/null

# The PF's link down (QEMU's set_link): the device plugin's VF is Unhealthy.
healthy() { sriovctl --json status | tr -d ' \n' | grep -q "\"healthy\":$1"; }
if wait_for 50 healthy 1; then pass "vf-healthy-with-link"; else fail "vf-healthy-with-link: $(sriovctl --json status)"; fi
echo "VMMONITOR set_link pf0 off"
if wait_for 150 healthy 0; then pass "vf-unhealthy-when-pf-link-down"; else fail "vf-unhealthy-when-pf-link-down: $(cat "/sys/class/net/$PFN/carrier") $(sriovctl --json status | tr -d ' \n' | head -c 600)"; fi
echo "VMMONITOR set_link pf0 on"
if wait_for 150 healthy 1; then pass "vf-healthy-when-link-back"; else fail "vf-healthy-when-link-back"; fi

kill -TERM "$PID"; wait "$PID"
expect_eq "sigterm-exit-0" "$?" 0
expect_eq "vfs-given-back" "$(cat "$SYS/sriov_numvfs")" 0
grep -E ' error | warning ' /tmp/sriovd.log | head -n 20
