"""Cosine and sine tables, built by the C++ library (``rome/tables.hpp``; math in double).

Every builder returns torch tensors in the requested ``dtype`` (float32 by default; keeping
tables in fp32 while x is bf16 avoids the precision loss of bf16 tables). Layouts:
``"half"`` (NeoX: ``[f0..f(n-1), f0..f(n-1)]``) matches rotation 'half', ``"pairs"`` (GPT-J:
``[f0, f0, f1, f1, ...]``; alias ``"interleave"``) matches rotation 'interleave'.

Scaling (transformers' rope_type formulas): pass ``scaling=Scaling.linear(f)``,
``Scaling.ntk(f)``, ``Scaling.dynamic_ntk(f, max_pos, seq_len)``,
``Scaling.yarn(f, original_max_position_embeddings)`` (fields such as ``beta_fast``,
``mscale``, ``attention_factor`` can be set on the object) or ``Scaling.llama3(f, ...)``.
YaRN's amplitude multiplies both cos and sin.
"""

from typing import Optional, Sequence, Tuple, Union

import torch

from . import _C

Scaling = _C.Scaling

__all__ = [
    "Scaling",
    "inverse_frequencies",
    "rope_table",
    "table_1d",
    "table_2d",
    "table_3d",
    "grid_table",
    "axes_table",
    "axes_cache",
    "frequency_table",
    "cos_sin_cache",
    "mrope_table",
    "mrope_cache",
    "mrope_column_axis",
    "mrope_frequency_axis",
    "cos_sin",
]

Positions = Union[int, Sequence[int], torch.Tensor]
Table = Tuple[torch.Tensor, torch.Tensor]


def _positions(positions: Positions) -> torch.Tensor:
    if isinstance(positions, int):
        return torch.arange(positions, dtype=torch.int64)
    return torch.as_tensor(positions, dtype=torch.int64).reshape(-1)


def _thetas(theta: Union[float, Sequence[float]]) -> list:
    return [float(theta)] if isinstance(theta, (int, float)) else [float(t) for t in theta]


def _cast(pair, dtype):
    return tuple(t.to(dtype) for t in pair)


def inverse_frequencies(
    dim: int, theta: float = 10000.0, scaling: Optional[Scaling] = None
) -> Tuple[torch.Tensor, float]:
    """``(inv_freq, amplitude)``: ``inv_freq[i] = theta^(-2i/dim)`` (float64, dim/2 values) after
    ``scaling``, and the amplitude (1 except YaRN) multiplying cos and sin."""
    if scaling is None:
        return _C.inverse_frequencies(int(dim), float(theta)), 1.0
    return _C.scaled_frequencies(int(dim), float(theta), scaling)


def rope_table(
    positions: Positions,
    dim: int,
    theta: float = 10000.0,
    layout: str = "half",
    scaling: Optional[Scaling] = None,
    dtype: torch.dtype = torch.float32,
) -> Table:
    """1D RoPE: ``(cos, sin)`` [P, dim] for ``positions`` (an int P means 0..P-1)."""
    inv_freq, amplitude = inverse_frequencies(dim, theta, scaling)
    return _cast(_C.rope_table(_positions(positions), inv_freq, layout, amplitude), dtype)


table_1d = rope_table


def grid_table(
    sizes: Sequence[int],
    dims: Sequence[int],
    theta: Union[float, Sequence[float]] = 10000.0,
    layout: str = "half",
    starts: Optional[Sequence[int]] = None,
    dtype: torch.dtype = torch.float32,
) -> Table:
    """Multi-axis RoPE over a grid (2D h x w, 3D t x h x w, ...): ``(cos, sin)``
    [prod(sizes), sum(dims)]. Axis a owns a block of ``dims[a]`` lanes with its own frequencies
    ``theta_a^(-2i/dims[a])``; rows enumerate the grid in row-major order (last axis fastest).
    Use with rotation 'half' and ``blocks=dims`` (or 'interleave' with layout 'pairs')."""
    return _cast(
        _C.grid_table([int(d) for d in dims], _thetas(theta), [int(s) for s in sizes], layout,
                      [int(s) for s in (starts or [])]),
        dtype,
    )


def table_2d(height: int, width: int, dims: Sequence[int], theta=10000.0, layout="half",
             dtype=torch.float32) -> Table:
    """2D grid table [height*width, sum(dims)] (dims: lanes of the h and w axes)."""
    return grid_table([height, width], dims, theta, layout, dtype=dtype)


def table_3d(frames: int, height: int, width: int, dims: Sequence[int], theta=10000.0,
             layout="half", dtype=torch.float32) -> Table:
    """3D grid table [frames*height*width, sum(dims)] (e.g. dims [44, 44, 40], Wan [44, 42, 42],
    HunyuanVideo/Flux [16, 56, 56])."""
    return grid_table([frames, height, width], dims, theta, layout, dtype=dtype)


def axes_table(
    positions: torch.Tensor,
    dims: Sequence[int],
    theta: Union[float, Sequence[float]] = 10000.0,
    layout: str = "half",
    dtype: torch.dtype = torch.float32,
) -> Table:
    """Multi-axis table for explicit per-token positions [T, n_axes]: ``(cos, sin)``
    [T, sum(dims)]."""
    positions = torch.as_tensor(positions, dtype=torch.int64)
    return _cast(_C.axes_table([int(d) for d in dims], _thetas(theta), positions, layout), dtype)


