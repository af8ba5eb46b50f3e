"""One decode step through transformers' ``apply_rotary_pos_emb`` and its RoME drop-in.

q [1, 32, 1, 128] and k [1, 8, 1, 128] bf16 with bf16 cos/sin [1, 1, 128] (Llama-style shapes,
what a decode step hands over), in inference mode: transformers' own formula
(``q * cos + rotate_half(q) * sin``), ``rome.hf.apply_rotary_pos_emb`` (its checks, the dtype
promotion and the op) and ``torch.ops.rome.rope`` alone. Medians of samples of 500 calls each, 1
and 2 threads with torch.set_num_threads; output allocation (as in the model) included.
"""

from typing import Callable, Dict

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
    return "\n".join(lines) + "\n"
