"""One decode step through transformers' ``apply_rotary_pos_emb`` and its RoME drop-in.

q [1, 32, 1, 128] and k [1, 8, 1, 128] bf16 with bf16 cos/sin [1, 1, 128] (Llama-style shapes,
what a decode step hands over), in inference mode: transformers' own formula
(``q * cos + rotate_half(q) * sin``), ``rome.hf.apply_rotary_pos_emb`` (its checks, the dtype
promotion and the op) and ``torch.ops.rome.rope`` alone. Medians of samples of 500 calls each, 1
and 2 threads with torch.set_num_threads; output allocation (as in the model) included.

Then the same step through each RoPE form rome.hf.patch_module serves beyond Llama's (one
transformers modeling module per form: up-casting, interleaved, half-width tables, MLA, ...):
the module's own function against the function patch_module puts in its place.
"""

import importlib
import warnings
from typing import Callable, Dict, List, Tuple

import torch

import rome
import rome.hf

from .measure import median_per_call_s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _transformers(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _median_us(fn: Callable[[], object], samples: int, inner: int = 500) -> float:
    return median_per_call_s(fn, samples, inner) * 1e6


# (modeling module, function, table width as a fraction of D): one module per form.
_FORM_MODULES: Tuple[Tuple[str, str, int], ...] = (
    ("olmo2", "apply_rotary_pos_emb", 1),             # Llama's, each result in its own dtype
    ("modernbert", "apply_rotary_pos_emb", 1),        # fp32 math, q's dtype
    ("cohere", "apply_rotary_pos_emb", 1),            # pairs, fp32 math
    ("helium", "apply_rotary_pos_emb", 1),            # pairs from a NeoX-layout table
    ("glm", "apply_rotary_pos_emb", 2),               # the same, partial rotary
    ("gpt_oss", "apply_rotary_pos_emb", 2),           # half rotation, D/2-wide tables
    ("nanochat", "apply_rotary_pos_emb", 1),          # rotation by -angle
    ("deepseek_v3", "apply_rotary_pos_emb_interleave", 1),  # MLA de-interleave
)


def _form_rows(q, k, cos, sin, samples: int, inner: int) -> List[Dict]:
    rows = []
    for family, name, narrow in _FORM_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except Exception as exc:  # another transformers version
            rows.append({"module": family, "error": f"{type(exc).__name__}: {exc}"[:120]})
            continue
        original = module.__dict__.get(name)
        width = cos.shape[-1] // narrow
        args = (q, k, cos[..., :width], sin[..., :width])
        handle = rome.hf.patch_module(module)
        try:
            replacement = module.__dict__.get(name)
            if original is None or replacement is original:
                rows.append({"module": family, "error": f"{name} not patched ({handle.skipped})"})
                continue
            rows.append({"module": family, "function": name,
                         "transformers": _median_us(lambda: original(*args), samples, inner),
                         "rome": _median_us(lambda: replacement(*args), samples, inner)})
        finally:
            handle.undo()
    return rows


def run(quick: bool = False, threads_list=(1, 2), progress: Callable[[str], None] = print) -> Dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g).bfloat16()
    k = torch.randn(1, 8, 1, 128, generator=g).bfloat16()
    cos = torch.randn(1, 1, 128, generator=g).bfloat16()
    sin = torch.randn(1, 1, 128, generator=g).bfloat16()
    c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)
    samples = 3 if quick else 9
    saved = torch.get_num_threads()
    rows = []
    try:
        with torch.inference_mode():
            for threads in threads_list:
                torch.set_num_threads(threads)
                progress(f"HF decode step, {threads} thread(s)")
                rows.append({
                    "threads": threads,
                    "transformers": _median_us(lambda: _transformers(q, k, cos, sin), samples),
                    "rome_hf": _median_us(lambda: rome.hf.apply_rotary_pos_emb(q, k, cos, sin),
                                          samples),
                    "op": _median_us(lambda: torch.ops.rome.rope.default(
                        q, k, c4, s4, None, "half", [], 128, "full", [], None, None), samples),
                    # --quick (CI): the forms on the first thread count, shorter samples.
                    "forms": ([] if quick and threads != threads_list[0] else
                              _form_rows(q, k, cos, sin, samples, 100 if quick else 500)),
                })
    finally:
        torch.set_num_threads(saved)
    return {"rows": rows, "isa": rome.active_isa()}


def markdown(res: Dict) -> str:
    lines = [
        f"### One decode step through the transformers drop-in ({res['isa']}; q [1, 32, 1, 128] + "
        "k [1, 8, 1, 128] bf16, µs per call)",
        "",
        "| threads | transformers' formula | rome.hf.apply_rotary_pos_emb | torch.ops.rome.rope alone |",
        "|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['threads']} | {r['transformers']:.1f} | {r['rome_hf']:.1f} | {r['op']:.1f} |")
    lines += [
        "",
        "The same step through the other forms rome.hf.patch_module serves (the module's own "
        "function vs its replacement; µs per call, ratio = RoME / transformers, target ≤ 0.5):",
        "",
        "| module (function) | threads | transformers | RoME | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        for f in r.get("forms", []):
            if "error" in f:
                lines.append(f"| {f['module']} | {r['threads']} | {f['error']} | | |")
                continue
            lines.append(f"| {f['module']} ({f['function']}) | {r['threads']} | "
                         f"{f['transformers']:.1f} | {f['rome']:.1f} | "
                         f"{f['rome'] / f['transformers']:.2f} |")
    return "\n".join(lines) + "\n"
