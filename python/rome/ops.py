"""The RoME operators (``torch.ops.rome.*``), with documented Python wrappers.

Every operator computes ``y = (x @ A) * cos + (x @ B) * sin`` over the last axis of ``x`` (the
head, of size D) with math in fp32 and one rounding to ``x``'s dtype. ``x`` may be float32,
float16 or bfloat16, rank 2 to 5, any strides with a contiguous last axis (out-of-place ops copy
an input whose last axis is strided). Tables may be float32, float16 or bfloat16 independently
of ``x``.

Errors raised by the library name the argument, what was expected and what was given:
``ValueError`` (invalid argument), ``IndexError`` (a position outside the cache),
``NotImplementedError`` (valid but unsupported). Outputs and in-place inputs are left untouched
when an error is raised.

All out-of-place operators support autograd (q/k/x, direct cos/sin tables and matrices); the
in-place ones are inference only.
"""

from typing import Optional, Sequence, Tuple

import torch

from . import _C  # noqa: F401  (registers torch.ops.rome)

__all__ = [
    "rope_matrix",
    "rope_matrix_",
    "rope",
    "rope_",
    "rotary_embedding",
    "apply_rotary_emb_interleaved",
    "rope_from_positions",
    "rope_from_positions_",
]


def _eager_entry(overload):
    """The C++ entry of an op overload, for calls that never run under torch.compile: an
    OpOverload's ``__call__`` only forwards to it (``self._op(*args, **kwargs)``), and that Python
    frame cost about 1.3 µs of a 7-8 µs one-token call here. Traced code keeps the overload, which
    torch.compile knows; a torch without ``_op`` gets the overload too."""
    return getattr(overload, "_op", overload)


# The entries the drop-ins call outside tracing (the extension registered the ops above): the CPU
# kernel's call straight from C++ where nothing but it would run, else the op with the same
# arguments (bindings/torch/eager.cpp). Positional arguments only; int lists as tuples (an empty
# tuple is not a new object for the garbage collector to count).
_EAGER_ROPE = _C._eager_rope(_eager_entry(torch.ops.rome.rope.default))
_EAGER_ROPE_ = _C._eager_rope_(_eager_entry(torch.ops.rome.rope_.default))
_EAGER_FROM_POSITIONS = _C._eager_rope_from_positions(
    _eager_entry(torch.ops.rome.rope_from_positions.default))
_EAGER_FROM_POSITIONS_ = _C._eager_rope_from_positions_(
    _eager_entry(torch.ops.rome.rope_from_positions_.default))
_EAGER_ROTARY_EMBEDDING = _C._eager_rotary_embedding(
    _eager_entry(torch.ops.rome.rotary_embedding.default))
_EAGER_FUSED_QK_NORM_ROPE = _C._eager_fused_qk_norm_rope(
    _eager_entry(torch.ops.rome.fused_qk_norm_rope.default))
_EAGER_ROPE_WITH_CACHE = _C._eager_rotary_embedding_with_cache(
    _eager_entry(torch.ops.rome.rotary_embedding_with_cache.default))


def _broadcasts_to(shape, target) -> bool:
    """True when a tensor of `shape` broadcasts to `target` without growing it. (Plain
    comparisons: torch.broadcast_shapes cost 10-90 µs per call in eager mode here, more than a
    decode step's RoPE.)"""
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(tuple(shape)), reversed(tuple(target))):
        if s != 1 and s != t:
            return False
    return True


