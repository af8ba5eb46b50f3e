"""The PyTorch columns: small ops, matrix forms (eager and torch.compile), RoME, the copy floor.

Each builder returns a :class:`Prepared` (a zero-argument callable returning the outputs, plus
notes) or raises :class:`NotApplicable` with the reason.

The PyTorch baselines do what models ship (HuggingFace transformers, vLLM's native path): tables
cast to x's dtype (bf16) and bf16 math. RoME gets float32 tables (one rounding at the end).
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from .rows import Inputs, matrix64

Outputs = Tuple[torch.Tensor, ...]


class NotApplicable(Exception):
    """The method cannot express this row (the message says why)."""


@dataclass
class Prepared:
    fn: Callable[[], Outputs]
    note: str = ""
    dtype: torch.dtype = torch.bfloat16  # the dtype the method computes in
    out_dtype: torch.dtype = torch.bfloat16  # the dtype it returns
    setup_s: float = 0.0  # e.g. torch.compile warm-up
    in_place: bool = False
    close: Optional[Callable[[], None]] = None  # releases threads, sessions


# ------------------------------------------------------------------------------------------------
# Small ops (what models ship)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J / transformers' rotate_every_two."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rotate(mode: str):
    return rotate_half if mode == "half" else rotate_every_two


def small_ops_direct(mode: str, dims: List[int]):
    rot = _rotate(mode)

    def fn(x, axis_tables):
        if len(dims) == 1:
            cos, sin = axis_tables[0]
            return x * cos + rot(x) * sin
        parts = []
        for xa, (cos, sin) in zip(x.split(dims, dim=-1), axis_tables):
            parts.append(xa * cos + rot(xa) * sin)
        return torch.cat(parts, dim=-1)

    return fn


def small_ops_cache(mode: str):
    """vLLM's forward_native / transformers: gather the rows, then rotate q and k."""
    rot = _rotate(mode)

    def fn(q, k, cos_cache, sin_cache, positions):
        cos = cos_cache.index_select(0, positions)
        sin = sin_cache.index_select(0, positions)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    return fn


# ------------------------------------------------------------------------------------------------
# Matrix forms


def matrix_direct(x, cos, sin, mat):
    return x * cos + (x @ mat) * sin


def axis_matrices_direct(dims: List[int]):
    def fn(x, axis_tables, mats):
        parts = []
        for xa, (cos, sin), m in zip(x.split(dims, dim=-1), axis_tables, mats):
            parts.append(xa * cos + (xa @ m) * sin)
        return torch.cat(parts, dim=-1)

    return fn


def matrix_cache(q, k, cos_cache, sin_cache, positions, mat):
    cos = cos_cache.index_select(0, positions)
    sin = sin_cache.index_select(0, positions)
    return q * cos + (q @ mat) * sin, k * cos + (k @ mat) * sin


# ------------------------------------------------------------------------------------------------
# Builders


def _as_tuple(out) -> Outputs:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _combined_matrix(inp: Inputs, dtype) -> torch.Tensor:
    return matrix64(inp.row).to(dtype)


def _axis_matrices(inp: Inputs, dtype) -> List[torch.Tensor]:
    m, out, at = matrix64(inp.row), [], 0
    for d in inp.row.dims:
        out.append(m[at:at + d, at:at + d].to(dtype))
        at += d
    return out


def build_small(inp: Inputs, compiled: bool = False) -> Prepared:
    row = inp.row
    if row.dense:
        raise NotApplicable("a dense matrix has no slice/cat form")
    if row.cache:
        f = small_ops_cache(row.mode)
        cos, sin = inp.tables(torch.bfloat16)
        args = (inp.q, inp.k, cos, sin, inp.positions)
        note = "index_select + rotate_half, bf16 cache"
    else:
        f = small_ops_direct(row.mode, row.dims)
        args = (inp.q, inp.axis_tables(torch.bfloat16))
        rot = "rotate_half" if row.mode == "half" else "rotate_every_two"
        note = (f"split per axis, {rot}, cat" if row.multi_axis else rot) + ", bf16 tables"
    return _finish(f, args, compiled, note)


