#!/usr/bin/env bash
# scripts/bench mask-iperf: the seed experiment of this project, end to end.
# A guest whose interrupt acknowledgement masks and unmasks its vector on
# every interrupt (RHEL 5's 2.6.18 MSI code) against the same guest not
# masking, in the same run: iperf3 through sriovd's virtio-net-pci over
# vfio-user, the driver being sriovd-guest (--mask-every-interrupt: each
# mask and unmask a Vector Control write that sriovd's MSI-X emulation
# serves). Two masking guests: one waits for each write's reply (a
# REGION_WRITE round trip, as the 2010 QEMU did), one posts them (No_reply,
# as QEMU's vfio-user client sends BAR writes: PCI memory writes are
# posted). Runs rotate through the three guests; figures are medians. The
# server's own count of masks (sriovctl routes) must match what each
# masking guest wrote.
# Each masking guest runs twice: with the control thread sleeping as soon
# as it is idle (control.poll_us: 0, before) and polling up to --poll-us
# after work (after; util/polling_loop.hpp), set by a reload between runs.
#   scripts/lib/mask_iperf.sh BUILD_DIR [--runs N] [--seconds S] [--poll-us US]
# JSON on stdout: nomask_gbps, mask_gbps, loss (1 - mask/nomask),
# posted_gbps, posted_loss, and the same for the polling daemon
# (mask_poll_*, posted_poll_*), *_irqs_per_sec, *_writes_per_sec,
# *_write_us, *_loss_per_round (each round against its own not-masking
# run), paired_loss (per guest: the median and quartiles of those),
# sriovd_cpu (the daemon's CPU seconds per second, each guest), poll_us,
# control_loop and session_loops (the daemon's poll counts: the control
# thread's, the session threads' summed), runs, seconds.
set -euo pipefail
build=${1:?build dir}
shift
runs=3
seconds=5
poll_us=50
while [[ $# -gt 0 ]]; do
  case $1 in
    --runs) runs=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    --poll-us) poll_us=$2; shift ;;
    *) echo "mask-iperf: unknown option $1" >&2; exit 64 ;;
  esac
  shift
done
cd "$(dirname "$0")/../.."
source scripts/lib/interop.sh
need_root_tun "bench mask-iperf"
fail() { echo "mask-iperf: $*" >&2; exit 1; }
source scripts/lib/iperf.sh
sriovd_bin=$build/src/sriovd
guest_bin=$build/src/sriovd-guest
sriovctl_bin=$build/src/sriovctl
tag=$$
nsA=sriovd-miA$tag
nsB=sriovd-miB$tag
interop_workspace sriovd-mask-iperf
interop_namespaces=("$nsA" "$nsB")
fresh_namespaces

sock=$work/vnet.sock
# write_config POLL_US: the daemon's file, its control thread polling up
# to POLL_US after work.
write_config() {
  simulated_host_config "$work/state" "$work/control.sock" "mipf$tag"
  echo "  poll_us: $1"
  cat <<CONF
virtio_devices:
  - name: mask-iperf
    type: net
    transport: vfio-user
    socket: $sock
    queue_size: 256
    packed: "off"
    backend: {type: tap, name: miA$tag, netns: $nsA, offloads: [csum, tso4, tso6]}
CONF
}
write_config 0 >"$work/sriovd.yaml"
"$sriovd_bin" --config "$work/sriovd.yaml" --foreground >"$work/sriovd.log" 2>&1 &
sriovd_pid=$!
pids+=("$sriovd_pid")
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
[[ -S $sock ]] || fail "sriovd did not create $sock: $(tail -n 5 "$work/sriovd.log")"
addr "$nsA" "miA$tag" 10.77.0.1

