"""Terminal table, Markdown, CSV, JSON and the PNG chart."""

import csv
import json
import math
from pathlib import Path
from typing import Dict, List, Optional

from .runner import BASELINES, LABELS

TIME_COLUMNS = ["small", "axis_matrix", "matrix", "compile_small", "compile_matrix", "ort", "bare_mm",
                "rome", "rome_inplace", "rome_cpp", "floor", "floor_cpp"]
PRECISION_COLUMNS = ["small", "axis_matrix", "matrix", "compile_small", "compile_matrix", "ort", "rome",
                     "rome_inplace"]
SHORT = {
    "small": "small ops", "axis_matrix": "axis mats", "matrix": "matrix", "compile_small": "cmp small",
    "compile_matrix": "cmp matrix", "ort": "ORT fp16", "bare_mm": "bare mm", "rome": "RoME",
    "rome_inplace": "RoME inpl", "rome_cpp": "RoME C++", "floor": "floor", "floor_cpp": "floor C++",
}
TARGET_TEXT = {
    "x20_vs_small": ">= 20x faster than small ops",
    "x2_vs_best_other": ">= 2x faster than the best other method",
    "within_1.15_of_floor": "RoME (torch op) within 1.15x of the floor (the faster copy)",
    "cpp_within_1.15_of_floor": "RoME C++ within 1.15x of the floor C++ (same process)",
    "precision": "precision <= fp32 matrix reference rounded to bf16",
    "dense_le_bare_matmul": "dense rows: RoME in place <= 1.0x PyTorch's best bare matmul x @ M",
    "amx_within_1.3_of_floor": "dense rows on AMX: RoME within 1.3x of the floor",
    "amx_x3_vs_torch_matrix": "dense rows on AMX: >= 3x faster than PyTorch eager x*cos + (x@M)*sin",
}


def _time(entry: Dict, decode: bool) -> str:
    t = entry.get("median_s")
    if t is None:
        return "n/a"
    if decode:
        return f"{t * 1e6:.1f}"
    ms = t * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _x(v: Optional[float], suffix="x") -> str:
    if v is None:
        return "-"
    return f"{v:.0f}{suffix}" if v >= 100 else f"{v:.1f}{suffix}" if v >= 10 else f"{v:.2f}{suffix}"


def _err(entry: Dict) -> str:
    e = entry.get("error")
    if e is None:
        return "n/a" if "na" in entry else "-"
    return f"{e['max_min_abs_rel']:.1e}"


def time_table(results: Dict) -> (List[str], List[List[str]]):
    header = ["row", "unit"] + [SHORT[k] for k in TIME_COLUMNS] + ["x small", "x best", "best other",
                                                                   "RoME/floor", "C++/floor"]
    body = []
    for r in results["rows"]:
        m, d = r["methods"], r["derived"]
        unit = "µs" if r["decode"] else "ms"
        body.append([r["title"], unit] + [_time(m.get(k, {}), r["decode"]) for k in TIME_COLUMNS] + [
            _x(d.get("speedup_vs_small")), _x(d.get("speedup_vs_best_other")),
            SHORT.get(d.get("best_other"), "-"), _x(d.get("rome_to_floor")), _x(d.get("rome_cpp_to_floor_cpp")),
        ])
    return header, body


def precision_table(results: Dict) -> (List[str], List[List[str]]):
    header = ["row"] + [SHORT[k] for k in PRECISION_COLUMNS] + ["fp32 ref->bf16", "RoME ok"]
    body = []
    for r in results["rows"]:
        m, d = r["methods"], r["derived"]
        ok = d.get("precision_ok")
        body.append([r["title"]] + [_err(m.get(k, {})) for k in PRECISION_COLUMNS] + [
            f"{r['fp32_reference_error']['max_min_abs_rel']:.1e}", "-" if ok is None else ("yes" if ok else "NO")])
    return header, body


