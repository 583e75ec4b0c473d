#!/usr/bin/env bash
# CI smoke of `scripts/bench mask-iperf`: one short run of each guest (one
# masking its vectors through the MSI-X table on every interrupt and
# waiting for each write, one masking with posted writes, one not; the
# masking ones again with the daemon's control thread polling); all must
# carry iperf3 traffic through virtio-net-pci over vfio-user, the server
# must have counted every mask the masking ones wrote (the script checks
# that), and the polling runs must have polled and found writes by it.
# No rate is asserted.
#   tests/interop/mask_iperf_smoke.sh BUILD_DIR
set -euo pipefail
build=${1:?build dir}
cd "$(dirname "$0")/../.."
source scripts/lib/interop.sh
need_root_tun "the mask-iperf bench"
# The widest window: that the polling works, whatever the machine's speed.
out=$(scripts/lib/mask_iperf.sh "$build" --runs 1 --seconds 2 --poll-us 1000)
echo "$out"
/usr/bin/python3 - "$out" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
bad = [k for k in ("nomask_gbps", "mask_gbps", "posted_gbps", "mask_writes_per_sec", "posted_writes_per_sec",
                  "nomask_irqs_per_sec", "mask_irqs_per_sec", "posted_irqs_per_sec", "mask_poll_gbps",
                  "posted_poll_gbps", "mask_poll_writes_per_sec", "posted_poll_writes_per_sec")
       if not r.get(k, 0) > 0]
# The device's writes arrive on its session thread: its polling found them
# (the control thread serves no VMM since the session threads).
bad += ["session_loops." + k for k in ("polls", "hits") if not r.get("session_loops", {}).get(k, 0) > 0]
bad += [k for k in ("posted_poll_loss_per_round", "sriovd_cpu") if not r.get(k)]
bad += ["paired_loss." + g for g in ("mask", "posted", "mask_poll", "posted_poll")
        if set(r.get("paired_loss", {}).get(g, {})) != {"median", "q1", "q3"}]
if bad:
    print("FAIL: zero or missing: " + ", ".join(bad))
    sys.exit(1)
print("PASS mask-iperf smoke")
PY
