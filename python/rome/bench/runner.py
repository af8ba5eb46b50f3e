"""Runs the rows and methods; returns plain dicts (what report.py prints and saves)."""

import ctypes
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import cpp, glibc_streaming, measure, methods, onnx_rt
from .rows import Row, make_inputs

BASELINES = ["small", "axis_matrix", "matrix", "compile_small", "compile_matrix", "ort"]


@dataclass
class Method:
    key: str
    label: str  # column header
    build: Optional[Callable] = None  # (Inputs, Config) -> Prepared
    compiled: bool = False


METHODS = [
    Method("small", "PyTorch small ops", lambda i, c: methods.build_small(i)),
    Method("axis_matrix", "per-axis matrices", lambda i, c: methods.build_axis_matrices(i)),
    Method("matrix", "combined matrix", lambda i, c: methods.build_matrix(i)),
    Method("compile_small", "compile(small ops)", lambda i, c: methods.build_small(i, True), True),
    Method("compile_matrix", "compile(matrix)", lambda i, c: methods.build_matrix(i, True), True),
    Method("ort", "ONNX Runtime", lambda i, c: onnx_rt.build_ort(i, c.threads)),
    Method("bare_mm", "bare matmul", lambda i, c: methods.build_bare_matmul(i)),
    Method("rome", "RoME", lambda i, c: methods.build_rome(i)),
    Method("rome_inplace", "RoME in place", lambda i, c: methods.build_rome_inplace(i)),
    Method("rome_cpp", "RoME C++"),
    Method("floor", "floor (copy)", lambda i, c: methods.build_floor(i, c.threads)),
    Method("floor_cpp", "floor C++"),
]
LABELS = {m.key: m.label for m in METHODS}


@dataclass
class Config:
    threads: int
    repeats: int
    warmup: int
    budget_s: float
    cpp_repeats: int
    compile: bool
    compile_rows: Optional[List[str]]  # None: every row
    timer: Optional[str]
    quick: bool
    skip_methods: Tuple[str, ...] = ()  # opt-in columns left out of this run (--full runs them)


# ------------------------------------------------------------------------------------------------
# Process setup