def matrix_table(results: Dict) -> (List[str], List[List[str]]):
    """Rows run as matrix products: which path, GFLOP/s of the matrix part, ratios."""
    header = ["row", "RoME path (ISA)", "GFLOP/s torch op", "GFLOP/s C++", "GFLOP/s bare mm",
              "RoME/bare mm", "inpl/bare mm", "RoME/floor", "x torch matrix", "vs permute path"]
    body = []
    by_key = {r["row"]: r for r in results["rows"]}
    for r in results["rows"]:
        if r.get("matrix", "rotate") == "rotate":
            continue
        d, m = r["derived"], r["methods"]
        cpp = m.get("rome_cpp", {})
        path = f"{d.get('path', '?')} ({cpp.get('isa', '?')})"
        versus = "-"
        base = by_key.get(r["row"].replace("forced_", ""))
        if r.get("matrix") == "forced" and base and base["methods"].get("rome", {}).get("median_s") \
                and m.get("rome", {}).get("median_s"):
            versus = _x(m["rome"]["median_s"] / base["methods"]["rome"]["median_s"]) + " slower"
        g = lambda k: f"{d[k]:.1f}" if k in d else "-"  # noqa: E731
        body.append([r["title"], path, g("rome_gflops"), g("rome_cpp_gflops"), g("bare_mm_gflops"),
                     _x(d.get("rome_to_bare_mm")), _x(d.get("rome_inplace_to_bare_mm")),
                     _x(d.get("rome_to_floor")), _x(d.get("speedup_vs_matrix")), versus])
    return header, body


def _matrix_note(results: Dict) -> List[str]:
    h, b = matrix_table(results)
    if not b:
        return []
    isa = results["machine"].get("isa")
    why = ("AMX tiles" if isa == "amx" else
           f"no AMX on this CPU (ISA {isa}): the FMA path, so the AMX targets are not evaluated here")
    return [f"Matrix path ({why}); GFLOP/s counts x·M on the diagonal blocks only (bare mm: the "
            "whole matrix it multiplies):", _plain(h, b), ""]


def _plain(header, body) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body])


def _markdown(header, body) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(str(c) for c in b) + " |" for b in body]
    return "\n".join(out)


def machine_lines(results: Dict) -> List[str]:
    mc, cfg = results["machine"], results["config"]
    return [
        f"CPU: {mc['cpu']} ({mc['cores']} cores, {mc['memory_gib']} GiB); RoME ISA: {mc['isa']} "
        f"(detected {mc['detected_isa']}, compiled {', '.join(mc['compiled_isas'] or [])})",
        f"threads: {mc['threads']} (torch, RoME, ONNX Runtime, rome_timer); torch {mc['torch']}; "
        f"onnxruntime {mc['onnxruntime']}; python {mc['python']}",
        f"load average (1, 5, 15 min) at start: {', '.join(str(x) for x in mc['load_average_at_start'])}, "
        f"at end: {', '.join(str(x) for x in results.get('load_average_at_end', []))}; malloc: {mc['malloc']}; "
        f"{mc.get('memmove', 'glibc threshold not recorded')}",
        f"repeats: {cfg['repeats']} per cell, columns timed round-robin (median after {cfg['warmup']} "
        f"warm-up calls; slow cells stop at {cfg['budget_s_per_cell']} s, >= 3 repeats), rome_timer "
        f"repeats: {cfg['cpp_repeats']}; "
        f"torch.compile: {'on' if cfg['compile'] else 'off'}; rome_timer: {mc['rome_timer']}",
        f"{mc['date']}; wall time {results.get('wall_s', '?')} s",
    ] + _load_warning(results)


def _load_warning(results: Dict) -> List[str]:
    """Other processes on these cores make every column slower and noisier (a descheduled thread
    of a 2-thread parallel region stalls the whole region for a scheduler tick). The 1-minute
    load average before the run should be near 0; at the end it includes this benchmark's own
    threads."""
    mc = results["machine"]
    cores = mc.get("cores") or 1
    start = mc["load_average_at_start"][0]
    end = (results.get("load_average_at_end") or [0.0])[0]
    if start > 1.0 or end > results["config"]["threads"] + 0.75:
        return [f"WARNING: load average {start:.1f} at start, {end:.1f} at end on {cores} cores: other "
                "processes were running; timings are inflated and noisy. Re-run on an idle machine."]
    return []