def build_axis_matrices(inp: Inputs, compiled: bool = False) -> Prepared:
    row = inp.row
    if not row.multi_axis:
        raise NotApplicable("one axis: same as the combined matrix")
    f = axis_matrices_direct(row.dims)
    mats = _axis_matrices(inp, torch.bfloat16)
    args = (inp.q, inp.axis_tables(torch.bfloat16), mats)
    return _finish(f, args, compiled, "x_a*cos_a + (x_a@M_a)*sin_a per axis, cat; bf16")


def build_matrix(inp: Inputs, compiled: bool = False) -> Prepared:
    row = inp.row
    mat = _combined_matrix(inp, torch.bfloat16)
    cos, sin = inp.tables(torch.bfloat16)
    if row.cache:
        args = (inp.q, inp.k, cos, sin, inp.positions, mat)
        return _finish(matrix_cache, args, compiled, "gather, x*cos + (x@M)*sin; bf16")
    args = (inp.q, cos, sin, mat)
    return _finish(matrix_direct, args, compiled, "x*cos + (x@M)*sin; bf16")


def build_bare_matmul(inp: Inputs) -> Prepared:
    """PyTorch's best bare product x @ M of a matrix row (no tables, no epilogue), into a
    preallocated output: the faster of the bf16 matmul and the fp32 matmul on copies converted
    beforehand (on CPUs without bf16 hardware torch's bf16 matmul is ~10x slower than its sgemm).
    A block-diagonal matrix is multiplied whole, as a user without RoME would."""
    from .measure import faster_of

    row = inp.row
    if not row.matrix_path:
        raise NotApplicable("only rows run as matrix products")
    x = inp.q
    m32 = _combined_matrix(inp, torch.float32)
    x32, out32 = x.float(), torch.empty(x.shape, dtype=torch.float32)
    m16, out16 = m32.to(x.dtype), torch.empty_like(x)
    low = str(x.dtype).replace("torch.", "")
    fns = {"fp32": lambda: (torch.matmul(x32, m32, out=out32),),
           low: lambda: (torch.matmul(x, m16, out=out16),)}
    best, seconds = faster_of(fns)
    other = low if best == "fp32" else "fp32"
    dtype = torch.float32 if best == "fp32" else x.dtype
    note = (f"torch.matmul(x, M, out=) in {best} (one trial call each: {other} took "
            f"{seconds[other] / seconds[best]:.1f}x as long); fp32 on copies converted beforehand")
    return Prepared(fns[best], note, dtype=dtype, out_dtype=dtype)


def _finish(f, args, compiled: bool, note: str) -> Prepared:
    if not compiled:
        return Prepared(lambda: _as_tuple(f(*args)), note)
    import time

    torch._dynamo.reset()
    g = torch.compile(f, dynamic=False)
    t0 = time.perf_counter()
    g(*args)  # compile
    setup = time.perf_counter() - t0
    return Prepared(lambda: _as_tuple(g(*args)), note + "; inductor", setup_s=setup)


def _rope_args(inp: Inputs):
    row = inp.row
    if row.matrix_path:
        assert not row.cache
        cos, sin = inp.tables(torch.float32)
        kind = "dense" if row.dense else "dense_forced"
        return (cos, sin, None, kind, [], -1, "full", [], None, _combined_matrix(inp, torch.float32))
    blocks = list(row.dims) if row.multi_axis else []
    if row.cache:
        cos, sin = inp.tables(torch.float32)
        pos = inp.positions.view(1, 1, -1)
        return (cos, sin, pos, row.mode, blocks, -1, "full", [], None, None)
    cos, sin = inp.tables(torch.float32)
    return (cos, sin, None, row.mode, blocks, -1, "full", [], None, None)


