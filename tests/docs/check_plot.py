#!/usr/bin/python3
"""scripts/bench --plot: every recorded result in docs/bench plots; two runs
of one benchmark give one chart per unit, each naming its figures and both
runs; a file that is not what a benchmark prints is refused, named.

    check_plot.py SOURCE_DIR
"""
import json
import pathlib
import subprocess
import sys
import tempfile

root = pathlib.Path(sys.argv[1])
bench = [str(root / "scripts" / "bench"), "--plot"]
problems = []
tmp = pathlib.Path(tempfile.mkdtemp())


def plot(*files, expect_ok=True):
    r = subprocess.run(bench + ["--out", str(tmp / "out")] + [str(f) for f in files], capture_output=True, text=True)
    if (r.returncode == 0) != expect_ok:
        problems.append(f"plot {files}: exit {r.returncode}: {r.stderr.strip()}")
    return r


recorded = sorted((root / "docs" / "bench").glob("*.json"))
for f in recorded:
    r = plot(f)
    if not r.stdout.split():
        problems.append(f"{f.name}: no chart")

a = {"bench": "demo", "date": "run-a", "tx_gbps": 9.5, "rx_gbps": 10.1, "latency_us_p50": 20.0, "ratio": 0.97,
     "runs": 3, "nested": {"doorbells_per_sec": 1.2e6}}
b = dict(a, date="run-b", tx_gbps=9.1)
(tmp / "a.json").write_text(json.dumps(a))
(tmp / "b.json").write_text(json.dumps(b))
r = plot(tmp / "a.json", tmp / "b.json")
charts = {pathlib.Path(p).name: pathlib.Path(p).read_text() for p in r.stdout.split()}
want = {"a-gbps.svg": ["tx_gbps", "rx_gbps"], "a-us.svg": ["latency_us_p50"], "a-ratio.svg": ["ratio"],
        "a-rate.svg": ["nested.doorbells_per_sec"]}
if set(charts) != set(want):
    problems.append(f"charts {sorted(charts)}, expected {sorted(want)} (one per unit; 'runs' is a parameter)")
for name, fields in want.items():
    for text in fields + ["run-a", "run-b"]:
        if name in charts and text not in charts[name]:
            problems.append(f"{name} does not name {text}")

(tmp / "list.json").write_text("[1, 2]")
r = plot(tmp / "list.json", expect_ok=False)
if "list.json" not in r.stderr or "one JSON object" not in r.stderr:
    problems.append(f"a list is refused without naming the file: {r.stderr.strip()}")
(tmp / "empty.json").write_text('{"bench": "x", "note": "no numbers"}')
r = plot(tmp / "empty.json", expect_ok=False)
if "no number" not in r.stderr:
    problems.append(f"a result without numbers: {r.stderr.strip()}")

for p in problems:
    print(p)
print(f"plot: {len(recorded)} recorded results plotted, {len(charts)} charts of two runs, {len(problems)} problems")
sys.exit(1 if problems else 0)
