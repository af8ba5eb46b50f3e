"""Fused passes against the separate ones (Qwen3-8B attention shapes: Hq 32, Hk = Hv 8, D 128,
bf16; T = 1, 16, 512, 4096 tokens; fp32 cos_sin_cache [8192, 128]; paged cache of 16-slot blocks).

- QK-norm + RoPE on a packed qkv [T, 48·128] in place: ``fused_qk_norm_rope`` (with the fp32
  cache, and with the cache in the model's dtype as vLLM's RotaryEmbedding holds it) against
  ``F.rms_norm`` of q and k followed by RoME's ``rotary_embedding`` (separate passes), and against
  eager PyTorch (``F.rms_norm`` + transformers' rotate_half formula, gathered cos/sin).
- RoPE + KV-cache write: ``rotary_embedding_with_cache`` (with and without QK-norm) against
  RoME's ``rotary_embedding`` + ``index_copy_`` of k and v into the cache, and against eager
  PyTorch (formula + ``index_copy_``).

Floors: a copy of the bytes each pass must move at least once (norm + RoPE: q and k read and
written; with the cache: also k and v written to the cache), the faster of torch's ``copy_`` and
memmove (streaming above 3/4 of the L3 under ``python -m rome.bench``: glibc_streaming.py). Timed round-robin in one process with torch.set_num_threads; decode sizes run 200 calls
per sample. Input allocation is outside the timings; the eager baselines allocate their
temporaries (as they would in a model).
"""

import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import rome

from .layouts import Memmove, _median_round_robin

HQ, HK, HV, D = 32, 8, 8, 128
TOKENS = (1, 16, 512, 4096)


