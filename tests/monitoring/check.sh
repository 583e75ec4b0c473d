#!/usr/bin/env bash
# The operators' kit as Prometheus and Grafana read it: the alert rules pass
# `promtool check rules` and their unit tests (`promtool test rules`,
# sriovd-alerts.test.yaml); the dashboard is JSON Grafana imports (unique
# panel ids, each panel placed, each query on the datasource variable).
# tests/integration/prometheus_test.sh runs both against a real sriovd.
#   tests/monitoring/check.sh
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
if ! command -v promtool >/dev/null; then
  if [[ $EUID -eq 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >&2
  else
    echo "SKIP: promtool is not installed and this is not root (apt-get install prometheus)" >&2
    exit 77
  fi
fi
promtool check rules "$src/config/prometheus/sriovd-alerts.yaml"
promtool test rules "$src/tests/monitoring/sriovd-alerts.test.yaml"
python3 - "$src/config/grafana/sriovd-dashboard.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
problems = []
ids = [p["id"] for p in d["panels"]]
if len(ids) != len(set(ids)):
    problems.append("panel ids are not unique")
names = {v["name"] for v in d["templating"]["list"]}
if not {"datasource", "instance"} <= names:
    problems.append("the datasource and instance variables are missing")
for p in d["panels"]:
    if not {"x", "y", "w", "h"} <= set(p.get("gridPos", {})):
        problems.append(f"panel {p['title']} has no place")
    if p["type"] == "row":
        continue
    if p.get("datasource", {}).get("uid") != "${datasource}" or not p.get("targets"):
        problems.append(f"panel {p['title']}: no query on the datasource variable")
    for t in p.get("targets", []):
        if "$instance" not in t["expr"]:
            problems.append(f"panel {p['title']}: {t['expr']} ignores the host chosen")
for p in problems:
    print("FAIL:", p)
print(f"dashboard: {len(ids)} panels, {len(problems)} problems")
sys.exit(1 if problems else 0)
PY
echo "monitoring: all passed"
