#!/usr/bin/env bash
# scripts/bench upgrade [--runs N]: the data path's stall while sriovd is
# upgraded in place (sriovctl upgrade: exec with a handover), against a
# plain restart of the same setup. A vhost-user virtio-net device on a
# tap in network namespace A; the project's front-end (sriovd-guest)
# bridges it to a tap in namespace B; numbered UDP flows from B to A every
# millisecond (scripts/lib/udp_probe.py). For each run: the longest gap in
# arrivals around it, datagrams lost, and whether the front-end kept its
# device. Goal (issue 41): stall <= 100 ms, no VM losing its device.
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
"$b/src/sriovd-guest" virtio-net --vhost-user "$dir/vu0.sock" --tap ug$tag --netns "$nsb" >"$dir/frontend.log" 2>&1 &
frontend=$!
pids+=("$frontend")
for _ in $(seq 100); do ip -n "$nsb" link show "ug$tag" >/dev/null 2>&1 && break; sleep 0.1; done
ip -n "$nsa" addr add 10.78.0.1/24 dev "vu$tag"
ip -n "$nsa" link set "vu$tag" up
ip -n "$nsb" addr add 10.78.0.2/24 dev "ug$tag"
ip -n "$nsb" link set "ug$tag" up
# A plain FIFO in front of the front-end's tap: an AQM (fq_codel) would drop
# what waits through a stall, which is the qdisc's choice, not a loss.
ip netns exec "$nsb" tc qdisc replace dev "ug$tag" root pfifo limit 100000
ip -n "$nsa" neigh replace 10.78.0.2 lladdr "$(ip netns exec "$nsb" cat "/sys/class/net/ug$tag/address")" dev "vu$tag" nud permanent
ip -n "$nsb" neigh replace 10.78.0.1 lladdr "$(ip netns exec "$nsa" cat "/sys/class/net/vu$tag/address")" dev "ug$tag" nud permanent
ip netns exec "$nsa" python3 scripts/lib/udp_probe.py recv 10.78.0.1 7777 "$dir/rx" &
pids+=($!)
for _ in $(seq 100); do [[ -e $dir/rx.ready ]] && break; sleep 0.1; done
ip netns exec "$nsb" python3 scripts/lib/udp_probe.py send 10.78.0.1 7777 1 &
pids+=($!)
for _ in $(seq 100); do [[ -s $dir/rx ]] && break; sleep 0.1; done
[[ -s $dir/rx ]] || { echo "bench upgrade: no traffic through the device; front-end: $(cat "$dir/frontend.log")" >&2; exit 1; }
sleep 1
device_kept=0
for i in $(seq "$runs"); do
  mark "upgrade$i"
  if ! out=$(ctl --timeout 60 upgrade 2>&1); then echo "bench upgrade: run $i: $out" >&2; exit 1; fi
  sleep 1.5
done
kill -0 "$frontend" 2>/dev/null && device_kept=1
connections=$(ctl --json devices | python3 -c 'import json, sys; print(json.load(sys.stdin)["virtio_devices"][0]["vhost_user"]["connections"])')
# A plain restart of the same setup: SIGTERM (the host given back), a new start.
mark restart
kill -TERM "$daemon"
wait "$daemon" 2>/dev/null || true
start_daemon
sleep 3
restart_kept=0
kill -0 "$frontend" 2>/dev/null && restart_kept=1
restart_connected=$(ctl --json devices | python3 -c 'import json, sys; print(1 if json.load(sys.stdin)["virtio_devices"][0]["state"] == "running" else 0)')
mark end
sleep 0.2
python3 scripts/lib/udp_probe.py report "$dir/rx" "$dir/marks" >"$dir/report.json"
python3 - "$dir/report.json" "$runs" "$device_kept" "$connections" "$restart_kept" "$restart_connected" <<'PYEOF'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
runs, kept, conns, rkept, rconn = (int(x) for x in sys.argv[2:])
up = [w["longest_gap_ms"] for w in r["windows"] if w["name"].startswith("upgrade")]
rs = [w for w in r["windows"] if w["name"] == "restart"][0]
out = {
    "bench": "upgrade",
    "unit": "ms of the longest gap in a 1 ms UDP stream through a vhost-user device",
    "handover": {"runs": runs, "stall_ms_p50": statistics.median(up), "stall_ms_max": max(up),
                 "stalls_ms": up, "frontend_kept_device": bool(kept), "connections_seen": conns},
    "restart": {"stall_ms": rs["longest_gap_ms"], "datagrams_after": rs["datagrams"],
                "frontend_kept_device": bool(rkept and rconn)},
    "datagrams": r["datagrams"], "lost": r["lost"], "duplicated": r["duplicated"],
    "goal": {"stall_ms_max": 100, "frontend_kept_device": True},
}
print(json.dumps(out))
print("upgrade in place: stall p50 %.1f ms, max %.1f ms over %d runs, front-end kept its device: %s; "
      "plain restart: %.0f ms%s; %d datagrams, %s lost"
      % (out["handover"]["stall_ms_p50"], out["handover"]["stall_ms_max"], runs, bool(kept), rs["longest_gap_ms"],
         "" if out["restart"]["frontend_kept_device"] else " and the device lost", r["datagrams"], r["lost"]),
      file=sys.stderr)
PYEOF
