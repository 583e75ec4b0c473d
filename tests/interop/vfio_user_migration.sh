#!/usr/bin/env bash
# interop.vfio_user_migration: a virtio-net-pci device over vfio-user moves
# from one sriovd to another under TCP traffic into the guest, with
# sriovd-guest as the VMM and its guest (no VMM here migrates vfio-user
# devices: QEMU 11.1 ignores them, README "Live migration").
#
# Two sriovd daemons stand for two hosts; each serves the device `mig` on a
# tap of its own, both taps on one bridge (the wire, namespace A, 10.78.0.1).
# sriovd-guest drives the device on A and bridges it to its tap in
# namespace B (10.78.0.2, the guest's kernel): iperf3 from A into the guest
# and a ping flow run while sriovd-guest migrates the device to B (DMA
# logging, pre-copy rounds, the guest paused, STOP, STOP_COPY, the state to
# B, RUNNING) and goes on there. Asserted: the migration completes, iperf3's
# stream survives it (its bytes all delivered), pings come back after it, B
# announces the guest (its RARP on B's tap), the bridge learns the guest's
# MAC on B's tap, A's device is free again, B's devices JSON shows the
# state it loaded. MIGRATION_REPORT=FILE appends the migration's JSON.
#   tests/interop/vfio_user_migration.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: vfio_user_migration.sh BUILD_DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$root/scripts/lib/interop.sh"
need_root_tun "interop.vfio_user_migration"
command -v iperf3 >/dev/null || { echo "SKIP: iperf3 missing (scripts/install-deps installs it)"; exit 77; }
tag=$$
wire=sriovd-vmw$tag
guest=sriovd-vmg$tag
interop_workspace sriovd-vfio-migrate "$wire" "$guest"
fail() {
  echo "FAIL: $*"
  for f in "$work"/*.log "$work/sniff.out"; do [[ -f $f ]] && { echo "--- $(basename "$f") ---"; tail -n 25 "$f"; }; done
  for h in A B; do echo "--- $h's devices ---"; ctl "$h" || true; done
  exit 1
}
ctl() { "$build/src/sriovctl" --socket "$work/$1/control.sock" --json devices; }

ip -n "$wire" link add br0 type bridge
ip -n "$wire" link set br0 up
ip -n "$wire" addr add 10.78.0.1/24 dev br0
ip -n "$wire" link set lo up
declare -A sriovd_pid
# start_host H: sriovd for host H, its device's tap on the bridge.
start_host() {
  local h=$1
  mkdir -p "$work/$h"
  {
    simulated_host_config "$work/$h/state" "$work/$h/control.sock" "vm$h$tag"
    cat <<CONF
virtio_devices:
  - name: mig
    type: net
    transport: vfio-user
    socket: $work/$h/mig.sock
    queue_size: 256
    packed: "off"
    mac: "$mac"
    backend: {type: tap, name: t$h$tag, netns: $wire, offloads: [csum, tso4, tso6]}
CONF
  } >"$work/$h/sriovd.yaml"
  "$build/src/sriovd" --config "$work/$h/sriovd.yaml" --foreground >"$work/sriovd-$h.log" 2>&1 &
  pids+=($!)
  sriovd_pid[$h]=$!
  for _ in $(seq 100); do [[ -S $work/$h/mig.sock ]] && break; sleep 0.1; done
  [[ -S $work/$h/mig.sock ]] || fail "sriovd $h did not serve its device"
  for _ in $(seq 100); do ip -n "$wire" link show "t$h$tag" >/dev/null 2>&1 && break; sleep 0.1; done
  ip -n "$wire" link set "t$h$tag" master br0 up || fail "sriovd $h's tap did not appear"
}
mac=02:5a:00:00:78:02
start_host A
start_host B
ip netns exec "$wire" python3 "$root/tests/interop/sniff.py" "tB$tag" "$mac" >"$work/sniff.out" &
pids+=($!)
for _ in $(seq 100); do grep -q ready "$work/sniff.out" 2>/dev/null && break; sleep 0.1; done

# The guest: sriovd-guest on A's device, moving to B's after 4 s.
"$build/src/sriovd-guest" --json virtio-net --socket "$work/A/mig.sock" --tap g$tag --netns "$guest" \
  --queue-size 256 --migrate-to "$work/B/mig.sock" --migrate-after 4 >"$work/guest.json" 2>"$work/guest.log" &
guest_pid=$!
pids+=("$guest_pid")
for _ in $(seq 100); do ip -n "$guest" link show "g$tag" >/dev/null 2>&1 && break; sleep 0.1; done
# The guest's kernel speaks with its NIC's MAC (the device's), as a VM does.
ip -n "$guest" link set "g$tag" address "$mac" up
ip -n "$guest" addr add 10.78.0.2/24 dev "g$tag"
ip -n "$guest" link set lo up
ip netns exec "$guest" iperf3 -s -1 -B 10.78.0.2 >"$work/iperf3-server.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do ip netns exec "$guest" ss -ltn 2>/dev/null | grep -q 10.78.0.2:5201 && break; sleep 0.1; done
ip netns exec "$wire" busybox ping -c 1 -W 5 10.78.0.2 >/dev/null || fail "the guest is not reachable through A"
# Into the guest across the migration: iperf3 for 8 s (the move comes at 4),
# and pings every 50 ms.
ip netns exec "$wire" busybox ping -i 0.05 -c 160 -W 1 10.78.0.2 >"$work/ping.txt" 2>&1 &
ping_pid=$!
pids+=("$ping_pid")
ip netns exec "$wire" iperf3 -c 10.78.0.2 -t 8 -J >"$work/iperf3.json" 2>"$work/iperf3-client.log" ||
  fail "iperf3 into the guest failed across the migration: $(tail -n 3 "$work/iperf3-client.log")"
wait "$ping_pid" || true
grep -q "migrated to" "$work/guest.log" || fail "sriovd-guest did not migrate: $(tail -n 5 "$work/guest.log")"
python3 - "$work/iperf3.json" <<'PY' || fail "iperf3's stream did not survive the migration"
import json, sys
d = json.load(open(sys.argv[1]))
sent = d["end"]["sum_sent"]["bytes"]
got = d["end"]["sum_received"]["bytes"]
print(f"PASS: iperf3 across the migration: {got / 1e6:.0f} MB received of {sent / 1e6:.0f} MB sent, "
      f"{d['end']['sum_received']['bits_per_second'] / 1e9:.2f} Gbit/s")
# TCP delivered the stream across the move: the client's count runs ahead
# by what was in flight when the test's time ran out, no more.
sys.exit(0 if got > 0 and got >= 0.98 * sent else 1)
PY
received=$(sed -n 's/.* \([0-9]*\) packets received.*/\1/p' "$work/ping.txt")
echo "PASS: $received of 160 pings answered across the migration"
[[ ${received:-0} -ge 150 ]] || fail "only ${received:-0} of 160 pings came back"
ip netns exec "$wire" busybox ping -c 3 -W 2 10.78.0.2 >/dev/null || fail "the guest is not reachable after the migration"
for _ in $(seq 50); do grep -q "tB$tag 0x8035 $mac" "$work/sniff.out" && break; sleep 0.1; done
grep -q "tB$tag 0x8035 $mac" "$work/sniff.out" || fail "B did not announce the guest (no RARP for $mac on its tap)"
echo "PASS: B announced the guest (a RARP for $mac on its tap)"
fdb=$(bridge -n "$wire" fdb show br br0)  # whole, then searched: grep -q would cut the pipe under pipefail
grep -qi "$mac dev tB$tag" <<<"$fdb" || fail "the bridge did not learn $mac on B's tap: $(grep -i "$mac" <<<"$fdb")"
echo "PASS: the wire's bridge learned $mac on B's tap"
python3 - "$(ctl A)" "$(ctl B)" <<'PY' || fail "the daemons' devices JSON after the migration"
import json, sys
a = json.loads(sys.argv[1])["virtio_devices"][0]
b = json.loads(sys.argv[2])["virtio_devices"][0]
ma, mb = a["vfio_user"]["migration"], b["vfio_user"]["migration"]
ok = (a["state"] == "listening" and ma["state"] == "RUNNING" and ma["saved_bytes"] > 0 and ma["dma_log_reports"] >= 6
      and b["state"] == "running" and mb["state"] == "RUNNING" and mb["loaded_bytes"] == ma["saved_bytes"])
print(f"{'PASS' if ok else 'FAIL'}: A {a['state']} {ma}; B {b['state']} {mb}")
sys.exit(0 if ok else 1)
PY
kill -INT "$guest_pid"
wait "$guest_pid" || fail "sriovd-guest failed: $(tail -n 5 "$work/guest.log")"
python3 - "$work/guest.json" "${MIGRATION_REPORT:-}" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["migration"]
print(f"PASS: migrated in {m['total_ms']:.0f} ms, downtime {m['downtime_ms']:.1f} ms (the device's part "
      f"{m['device_downtime_ms']:.1f} ms), {m['state_bytes']} bytes of state, {m['precopy_pages']} pages "
      f"logged in pre-copy, {m['final_pages']} after the pause")
if sys.argv[2]:
    with open(sys.argv[2], "a") as f:
        f.write(json.dumps(m) + "\n")
PY
for h in A B; do kill -0 "${sriovd_pid[$h]}" || fail "sriovd $h died"; done
echo "interop.vfio_user_migration: OK"