def notes(results: Dict) -> List[str]:
    lines = [
        "Times: median per call, ms (decode row: µs). x = x [1, 24, S, 128] bf16 BNSD unless the row says "
        "otherwise; RoME gets fp32 tables, the PyTorch columns bf16 tables and bf16 math (as transformers "
        "and vLLM's native path ship), ONNX Runtime fp16 (its CPU RotaryEmbedding has no bf16 kernel).",
        "floor = memcpy of x into a preallocated y plus one read of RoME's fp32 table rows, split over "
        "the same threads, in the benchmark process; floor C++ = the same in rome_timer's process (the "
        "process of RoME C++), or there a copy with non-temporal stores when that is faster (below its "
        "non-temporal threshold glibc's memcpy uses ordinary stores, reading every destination line "
        "first). RoME/floor = RoME (torch op, out of place) / the faster of the two floors; C++/floor "
        "= RoME C++ / floor C++ (one process).",
        "x small = small ops / RoME; x best = best non-RoME column / RoME (best other names it).",
        "Precision: max over elements of min(abs err, rel err) against a float64 reference, on a slice: "
        + (results["rows"][0]["precision_slice"] if results["rows"] else "") + " (per row). "
        "fp32 ref->bf16 is the fp32 matrix form rounded once to bf16 (RoME's target).",
    ]
    seen = {}
    for r in results["rows"]:
        for k, e in r["methods"].items():
            text = e.get("na")
            if text:
                seen.setdefault(f"{LABELS.get(k, k)} n/a: {text}", []).append(r["title"])
    for k in ("ort", "small", "compile_small"):
        for r in results["rows"]:
            e = r["methods"].get(k, {})
            if e.get("note"):
                seen.setdefault(f"{LABELS[k]}: {e['note']}", []).append(r["title"])
    for text, rows in seen.items():
        lines.append(f"{text} ({'; '.join(rows)})")
    return lines


def targets_lines(results: Dict) -> List[str]:
    out = []
    for key, text in TARGET_TEXT.items():
        rows = [r for r in results["rows"] if key in r["derived"].get("targets", {})]
        if not rows:
            continue
        missed = [r for r in rows if not r["derived"]["targets"][key]]
        status = "met on every large row" if not missed else f"MISSED on {len(missed)} of {len(rows)} rows"
        detail = ""
        if key == "x20_vs_small":
            detail = _range(rows, "speedup_vs_small", "x")
        elif key == "x2_vs_best_other":
            detail = _range(rows, "speedup_vs_best_other", "x")
        elif key == "within_1.15_of_floor":
            detail = _range(rows, "rome_to_floor", "x floor")
        elif key == "cpp_within_1.15_of_floor":
            detail = _range(rows, "rome_cpp_to_floor_cpp", "x floor")
        elif key == "dense_le_bare_matmul":
            detail = _range(rows, "rome_inplace_to_bare_mm", "x bare matmul")
        elif key == "precision":
            worst = max(r["derived"]["rome_error"] / max(r["derived"]["fp32_reference_error"], 1e-300) for r in rows)
            detail = f"worst RoME error / fp32-ref error = {worst:.2f}"
        out.append(f"- {text}: {status} ({detail})")
        if missed:
            measured, ceiling, unit = MISSED_DETAIL.get(key, (None, None, ""))
            parts = []
            for r in missed:
                d = r["derived"]
                if measured and measured in d:
                    extra = f" (at the floor: {d[ceiling]:.1f}{unit})" if ceiling and ceiling in d else ""
                    parts.append(f"{r['title']}: {d[measured]:.2f}{unit}{extra}")
                else:
                    parts.append(r["title"])
            out.append("  missed: " + "; ".join(parts))
    return out


# For a missed target: the measured value and, where it applies, what a method running exactly at
# the floor would reach (a speed-up can never exceed other / floor).
MISSED_DETAIL = {
    "x20_vs_small": ("speedup_vs_small", "ceiling_vs_small", "x"),
    "x2_vs_best_other": ("speedup_vs_best_other", "ceiling_vs_best_other", "x"),
    "within_1.15_of_floor": ("rome_to_floor", None, "x"),
    "cpp_within_1.15_of_floor": ("rome_cpp_to_floor_cpp", None, "x"),
    "dense_le_bare_matmul": ("rome_inplace_to_bare_mm", None, "x"),
}


def _range(rows, key, unit) -> str:
    vals = [r["derived"][key] for r in rows if key in r["derived"]]
    return f"{min(vals):.2f} to {max(vals):.2f}{unit}" if vals else "n/a"


def terminal(results: Dict) -> str:
    h, b = time_table(results)
    ph, pb = precision_table(results)
    parts = ["RoME benchmark", *machine_lines(results), "", "Time per call (ms; decode: µs)", _plain(h, b), "",
             "Precision: max min(abs, rel) error vs float64", _plain(ph, pb), "", *_matrix_note(results),
             "Targets (large rows):",
             *targets_lines(results), "", "Notes:", *("- " + n for n in notes(results))]
    return "\n".join(parts)


