#!/usr/bin/env bash
# sriovd's metrics as Prometheus sees them: the exposition passes
# `promtool check metrics`, and a real Prometheus server (Debian's) scraping
# sriovd on loopback answers PromQL queries through its HTTP API with the
# values sriovctl shows after traffic (an MSI-X storm through a VF export).
#   tests/integration/prometheus_test.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/interop.sh"
build=${1:?usage: prometheus_test.sh BUILD_DIR}
sriovd=$build/src/sriovd
ctl=$build/src/sriovctl
guest=$build/src/sriovd-guest

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if [[ $EUID -eq 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >&2
  else
    echo "SKIP: prometheus/promtool are not installed and this is not root (apt-get install prometheus)" >&2
    exit 77
  fi
fi

work=$(mktemp -d /tmp/sriovd-prom.XXXXXX)
pids=()
cleanup() {
  kill_tree "${pids[@]}"
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  echo "--- sriovd log" >&2
  tail -n 20 "$work/sriovd.log" >&2 || true
  [[ -f $work/prometheus.log ]] && { echo "--- prometheus log" >&2; tail -n 20 "$work/prometheus.log" >&2; }
  exit 1
}
# Python reads JSON here: d is the document on stdin.
json_get() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }
free_port() { python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

{
  simulated_host_config "$work/state" "$work/control.sock" "prpf$$"
  cat <<CONF
metrics: {listen: "127.0.0.1:0"}
physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 2
    vfs:
      - {index: 0, assign: {owner: vm-prom, socket: $work/vf0.sock, msix_policy: relay}}
CONF
} >"$work/sriovd.yaml"
"$sriovd" --config "$work/sriovd.yaml" --foreground >"$work/sriovd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $work/vf0.sock ]] && break; sleep 0.1; done
[[ -S $work/vf0.sock ]] || fail "sriovd did not start"
port=$("$ctl" -s "$work/control.sock" --json status | json_get "d['metrics']['port']")
[[ $port -gt 0 ]] || fail "sriovctl status shows no metrics port"

# The exposition itself.
python3 -c "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$port/metrics', timeout=5).read().decode())" \
  >"$work/metrics.txt" || fail "GET /metrics on 127.0.0.1:$port"
promtool check metrics <"$work/metrics.txt" || fail "promtool check metrics"
grep -q '^sriovd_vf_info{pf="0000:3b:00.0",vf="0",address="0000:3b:02.0",driver="vfio-pci",owner="vm-prom",export="vfio-user",state="assigned"} 1$' \
  "$work/metrics.txt" || fail "no sriovd_vf_info for VF 0: $(grep sriovd_vf_info "$work/metrics.txt")"
echo "PASS promtool check metrics ($(grep -c '^sriovd_' "$work/metrics.txt") sriovd samples)"

# Traffic: interrupts through the export, then what sriovctl says of them.
"$guest" --json msix-storm --socket "$work/vf0.sock" --seconds 1 --rate 20000 --no-mask >"$work/storm.json" ||
  fail "the MSI-X storm"
handled=$(json_get "d['handled']" <"$work/storm.json")
[[ $handled -gt 0 ]] || fail "no interrupt reached the guest"
# (The routes went with the client; the export keeps their totals.)
"$ctl" -s "$work/control.sock" --json devices >"$work/devices.json"
delivered=$(json_get "[e['interrupts']['delivered'] for e in d['vfio_user_exports'] if e['vf_index'] == 0][0]" <"$work/devices.json")
connections=$(json_get "[e['vfio_user']['connections'] for e in d['vfio_user_exports'] if e['vf_index'] == 0][0]" <"$work/devices.json")
[[ $delivered -gt 0 && $connections -eq 1 ]] || fail "sriovctl: delivered $delivered, connections $connections"

# A real Prometheus scraping it every second.
prom_port=$(free_port)
cat >"$work/prometheus.yml" <<CONF
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: sriovd
    static_configs: [{targets: ["127.0.0.1:$port"]}]
CONF
promtool check config "$work/prometheus.yml" >/dev/null || fail "promtool check config"
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" >"$work/prometheus.log" 2>&1 &
pids+=($!)
# query PROMQL: the value of its single series, or nothing yet.
query() {
  python3 - "$prom_port" "$1" <<'PY'
import json, sys, urllib.parse, urllib.request
port, q = sys.argv[1], sys.argv[2]
try:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    d = json.load(urllib.request.urlopen(url, timeout=2))
    r = d["data"]["result"]
    if d["status"] == "success" and len(r) == 1:
        print(r[0]["value"][1])
except Exception:
    pass
PY
}
expect() {  # PROMQL VALUE: within 30 s
  local got=""
  for _ in $(seq 150); do
    got=$(query "$1")
    [[ $got == "$2" ]] && { echo "PASS $1 = $2"; return 0; }
    sleep 0.2
  done
  fail "Prometheus: $1 is '${got}', expected $2"
}
expect 'up{job="sriovd"}' 1
expect 'sriovd_export_interrupts_delivered_total{pf="0000:3b:00.0",vf="0"}' "$delivered"
expect 'sriovd_export_connections_total{pf="0000:3b:00.0",vf="0"}' 1
expect 'count(sriovd_vf_info{pf="0000:3b:00.0"})' 2
expect 'sriovd_host_transactions_total{outcome="committed"}' 1
expect 'sriovd_build_info' 1
# A second daemon whose metrics port is taken stops before it touches its host.
{
  simulated_host_config "$work/state2" "$work/control2.sock" "pr2pf$$"
  cat <<CONF
metrics: {listen: "127.0.0.1:$port"}
physical_functions:
  - {address: "0000:3b:00.0", num_vfs: 1}
CONF
} >"$work/second.yaml"
rc=0
timeout 20 "$sriovd" --config "$work/second.yaml" --foreground >"$work/second.log" 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "a second sriovd started on a metrics port in use"
grep -q "metrics.listen 127.0.0.1:$port: cannot listen" "$work/second.log" || fail "no clear error: $(tail -n 3 "$work/second.log")"
! grep -q "sriov_numvfs" "$work/second.log" || fail "the second sriovd changed its host before failing"
echo "PASS a metrics port in use: exit $rc, '$(grep -o "metrics.listen.*" "$work/second.log" | head -n 1)'"
echo "prometheus_test: all passed"