def axes_cache(
    max_positions: int,
    dims: Sequence[int],
    theta: Union[float, Sequence[float]] = 10000.0,
    layout: str = "half",
    dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor, list]:
    """A position cache for multi-axis RoPE: ``(cos, sin, column_axis)`` with cos/sin
    [max_positions, sum(dims)] (row p: every axis at position p) and column_axis the axis of each
    column. Pass them to :func:`rome.ops.rope` with positions [..., n_axes]."""
    n_axes = len(dims)
    rows = torch.arange(max_positions, dtype=torch.int64).unsqueeze(1).expand(max_positions, n_axes)
    cos, sin = axes_table(rows.contiguous(), dims, theta, layout, dtype)
    column_axis = [a for a, d in enumerate(dims) for _ in range(int(d))]
    return cos, sin, column_axis


def frequency_table(
    num_positions: int,
    dim: int,
    theta: float = 10000.0,
    scaling: Optional[Scaling] = None,
    dtype: torch.dtype = torch.float32,
) -> Table:
    """Half-width tables ``(cos, sin)`` [P, dim/2], one value per frequency (ONNX
    RotaryEmbedding caches). Use with ``table_width='halves'`` (rotation 'half') or ``'pairs'``
    (rotation 'interleave')."""
    inv_freq, amplitude = inverse_frequencies(dim, theta, scaling)
    return _cast(_C.frequency_table(int(num_positions), inv_freq, amplitude), dtype)


def cos_sin_cache(
    max_positions: int,
    rotary_dim: int,
    theta: float = 10000.0,
    scaling: Optional[Scaling] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """vLLM's ``cos_sin_cache`` [max_positions, rotary_dim] = cat(cos, sin) per row, for
    :func:`rome.ops.rotary_embedding`."""
    inv_freq, amplitude = inverse_frequencies(rotary_dim, theta, scaling)
    return _C.cos_sin_cache(int(max_positions), inv_freq, amplitude).to(dtype)


def mrope_column_axis(sections: Sequence[int], mode: str = "sectioned") -> list:
    """Axis (0 = t, 1 = h, 2 = w) of each of the head_dim lanes (half layout) for MRoPE:
    ``mode`` 'sectioned' (Qwen2-VL) or 'interleaved' (Qwen3-VL)."""
    return list(_C.mrope_column_axis([int(s) for s in sections], mode))


def mrope_frequency_axis(sections: Sequence[int], mode: str = "sectioned") -> list:
    """Axis of each of the head_dim/2 frequencies for MRoPE."""
    return list(_C.mrope_frequency_axis([int(s) for s in sections], mode))


def mrope_table(
    positions: torch.Tensor,
    dim: int,
    sections: Sequence[int],
    theta: float = 10000.0,
    mode: str = "sectioned",
    scaling: Optional[Scaling] = None,
    dtype: torch.dtype = torch.float32,
) -> Table:
    """MRoPE ``(cos, sin)`` [T, dim] (half layout) from positions [3, T] (t, h, w);
    sum(sections) = dim/2, e.g. Qwen2-VL [16, 24, 24] for dim 128."""
    inv_freq, amplitude = inverse_frequencies(dim, theta, scaling)
    positions = torch.as_tensor(positions, dtype=torch.int64)
    return _cast(_C.mrope_table(positions, inv_freq, [int(s) for s in sections], mode, amplitude), dtype)


def mrope_cache(
    max_positions: int,
    dim: int,
    sections: Sequence[int],
    theta: float = 10000.0,
    mode: str = "sectioned",
    scaling: Optional[Scaling] = None,
    dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor, list]:
    """MRoPE as a position cache: ``(cos, sin, column_axis)`` with cos/sin [max_positions, dim]
    (half layout). Pass to :func:`rome.ops.rope` with positions [..., 3] and
    ``column_axis=column_axis``."""
    cos, sin = rope_table(max_positions, dim, theta, "half", scaling, dtype)
    return cos, sin, mrope_column_axis(sections, mode)


def cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    layout: str = "half",
    amplitude: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> Table:
    """The exact table builder of table-free RoPE, for callers that must hand tables on:
    ``amplitude·cos/sin(positions × inv_freq)`` of shape ``positions.shape + [2·len(inv_freq)]``
    laid out by ``layout`` ('half' or 'pairs'), each value within 2 fp32 ulp of the true one
    (< 1e-7; amplitude one more fp32 rounding) at any position (the same kernel and bits as
    :func:`rome.ops.rope_from_positions`). ``positions`` is int32/int64 of any shape;
    ``inv_freq`` 1-D float (values taken exactly)."""
    if layout == "interleave":
        layout = "pairs"
    if layout not in ("half", "pairs"):
        raise ValueError(f"rome: layout: expected 'half' or 'pairs', got {layout!r}")
    return torch.ops.rome.cos_sin.default(torch.as_tensor(positions), inv_freq, layout,
                                          float(amplitude), dtype)
