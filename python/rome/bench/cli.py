"""Command line of ``python -m rome.bench``."""

import argparse
import os
import sys
from pathlib import Path

from .rows import (DEFAULT_LLM_SEQ, DEFAULT_SEQ, QUICK_LLM_SEQ, QUICK_SEQ, ROW_KEYS, all_rows)

# With --quick, torch.compile runs on this row only (a compile costs seconds; the first one in a
# fresh environment close to a minute).
QUICK_COMPILE_ROWS = ["half_1d"]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rome.bench",
        description="RoME against PyTorch small ops, matrix forms (eager and torch.compile), ONNX Runtime "
                    "and a copy of the same bytes, in one process, same threads.",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"CI size: S = {QUICK_SEQ} (LLM rows too), 3 repeats, torch.compile on "
                        f"{', '.join(QUICK_COMPILE_ROWS)} only")
    p.add_argument("--rows", default="all",
                   help=f"comma-separated rows (default all): {', '.join(ROW_KEYS)}")
    p.add_argument("--threads", type=int, default=0, help="threads for every method (default: every core)")
    p.add_argument("--repeats", type=int, default=0, help="timed repeats per cell (default 10, quick 3)")
    p.add_argument("--seq", type=int, default=0, help=f"S of the [1, 24, S, 128] rows (default {DEFAULT_SEQ})")
    p.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    p.add_argument("--timer", default=None, help="path of rome_timer (default: build/rome_timer)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from . import report, runner

    seq = args.seq or (QUICK_SEQ if args.quick else DEFAULT_SEQ)
    llm_seq = QUICK_LLM_SEQ if args.quick else DEFAULT_LLM_SEQ
    rows = all_rows(seq, llm_seq)
    if args.rows != "all":
        wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = [w for w in wanted if w not in ROW_KEYS]
        if unknown:
            print(f"unknown rows: {', '.join(unknown)} (choose from {', '.join(ROW_KEYS)})", file=sys.stderr)
            return 2
        rows = [r for r in rows if r.key in wanted]
    threads = args.threads or len(os.sched_getaffinity(0))
    cfg = runner.Config(
        threads=threads,
        repeats=args.repeats or (3 if args.quick else 10),
        warmup=1 if args.quick else 2,
        budget_s=0.5 if args.quick else 6.0,
        cpp_repeats=5 if args.quick else 20,
        compile=not args.no_compile,
        compile_rows=QUICK_COMPILE_ROWS if args.quick else None,
        timer=args.timer,
        quick=args.quick,
    )
    del torch
    results = runner.run(rows, cfg)
    paths = report.save(results, Path(args.out))
    print(report.terminal(results))
    print()
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
