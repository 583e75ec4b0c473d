#!/usr/bin/env bash
# scripts/bench mask-iperf: the seed experiment of this project, end to end.
# A guest whose interrupt acknowledgement masks and unmasks its vector on
# every interrupt (RHEL 5's 2.6.18 MSI code) against the same guest not
# masking, in the same run: iperf3 through sriovd's virtio-net-pci over
# vfio-user, the driver being sriovd-guest (--mask-every-interrupt: each
# mask and unmask a Vector Control write, a vfio-user REGION_WRITE round
# trip that sriovd's MSI-X emulation serves). Runs alternate between the two
# guests; figures are medians.
#   scripts/lib/mask_iperf.sh BUILD_DIR [--runs N] [--seconds S]
# JSON on stdout: nomask_gbps, mask_gbps, loss (1 - mask/nomask),
# nomask_irqs_per_sec, mask_irqs_per_sec, mask_writes_per_sec, runs, seconds.
set -euo pipefail
build=${1:?build dir}
shift
runs=3
seconds=5
while [[ $# -gt 0 ]]; do
  case $1 in
    --runs) runs=$2; shift ;;
    --seconds) seconds=$2; shift ;;
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
tag=$$
nsA=sriovd-miA$tag
nsB=sriovd-miB$tag
interop_workspace sriovd-mask-iperf
interop_namespaces=("$nsA" "$nsB")
fresh_namespaces

sock=$work/vnet.sock
{
  simulated_host_config "$work/state" "$work/control.sock" "mipf$tag"
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
} >"$work/sriovd.yaml"
"$sriovd_bin" --config "$work/sriovd.yaml" --foreground >"$work/sriovd.log" 2>&1 &
sriovd_pid=$!
pids+=("$sriovd_pid")
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
[[ -S $sock ]] || fail "sriovd did not create $sock: $(tail -n 5 "$work/sriovd.log")"
addr "$nsA" "miA$tag" 10.77.0.1

declare -A values irqs writes write_us
# one_run MODE: a guest (masking or not) up, one iperf3, the guest's counts.
one_run() {
  local mode=$1 extra=()
  [[ $mode == mask ]] && extra=(--mask-every-interrupt)
  local glog=$work/guest-$mode-$RANDOM.json
  "$guest_bin" --json virtio-net --socket "$sock" --tap "miB$tag" --netns "$nsB" --queue-size 256 "${extra[@]}" \
    >"$glog" 2>"$glog.err" &
  local gpid=$!
  pids+=("$gpid")
  wait_link "$nsB" "miB$tag"
  addr "$nsB" "miB$tag" 10.77.0.2
  # Each guest's tap is new, with a new MAC: A must not use the last one's.
  ip -n "$nsA" neigh flush dev "miA$tag"
  ready || fail "$mode: 10.77.0.2 is not reachable through the path ($(tail -n 3 "$glog.err"))"
  local t0 t1 g t
  t0=$(date +%s.%N)
  read -r g t <<<"$(iperf_once)"
  t1=$(date +%s.%N)
  [[ $g == ERR ]] && fail "$mode: iperf3 failed"
  kill -INT "$gpid"
  wait "$gpid" || fail "$mode: sriovd-guest failed: $(tail -n 3 "$glog.err")"
  pids=("${pids[@]:0:${#pids[@]}-1}")
  local counts
  counts=$(python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(j["interrupts"], j["mask_writes"], j["mask_write_us"])' "$glog")
  local n w us
  read -r n w us <<<"$counts"
  local per irq_s w_s
  per=$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')
  irq_s=$(awk -v n="$n" -v s="$per" 'BEGIN {printf "%.0f", n / s}')
  w_s=$(awk -v n="$w" -v s="$per" 'BEGIN {printf "%.0f", n / s}')
  echo "  $mode: $g Gbit/s, $irq_s interrupts/s, $w_s mask writes/s ($us us each)" >&2
  write_us[$mode]+=" $us"
  values[$mode]+=" $g"
  irqs[$mode]+=" $irq_s"
  writes[$mode]+=" $w_s"
  [[ $mode == mask && $w -eq 0 ]] && fail "the masking guest wrote no Vector Control"
  return 0
}
for r in $(seq "$runs"); do
  # Alternating which goes first, so a slow second half of the run falls on both.
  if ((r % 2)); then one_run nomask; one_run mask; else one_run mask; one_run nomask; fi
done
kill -0 "$sriovd_pid" || fail "sriovd died: $(tail -n 5 "$work/sriovd.log")"
# shellcheck disable=SC2086
nm=$(median ${values[nomask]})
# shellcheck disable=SC2086
m=$(median ${values[mask]})
# shellcheck disable=SC2086
cat <<JSON
{"nomask_gbps": $nm, "mask_gbps": $m, "loss": $(awk -v a="$m" -v b="$nm" 'BEGIN {printf "%.4f", (b > 0 ? 1 - a / b : 0)}'),
 "nomask_irqs_per_sec": $(median ${irqs[nomask]}), "mask_irqs_per_sec": $(median ${irqs[mask]}),
 "mask_writes_per_sec": $(median ${writes[mask]}), "mask_write_us": $(median ${write_us[mask]}),
 "runs": $runs, "seconds": $seconds}
JSON
