"""The executor study: RoME against a copy of the same bytes on every layout a user meets
(BNSD, BSND, packed q/k slices of a fused qkv buffer), in place and out of place into
preallocated outputs, on 1 and on 2 threads set the way a PyTorch user sets them
(torch.set_num_threads), plus vLLM's own contract (prefill and decode).

Every cell is timed in this process, round-robin with its floor: the faster of torch's copy_ and
glibc's memmove (on as many Python threads, ctypes releases the GIL) of the same x bytes into a
preallocated buffer. ``python -m rome.bench`` runs with memmove streaming above 3/4 of the L3
(glibc_streaming.py: without it, glibc on a VM that reports its host's L3 read every destination
line of a copy up to 192 MB, and the floor was 1.5x what the memory allows). The floor leaves out the table reads (RoME reads them too), so ratios are
slightly pessimistic for RoME. Out-of-place RoME writes into preallocated outputs
(rome.ops.rope(out=...)); the "fresh" column is the allocating op in this process's default
allocator, page faults included (what a plain `y = rope(x)` pays).
"""

import ctypes
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

import rome

from . import glibc_streaming
from .measure import round_robin_samples
from .rows import axis_angles, lane_layout

HEAD = 128


@dataclass
class Variant:
    key: str
    title: str
    rotation: str  # rome rotation
    blocks: List[int] = field(default_factory=list)
    rotary_dim: int = -1
    cache: bool = False  # positions into a [P, 128] cache instead of direct tables
    table_free: bool = False  # positions and frequencies, no table (rope_from_positions)
    x_dtype: torch.dtype = torch.bfloat16
    table_dtype: torch.dtype = torch.float32


DEFAULT_VARIANTS = [
    Variant("half", "half 1D", "half"),
    Variant("interleave", "interleave 1D", "interleave"),
    Variant("half_3d", "half 3D 44/44/40", "half", [44, 44, 40]),
    Variant("wan_3d", "interleave 3D 44/42/42", "interleave", [44, 42, 42]),
    Variant("positions", "half 1D, positions", "half", cache=True),
    # The same positions, cos/sin computed in the kernel (no out= form: that column is empty).
    Variant("table_free", "half 1D, table-free", "half", table_free=True),
    # What transformers' rotary modules and vLLM's cos_sin_cache hand over in a bf16 model.
    Variant("half_bf16_tables", "half 1D, bf16 tables", "half", table_dtype=torch.bfloat16),
]
FULL_VARIANTS = DEFAULT_VARIANTS + [
    Variant("quarter", "quarter", "quarter"),
    Variant("half_2d", "half 2D 64+64", "half", [64, 64]),
    Variant("partial", "half, partial 64 of 128", "half", rotary_dim=64),
    Variant("interleave_half", "interleave-half (MLA)", "interleave_half"),
    Variant("half_fp16", "half 1D, fp16 x", "half", x_dtype=torch.float16),
    Variant("half_fp16_tables", "half 1D, fp16 x and tables", "half", x_dtype=torch.float16,
            table_dtype=torch.float16),
    Variant("half_fp32", "half 1D, fp32 x", "half", x_dtype=torch.float32),
]
LAYOUTS = ["bnsd", "bsnd", "packed"]


# ------------------------------------------------------------------------------------------------
# Floors