def markdown(results: Dict, png_name: Optional[str] = None) -> str:
    h, b = time_table(results)
    ph, pb = precision_table(results)
    parts = ["# RoME benchmark", "", *("- " + line for line in machine_lines(results)), "",
             "## Time per call (ms; decode row: µs)", "", _markdown(h, b), "",
             "## Precision (max over elements of min(abs err, rel err) vs float64)", "", _markdown(ph, pb), "",
             *_matrix_markdown(results),
             "## Targets (large rows)", "", *targets_lines(results), "", "## Notes", "",
             *("- " + n for n in notes(results)), ""]
    if png_name:
        parts += [f"![time per method per row]({png_name})", ""]
    return "\n".join(parts)


def _matrix_markdown(results: Dict) -> List[str]:
    h, b = matrix_table(results)
    if not b:
        return []
    lines = _matrix_note(results)
    return ["## Matrix path", "", lines[0], "", _markdown(h, b), ""]


def write_csv(results: Dict, path: Path):
    fields = ["row", "title", "shape", "method", "label", "median_ms", "min_ms", "repeats", "inner",
              "err_max_min_abs_rel", "err_max_abs", "err_max_rel", "err_bound", "compile_s", "note", "na"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in results["rows"]:
            for k, e in r["methods"].items():
                err = e.get("error") or {}
                w.writerow({
                    "row": r["row"], "title": r["title"], "shape": r["shape"], "method": k, "label": e.get("label", k),
                    "median_ms": None if e.get("median_s") is None else e["median_s"] * 1e3,
                    "min_ms": None if e.get("min_s") is None else e["min_s"] * 1e3,
                    "repeats": e.get("repeats"), "inner": e.get("inner"),
                    "err_max_min_abs_rel": err.get("max_min_abs_rel"), "err_max_abs": err.get("max_abs"),
                    "err_max_rel": err.get("max_rel"), "err_bound": e.get("error_bound"),
                    "compile_s": e.get("compile_s"), "note": e.get("note", ""), "na": e.get("na", ""),
                })


def write_png(results: Dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [k for k in TIME_COLUMNS if any(r["methods"].get(k, {}).get("median_s") for r in results["rows"])]
    big = [r for r in results["rows"] if not r["decode"]]
    small = [r for r in results["rows"] if r["decode"]]
    colors = {
        "small": "#d62728", "axis_matrix": "#ff9896", "matrix": "#ff7f0e", "compile_small": "#9467bd",
        "compile_matrix": "#c5b0d5", "ort": "#8c564b", "bare_mm": "#7f7f7f", "rome": "#1f77b4",
        "rome_inplace": "#aec7e8", "rome_cpp": "#17becf", "floor": "#2ca02c", "floor_cpp": "#98df8a",
    }
    panels = [(big, 1e3, "ms per call (log)")] + ([(small, 1e6, "µs per call (log)")] if small else [])
    widths = [max(1, len(p[0])) * 1.0 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 + 1.6 * sum(widths), 6.5),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    n = len(methods)
    bar = 0.8 / max(n, 1)
    for ax, (rows, scale, unit) in zip(axes[0], panels):
        for j, k in enumerate(methods):
            xs, ys = [], []
            for i, r in enumerate(rows):
                t = r["methods"].get(k, {}).get("median_s")
                if t:
                    xs.append(i - 0.4 + bar * (j + 0.5))
                    ys.append(t * scale)
            ax.bar(xs, ys, width=bar, color=colors.get(k), label=LABELS[k], edgecolor="black", linewidth=0.3)
        ax.set_yscale("log")
        ax.set_ylabel(unit)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["title"].replace(", ", "\n").replace(" (", "\n(") for r in rows], fontsize=8)
        ax.set_axisbelow(True)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.set_xlim(-0.5, len(rows) - 0.5)
    mc = results["machine"]
    fig.suptitle(f"RoME vs other RoPE implementations — {mc['cpu']}, {mc['threads']} threads, "
                 f"ISA {mc['isa']}, torch {mc['torch']} (lower is better)", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(results: Dict, out_dir: Path) -> Dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"bench.{ext}" for ext in ("md", "csv", "json", "png")}
    try:
        write_png(results, paths["png"])
    except Exception as e:  # matplotlib missing: everything else still gets written
        paths.pop("png")
        results.setdefault("warnings", []).append(f"no chart: {e}")
    paths["md"].write_text(markdown(results, paths["png"].name if "png" in paths else None))
    write_csv(results, paths["csv"])
    paths["json"].write_text(json.dumps(results, indent=1, default=_json_default))
    return paths


def _json_default(o):
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if hasattr(o, "item"):
        return o.item()
    return str(o)


__all__ = ["terminal", "markdown", "save", "BASELINES"]
