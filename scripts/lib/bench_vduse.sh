#!/usr/bin/env bash
# scripts/bench vduse: sriovd's virtio-net driven by the kernel itself
# (VDUSE bound to virtio_vdpa: a netdev of the 6.12 guest) beside the same
# device over vhost-user (sriovd-guest as the front-end, its tap the
# guest's netdev), both on a tap in a namespace of their own, in one boot of
# QEMU 10 (TCG) - tests/vm/scenarios/bench-vduse.sh. iperf3 both ways,
# alternated run by run. Prints one JSON object: each path's Mbit/s per run
# and median, and vduse/vhost-user per direction (this machine's noise is in
# the ratio, not in either number alone).
#   scripts/lib/bench_vduse.sh BUILD_DIR [--runs N] [--seconds S]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: bench_vduse.sh BUILD_DIR [--runs N] [--seconds S]}
shift
runs=3 seconds=5
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) echo "bench vduse: unknown argument $1" >&2; exit 64 ;;
  esac
done
[[ $runs =~ ^[1-9][0-9]?$ && $seconds =~ ^[1-9][0-9]?$ ]] ||
  { echo "bench vduse: --runs and --seconds take 1-99" >&2; exit 64; }
source "$here/tests/vm/igb-lib.sh"
igb_prepare 6.12 >&2 || { echo "bench vduse: QEMU 10 or the 6.12 kernel cannot be had" >&2; exit 1; }
# The scenario with this run's parameters in front.
scenario=$(mktemp /tmp/sriovd-bench-vduse.XXXXXX.sh)
log=$(mktemp /tmp/sriovd-bench-vduse.XXXXXX.log)
trap 'rm -f "$scenario"' EXIT
{
  echo "RUNS=$runs"
  echo "SECS=$seconds"
  cat "$here/tests/vm/scenarios/bench-vduse.sh"
} >"$scenario"
VM_TIMEOUT=$((240 + runs * 4 * (seconds + 4)))
if ! igb_run 6.12 "$scenario" "$log" "$build/src/sriovd" "$build/src/sriovctl" "$build/src/sriovd-guest" \
    "$(command -v iperf3)" >&2; then
  echo "bench vduse: the VM run failed; console in $log" >&2
  exit 1
fi
sed -n 's/^VMTEST BENCH //p' "$log"
rm -f "$log"