class Memmove:
    def __init__(self):
        libc = ctypes.CDLL(None)
        self.fn = libc.memmove
        self.fn.restype = ctypes.c_void_p
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    def copier(self, nbytes: int, threads: int) -> Callable[[], None]:
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        dst.fill_(2)
        pieces = max(1, min(threads, nbytes // (256 << 10)))
        spans = [(src.data_ptr() + nbytes * i // pieces, dst.data_ptr() + nbytes * i // pieces,
                  nbytes * (i + 1) // pieces - nbytes * i // pieces) for i in range(pieces)]
        pool = ThreadPoolExecutor(pieces) if pieces > 1 else None
        keep = (src, dst)

        def run():
            _ = keep
            if pool is None:
                self.fn(spans[0][1], spans[0][0], spans[0][2])
            else:
                list(pool.map(lambda s: self.fn(s[1], s[0], s[2]), spans))

        return run


# ------------------------------------------------------------------------------------------------
# Inputs


def _tables(v: Variant, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """[tokens, rotary_dim] per-lane tables (fp64 math, then the variant's dtype)."""
    rd = HEAD if v.rotary_dim < 0 else v.rotary_dim
    dims = v.blocks or [rd]
    mode = "half" if v.rotation in ("half", "quarter", "interleave_half") else "interleave"
    pos = torch.arange(tokens)
    cos = torch.cat([lane_layout(torch.cos(axis_angles(pos, d)), mode) for d in dims], dim=-1)
    sin = torch.cat([lane_layout(torch.sin(axis_angles(pos, d)), mode) for d in dims], dim=-1)
    return cos.to(v.table_dtype), sin.to(v.table_dtype)


@dataclass
class Case:
    q: torch.Tensor
    k: Optional[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    kwargs: Dict
    views: Callable[[torch.Tensor], Tuple[torch.Tensor, Optional[torch.Tensor]]]  # buffer -> (q, k)
    buffer: torch.Tensor  # what q and k are views of


def make_case(v: Variant, layout: str, tokens: int, heads: int, k_heads: int) -> Case:
    g = torch.Generator().manual_seed(0)
    cos, sin = _tables(v, tokens)
    kwargs: Dict = dict(rotation=v.rotation, blocks=v.blocks, rotary_dim=v.rotary_dim)
    if layout == "bnsd":
        buffer = torch.randn(1, heads, tokens, HEAD, generator=g).to(v.x_dtype)
        views = lambda b: (b, None)  # noqa: E731
    elif layout == "bsnd":
        buffer = torch.randn(1, tokens, heads, HEAD, generator=g).to(v.x_dtype)
        views = lambda b: (b, None)  # noqa: E731
        cos, sin = cos[None, :, None], sin[None, :, None]
    else:  # q and k slices of a fused [T, (Hq + 2 Hk) * D] buffer
        buffer = torch.randn(tokens, (heads + 2 * k_heads) * HEAD, generator=g).to(v.x_dtype)

        def views(b):
            return (b[:, : heads * HEAD].view(tokens, heads, HEAD),
                    b[:, heads * HEAD : (heads + k_heads) * HEAD].view(tokens, k_heads, HEAD))

        cos, sin = cos[:, None], sin[:, None]
    q, k = views(buffer)
    shape = [1] * (q.dim() - 1)
    shape[q.dim() - 2 if layout == "bnsd" else (1 if layout == "bsnd" else 0)] = tokens
    if v.cache:
        # Positions into a cache twice as long, in an order that is not a range.
        cache_cos, cache_sin = _tables(v, 2 * tokens)
        perm = torch.randperm(2 * tokens, generator=g)[:tokens]
        kwargs["positions"] = perm.view(shape)
        cos, sin = cache_cos, cache_sin
    if v.table_free:
        # The same random positions as the cache rows; cos and sin are the frequencies.
        perm = torch.randperm(2 * tokens, generator=g)[:tokens]
        kwargs = dict(rotation=v.rotation, positions=perm.view(shape))
        cos = 1.0 / 500000.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD)
        sin = None
    return Case(q, k, cos, sin, kwargs, views, buffer)


# ------------------------------------------------------------------------------------------------
# Timing


def _median_round_robin(fns: Dict[str, Callable[[], None]], repeats: int, warmup: int) -> Dict[str, float]:
    samples = round_robin_samples(fns, repeats, warmup)
    return {k: statistics.median(v) for k, v in samples.items()}


def measure_cell(case: Case, threads: int, repeats: int, memmove: Memmove) -> Dict[str, float]:
    torch.set_num_threads(threads)
    ops = [case.q] + ([case.k] if case.k is not None else [])
    outs = [torch.empty_like(t) for t in ops]
    nbytes = sum(t.numel() * t.element_size() for t in ops)
    # In place on a copy of the whole buffer (the same slices); rotating again and again is fine.
    work_q, work_k = case.views(case.buffer.clone())
    k_out = outs[1] if case.k is not None else None

    if case.sin is None:  # table-free: case.cos holds the frequencies; no out= form
        kw = dict(case.kwargs)
        positions = kw.pop("positions")

        def inplace():
            rome.ops.rope_from_positions_(work_q, work_k, positions, case.cos, **kw)

        out_of_place = None

        def fresh():
            rome.ops.rope_from_positions(ops[0], case.k, positions, case.cos, **kw)
    else:
        def inplace():
            rome.ops.rope_(work_q, work_k, case.cos, case.sin, **case.kwargs)

        def out_of_place():
            rome.ops.rope(ops[0], case.k, case.cos, case.sin, out=(outs[0], k_out), **case.kwargs)

        def fresh():
            rome.ops.rope(ops[0], case.k, case.cos, case.sin, **case.kwargs)

    def torch_copy():
        for s, d in zip(ops, outs):
            d.copy_(s)

    fns = {"inplace": inplace, "out": out_of_place, "fresh": fresh, "copy": torch_copy,
           "memmove": memmove.copier(nbytes, threads)}
    t = _median_round_robin({k: f for k, f in fns.items() if f is not None}, repeats, warmup=2)
    t.setdefault("out", None)
    t["floor"] = min(t["copy"], t["memmove"])
    t["bytes"] = nbytes
    return t


def vllm_cases(quick: bool) -> List[Tuple[str, int, torch.dtype]]:
    t = 512 if quick else 4096
    return [(f"prefill T={t}, fp32 cache", t, torch.float32), (f"prefill T={t}, bf16 cache", t, torch.bfloat16),
            ("decode T=1", 1, torch.float32), ("decode T=16", 16, torch.float32)]


def measure_vllm(name: str, tokens: int, cache_dtype: torch.dtype, threads: int, repeats: int,
                 memmove: Memmove) -> Dict:
    """vLLM's rotary_embedding (in place, NeoX, q [T, 32·128] + k [T, 8·128] bf16, cache
    [8192, 128]) and the copy of the same q and k: the faster of torch's copy_ and memmove."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, 32 * HEAD, generator=g).to(torch.bfloat16)
    k = torch.randn(tokens, 8 * HEAD, generator=g).to(torch.bfloat16)
    pos = torch.arange(8192)
    ang = axis_angles(pos, HEAD)
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1).to(cache_dtype)
    positions = torch.randint(0, 8192, (tokens,), generator=g)
    qo, ko = torch.empty_like(q), torch.empty_like(k)

    def rome_call():
        rome.ops.rotary_embedding(positions, q, k, HEAD, cache, True)

    def copy():
        qo.copy_(q)
        ko.copy_(k)

    decode = tokens <= 16
    inner = 200 if decode else 1
    mm = memmove.copier((q.numel() + k.numel()) * q.element_size(), threads)
    fns = {"rome": lambda: [rome_call() for _ in range(inner)], "copy": lambda: [copy() for _ in range(inner)],
           "memmove": lambda: [mm() for _ in range(inner)]}
    t = _median_round_robin(fns, repeats if not decode else max(repeats, 15), warmup=2)
    copy_s = min(t["copy"], t["memmove"])
    return {"case": name, "threads": threads, "rome_s": t["rome"] / inner, "copy_s": copy_s / inner,
            "decode": decode}


def run(quick: bool = False, full: bool = False, threads_list=(1, 2), repeats: int = 0,
        progress: Callable[[str], None] = print) -> Dict:
    tokens = 512 if quick else 28800
    heads, k_heads = 24, 8
    variants = FULL_VARIANTS if full else DEFAULT_VARIANTS
    repeats = repeats or (3 if quick else 7)
    memmove = Memmove()
    cells = []
    saved_threads = torch.get_num_threads()
    start = time.perf_counter()
    try:
        for v in variants:
            for layout in LAYOUTS:
                case = make_case(v, layout, tokens, heads, k_heads)
                for threads in threads_list:
                    progress(f"layouts: {v.title}, {layout}, {threads} thread(s)  "
                             f"({time.perf_counter() - start:.0f} s)")
                    t = measure_cell(case, threads, repeats, memmove)
                    cells.append({"variant": v.key, "title": v.title, "layout": layout, "threads": threads,
                                  "x_dtype": str(v.x_dtype).replace("torch.", ""),
                                  "table_dtype": str(v.table_dtype).replace("torch.", ""), **t})
                del case
        vllm = []
        for name, tok, cache_dtype in vllm_cases(quick):
            for threads in threads_list:
                progress(f"vLLM contract: {name}, {threads} thread(s)")
                vllm.append(measure_vllm(name, tok, cache_dtype, threads, repeats, memmove))
    finally:
        torch.set_num_threads(saved_threads)
    return {"tokens": tokens, "heads": heads, "k_heads": k_heads, "repeats": repeats, "cells": cells,
            "vllm": vllm, "isa": rome.active_isa(), "memmove": glibc_streaming.describe(),
            "wall_s": round(time.perf_counter() - start, 1)}


# ------------------------------------------------------------------------------------------------
# Report


def _ratio(t: Optional[float], floor: float) -> str:
    if t is None:
        return "—"
    return f"{t / floor:.2f}x" if floor > 0 else "n/a"


def markdown(res: Dict) -> str:
    lines = [
        f"### RoME vs the copy floor by layout ({res['isa']}, {res['tokens']} tokens x {res['heads']} heads "
        f"x 128, bf16 x and fp32 tables unless named; packed adds {res['k_heads']} k heads)",
        "",
        f"Ratio to the copy of the same x bytes (faster of torch copy_ and memmove, same threads; "
        f"{res.get('memmove', 'memmove threshold not recorded')}); "
        "threads set with torch.set_num_threads. *out* writes into preallocated outputs "
        "(rope(out=...)); *fresh* allocates its output on every call (page faults included).",
        "",
        "| variant | layout | threads | floor ms | in place | out (preallocated) | out (fresh) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in res["cells"]:
        lines.append(
            f"| {c['title']} | {c['layout']} | {c['threads']} | {c['floor'] * 1e3:.2f} | "
            f"{_ratio(c['inplace'], c['floor'])} | {_ratio(c['out'], c['floor'])} | {_ratio(c['fresh'], c['floor'])} |")
    worst: Dict[Tuple[str, int], float] = {}
    for c in res["cells"]:
        for mode in ("inplace", "out"):
            if c.get(mode) is None:
                continue
            key = (c["layout"], c["threads"])
            worst[key] = max(worst.get(key, 0.0), c[mode] / c["floor"])
    lines += ["", "Worst ratio (in place or preallocated out) per layout and thread count: " +
              ", ".join(f"{layout} {t}T {r:.2f}x" for (layout, t), r in sorted(worst.items())), ""]
    lines += ["### vLLM's contract (rotary_embedding in place, NeoX, q [T, 32x128] + k [T, 8x128] bf16)", "",
              "| case | threads | copy of q and k (faster of copy_ and memmove) | RoME | ratio |", "|---|---:|---:|---:|---:|"]
    for r in res["vllm"]:
        unit, scale = ("us", 1e6) if r["decode"] else ("ms", 1e3)
        lines.append(f"| {r['case']} | {r['threads']} | {r['copy_s'] * scale:.2f} {unit} | "
                     f"{r['rome_s'] * scale:.2f} {unit} | {r['rome_s'] / r['copy_s']:.2f}x |")
    return "\n".join(lines) + "\n"
