"""Merges runs of single rows into one report:

    python -m rome.bench --rows half_1d --out runs/half_1d     (one row at a time, e.g. when
    python -m rome.bench --rows decode  --out runs/decode       the machine is idle in between)
    python -m rome.bench.merge bench-results runs/half_1d runs/decode

Rows keep their order of the full benchmark; the machine line and start load come from the first
run, the end load is the highest of all runs, the wall time is the sum.
"""

import argparse
import json
import sys
from pathlib import Path

from . import report
from .rows import ROW_KEYS


def merge(runs):
    first = runs[0]
    rows = {}
    for run in runs:
        for r in run["rows"]:
            rows[r["row"]] = r
    merged = dict(first)
    merged["rows"] = [rows[k] for k in ROW_KEYS if k in rows]
    merged["wall_s"] = round(sum(r.get("wall_s", 0) for r in runs), 1)
    merged["machine"] = dict(first["machine"])
    merged["machine"]["load_average_at_start"] = max(r["machine"]["load_average_at_start"] for r in runs)
    ends = [r.get("load_average_at_end") for r in runs if r.get("load_average_at_end")]
    if ends:
        merged["load_average_at_end"] = max(ends)
    merged["machine"]["date"] = f"{first['machine']['date']} (merged from {len(runs)} runs)"
    merged["config"] = dict(first["config"])
    merged["config"]["rows"] = [r["row"] for r in merged["rows"]]
    return merged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rome.bench.merge", description=__doc__.splitlines()[0])
    p.add_argument("out", help="output directory")
    p.add_argument("runs", nargs="+", help="directories holding bench.json")
    args = p.parse_args(argv)
    runs = [json.loads((Path(d) / "bench.json").read_text()) for d in args.runs]
    merged = merge(runs)
    paths = report.save(merged, Path(args.out))
    print(report.terminal(merged))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
