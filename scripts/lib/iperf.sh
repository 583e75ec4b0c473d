# shellcheck shell=bash disable=SC2154  # nsA, nsB, seconds: the caller's (see below)
# check-shell: caller-defines fail
# What iperf-validate and bench mask-iperf share: two namespaces ($nsA,
# $nsB, remade by fresh_namespaces), the links in them, iperf3 from A
# (10.77.0.1) to B (10.77.0.2) for $seconds, medians, and stop_all for the
# processes in pids=() (scripts/lib/interop.sh's workspace). The caller
# defines fail().
#   source scripts/lib/iperf.sh   (after scripts/lib/interop.sh)

wait_link() {  # ns dev
  for _ in $(seq 100); do ip -n "$1" link show "$2" >/dev/null 2>&1 && return 0; sleep 0.1; done
  fail "interface $2 did not appear in namespace $1"
}
addr() {  # ns dev ip
  ip -n "$1" link set "$2" txqueuelen 10000 up
  ip -n "$1" addr add "$3/24" dev "$2"
}
# Last started, first stopped, each gone before the next is told: a front-end
# ends (and reports its counts) while its back-end is still there; stopped
# together, the back-end could close the channel first and the front-end
# would end on that error instead. 10 s each, then SIGKILL.
stop_all() {
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -INT "${pids[i]}" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "${pids[i]}" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  pids=()
}
# iperf3 from A (10.77.0.1) to B (10.77.0.2); prints "gbps retransmits".
iperf_once() {
  ip netns exec "$nsB" iperf3 -s -1 -B 10.77.0.2 >/dev/null 2>&1 &
  local server=$!
  for _ in $(seq 50); do ip netns exec "$nsB" ss -ltn 2>/dev/null | grep -q 10.77.0.2:5201 && break; sleep 0.1; done
  local out
  out=$(ip netns exec "$nsA" iperf3 -c 10.77.0.2 -t "$seconds" -J 2>&1) || { kill "$server" 2>/dev/null; echo "ERR"; return; }
  wait "$server" 2>/dev/null || true
  python3 - "$out" <<'PY'
import json, sys
d = json.loads(sys.argv[1])
if "error" in d:
    print("ERR")
else:
    e = d["end"]
    print(f'{e["sum_received"]["bits_per_second"] / 1e9:.3f} {e["sum_sent"].get("retransmits", 0)}')
PY
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ready() {  # ns: both ends answer
  for _ in $(seq 100); do
    ip netns exec "$nsA" bash -c 'echo x >/dev/udp/10.77.0.2/9' 2>/dev/null
    ip -n "$nsA" neigh show 10.77.0.2 | grep -q REACHABLE && return 0
    sleep 0.1
  done
  return 1
}

fresh_namespaces() {
  ip netns del "$nsA" 2>/dev/null || true
  ip netns del "$nsB" 2>/dev/null || true
  ip netns add "$nsA"
  ip netns add "$nsB"
  ip -n "$nsA" link set lo up
  ip -n "$nsB" link set lo up
}

