#!/usr/bin/env bash
# scripts/bench migration: what live migration costs with sriovd's
# NICs, each against its baseline in the same run.
#  - Dirty logging: iperf3 through sriovd's vhost-user device with its
#    user-space front-end (scripts/iperf-validate --frontend
#    sriovd-vhost-user), without and with --dirty-log (the device marks
#    every page it writes; the front-end takes the log every 10 ms, as a
#    migration's copy does). Goal: logging costs <= 10 %. The same through
#    virtio-net-pci over vfio-user (--frontend sriovd: the device's DMA
#    log, a DMA_LOGGING_REPORT every 10 ms).
#  - The migration: a Linux guest with a TCP stream flowing in, migrated
#    between two QEMU 7.2 processes (tests/interop/qemu_migration.sh, round
#    1), with sriovd's NICs and with QEMU's own virtio-net on taps;
#    QEMU's total time and downtime. Goal: downtime within 1.2x of QEMU's
#    own device.
#  - virtio-net-pci over vfio-user moved between two sriovd daemons under
#    iperf3 (tests/interop/vfio_user_migration.sh, sriovd-guest as the
#    VMM): its total time and the guest's downtime.
# Runs alternate (off/on, sriovd/tap) so a machine that changes speed
# moves both. Prints one JSON object.
#   scripts/lib/bench_migration.sh BUILD_DIR [--runs N] [--seconds S]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: bench_migration.sh BUILD_DIR [--runs N] [--seconds S]}
shift
runs=3 seconds=5
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) echo "bench migration: unknown argument $1" >&2; exit 64 ;;
  esac
done
[[ $EUID -eq 0 ]] || { echo "bench migration: needs root (namespaces, taps, QEMU)" >&2; exit 1; }
work=$(mktemp -d /tmp/sriovd-bench-migration.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$here"
for i in $(seq "$runs"); do
  for fe in sriovd-vhost-user sriovd; do
    for mode in off on; do
      flag=()
      [[ $mode == on ]] && flag=(--dirty-log)
      echo "bench migration: iperf3 through $fe, dirty logging $mode (run $i)" >&2
      SRIOVD_BIN="$build/src/sriovd" scripts/iperf-validate --frontend "$fe" --runs 1 \
        --seconds "$seconds" "${flag[@]}" >"$work/iperf-$fe-$mode-$i.json" || {
        echo "bench migration: iperf-validate failed" >&2
        exit 1
      }
    done
  done
  echo "bench migration: virtio-net-pci over vfio-user moved between two sriovd (run $i)" >&2
  MIGRATION_REPORT="$work/mig-vfio-user.jsonl" tests/interop/vfio_user_migration.sh "$build" \
    >"$work/mig-vfio-user-$i.log" 2>&1 || {
    echo "bench migration: the vfio-user migration failed:" >&2
    tail -n 30 "$work/mig-vfio-user-$i.log" >&2
    exit 1
  }
  for nic in sriovd qemu-tap; do
    echo "bench migration: migrating a guest on $nic (run $i)" >&2
    MIGRATION_NIC=$nic MIGRATION_ROUNDS=1 MIGRATION_REPORT="$work/mig-$nic.jsonl" \
      tests/interop/qemu_migration.sh "$build" >"$work/mig-$nic-$i.log" 2>&1 || {
      echo "bench migration: the migration on $nic failed:" >&2
      tail -n 30 "$work/mig-$nic-$i.log" >&2
      exit 1
    }
  done
done
WORK=$work python3 - <<'PY'
import glob, json, os, statistics
w = os.environ["WORK"]
def med(v):
    return round(statistics.median(v), 3) if v else None
out = {}
# vhost-user (the log QEMU shares) as logging_*; virtio-pci over vfio-user
# (the device's DMA log, reported every 10 ms) as pci_logging_*.
for fe, key in (("sriovd-vhost-user", "logging"), ("sriovd", "pci_logging")):
    for mode in ("off", "on"):
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{w}/iperf-{fe}-{mode}-*.json"))]
        out[f"{key}_{mode}_gbps"] = med([r["sriovd_gbps"] for r in runs])
        out[f"{key}_{mode}_per_run_gbps"] = [r["sriovd_gbps"] for r in runs]
        if mode == "on":
            out[f"{key}_dirty_pages_per_run"] = [r["dirty_pages"] for r in runs]
    out[f"{key}_on_vs_off"] = (round(out[f"{key}_on_gbps"] / out[f"{key}_off_gbps"], 3)
                               if out[f"{key}_off_gbps"] else None)
for nic in ("sriovd", "qemu-tap"):
    rs = [json.loads(l) for l in open(f"{w}/mig-{nic}.jsonl") if l.strip()]
    key = nic.replace("-", "_")
    out[f"{key}_total_ms"] = med([r["total-time"] for r in rs])
    out[f"{key}_downtime_ms"] = med([r["downtime"] for r in rs])
    # Under TCG the downtime is bimodal for both devices (a few ms, or
    # 30-70 ms when the stop lands badly): the mean shows it too.
    out[f"{key}_downtime_mean_ms"] = round(statistics.mean([r["downtime"] for r in rs]), 1)
    out[f"{key}_downtime_per_run_ms"] = [r["downtime"] for r in rs]
# virtio-net-pci over vfio-user, sriovd-guest as the VMM under iperf3: the
# guest paused from the pause to RUNNING on the destination, and the
# device's part of it (from the guest stopped).
vu = [json.loads(l) for l in open(f"{w}/mig-vfio-user.jsonl") if l.strip()]
out["vfio_user_total_ms"] = med([r["total_ms"] for r in vu])
out["vfio_user_downtime_ms"] = med([r["downtime_ms"] for r in vu])
out["vfio_user_device_downtime_ms"] = med([r["device_downtime_ms"] for r in vu])
out["vfio_user_downtime_per_run_ms"] = [round(r["downtime_ms"], 2) for r in vu]
out["downtime_sriovd_vs_qemu_tap"] = (round(out["sriovd_downtime_ms"] / out["qemu_tap_downtime_ms"], 3)
                                      if out["qemu_tap_downtime_ms"] else None)
out["downtime_mean_sriovd_vs_qemu_tap"] = (round(out["sriovd_downtime_mean_ms"] / out["qemu_tap_downtime_mean_ms"], 3)
                                           if out["qemu_tap_downtime_mean_ms"] else None)
out["runs"] = len(out["sriovd_downtime_per_run_ms"])
print(json.dumps(out))
PY
