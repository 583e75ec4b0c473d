#!/usr/bin/env bash
# scripts/bench upgrade [--runs N]: the data path's stall while sriovd is
# upgraded in place (sriovctl upgrade: exec with a handover), against a
# plain restart of the same setup. Two virtio-net devices on taps in
# network namespace A, one over vhost-user, one virtio-net-pci over
# vfio-user; the project's front-ends (sriovd-guest: a vhost-user
# front-end, a vfio-user client with its guest driver) bridge each to a
# tap in namespace B; numbered UDP flows from B to A through each every
# millisecond (scripts/lib/udp_probe.py). For each run: the longest gap in
# arrivals around it, datagrams lost, and whether the front-ends kept their
# devices. Goal (issue 41): stall <= 100 ms, no VM losing its device.
# Root (namespaces, taps). JSON on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/lib/kill-tree.sh
source scripts/lib/kill-tree.sh
runs=5
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    *) echo "usage: scripts/bench upgrade [--runs N]" >&2; exit 64 ;;
  esac
done
if [[ $EUID -ne 0 || ! -w /dev/net/tun ]]; then
  echo "bench upgrade: needs root and /dev/net/tun (network namespaces, taps)" >&2
  exit 1
fi
b=$PWD/build/release
tag=$$
nsa=sriovd-ua$tag nsb=sriovd-ub$tag
dir=$(mktemp -d /tmp/sriovd-bench-upgrade.XXXXXX)
pids=()
cleanup() {
  ((${#pids[@]})) && kill_tree "${pids[@]}"
  [[ -n ${daemon:-} ]] && kill_tree "$daemon"
  ip netns del "$nsa" 2>/dev/null || true
  ip netns del "$nsb" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
ip netns add "$nsa"
ip netns add "$nsb"
cat >"$dir/sriovd.yaml" <<EOF
version: 1
host: simulated
state_dir: $dir/state
simulated:
  physical_functions:
    - {address: "0000:3b:00.0", netdev: simpf0, total_vfs: 4, msix_vectors_per_vf: 4}
control: {socket: $dir/control.sock}
physical_functions:
  - {address: "0000:3b:00.0", num_vfs: 1}
virtio_devices:
  - {name: vu0, type: net, transport: vhost-user, socket: $dir/vu0.sock,
     backend: {type: tap, name: vu$tag, netns: $nsa}}
  - {name: vp0, type: net, transport: vfio-user, socket: $dir/vp0.sock,
     backend: {type: tap, name: vp$tag, netns: $nsa}}
EOF
ctl() { "$b/src/sriovctl" --socket "$dir/control.sock" "$@"; }
start_daemon() {
  "$b/src/sriovd" --config "$dir/sriovd.yaml" --foreground >>"$dir/sriovd.log" 2>&1 &
  daemon=$!
  for _ in $(seq 100); do ctl status >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "bench upgrade: sriovd did not come up; its log:" >&2
  tail -n 30 "$dir/sriovd.log" >&2
  return 1
}
now() { python3 -c 'import time; print("%.6f" % time.monotonic())'; }
mark() { echo "$1 $(now)" >>"$dir/marks"; }
start_daemon
"$b/src/sriovd-guest" virtio-net --vhost-user "$dir/vu0.sock" --tap ug$tag --netns "$nsb" >"$dir/frontend-vu0.log" 2>&1 &
frontend_vu0=$!
"$b/src/sriovd-guest" virtio-net --socket "$dir/vp0.sock" --tap pg$tag --netns "$nsb" >"$dir/frontend-vp0.log" 2>&1 &
frontend_vp0=$!
pids+=("$frontend_vu0" "$frontend_vp0")
# flow NAME SRIOVD_TAP GUEST_TAP SUBNET: a numbered UDP stream from the
# front-end's tap to sriovd's, received into $dir/rx-NAME.
flow() {
  local name=$1 host_tap=$2 guest_tap=$3 net=$4
  for _ in $(seq 100); do ip -n "$nsb" link show "$guest_tap" >/dev/null 2>&1 && break; sleep 0.1; done
  ip -n "$nsa" addr add "$net.1/24" dev "$host_tap"
  ip -n "$nsa" link set "$host_tap" up
  ip -n "$nsb" addr add "$net.2/24" dev "$guest_tap"
  ip -n "$nsb" link set "$guest_tap" up
  # A plain FIFO in front of the front-end's tap: an AQM (fq_codel) would
  # drop what waits through a stall, which is the qdisc's choice, not a loss.
  ip netns exec "$nsb" tc qdisc replace dev "$guest_tap" root pfifo limit 100000
  ip -n "$nsa" neigh replace "$net.2" lladdr "$(ip netns exec "$nsb" cat "/sys/class/net/$guest_tap/address")" \
    dev "$host_tap" nud permanent
  ip -n "$nsb" neigh replace "$net.1" lladdr "$(ip netns exec "$nsa" cat "/sys/class/net/$host_tap/address")" \
    dev "$guest_tap" nud permanent
  ip netns exec "$nsa" python3 scripts/lib/udp_probe.py recv "$net.1" 7777 "$dir/rx-$name" &
  pids+=($!)
  for _ in $(seq 100); do [[ -e $dir/rx-$name.ready ]] && break; sleep 0.1; done
  ip netns exec "$nsb" python3 scripts/lib/udp_probe.py send "$net.1" 7777 1 &
  pids+=($!)
  for _ in $(seq 100); do [[ -s $dir/rx-$name ]] && break; sleep 0.1; done
  [[ -s $dir/rx-$name ]] || {
    echo "bench upgrade: no traffic through $name; front-end: $(cat "$dir/frontend-$name.log")" >&2
    exit 1
  }
}
flow vu0 "vu$tag" "ug$tag" 10.78.0
flow vp0 "vp$tag" "pg$tag" 10.79.0
sleep 1
device_kept=0
for i in $(seq "$runs"); do
  mark "upgrade$i"
  if ! out=$(ctl --timeout 60 upgrade 2>&1); then echo "bench upgrade: run $i: $out" >&2; exit 1; fi
  sleep 1.5
done
kill -0 "$frontend_vu0" 2>/dev/null && kill -0 "$frontend_vp0" 2>/dev/null && device_kept=1
# The connections each device's server counts (1: the front-end's, taken over each time).
connections=$(ctl --json devices | python3 -c 'import json, sys; v = json.load(sys.stdin)["virtio_devices"]; print(v[0]["vhost_user"]["connections"], v[1]["vfio_user"]["connections"])')
# A plain restart of the same setup: SIGTERM (the host given back), a new start.
mark restart
kill -TERM "$daemon"
wait "$daemon" 2>/dev/null || true
start_daemon
sleep 3
# A front-end kept its device through the restart when its process lives
# and its device runs again: QEMU's vhost-user front-end reconnects, a
# vfio-user client (QEMU's too) does not.
restart_kept=$(ctl --json devices | python3 -c '
import json, sys
v = json.load(sys.stdin)["virtio_devices"]
print(" ".join("1" if d["state"] == "running" else "0" for d in v[:2]))')
kill -0 "$frontend_vu0" 2>/dev/null || restart_kept="0 ${restart_kept#* }"
kill -0 "$frontend_vp0" 2>/dev/null || restart_kept="${restart_kept% *} 0"
mark end
sleep 0.2
for name in vu0 vp0; do python3 scripts/lib/udp_probe.py report "$dir/rx-$name" "$dir/marks" >"$dir/report-$name.json"; done
python3 - "$dir" "$runs" "$device_kept" "$connections" "$restart_kept" <<'PYEOF'
import json, statistics, sys
d, runs, kept = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conns = [int(x) for x in sys.argv[4].split()]
rkept = [int(x) for x in sys.argv[5].split()]
out = {"bench": "upgrade", "unit": "ms of the longest gap in a 1 ms UDP stream through each device",
       "runs": runs, "frontends_kept_devices": bool(kept),
       "goal": {"stall_ms_max": 100, "frontend_kept_device": True}}
lines = []
for i, (name, transport, key) in enumerate([("vu0", "vhost-user", "vhost_user"), ("vp0", "vfio-user", "vfio_user")]):
    r = json.load(open("%s/report-%s.json" % (d, name)))
    up = [w["longest_gap_ms"] for w in r["windows"] if w["name"].startswith("upgrade")]
    rs = [w for w in r["windows"] if w["name"] == "restart"][0]
    out[key] = {
        "handover": {"stall_ms_p50": statistics.median(up), "stall_ms_max": max(up), "stalls_ms": up,
                     "connections_seen": conns[i]},
        "restart": {"stall_ms": rs["longest_gap_ms"], "datagrams_after": rs["datagrams"],
                    "frontend_kept_device": bool(rkept[i])},
        "datagrams": r["datagrams"], "lost": r["lost"], "duplicated": r["duplicated"]}
    h = out[key]["handover"]
    lines.append("%s: upgrade in place stall p50 %.1f ms, max %.1f ms; plain restart %.0f ms%s; %d datagrams, %s lost"
                 % (transport, h["stall_ms_p50"], h["stall_ms_max"], rs["longest_gap_ms"],
                    "" if rkept[i] else " and the device lost", r["datagrams"], r["lost"]))
print(json.dumps(out))
print("%d upgrades, front-ends kept their devices: %s\n  %s" % (runs, bool(kept), "\n  ".join(lines)), file=sys.stderr)
PYEOF