def rope_matrix(x: torch.Tensor, mat: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """The original RoME signature: ``x * cos + (x @ mat) * sin`` — note **sin before cos**.

    Args:
        x: [..., D], rank 2 to 5 (BNSD, BSND, [T, D], ...).
        mat: [D, D], any matrix in any float dtype. Signed permutations (half, interleave,
            quarter, block diagonals of those; see :mod:`rome.matrices`) run as pure vector
            permutes; other matrices as a matrix product.
        sin, cos: broadcastable to ``x`` with last axis D (e.g. [1, 1, S, D], [B, 1, S, D],
            [S, D], [1, S, 1, D]).

    Returns:
        A new tensor with ``x``'s shape and dtype. Differentiable in x, mat, sin and cos.
    """
    return torch.ops.rome.rope_matrix.default(x, mat, sin, cos)


def rope_matrix_(x: torch.Tensor, mat: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """In-place :func:`rope_matrix` (inference only); returns ``x``.

    The operator ``torch.ops.rome.rope_matrix_`` itself returns nothing (functionalization, used
    by torch.compile and export, does not accept custom ops returning an alias of an input)."""
    torch.ops.rome.rope_matrix_.default(x, mat, sin, cos)
    return x


def _int_list(values: Optional[Sequence[int]]) -> tuple:
    return () if values is None else tuple(int(v) for v in values)


def rope(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    rotation: str = "half",
    blocks: Optional[Sequence[int]] = None,
    rotary_dim: int = -1,
    table_width: str = "full",
    column_axis: Optional[Sequence[int]] = None,
    mat_a: Optional[torch.Tensor] = None,
    mat_b: Optional[torch.Tensor] = None,
    out: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The general RoME operator: rotates ``q`` and ``k`` in one pass over the tables.

    Args:
        q: [..., D], rank 2 to 5.
        k: like ``q`` or ``None``. May have fewer heads (GQA/MQA): its shape must equal q's on
            every axis the tables vary along.
        cos, sin: either **direct tables**, broadcastable to q with last axis = table width
            (e.g. [1, 1, S, W], [B, 1, S, W], [S, W]); or, when ``positions`` is given, a
            **cache** [P, W] whose rows are gathered by position.
        positions: int32/int64 positions into the cache, of rank ``q.dim() - 1`` (fewer leading
            axes broadcast), broadcastable to ``q.shape[:-1]``. With ``column_axis`` it has one
            more trailing axis holding one position per axis (t, h, w, ...: MRoPE, grids).
            A position outside ``[0, P)`` raises ``IndexError``.
        rotation: ``"half"`` (NeoX rotate_half), ``"interleave"`` (GPT-J), ``"quarter"``,
            ``"interleave_half"`` (DeepSeek MLA: de-interleave then rotate half; output in
            de-interleaved order) or ``"dense"`` (``mat_b`` and optional ``mat_a``; signed
            permutations among them still take the permute path). ``"dense_forced"`` runs the
            matrices as products even when they are signed permutations (to compare paths).
        blocks: block sizes of a block-diagonal rotation of that kind, summing to rotary_dim
            (e.g. [44, 44, 40] for 3D RoPE with half blocks). Empty: one block.
        rotary_dim: lanes rotated (-1: all of D). Smaller means partial rotary: lanes past
            rotary_dim pass through unchanged, and tables cover only rotary_dim lanes.
        table_width: ``"full"`` (W = rotary_dim, one column per lane), ``"halves"``
            (W = rotary_dim/2, lane j reads column j % W: NeoX caches) or ``"pairs"``
            (W = rotary_dim/2, lane j reads column j // 2: GPT-J caches).
        column_axis: with positions, the axis (index into positions' last axis) each table
            column reads its position from (W entries).
        mat_a, mat_b: [rotary_dim, rotary_dim] matrices for ``rotation="dense"`` or
            ``"dense_forced"``.
        out: ``(q_out, k_out)`` preallocated outputs (q's and k's shapes and dtypes, last axis
            contiguous; ``k_out`` None when ``k`` is None). Written in place through
            ``torch.ops.rome.rope_out``, which allocates nothing: the way to avoid a fresh
            output (and its page faults) on every call. Inference only.

    Returns:
        ``(q_out, k_out)``; ``k_out`` is an empty tensor of shape [0] when ``k`` is None (or
        ``out``'s second entry when given). Differentiable in q, k, direct cos/sin, mat_a and
        mat_b (without ``out``).
    """
    if out is not None:
        q_out, k_out = out
        torch.ops.rome.rope_out.default(
            q, k, cos, sin, q_out, k_out, positions, rotation, _int_list(blocks), int(rotary_dim),
            table_width, _int_list(column_axis), mat_a, mat_b,
        )
        return q_out, k_out
    # Eager calls take the op's C++ entry; torch.compile traces the op itself.
    entry = torch.ops.rome.rope.default if torch.compiler.is_compiling() else _EAGER_ROPE
    return entry(
        q, k, cos, sin, positions, rotation, _int_list(blocks), int(rotary_dim), table_width,
        _int_list(column_axis), mat_a, mat_b,
    )


def rope_(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    rotation: str = "half",
    blocks: Optional[Sequence[int]] = None,
    rotary_dim: int = -1,
    table_width: str = "full",
    column_axis: Optional[Sequence[int]] = None,
    mat_a: Optional[torch.Tensor] = None,
    mat_b: Optional[torch.Tensor] = None,
) -> None:
    """In-place :func:`rope` on ``q`` (and ``k``). Inference only: raises if an input requires
    grad while grad mode is on. Partial rotary leaves the pass-through lanes untouched."""
    entry = torch.ops.rome.rope_.default if torch.compiler.is_compiling() else _EAGER_ROPE_
    entry(
        q, k, cos, sin, positions, rotation, _int_list(blocks), int(rotary_dim), table_width,
        _int_list(column_axis), mat_a, mat_b,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rope_dim_offset: int = 0,
    inverse: bool = False,
) -> None:
    """vLLM's ``rotary_embedding`` contract, in place.

    Args:
        positions: [T] or [B, S] int32/int64.
        query: [T, H*D], [T, H, D] or [B, S, H*D] (D = head_size); row-strided slices of a fused
            qkv buffer work without copies.
        key: like query (may have fewer heads) or None.
        head_size: D.
        cos_sin_cache: [max_position, rotary_dim] = cat(cos, sin) of rotary_dim/2 columns each.
            rotary_dim < head_size is partial rotary.
        is_neox: NeoX rotate_half (True) or GPT-J interleave (False).
        rope_dim_offset: the rotated lanes are [rope_dim_offset, rope_dim_offset + rotary_dim)
            of each head ([nope | rope] heads); the other lanes are not touched.
        inverse: rotate by −θ (the sine negated, no new table): undoes a forward call with the
            same positions up to rounding.
    """
    entry = (torch.ops.rome.rotary_embedding.default if torch.compiler.is_compiling()
             else _EAGER_ROTARY_EMBEDDING)
    entry(positions, query, key, int(head_size), cos_sin_cache, bool(is_neox),
          int(rope_dim_offset), bool(inverse))


def fused_qk_norm_rope(
    qkv: torch.Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    position_ids: torch.Tensor,
    gemma_norm: bool = False,
) -> None:
    """vLLM's ``fused_qk_norm_rope``, in place: every q and k head of ``qkv``
    [T, (Hq + Hk + Hv)·head_dim] (any row stride) is RMS-normalised over head_dim with its weight
    (``(1 + w)`` with ``gemma_norm``), in fp32, then rotated (``cos_sin_cache`` [max_pos, rot]
    = cat(cos, sin); rot < head_dim: the other lanes are normalised, not rotated) and rounded
    once. v is untouched. Positions outside the cache raise before anything is written."""
    entry = (torch.ops.rome.fused_qk_norm_rope.default if torch.compiler.is_compiling()
             else _EAGER_FUSED_QK_NORM_ROPE)
    entry(qkv, int(num_heads_q), int(num_heads_k), int(num_heads_v), int(head_dim), float(eps),
          q_weight, k_weight, cos_sin_cache, bool(is_neox), position_ids, bool(gemma_norm))


def rotary_embedding_with_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: Optional[torch.Tensor] = None,
    k_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    gemma_norm: bool = False,
) -> None:
    """RoPE + the paged KV-cache write in one pass: query [T, Hq·D] and key [T, Hk·D] (or
    [T, H, D]) rotated in place, then the rotated key and ``value`` written to ``key_cache`` /
    ``value_cache`` [num_blocks, block_size, Hk, D] at ``slot_mapping[t]`` (int32/int64;
    slot = block·block_size + offset; -1: a padding token, rotated but not stored). With
    ``q_weight`` and ``k_weight`` the heads are RMS-normalised first (QK-norm, as
    :func:`fused_qk_norm_rope`). A slot outside the cache or used twice raises before anything
    is written."""
    entry = (torch.ops.rome.rotary_embedding_with_cache.default if torch.compiler.is_compiling()
             else _EAGER_ROPE_WITH_CACHE)
    entry(positions, query, key, value, int(head_size), cos_sin_cache, bool(is_neox), key_cache,
          value_cache, slot_mapping, q_weight, k_weight, float(eps), bool(gemma_norm))


def apply_rotary_emb_interleaved(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """ExecuTorch's ``apply_rotary_emb_interleaved`` contract (complex pair rotation).

    Args:
        x: [B, N, C] with (real, imag) pairs interleaved along C.
        freqs_cis: any shape with N*C elements whose flattened layout is [N, C/2, 2]
            (cos, sin) pairs, e.g. [1, N, C/2, 2] or [N, C].

    Returns:
        ``out[..., 2k] = x[2k] cos[k] - x[2k+1] sin[k]``,
        ``out[..., 2k+1] = x[2k] sin[k] + x[2k+1] cos[k]``, x's dtype. Differentiable in x and
        freqs_cis.
    """
    return torch.ops.rome.apply_rotary_emb_interleaved.default(x, freqs_cis)


def rope_from_positions(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotation: str = "half",
    blocks: Optional[Sequence[int]] = None,
    rotary_dim: int = -1,
    amplitude: float = 1.0,
    column_axis: Optional[Sequence[int]] = None,
    inverse: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Table-free RoPE: no cos/sin table anywhere. Each token's cos/sin are computed inside the
    kernel from ``positions × inv_freq`` (the angle without rounding error, reduced by π/2 in
    double, cos/sin in fp32 on the reduced argument) and applied to every head of q and k.
    Within 2 fp32 ulp at any position below 2^50 / max(inv_freq); fp32 tables built the usual way
    are off by ~4e-2 at position 10^6.

    Args:
        q, k: as for :func:`rope` (k may be None; GQA k with fewer heads).
        positions: int32/int64, broadcastable to x's shape without its last axis, leading axes
            optional: ``[S]`` for BNSD ``[B, H, S, D]``, ``[B, S, 1]`` for BSND, ``[T, 1]`` for
            packed ``[T, H, D]``; with ``column_axis`` one more trailing axis (t, h, w, ...).
        inv_freq: ``rotary_dim/2`` frequencies (any float dtype; values taken exactly). Pair i
            is lanes i and i + rotary_dim/2 for 'half', 2i and 2i + 1 for 'interleave', the
            pairs of each block in turn with ``blocks``.
        rotation, blocks, rotary_dim: as for :func:`rope` ('dense' is not table-free).
        amplitude: multiplies cos and sin (YaRN / LongRoPE attention scaling).
        column_axis: per frequency, the axis of ``positions``' last dimension that drives it
            (MRoPE, multi-axis grids).
        inverse: rotate by −θ.

    Returns ``(q_out, k_out)``; ``k_out`` is an empty tensor when ``k`` is None. Autograd flows
    to q and k (the gradient is the transposed rotation), not to ``inv_freq``.
    """
    entry = (torch.ops.rome.rope_from_positions.default if torch.compiler.is_compiling()
             else _EAGER_FROM_POSITIONS)
    return entry(
        q, k, positions, inv_freq, rotation, _int_list(blocks), int(rotary_dim), float(amplitude),
        _int_list(column_axis), bool(inverse),
    )


def rope_from_positions_(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotation: str = "half",
    blocks: Optional[Sequence[int]] = None,
    rotary_dim: int = -1,
    amplitude: float = 1.0,
    column_axis: Optional[Sequence[int]] = None,
    inverse: bool = False,
) -> None:
    """In-place :func:`rope_from_positions` (inference only)."""
    entry = (torch.ops.rome.rope_from_positions_.default if torch.compiler.is_compiling()
             else _EAGER_FROM_POSITIONS_)
    entry(
        q, k, positions, inv_freq, rotation, _int_list(blocks), int(rotary_dim), float(amplitude),
        _int_list(column_axis), bool(inverse),
    )