declare -A values irqs writes write_us cpu
# The daemon's CPU time so far (all its threads), in clock ticks.
sriovd_ticks() { awk '{print $14 + $15}' "/proc/$sriovd_pid/stat"; }
ticks_per_s=$(getconf CLK_TCK)
ctl() { "$sriovctl_bin" --socket "$work/control.sock" --json "$@"; }
# Masks the server has counted on the device's vectors so far.
server_masks() {
  ctl routes |
    python3 -c 'import json, sys; print(sum(r["masks"] for r in json.load(sys.stdin)["routes"] if r["device"] == "mask-iperf"))'
}
# set_poll US: the running daemon's control.poll_us, by a reload.
set_poll() {
  write_config "$1" >"$work/sriovd.yaml"
  ctl reload >/dev/null || fail "the reload to control.poll_us $1 failed"
  [[ $(ctl status | python3 -c 'import json, sys; print(json.load(sys.stdin)["control_loop"]["poll_us"])') == "$1" ]] ||
    fail "after the reload the daemon does not poll for $1 us"
}
# one_run MODE: a guest (not masking, masking with round trips, masking
# with posted writes; -poll: the daemon polling) up, one iperf3, the
# guest's counts.
one_run() {
  local mode=$1 extra=()
  [[ $mode == mask* ]] && extra=(--mask-every-interrupt)
  [[ $mode == posted* ]] && extra=(--mask-every-interrupt --posted-writes)
  if [[ $mode == *-poll ]]; then set_poll "$poll_us"; else set_poll 0; fi
  local glog=$work/guest-$mode-$RANDOM.json before
  before=$(server_masks)
  "$guest_bin" --json virtio-net --socket "$sock" --tap "miB$tag" --netns "$nsB" --queue-size 256 "${extra[@]}" \
    >"$glog" 2>"$glog.err" &
  local gpid=$!
  pids+=("$gpid")
  wait_link "$nsB" "miB$tag"
  addr "$nsB" "miB$tag" 10.77.0.2
  # Each guest's tap is new, with a new MAC: A must not use the last one's.
  ip -n "$nsA" neigh flush dev "miA$tag"
  ready || fail "$mode: 10.77.0.2 is not reachable through the path ($(tail -n 3 "$glog.err"))"
  local t0 t1 g c0 c1
  c0=$(sriovd_ticks)
  t0=$(date +%s.%N)
  read -r g _ <<<"$(iperf_once)"
  t1=$(date +%s.%N)
  c1=$(sriovd_ticks)
  [[ $g == ERR ]] && fail "$mode: iperf3 failed"
  kill -INT "$gpid"
  wait "$gpid" || fail "$mode: sriovd-guest failed: $(tail -n 3 "$glog.err")"
  pids=("${pids[@]:0:${#pids[@]}-1}")
  local counts
  counts=$(python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(j["interrupts"], j["mask_writes"], j["mask_write_us"])' "$glog")
  local n w us
  read -r n w us <<<"$counts"
  # The server read every write the guest sent before it saw the guest go:
  # one mask per interrupt (the other write unmasks), and the vectors the
  # device reset masks when the guest leaves (their reset state, PCI 3.0
  # 6.8.2.9): at most 8 more.
  local seen=0
  for _ in $(seq 50); do
    seen=$(($(server_masks) - before))
    ((seen * 2 >= w)) && break
    sleep 0.1
  done
  ((seen * 2 >= w && seen * 2 <= w + 16)) ||
    fail "$mode: the guest wrote $w Vector Controls, the server counted $seen masks"
  local per irq_s w_s
  per=$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')
  irq_s=$(awk -v n="$n" -v s="$per" 'BEGIN {printf "%.0f", n / s}')
  w_s=$(awk -v n="$w" -v s="$per" 'BEGIN {printf "%.0f", n / s}')
  echo "  $mode: $g Gbit/s, $irq_s interrupts/s, $w_s mask writes/s ($us us each)" >&2
  write_us[$mode]+=" $us"
  values[$mode]+=" $g"
  cpu[$mode]+=" $(awk -v c="$((c1 - c0))" -v hz="$ticks_per_s" -v s="$per" 'BEGIN {printf "%.3f", c / hz / s}')"
  irqs[$mode]+=" $irq_s"
  writes[$mode]+=" $w_s"
  [[ $mode != nomask && $w -eq 0 ]] && fail "the $mode guest wrote no Vector Control"
  return 0
}
# The order rotates, so a slow part of the run falls on each guest.
order=(nomask mask posted mask-poll posted-poll)
for r in $(seq "$runs"); do
  for i in "${!order[@]}"; do one_run "${order[(r + i) % ${#order[@]}]}"; done
done
kill -0 "$sriovd_pid" || fail "sriovd died: $(tail -n 5 "$work/sriovd.log")"
# shellcheck disable=SC2086
nm=$(median ${values[nomask]})
# shellcheck disable=SC2086
m=$(median ${values[mask]})
# shellcheck disable=SC2086
p=$(median ${values[posted]})
# shellcheck disable=SC2086
mp=$(median ${values[mask-poll]})
# shellcheck disable=SC2086
pp=$(median ${values[posted-poll]})
loop=$(ctl status | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["control_loop"]))')
# The session threads' loops, where the device's messages are served: what
# their polling found, summed.
session_loops=$(ctl status | python3 -c '
import json, sys
t = json.load(sys.stdin)["session_threads"]
print(json.dumps({k: sum(x[k] for x in t) for k in ("polls", "hits", "polled_us")}))')
loss() { awk -v a="$1" -v b="$nm" 'BEGIN {printf "%.4f", (b > 0 ? 1 - a / b : 0)}'; }
# Each round's loss against that round's not-masking run (the rounds are
# back to back: a slow stretch of the machine falls on both), as a list.
per_round() {
  python3 - "${values[nomask]}" "${values[$1]}" <<'PY'
import json, sys
ref, got = (list(map(float, a.split())) for a in sys.argv[1:3])
print(json.dumps([round(1 - g / r, 4) if r > 0 else 0 for r, g in zip(ref, got)]))
PY
}
# The per-round losses summed up: their median and quartiles (pairs measured
# back to back, so a slow stretch of the machine cancels out of each; the
# quartiles show how far one invocation can be trusted).
paired() {
  python3 - "${values[nomask]}" "${values[mask]}" "${values[posted]}" "${values[mask-poll]}" \
    "${values[posted-poll]}" <<'PY'
import json, statistics, sys
ref, *guests = ([float(x) for x in a.split()] for a in sys.argv[1:])
out = {}
for name, got in zip(("mask", "posted", "mask_poll", "posted_poll"), guests):
    losses = sorted(1 - g / r for r, g in zip(ref, got) if r > 0)
    q = statistics.quantiles(losses, n=4) if len(losses) > 1 else losses * 3
    out[name] = {"median": round(statistics.median(losses), 4), "q1": round(q[0], 4), "q3": round(q[2], 4)}
print(json.dumps(out))
PY
}
# shellcheck disable=SC2086
cat <<JSON
{"nomask_gbps": $nm, "mask_gbps": $m, "loss": $(loss "$m"), "posted_gbps": $p, "posted_loss": $(loss "$p"),
 "nomask_irqs_per_sec": $(median ${irqs[nomask]}), "mask_irqs_per_sec": $(median ${irqs[mask]}),
 "posted_irqs_per_sec": $(median ${irqs[posted]}),
 "mask_writes_per_sec": $(median ${writes[mask]}), "posted_writes_per_sec": $(median ${writes[posted]}),
 "mask_write_us": $(median ${write_us[mask]}), "posted_write_us": $(median ${write_us[posted]}),
 "mask_poll_gbps": $mp, "mask_poll_loss": $(loss "$mp"), "posted_poll_gbps": $pp, "posted_poll_loss": $(loss "$pp"),
 "mask_poll_irqs_per_sec": $(median ${irqs[mask-poll]}), "posted_poll_irqs_per_sec": $(median ${irqs[posted-poll]}),
 "mask_poll_writes_per_sec": $(median ${writes[mask-poll]}),
 "posted_poll_writes_per_sec": $(median ${writes[posted-poll]}),
 "mask_poll_write_us": $(median ${write_us[mask-poll]}), "posted_poll_write_us": $(median ${write_us[posted-poll]}),
 "loss_per_round": $(per_round mask), "posted_loss_per_round": $(per_round posted),
 "mask_poll_loss_per_round": $(per_round mask-poll), "posted_poll_loss_per_round": $(per_round posted-poll),
 "paired_loss": $(paired),
 "sriovd_cpu": {"nomask": $(median ${cpu[nomask]}), "mask": $(median ${cpu[mask]}), "posted": $(median ${cpu[posted]}),
                "mask_poll": $(median ${cpu[mask-poll]}), "posted_poll": $(median ${cpu[posted-poll]})},
 "poll_us": $poll_us, "control_loop": $loop, "session_loops": $session_loops,
 "runs": $runs, "seconds": $seconds}
JSON
