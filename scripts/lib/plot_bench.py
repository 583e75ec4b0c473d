#!/usr/bin/python3
"""Renders what scripts/bench printed (one JSON object per file) as SVG bar
charts with gnuplot: the numeric fields grouped by what they measure
(one unit per chart: Gbit/s, per second, microseconds, ratios...; nested objects flattened as a.b), one chart
per group, one bar per field and input file - so several files of the same
benchmark (runs, days, commits) stand side by side. Lists and text are
left out.

    plot_bench.py [--out DIR] [--title TEXT] FILE.json...

Prints the SVGs it wrote, one per line. Exits 1 (saying why) when a file is
not one JSON object or has no number to plot, or gnuplot fails.
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

GROUPS = [  # (name, axis label, pattern on the field's last part): one unit per chart
    ("ratio", "ratio", re.compile(r"(ratio|_vs_|_over_|paired)")),
    ("gbps", "Gbit/s", re.compile(r"_gbps")),
    ("mbps", "Mbit/s", re.compile(r"_mbps")),
    ("rate", "per second", re.compile(r"(per_sec|_mpps|_kpps|_pps|_per_s$|_k?ops)")),
    ("us", "microseconds", re.compile(r"_us($|_)")),
    ("ns", "nanoseconds", re.compile(r"_ns($|_)")),
    ("ms", "milliseconds", re.compile(r"_ms($|_)")),
    ("seconds", "seconds", re.compile(r"(_s$|_seconds)")),
]


# How a benchmark was run, not what it measured.
PARAMETERS = {"runs", "samples", "queue_size", "seconds", "vectors", "clients", "threads"}


def flatten(obj, prefix=""):
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool) or value is None or key in PARAMETERS or key.startswith(("target_", "goal_")):
            continue
        if isinstance(value, (int, float)):
            yield name, float(value)
        elif isinstance(value, dict):
            yield from flatten(value, name + ".")


def group_of(field):
    last = field.rsplit(".", 1)[-1]
    for name, _, pattern in GROUPS:
        if pattern.search(last):
            return name
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="directory for the SVGs (made if missing)")
    ap.add_argument("--title", help="chart title (default: the benchmark's name or the first file's)")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()

    series = []  # (label, {field: value})
    for f in args.files:
        try:
            doc = json.loads(pathlib.Path(f).read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"plot: {f}: not JSON ({e})")
        if not isinstance(doc, dict):
            sys.exit(f"plot: {f}: not one JSON object (what scripts/bench prints)")
        values = dict(flatten(doc))
        if not values:
            sys.exit(f"plot: {f}: no number to plot")
        label = str(doc.get("label") or doc.get("date") or pathlib.Path(f).stem)
        series.append((label, values))

    stem = pathlib.Path(args.files[0]).stem
    title = args.title or str(json.loads(pathlib.Path(args.files[0]).read_text()).get("bench", stem))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = []
    for _, values in series:
        fields += [k for k in values if k not in fields]
    by_group = {}
    for field in fields:
        by_group.setdefault(group_of(field), []).append(field)

    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for group, members in by_group.items():
            # One cluster per input file (its label under it), one bar per
            # field in the same colour across the clusters (named in the key).
            data = pathlib.Path(tmp) / f"{group}.dat"
            with data.open("w") as d:
                d.write("run " + " ".join(f'"{field}"' for field in members) + "\n")
                for label, values in series:
                    cells = [repr(values[field]) if field in values else "?" for field in members]
                    d.write(f'"{label}" ' + " ".join(cells) + "\n")
            svg = out / f"{stem}-{group}.svg"
            axis = dict((n, a) for n, a, _ in GROUPS).get(group, "value")
            width = max(560, 420 + 60 * len(members) * len(series))
            plot = "plot " + ", ".join(
                f'"{data}" using {i + 2}:xtic(1) title columnheader({i + 2})' for i in range(len(members)))
            script = f"""
set terminal svg size {min(width, 1400)},{max(360, 120 + 18 * len(members))} dynamic font "Helvetica,11" noenhanced
set output "{svg}"
set title "{title}: {axis}"
set ylabel "{axis}"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set grid ytics
set yrange [0:*]
set xtics nomirror
set key outside right top vertical Left reverse
set datafile missing "?"
{plot}
"""
            r = subprocess.run(["gnuplot"], input=script, capture_output=True, text=True)
            if r.returncode != 0 or not svg.exists():
                sys.exit(f"plot: gnuplot failed for {group}: {r.stderr.strip()}")
            written.append(str(svg))
    for w in written:
        print(w)


if __name__ == "__main__":
    main()