def _cache(rows: int = 8192) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(rows, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], -1).float()


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def cell(tokens: int, threads: int, repeats: int, memmove: Memmove, inner_small: int = 200) -> Dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(tokens)
    cache = _cache()
    cache_bf16 = cache.to(torch.bfloat16)  # vLLM's RotaryEmbedding casts its cache to the model dtype
    positions = torch.randint(0, 8192, (tokens,), generator=g)
    qkv = torch.randn(tokens, (HQ + HK + HV) * D, generator=g).to(torch.bfloat16)
    # Unit weights: the in-place ops run again and again on the same qkv, and with lane weights
    # of 0.5-1.5 norm + rotation acted as a power iteration, driving most lanes to bf16
    # subnormals within a few hundred calls (on the AMX Xeon, fused_qk_norm_rope at T = 1 took
    # 84 us on such data against 9 us on fresh data: every op on the same qkv was timing
    # microcode assists). The kernels' cost does not depend on the weights' values.
    wq = torch.ones(D, dtype=torch.bfloat16)
    wk = torch.ones(D, dtype=torch.bfloat16)
    blocks = max(4, (tokens + 15) // 16 * 2)
    kc = torch.zeros(blocks, 16, HK, D, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * 16, generator=g)[:tokens]
    q, k, v = qkv.split([HQ * D, HK * D, HV * D], dim=-1)
    query, key, value = q.contiguous(), k.contiguous(), v.contiguous()
    kc_flat, vc_flat = kc.view(-1, HK * D), vc.view(-1, HV * D)
    # Eager tables as transformers' rotary module hands them over ([T, 1, D] per token).
    c_full = torch.cat([cache[positions, : D // 2]] * 2, -1)[:, None].to(torch.bfloat16)
    s_full = torch.cat([cache[positions, D // 2:]] * 2, -1)[:, None].to(torch.bfloat16)

    def fused_norm():
        rome.ops.fused_qk_norm_rope(qkv, HQ, HK, HV, D, 1e-6, wq, wk, cache, True, positions)

    def fused_norm_bf16():
        rome.ops.fused_qk_norm_rope(qkv, HQ, HK, HV, D, 1e-6, wq, wk, cache_bf16, True, positions)

    def separate_norm():
        qn = F.rms_norm(q.view(tokens, HQ, D), (D,), wq, 1e-6)
        kn = F.rms_norm(k.view(tokens, HK, D), (D,), wk, 1e-6)
        rome.ops.rotary_embedding(positions, qn, kn, D, cache, True)

    def eager_norm():
        qn = F.rms_norm(q.view(tokens, HQ, D), (D,), wq, 1e-6)
        kn = F.rms_norm(k.view(tokens, HK, D), (D,), wk, 1e-6)
        _hf_rope(qn, c_full, s_full)
        _hf_rope(kn, c_full, s_full)

    def fused_cache():
        rome.ops.rotary_embedding_with_cache(positions, query, key, value, D, cache, True, kc, vc,
                                             slots)

    def fused_norm_cache():
        rome.ops.rotary_embedding_with_cache(positions, query, key, value, D, cache, True, kc, vc,
                                             slots, wq, wk, 1e-6)

    def separate_cache():
        rome.ops.rotary_embedding(positions, query, key, D, cache, True)
        kc_flat.index_copy_(0, slots, key)
        vc_flat.index_copy_(0, slots, value)

    def eager_cache():
        qr = _hf_rope(query.view(tokens, HQ, D), c_full, s_full)
        kr = _hf_rope(key.view(tokens, HK, D), c_full, s_full)
        kc_flat.index_copy_(0, slots, kr.view(tokens, -1))
        vc_flat.index_copy_(0, slots, value)
        return qr

    es = 2
    qk_bytes = tokens * (HQ + HK) * D * es
    cache_bytes = qk_bytes + tokens * (HK + HV) * D * es
    src_a, dst_a = torch.empty(qk_bytes, dtype=torch.uint8), torch.empty(qk_bytes, dtype=torch.uint8)
    src_b = torch.empty(cache_bytes, dtype=torch.uint8)
    dst_b = torch.empty(cache_bytes, dtype=torch.uint8)
    mm_a, mm_b = memmove.copier(qk_bytes, threads), memmove.copier(cache_bytes, threads)
    fns = {"fused_norm": fused_norm, "fused_norm_bf16": fused_norm_bf16,
           "separate_norm": separate_norm, "eager_norm": eager_norm,
           "fused_cache": fused_cache, "fused_norm_cache": fused_norm_cache,
           "separate_cache": separate_cache, "eager_cache": eager_cache,
           "copy_a": lambda: dst_a.copy_(src_a), "memmove_a": mm_a,
           "copy_b": lambda: dst_b.copy_(src_b), "memmove_b": mm_b}
    inner = inner_small if tokens <= 16 else 1
    if inner > 1:
        fns = {key: (lambda f=f: [f() for _ in range(inner)]) for key, f in fns.items()}
    t = _median_round_robin(fns, repeats if inner == 1 else max(repeats, 9), warmup=2)
    t = {key: value / inner for key, value in t.items()}
    t["floor_norm"] = min(t.pop("copy_a"), t.pop("memmove_a"))
    t["floor_cache"] = min(t.pop("copy_b"), t.pop("memmove_b"))
    return {"tokens": tokens, "threads": threads, **t}


def run(quick: bool = False, threads_list=(1, 2), repeats: int = 0,
        progress: Callable[[str], None] = print) -> Dict:
    tokens_list = (1, 16, 256) if quick else TOKENS
    repeats = repeats or (3 if quick else 7)
    memmove = Memmove()
    saved = torch.get_num_threads()
    start = time.perf_counter()
    cells: List[Dict] = []
    try:
        for tokens in tokens_list:
            for threads in threads_list:
                progress(f"fused passes: T={tokens}, {threads} thread(s)")
                # --quick (CI): 20 calls per sample for the small T instead of 200.
                cells.append(cell(tokens, threads, repeats, memmove, 20 if quick else 200))
    finally:
        torch.set_num_threads(saved)
    return {"cells": cells, "isa": rome.active_isa(), "wall_s": round(time.perf_counter() - start, 1)}


def _fmt(t: float, floor: float) -> str:
    unit = f"{t * 1e6:.1f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms"
    return f"{t / floor:.2f}x ({unit})" if floor > 0 else unit


def markdown(res: Dict) -> str:
    lines = [
        f"### Fused passes vs separate ones ({res['isa']}; Hq 32, Hk = Hv 8, D 128, bf16)",
        "",
        "QK-norm + RoPE in place on a packed qkv; ratio to the copy of q and k (time in brackets).",
        "",
        "| T | threads | floor | fused_qk_norm_rope | same, bf16 cache | rms_norm + RoME rope | "
        "eager (rms_norm + HF rope) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["cells"]:
        f = c["floor_norm"]
        lines.append(f"| {c['tokens']} | {c['threads']} | {_fmt(f, 0)} | {_fmt(c['fused_norm'], f)} | "
                     f"{_fmt(c['fused_norm_bf16'], f)} | {_fmt(c['separate_norm'], f)} | "
                     f"{_fmt(c['eager_norm'], f)} |")
    lines += [
        "",
        "RoPE + paged KV-cache write; ratio to the copy of q, k and of k, v into the cache.",
        "",
        "| T | threads | floor | rotary_embedding_with_cache | + QK-norm | RoME rope + index_copy_ | "
        "eager (HF rope + index_copy_) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["cells"]:
        f = c["floor_cache"]
        lines.append(f"| {c['tokens']} | {c['threads']} | {_fmt(f, 0)} | {_fmt(c['fused_cache'], f)} | "
                     f"{_fmt(c['fused_norm_cache'], f)} | {_fmt(c['separate_cache'], f)} | "
                     f"{_fmt(c['eager_cache'], f)} |")
    return "\n".join(lines) + "\n"