def keep_freed_memory() -> bool:
    """glibc malloc: no mmap for large blocks, no trimming, so a freed 177 MB output is reused by
    the next call instead of being unmapped and page-faulted in again (on this VM that costs
    several times the RoPE itself). Applies to every column alike."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1
        ok &= libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1)) == 1
        return bool(ok)
    except OSError:
        return False


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(cfg: Config, malloc_tuned: bool, timer: Optional[str]) -> Dict:
    import rome

    info = rome.cpu_info()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "isa": info.get("active_isa"),
        "detected_isa": info.get("detected_isa"),
        "compiled_isas": info.get("compiled_isas"),
        "threads": cfg.threads,
        "torch": torch.__version__,
        "onnxruntime": onnx_rt.version(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "malloc": "freed memory kept (mallopt: no mmap, no trim)" if malloc_tuned else "system default",
        "memmove": glibc_streaming.describe(),
        "rome_timer": timer or "not found (build it: make build)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


class Progress:
    def __init__(self, total_rows: int):
        self.total = total_rows
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.width = 0

    def __call__(self, index: int, row: Row, what: str):
        elapsed = time.perf_counter() - self.start
        text = f"[{index}/{self.total}] {row.title}: {what}  ({elapsed:.0f} s)"
        if self.tty:
            pad = max(0, self.width - len(text))
            sys.stderr.write("\r" + text + " " * pad)
            self.width = len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self):
        if self.tty:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


# ------------------------------------------------------------------------------------------------
# One row


def run_row(row: Row, cfg: Config, timer_path, progress: Callable[[str], None]) -> Dict:
    row_start = time.perf_counter()
    progress("inputs and fp64 reference")
    inp = make_inputs(row)
    ref = measure.Reference(inp)
    fp32_ref = ref.fp32_reference_error()
    result = {
        "row": row.key,
        "title": row.title,
        "shape": row.shape_text,
        "mode": row.mode,
        "dims": row.dims,
        "grid": row.grid,
        "decode": row.decode,
        "matrix": row.matrix,
        "matrix_flops": row.matrix_flops() if row.matrix_path else 0,
        "whole_matrix_flops": row.matrix_flops(whole=True) if row.matrix_path else 0,
        "bytes": row.bytes_moved(),
        "precision_slice": ref.description,
        "fp32_reference_error": vars(fp32_ref),
        "methods": {},
    }
    methods_out: Dict[str, Dict] = result["methods"]

    # 1. Build every method, warm it up, take its precision, plan its samples.
    plans: Dict[str, measure.Plan] = {}
    preps: Dict[str, methods.Prepared] = {}
    for m in METHODS:
        if m.build is None:
            continue
        entry = methods_out[m.key] = {"label": m.label}
        if m.key in ("rome", "rome_inplace"):
            why = methods.exists_rome_op()
            if why:
                entry["na"] = why
                continue
        if m.key in cfg.skip_methods:
            entry["na"] = "opt-in (python -m rome.bench --full)"
            continue
        if m.compiled and not cfg.compile:
            entry["na"] = "--no-compile"
            continue
        if m.compiled and cfg.compile_rows is not None and row.key not in cfg.compile_rows:
            entry["na"] = ("torch.compile only on " + ", ".join(cfg.compile_rows) +
                           ("" if cfg.quick else " (--full: every row)"))
            continue
        progress(m.label + (": compiling" if m.compiled else ": warm-up"))
        try:
            prep = m.build(inp, cfg)
            first = getattr(prep, "first_call", None)
            first_out = first() if first else None
            plan, out = measure.plan(prep.fn, cfg.repeats, cfg.warmup, cfg.budget_s)
        except methods.NotApplicable as e:
            entry["na"] = str(e)
            continue
        except Exception as e:  # a broken baseline must not stop the benchmark
            entry["na"] = f"failed: {e.__class__.__name__}: {str(e).splitlines()[0][:200]}"
            continue
        entry["note"] = prep.note
        if prep.setup_s:
            entry["compile_s"] = round(prep.setup_s, 2)
        if m.key not in ("floor", "bare_mm"):  # not RoPE: no precision to compare
            err = ref.error(first_out if first_out is not None else out)
            entry["error"] = vars(err)
            entry["error_bound"] = measure.precision_bound(prep.dtype, prep.out_dtype)
        del out, first_out
        plans[m.key], preps[m.key] = plan, prep
    measure.free_memory()

    # 2. Time them round-robin: sample r of every method is taken in round r (slow methods with
    # fewer samples spread theirs over the rounds), so load from other processes, frequency or
    # cache state changes hit every column alike.
    rounds = max((p.samples_wanted for p in plans.values()), default=0)
    for r in range(rounds):
        progress(f"timing, round {r + 1}/{rounds}")
        for key, plan in plans.items():
            if plan.due(r, rounds):
                plan.sample()
    for key, plan in plans.items():
        t = plan.timing()
        methods_out[key].update(median_s=t.median_s, min_s=t.min_s, repeats=t.repeats, inner=t.inner)
    for prep in preps.values():
        if prep.close is not None:
            prep.close()
    del preps, plans
    torch._dynamo.reset()
    measure.free_memory()

    # RoME from C++ (its own process, its own copy floor).
    if timer_path is None:
        why = "rome_timer not found (make build builds build/rome_timer)"
        methods_out["rome_cpp"] = {"label": LABELS["rome_cpp"], "na": why}
        methods_out["floor_cpp"] = {"label": LABELS["floor_cpp"], "na": why}
    else:
        progress("RoME C++ (rome_timer)")
        del inp, ref
        measure.free_memory()
        try:
            t = cpp.run(timer_path, row, cfg.threads, cfg.cpp_repeats)
            methods_out["rome_cpp"] = {
                "label": LABELS["rome_cpp"], "median_s": t["rome_median_s"], "min_s": t["rome_min_s"],
                "repeats": t["repeats"], "inner": t["inner"], "isa": t["isa"],
                "path": t.get("path"), "matrix_flops": t.get("matrix_flops"),
                "note": "rope_forward into preallocated outputs; same kernel as RoME (torch)",
                "command": t["command"],
            }
            # The faster of memcpy and a copy with non-temporal stores (bench/common/copy_floor.hpp:
            # below glibc's non-temporal threshold memcpy reads every destination line first). The
            # smaller of two noisy medians leans a little low.
            stream = t.get("stream_copy_median_s")
            use_stream = stream is not None and stream < t["copy_median_s"]
            methods_out["floor_cpp"] = {
                "label": LABELS["floor_cpp"],
                "median_s": stream if use_stream else t["copy_median_s"],
                "min_s": t["stream_copy_min_s"] if use_stream else t["copy_min_s"],
                "repeats": t["repeats"], "inner": t["inner"],
                "note": ("non-temporal copy" if use_stream else "memcpy") +
                        " x->y + read the fp32 tables, RoME's thread pool (same process as RoME C++)",
            }
        except Exception as e:
            why = f"rome_timer failed: {str(e)[:200]}"
            methods_out["rome_cpp"] = {"label": LABELS["rome_cpp"], "na": why}
            methods_out["floor_cpp"] = {"label": LABELS["floor_cpp"], "na": why}

    result["derived"] = derive(result)
    result["wall_s"] = round(time.perf_counter() - row_start, 1)
    return result


def _t(methods_out: Dict, key: str) -> Optional[float]:
    return methods_out.get(key, {}).get("median_s")


def derive(result: Dict) -> Dict:
    m = result["methods"]
    rome_t = _t(m, "rome")
    out: Dict = {}
    baselines = {k: _t(m, k) for k in BASELINES if _t(m, k) is not None}
    if baselines:
        best = min(baselines, key=baselines.get)
        out["best_other"] = best
        out["best_other_s"] = baselines[best]
    if rome_t:
        if _t(m, "small"):
            out["speedup_vs_small"] = _t(m, "small") / rome_t
        if baselines:
            out["speedup_vs_best_other"] = out["best_other_s"] / rome_t
        floors = [t for t in (_t(m, "floor"), _t(m, "floor_cpp")) if t]
        if floors:
            out["floor_s"] = min(floors)
            out["rome_to_floor"] = rome_t / out["floor_s"]
            if _t(m, "rome_inplace"):
                out["rome_inplace_to_floor"] = _t(m, "rome_inplace") / out["floor_s"]
            # What any method running at the floor would achieve: the ceiling of the speed-ups.
            if _t(m, "small"):
                out["ceiling_vs_small"] = _t(m, "small") / out["floor_s"]
            if baselines:
                out["ceiling_vs_best_other"] = out["best_other_s"] / out["floor_s"]
    if _t(m, "rome_cpp") and _t(m, "floor_cpp"):
        out["rome_cpp_to_floor_cpp"] = _t(m, "rome_cpp") / _t(m, "floor_cpp")
    err = m.get("rome", {}).get("error")
    if err is not None:
        ref = result["fp32_reference_error"]["max_min_abs_rel"]
        out["rome_error"] = err["max_min_abs_rel"]
        out["fp32_reference_error"] = ref
        out["precision_ok"] = err["max_min_abs_rel"] <= ref * (1 + 1e-9) + 1e-30
    if result.get("matrix", "rotate") != "rotate":
        out.update(matrix_path_figures(result))
        out["targets"] = matrix_targets(result, out)
    elif not result["decode"]:
        targets = {}
        if "speedup_vs_small" in out:
            targets["x20_vs_small"] = out["speedup_vs_small"] >= 20
        if "speedup_vs_best_other" in out:
            targets["x2_vs_best_other"] = out["speedup_vs_best_other"] >= 2
        if "rome_to_floor" in out:
            targets["within_1.15_of_floor"] = out["rome_to_floor"] <= 1.15
        if "rome_cpp_to_floor_cpp" in out:
            targets["cpp_within_1.15_of_floor"] = out["rome_cpp_to_floor_cpp"] <= 1.15
        if "precision_ok" in out:
            targets["precision"] = out["precision_ok"]
        out["targets"] = targets
    return out


def matrix_path_figures(result: Dict) -> Dict:
    """Rows run as matrix products: achieved GFLOP/s of the matrix part (x·M on the diagonal
    blocks) and the speed-up over PyTorch's eager x*cos + (x@M)*sin."""
    m, out = result["methods"], {}
    flops = result.get("matrix_flops") or 0
    for key in ("rome", "rome_cpp"):
        if _t(m, key) and flops:
            out[f"{key}_gflops"] = flops / _t(m, key) / 1e9
    if _t(m, "rome") and _t(m, "matrix"):
        out["speedup_vs_matrix"] = _t(m, "matrix") / _t(m, "rome")
    if _t(m, "bare_mm"):
        if result.get("whole_matrix_flops"):  # it multiplies the whole matrix, blocks or not
            out["bare_mm_gflops"] = result["whole_matrix_flops"] / _t(m, "bare_mm") / 1e9
        for key in ("rome", "rome_inplace"):
            if _t(m, key):
                out[f"{key}_to_bare_mm"] = _t(m, key) / _t(m, "bare_mm")
    path = m.get("rome_cpp", {}).get("path")
    if path:
        out["path"] = path
    return out


