"""Command line of ``python -m rome.bench``."""

import argparse
import json
import os
import sys
from pathlib import Path

from .rows import (DEFAULT_LLM_SEQ, DEFAULT_SEQ, QUICK_LLM_SEQ, QUICK_SEQ, ROW_KEYS, all_rows)

# With --quick, torch.compile runs on this row only (a compile costs seconds; the first one in a
# fresh environment close to a minute).
QUICK_COMPILE_ROWS = ["half_1d"]
# The default run (about 10 minutes on a 2-core AVX2 machine): the layout study, then the operator
# table on these rows without the columns that take seconds per call there (PyTorch's bf16 matmul
# forms run ~10x slower than fp32 sgemm on CPUs without bf16 hardware) and with torch.compile on
# one row. --full runs every row and column.
DEFAULT_ROWS = ["interleave_1d", "half_1d", "half_3d", "wan_3d", "llm_prefill", "decode"]
DEFAULT_COMPILE_ROWS = ["half_1d"]
OPT_IN_METHODS = ("axis_matrix", "matrix", "compile_matrix")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rome.bench",
        description="RoME against PyTorch small ops, matrix forms (eager and torch.compile), ONNX Runtime "
                    "and a copy of the same bytes, in one process, same threads.",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"CI size: S = {QUICK_SEQ} (LLM rows too), 3 repeats, torch.compile on "
                        f"{', '.join(QUICK_COMPILE_ROWS)} only")
    p.add_argument("--full", action="store_true",
                   help="the exhaustive study: every variant of the layout study, every row and column of "
                        "the operator table (bf16 matmul baselines, dense rows, torch.compile everywhere)")
    p.add_argument("--rows", default="",
                   help=f"comma-separated operator-table rows (default {', '.join(DEFAULT_ROWS)}; "
                        f"--full: all): {', '.join(ROW_KEYS)}")
    p.add_argument("--no-layouts", action="store_true", help="skip the layout study")
    p.add_argument("--layouts-only", action="store_true", help="run only the layout study")
    p.add_argument("--no-varlen", action="store_true",
                   help="skip the ragged-batch and KV-cache re-rotation rows")
    p.add_argument("--no-fused", action="store_true",
                   help="skip the fused QK-norm + RoPE, RoPE + KV-cache write and HF decode rows")
    p.add_argument("--no-table-free", action="store_true",
                   help="skip the table-free RoPE precision and speed tables")
    p.add_argument("--no-dense", action="store_true",
                   help="skip the dense path vs PyTorch's best matmul (forward and backward)")
    p.add_argument("--no-models", action="store_true",
                   help="skip the real-model table (transformers LLM layers with and without RoME)")
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
    # --quick (CI size) keeps every row and column: cheap at its size.
    row_arg = args.rows or ("all" if args.full or args.quick else ",".join(DEFAULT_ROWS))
    if row_arg != "all":
        wanted = [r.strip() for r in row_arg.split(",") if r.strip()]
        unknown = [w for w in wanted if w not in ROW_KEYS]
        if unknown:
            print(f"unknown rows: {', '.join(unknown)} (choose from {', '.join(ROW_KEYS)})", file=sys.stderr)
            return 2
        rows = [r for r in rows if r.key in wanted]
    threads = args.threads or len(os.sched_getaffinity(0))
    out_dir = Path(args.out)
    threads_list = sorted({1, threads})

    def section(module, name: str, **kw) -> dict:
        """Runs one study, prints its table and writes <name>.md / <name>.json (a study with its
        own save() writes its files, e.g. the models' csv and chart)."""
        res = module.run(quick=args.quick, threads_list=threads_list,
                         progress=lambda what: print(what, file=sys.stderr, flush=True), **kw)
        out_dir.mkdir(parents=True, exist_ok=True)
        if hasattr(module, "save"):
            text = module.save(res, out_dir)["md"].read_text()
        else:
            (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
            text = module.markdown(res)
            (out_dir / f"{name}.md").write_text(text)
        print(text)
        wall = f" ({res['wall_s']:.0f} s)" if "wall_s" in res else ""
        print(f"wrote {out_dir / (name + '.md')}, {out_dir / (name + '.json')}{wall}")
        print()
        return res

    if not args.no_layouts:
        from . import layouts

        section(layouts, "layouts", full=args.full)
        if args.layouts_only:
            return 0
    if not args.no_varlen:
        from . import varlen_kv

        section(varlen_kv, "varlen_kv")
    if not args.no_fused:
        from . import fused, hf_decode

        section(fused, "fused")
        section(hf_decode, "hf_decode")
    if not args.no_table_free:
        from . import table_free

        section(table_free, "table_free")
    if not args.no_dense:
        from . import dense

        section(dense, "dense")
    if not args.no_models:
        from . import models

        section(models, "models")
    if args.quick:
        compile_rows = QUICK_COMPILE_ROWS
    elif args.full:
        compile_rows = None
    else:
        compile_rows = DEFAULT_COMPILE_ROWS
    cfg = runner.Config(
        threads=threads,
        repeats=args.repeats or (3 if args.quick else 10),
        warmup=1 if args.quick else 2,
        budget_s=0.5 if args.quick else 6.0,
        cpp_repeats=5 if args.quick else 20,
        compile=not args.no_compile,
        compile_rows=compile_rows,
        timer=args.timer,
        quick=args.quick,
        skip_methods=() if args.full or args.quick else OPT_IN_METHODS,
    )
    del torch
    results = runner.run(rows, cfg)
    paths = report.save(results, out_dir)
    print(report.terminal(results))
    print()
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
