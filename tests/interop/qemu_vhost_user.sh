#!/usr/bin/env bash
# Interop: QEMU 7.2 with a Linux guest as the vhost-user front-end. The
# guest's virtio-net driver (modules from the Debian kernel of tests/vm)
# talks to sriovd; sriovd's tap sits in a network namespace this test
# creates, with an iperf3 server. The guest pings it and runs iperf3.
#   tests/interop/qemu_vhost_user.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/interop.sh"
build=${1:?usage: qemu_vhost_user.sh BUILD_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=../vm/vm-lib.sh
source "$here/vm/vm-lib.sh"
vm_install_tools || { echo "SKIP: QEMU tools missing and not root" >&2; exit 77; }
need_root_tun "the QEMU interop test"
ns=sriovd-qm$$
tap=sdqm$$
interop_workspace sriovd-qemu "$ns"
sock=$work/guest-net.sock
{
  simulated_host_config "$work/state" "$work/control.sock" "sdqpf$$"
  cat <<CONF
virtio_devices:
  - name: guest-net
    type: net
    transport: vhost-user
    socket: $sock
    queue_size: 256
    packed: "off"
    backend: {type: tap, name: $tap, netns: $ns}
CONF
} >"$work/sriovd.yaml"
"$build/src/sriovd" --config "$work/sriovd.yaml" --foreground >"$work/sriovd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
[[ -S $sock ]] || { echo "sriovd did not come up:"; cat "$work/sriovd.log"; exit 1; }
ip netns exec "$ns" ip addr add 10.88.0.1/24 dev "$tap"
ip netns exec "$ns" iperf3 -s -B 10.88.0.1 >/dev/null 2>&1 &
pids+=($!)

# vectors=0: QEMU 7.2 under TCG crashes when the guest enables MSI-X on a
# vhost-user device (TESTING.md); the guest uses INTx, fed by the call fd.
# reconnect=1: QEMU reconnects when the back-end goes away (part 2).
export VM_QEMU_EXTRA="-object memory-backend-memfd,id=mem,size=768M,share=on -numa node,memdev=mem
  -chardev socket,id=c0,path=$sock,reconnect=1 -netdev vhost-user,id=n0,chardev=c0
  -device virtio-net-pci,netdev=n0,vectors=0"
rc=0
sriovd_pid=${pids[0]}

# Part 1: ping and iperf3 from the guest.
log=$work/console.log
vm_run "$here/vm/scenarios/virtio-net-guest.sh" "$log" /usr/bin/iperf3 || rc=1
grep -E '^VMTEST (BENCH|FAIL)' "$log" || true
kill -0 "$sriovd_pid" || { echo "sriovd died:"; tail -n 20 "$work/sriovd.log"; rc=1; }
grep -q "front-end connected" "$work/sriovd.log" || { echo "QEMU never connected"; rc=1; }
[[ $rc -eq 0 ]] || { echo "--- console ---"; cat "$log"; echo "--- sriovd ---"; cat "$work/sriovd.log"; exit 1; }

# Part 1b (issue 41): sriovd is upgraded in place twice (sriovctl upgrade:
# exec with a handover) while the guest runs iperf3: QEMU keeps its
# connection (sriovd counts one), the transfer ends without an error, the
# guest's link never drops.
log1b=$work/console-upgrade.log
vm_run "$here/vm/scenarios/virtio-net-upgrade.sh" "$log1b" /usr/bin/iperf3 &
vm=$!
pids+=("$vm")
for _ in $(seq 1200); do grep -q 'phase-upgrade-ready' "$log1b" 2>/dev/null && break; sleep 0.1; done
for _ in 1 2; do
  "$build/src/sriovctl" --socket "$work/control.sock" --timeout 60 upgrade || rc=1
  sleep 2
done
# While the guest still runs: QEMU's one connection, served by the upgraded
# sriovd (which counts the connection it took over as its first).
conn=$("$build/src/sriovctl" --socket "$work/control.sock" --json devices |
  python3 -c 'import json, sys; v = json.load(sys.stdin)["virtio_devices"][0]; print(v["state"], v["vhost_user"]["connections"])')
[[ $conn == "running 1" ]] || { echo "QEMU's connection after the upgrades: $conn (want: running 1)"; rc=1; }
wait "$vm" || rc=1
grep -E '^VMTEST (BENCH|PASS|FAIL)' "$log1b" || true
grep -q "VMTEST FAIL" "$log1b" && rc=1
grep -q 'VMTEST PASS guest-iperf3-through-upgrades' "$log1b" || rc=1
[[ $(grep -c "guest-net: front-end taken over from the previous sriovd" "$work/sriovd.log") -eq 2 ]] ||
  { echo "QEMU's connection was not taken over twice"; rc=1; }
[[ $rc -eq 0 ]] || { echo "--- console ---"; cat "$log1b"; echo "--- sriovd ---"; cat "$work/sriovd.log"; exit 1; }

# Part 2: sriovd is SIGKILLed and started again while the guest runs; QEMU
# reconnects and the guest's traffic resumes.
log2=$work/console-reconnect.log
vm_run "$here/vm/scenarios/virtio-net-reconnect.sh" "$log2" &
vm=$!
pids+=("$vm")
for _ in $(seq 1200); do grep -q 'phase1-before-restart' "$log2" 2>/dev/null && break; sleep 0.1; done
kill -KILL "$sriovd_pid"
wait "$sriovd_pid" 2>/dev/null || true
"$build/src/sriovd" --config "$work/sriovd.yaml" --foreground >"$work/sriovd-2.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do ip -n "$ns" link show "$tap" >/dev/null 2>&1 && break; sleep 0.1; done
ip netns exec "$ns" ip addr add 10.88.0.1/24 dev "$tap"
wait "$vm" || rc=1
grep -E '^VMTEST (PASS|FAIL)' "$log2" || true
grep -q "front-end connected" "$work/sriovd-2.log" || { echo "QEMU did not reconnect to the new sriovd"; rc=1; }
[[ $rc -eq 0 ]] || { echo "--- console ---"; cat "$log2"; echo "--- sriovd (2) ---"; cat "$work/sriovd-2.log"; exit 1; }

# Part 3: client mode. QEMU listens (server=on,wait=off) and sriovd, started
# first, keeps trying until the socket is there.
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
pids=()
vmm_sock=$work/qemu-listens.sock
sed -e "s|socket: $sock|socket: $vmm_sock\n    socket_mode: client|" "$work/sriovd.yaml" >"$work/sriovd-client.yaml"
"$build/src/sriovd" --config "$work/sriovd-client.yaml" --foreground >"$work/sriovd-3.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do ip -n "$ns" link show "$tap" >/dev/null 2>&1 && break; sleep 0.1; done
ip netns exec "$ns" ip addr add 10.88.0.1/24 dev "$tap"
ip netns exec "$ns" iperf3 -s -B 10.88.0.1 >/dev/null 2>&1 &
pids+=($!)
export VM_QEMU_EXTRA="-object memory-backend-memfd,id=mem,size=768M,share=on -numa node,memdev=mem
  -chardev socket,id=c0,path=$vmm_sock,server=on,wait=off -netdev vhost-user,id=n0,chardev=c0
  -device virtio-net-pci,netdev=n0,vectors=0"
log3=$work/console-client.log
GUEST_IPERF_SECONDS=2 vm_run "$here/vm/scenarios/virtio-net-guest.sh" "$log3" /usr/bin/iperf3 || rc=1
grep -q "front-end connected" "$work/sriovd-3.log" || { echo "sriovd (client mode) never connected"; rc=1; }
[[ $rc -eq 0 ]] || { echo "--- console ---"; cat "$log3"; echo "--- sriovd (client) ---"; cat "$work/sriovd-3.log"; exit 1; }

# Part 4: a vIOMMU. The device has iommu_platform=on (VIRTIO_F_ACCESS_PLATFORM)
# behind QEMU's intel-iommu with a device IOTLB: every ring and buffer
# address is an IOVA, sriovd asks QEMU for translations (IOTLB misses on
# the back-end channel) and QEMU sends updates and invalidations.
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
pids=()
sed -e "s|    packed: \"off\"|    packed: \"off\"\n    iommu_platform: true|" "$work/sriovd.yaml" >"$work/sriovd-iommu.yaml"
grep -q "iommu_platform: true" "$work/sriovd-iommu.yaml" || { echo "could not write the iommu config"; exit 1; }
"$build/src/sriovd" --config "$work/sriovd-iommu.yaml" --foreground --log-level debug >"$work/sriovd-4.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
ip netns exec "$ns" ip addr add 10.88.0.1/24 dev "$tap"
ip netns exec "$ns" iperf3 -s -B 10.88.0.1 >/dev/null 2>&1 &
pids+=($!)
export VM_IOMMU_OPTS=",device-iotlb=on"
export VM_QEMU_EXTRA="-object memory-backend-memfd,id=mem,size=768M,share=on -numa node,memdev=mem
  -chardev socket,id=c0,path=$sock -netdev vhost-user,id=n0,chardev=c0
  -device virtio-net-pci,netdev=n0,vectors=0,disable-legacy=on,iommu_platform=on,ats=on"
log4=$work/console-iommu.log
GUEST_IPERF_SECONDS=2 vm_run "$here/vm/scenarios/virtio-net-guest.sh" "$log4" /usr/bin/iperf3 || rc=1
unset VM_IOMMU_OPTS
grep -E '^VMTEST (BENCH|FAIL)' "$log4" || true
# The traffic went through the IOTLB, and QEMU used memory slots.
grep -q "IOTLB type 2" "$work/sriovd-4.log" || { echo "no IOTLB update reached sriovd"; rc=1; }
grep -q "ADD_MEM_REG" "$work/sriovd-4.log" || { echo "QEMU did not use CONFIGURE_MEM_SLOTS (ADD_MEM_REG)"; rc=1; }
echo "IOTLB updates: $(grep -c 'IOTLB type 2' "$work/sriovd-4.log"), misses asked: $(grep -c 'IOTLB miss' "$work/sriovd-4.log")"
[[ $rc -eq 0 ]] || { echo "--- console ---"; cat "$log4"; echo "--- sriovd (iommu) ---"; cat "$work/sriovd-4.log"; }
exit $rc