def matrix_targets(result: Dict, derived: Dict) -> Dict:
    """Dense rows: RoME in place (which allocates nothing, as the bare matmul into its
    preallocated output) no slower than PyTorch's best bare matmul of the same product, on every
    CPU; the matrix-unit targets apply when RoME ran on AMX."""
    isa = result["methods"].get("rome_cpp", {}).get("isa")
    if result.get("matrix") != "orthogonal":
        return {}
    targets = {}
    if "rome_inplace_to_bare_mm" in derived:
        targets["dense_le_bare_matmul"] = derived["rome_inplace_to_bare_mm"] <= 1.0
    if "precision_ok" in derived:
        targets["precision"] = derived["precision_ok"]
    if isa != "amx":
        return targets
    if "rome_to_floor" in derived:
        targets["amx_within_1.3_of_floor"] = derived["rome_to_floor"] <= 1.3
    if "speedup_vs_matrix" in derived:
        targets["amx_x3_vs_torch_matrix"] = derived["speedup_vs_matrix"] >= 3
    return targets


def run(rows: List[Row], cfg: Config) -> Dict:
    malloc_tuned = os.environ.get("ROME_BENCH_SYSTEM_MALLOC") != "1" and keep_freed_memory()
    torch.set_num_threads(cfg.threads)
    import rome

    rome.set_num_threads(cfg.threads)
    timer_path = cpp.find_timer(cfg.timer)
    info = machine(cfg, malloc_tuned, str(timer_path) if timer_path else None)
    progress = Progress(len(rows))
    results = []
    t0 = time.perf_counter()
    try:
        for i, row in enumerate(rows, 1):
            results.append(run_row(row, cfg, timer_path, lambda what, i=i, row=row: progress(i, row, what)))
    finally:
        progress.done()
    return {
        "machine": info,
        "config": {
            "threads": cfg.threads, "repeats": cfg.repeats, "warmup": cfg.warmup,
            "budget_s_per_cell": cfg.budget_s, "cpp_repeats": cfg.cpp_repeats,
            "compile": cfg.compile, "compile_rows": cfg.compile_rows, "quick": cfg.quick,
            "rows": [r.key for r in rows],
        },
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "rows": results,
    }