def build_rome(inp: Inputs) -> Prepared:
    op = torch.ops.rome.rope
    args = _rope_args(inp)
    q, k = inp.q, inp.k
    if k is None:
        fn = lambda: (op(q, None, *args)[0],)  # noqa: E731
    else:
        fn = lambda: op(q, k, *args)  # noqa: E731
    note = "torch.ops.rome.rope, fp32 tables"
    if inp.row.matrix_path:
        note += f", rotation='{args[3]}' (matrix path), fp32 M"
    return Prepared(fn, note, dtype=torch.float32)


def build_rome_inplace(inp: Inputs) -> Prepared:
    op = torch.ops.rome.rope_
    args = _rope_args(inp)
    q = inp.q.clone()
    k = None if inp.k is None else inp.k.clone()
    # Each call rotates the previous result again; precision is taken from the first call.
    first = {}

    def fn():
        op(q, k, *args)
        return (q,) if k is None else (q, k)

    def first_call():
        out = fn()
        first["out"] = tuple(t.clone() for t in out)
        return first["out"]

    prep = Prepared(fn, "torch.ops.rome.rope_, fp32 tables", dtype=torch.float32, in_place=True)
    prep.first_call = first_call
    return prep


def build_floor(inp: Inputs, threads: int) -> Prepared:
    """Streams the same bytes as RoME: memcpy of x (and k) into preallocated outputs plus one read
    of the fp32 table rows RoME reads, cut into `threads` contiguous pieces run on `threads`
    Python threads (ctypes and numpy release the GIL). glibc's memcpy streams with non-temporal
    stores, so this is a stricter floor than torch's copy_. Work under 256 KiB per thread runs on
    the calling thread (as RoME does)."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    libc = ctypes.CDLL(None)
    memmove = libc.memmove
    memmove.restype = ctypes.c_void_p
    memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    row = inp.row
    srcs = inp.operands()
    dsts = [torch.empty_like(t) for t in srcs]
    cos, sin = inp.tables(torch.float32)
    if row.cache:
        lo = int(inp.positions[0])
        cos, sin = cos[lo:lo + row.seq], sin[lo:lo + row.seq]  # positions are a range
    # (src address, dst address or None, bytes, uint8 numpy view for reads)
    spans = [(s.data_ptr(), d.data_ptr(), s.numel() * s.element_size(), None) for s, d in zip(srcs, dsts)]
    for t in (cos, sin):
        t = t.contiguous()
        spans.append((t.data_ptr(), None, t.numel() * 4, t.view(-1).view(torch.uint8).numpy()))
    total = sum(sp[2] for sp in spans)
    pieces = max(1, min(threads, total // (256 << 10)))

    def piece_work(begin, end):
        work, at = [], 0
        for src, dst, nbytes, view in spans:
            a, b = max(begin, at), min(end, at + nbytes)
            if a < b:
                if dst is not None:
                    work.append((memmove, (dst + a - at, src + a - at, b - a)))
                else:
                    chunk = view[a - at:b - at]
                    chunk = chunk[: len(chunk) // 8 * 8].view(np.uint64)
                    work.append((np.bitwise_xor.reduce, (chunk,)))
            at += nbytes
        return work

    bounds = [total * p // pieces // 64 * 64 for p in range(pieces)] + [total]
    works = [piece_work(bounds[p], bounds[p + 1]) for p in range(pieces)]

    def run(work):
        for f, args in work:
            f(*args)

    if pieces == 1:
        def fn():
            run(works[0])
            return tuple(dsts)
        pool = None
    else:
        pool = ThreadPoolExecutor(pieces)

        def fn():
            list(pool.map(run, works))
            return tuple(dsts)

    prep = Prepared(fn, f"memcpy x->y + read fp32 tables, {pieces} thread(s), in process")
    prep.keepalive = (cos, sin, spans)
    if pool is not None:
        prep.close = pool.shutdown
    return prep


def exists_rome_op() -> Optional[str]:
    try:
        import rome  # noqa: F401

        torch.ops.rome.rope  # noqa: B018
        return None
    except Exception as e:  # pragma: no cover - reported as n/a
        return f"rome extension not importable: {e}"
