#!/usr/bin/env bash
# sriovd's metrics as Prometheus sees them: the exposition passes
# `promtool check metrics`, and a real Prometheus server (Debian's) scraping
# sriovd on loopback answers PromQL queries through its HTTP API with the
# values sriovctl shows after traffic (an MSI-X storm through a VF export).
# The shipped alert rules (config/prometheus/sriovd-alerts.yaml), loaded into
# that Prometheus, fire on what the daemon really shows: a failed device, a
# PF's link down (and not its VF's alert too), a change that could not be
# given back; every query of the shipped Grafana dashboard
# (config/grafana/sriovd-dashboard.json) runs there and names only metrics
# sriovd exports.
#   tests/integration/prometheus_test.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/interop.sh"
build=${1:?usage: prometheus_test.sh BUILD_DIR}
src=$(cd "$(dirname "$0")/../.." && pwd)
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
# A device that cannot be served: its tap's namespace does not exist.
virtio_devices:
  - name: prom-failed
    type: net
    transport: vhost-user
    socket: $work/failed.sock
    backend: {type: tap, name: prf$$, netns: sriovd-no-such-ns-$$}
CONF
} >"$work/sriovd.yaml"
# Under a systemd watchdog (WATCHDOG_USEC, as the unit's WatchdogSec sets it).
WATCHDOG_USEC=200000 "$sriovd" --config "$work/sriovd.yaml" --foreground >"$work/sriovd.log" 2>&1 &
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
rule_files: ["$src/config/prometheus/sriovd-alerts.yaml"]
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

# The alert rules, on what sriovd shows. ALERTS has a series per alert that
# is pending (within its `for`) or firing.
expect 'sriovd_device_failed{kind="virtio",device="prom-failed"}' 1
expect 'count(ALERTS{alertname="SriovdDeviceFailed",device="prom-failed"})' 1
expect 'count(ALERTS{alertname="SriovdDeviceFailed"})' 1
expect 'sriovd_vf_healthy{pf="0000:3b:00.0",vf="0"}' 1
"$ctl" -s "$work/control.sock" simulate-link 0000:3b:00.0 down >/dev/null || fail "simulate-link down"
expect 'sriovd_pf_link_up{pf="0000:3b:00.0"}' 0
expect 'sriovd_vf_healthy{pf="0000:3b:00.0",vf="0"}' 0
expect 'count(ALERTS{alertname="SriovdPfLinkDown",pf="0000:3b:00.0"})' 1
expect 'count(ALERTS{alertname="SriovdVfUnhealthy"}) or vector(0)' 0
"$ctl" -s "$work/control.sock" simulate-link 0000:3b:00.0 up >/dev/null || fail "simulate-link up"
expect 'sriovd_pf_link_up{pf="0000:3b:00.0"}' 1
expect 'count(ALERTS{alertname="SriovdPfLinkDown"}) or vector(0)' 0
# A reload whose binding fails, and whose rollback of it fails too: the host
# is not given back.
sed -i "s#^      - {index: 0, assign: .*#&\n      - {index: 1, assign: {owner: vm-two, socket: $work/vf1.sock}}#" "$work/sriovd.yaml"
"$ctl" -s "$work/control.sock" simulate-fault 0000:3b:02.1/driver_override --errno 16 --times 2 >/dev/null ||
  fail "simulate-fault"
! "$ctl" -s "$work/control.sock" reload >"$work/reload.txt" 2>&1 || fail "the reload was not refused"
grep -q "rollback problem" "$work/reload.txt" || fail "no rollback problem: $(cat "$work/reload.txt")"
expect 'sriovd_host_restore_failures_total' 1
expect 'count(ALERTS{alertname="SriovdRestoreFailed",alertstate="firing"})' 1
expect 'count(ALERTS{alertname="SriovdHostChangeRolledBack",alertstate="firing"})' 1
expect 'count(ALERTS{alertname="SriovdReloadFailed",alertstate="firing"})' 1
# The watchdog's metrics (whether a ping was late depends on how busy the
# machine is - a loaded CI run makes some late, as it should: the rule's
# firing is unit-tested by promtool, not timed here).
expect 'sriovd_watchdog_interval_seconds' 0.1
expect 'sriovd_watchdog_pings_total > bool 0' 1
expect 'sriovd_watchdog_late_pings_total >= bool 0' 1

# The dashboard: every query runs, and names only metrics sriovd exports.
python3 - "$prom_port" "$src/config/grafana/sriovd-dashboard.json" "$work/metrics.txt" <<'PY' || fail "the dashboard's queries"
import json, re, sys, urllib.parse, urllib.request
port, dashboard, metrics = sys.argv[1], json.load(open(sys.argv[2])), open(sys.argv[3]).read()
exported = set(re.findall(r"^(?:# (?:HELP|TYPE) )?(sriovd_[a-z_]+)", metrics, re.M))
problems, queries, with_data = [], 0, 0
for panel in dashboard["panels"]:
    for target in panel.get("targets", []):
        expr = target["expr"].replace("$instance", ".*").replace("$__rate_interval", "1m")
        queries += 1
        for name in set(re.findall(r"\b(sriovd_[a-z_]+)", expr)) - exported:
            problems.append(f"panel '{panel['title']}': {name} is no metric of sriovd")
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        d = json.load(urllib.request.urlopen(url, timeout=5))
        if d["status"] != "success":
            problems.append(f"panel '{panel['title']}': {expr}: {d}")
        elif d["data"]["result"]:
            with_data += 1
for p in problems:
    print("FAIL:", p)
print(f"PASS the dashboard: {queries} queries ran on Prometheus, {with_data} with data now")
sys.exit(1 if problems else 0)
PY
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
