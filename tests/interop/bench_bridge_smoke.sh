#!/usr/bin/env bash
# CI smoke of `scripts/bench bridge`: one short run of every bridge (sriovd
# af_packet / af_xdp, DPDK af_packet / af_xdp), both directions, 64 B; each
# must have moved frames, and the JSON must carry every figure and ratio.
# No rate is asserted (timing does not belong in tests): the full bench is
# `scripts/bench bridge`.
#   tests/interop/bench_bridge_smoke.sh BUILD_DIR
set -euo pipefail
build=${1:?build dir}
cd "$(dirname "$0")/../.."
source scripts/lib/interop.sh
need_root_tun "the bridge bench"
need_testpmd
out=$(mktemp /tmp/sriovd-bench-bridge-smoke.XXXXXX.json)
trap 'rm -f "$out"' EXIT
/usr/bin/python3 scripts/lib/bench_bridge.py --build-dir "$build" --runs 1 --seconds 1 --warmup 1 --sizes 64 >"$out"
/usr/bin/python3 - "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
bad = []
for v in ("sriovd_af_packet", "sriovd_af_xdp", "dpdk_af_packet", "dpdk_af_xdp"):
    for d in ("tx", "rx"):
        key = f"{v}_{d}_64_mpps"
        if not r["results"].get(key, 0) > 0:
            bad.append(f"{key} = {r['results'].get(key)}")
for key in ("af_packet_tx_64", "af_packet_rx_64", "af_xdp_tx_64", "af_xdp_rx_64"):
    if key not in r["ratios"]:
        bad.append(f"ratio {key} missing")
    if len(r["ratios_per_run"].get(key, [])) != r["runs"]:
        bad.append(f"ratios_per_run {key}: {r['ratios_per_run'].get(key)}, one per run expected")
print(json.dumps(r["ratios"], sort_keys=True))
if bad:
    print("FAIL: " + "; ".join(bad))
    sys.exit(1)
print("PASS bench bridge smoke")
PY
