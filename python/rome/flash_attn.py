"""Drop-in for flash-attn's rotary API (``flash_attn.layers.rotary``) on the CPU.

- :func:`apply_rotary_emb` — ``apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False,
  seqlen_offsets=0, cu_seqlens=None, max_seqlen=None)``: x [B, S, H, D], or [total, H, D] packed
  sequences with ``cu_seqlens`` (int32/int64 [B+1]); cos/sin [seqlen_ro, rotary_dim/2];
  ``seqlen_offsets`` an int or a [B] tensor shifting each sequence's positions (batched decode
  with a KV cache). The first rotary_dim lanes rotate, the rest pass through. Differentiable in x.
- :func:`apply_rotary_emb_qkv_` — q and k of a packed qkv [B, S, 3, H, D] (or [B, S, H_total, D]
  with ``num_heads_q``: GQA, H_total = Hq + 2·Hk) rotated in place in one pass.

Every call is one RoME op over the whole batch: ragged batches gather each token's table row by
its position (no padding, no loop over sequences). Unlike flash-attn's Triton kernel, which reads
cos = 1, sin = 0 past the table, a position past ``seqlen_ro`` raises ``ValueError``.
"""

from typing import Optional, Tuple, Union

import torch

from . import ops

__all__ = ["apply_rotary_emb", "apply_rotary_emb_qkv_"]


def _fail(argument: str, expected: str, given) -> None:
    raise ValueError(f"{argument}: expected {expected}, got {given}")


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> int:
    if cos.dim() != 2:
        _fail("cos", "[seqlen_ro, rotary_dim/2]", list(cos.shape))
    if sin.shape != cos.shape:
        _fail("sin", f"the shape of cos {list(cos.shape)}", list(sin.shape))
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0 or rotary_dim > head_dim:
        _fail("cos", f"rotary_dim/2 columns with 0 < rotary_dim <= headdim {head_dim}",
              list(cos.shape))
    return rotary_dim


def _sequence_offsets(seqlen_offsets, batch: int) -> Union[int, torch.Tensor]:
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.dim() == 0:
            return int(seqlen_offsets)
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32,
                                                                           torch.int64):
            _fail("seqlen_offsets", f"an int or an int32/int64 tensor [{batch}]",
                  f"{seqlen_offsets.dtype} {list(seqlen_offsets.shape)}")
        return seqlen_offsets.to(torch.int64)
    return int(seqlen_offsets)


def _positions_and_tables(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen):
    """(cos, sin, positions) for ops.rope: direct table views when every sequence starts at the
    same int offset, else a cache gathered by per-token positions."""
    seqlen_ro = cos.shape[0]
    if cu_seqlens is None:
        if x.dim() != 4:
            _fail("x", "[batch, seqlen, nheads, headdim] (or [total, nheads, headdim] with "
                  "cu_seqlens)", list(x.shape))
        batch, seqlen = x.shape[0], x.shape[1]
        offsets = _sequence_offsets(seqlen_offsets, batch)
        if isinstance(offsets, int):
            if offsets < 0 or offsets + seqlen > seqlen_ro:
                _fail("seqlen_offsets", f"positions offset..offset+seqlen-1 inside the table of "
                      f"{seqlen_ro} rows (seqlen {seqlen})", offsets)
            # [seqlen, 1, W] views broadcast over batch and heads.
            return cos[offsets:offsets + seqlen, None], sin[offsets:offsets + seqlen, None], None
        positions = torch.arange(seqlen, dtype=torch.int64)[None, :] + offsets[:, None]
        _check_range(positions, seqlen_ro)
        return cos, sin, positions[..., None]
    if x.dim() != 3:
        _fail("x", "[total_seqlen, nheads, headdim] with cu_seqlens", list(x.shape))
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32,
                                                                                 torch.int64):
        _fail("cu_seqlens", "an int32/int64 tensor [batch + 1]",
              f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != x.shape[0] or bool((lengths < 0).any()):
        _fail("cu_seqlens", f"0 = cu[0] <= cu[1] <= ... <= cu[-1] = total_seqlen {x.shape[0]}",
              cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else "another sequence")
    batch = lengths.numel()
    if max_seqlen is not None and batch > 0 and int(lengths.max()) > int(max_seqlen):
        _fail("max_seqlen", f"at least the longest sequence ({int(lengths.max())})", max_seqlen)
    offsets = _sequence_offsets(seqlen_offsets, batch)
    sequence = torch.repeat_interleave(torch.arange(batch), lengths, output_size=x.shape[0])
    positions = torch.arange(x.shape[0], dtype=torch.int64) - cu[:-1][sequence]
    positions = positions + (offsets[sequence] if isinstance(offsets, torch.Tensor) else offsets)
    _check_range(positions, seqlen_ro)
    return cos, sin, positions[:, None]


def _check_range(positions: torch.Tensor, seqlen_ro: int) -> None:
    if positions.numel() == 0:
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= seqlen_ro:
        _fail("seqlen_offsets", f"every position (offset + index in its sequence) in "
              f"[0, seqlen_ro = {seqlen_ro})", f"positions {low}..{high}")


def _without_grad(table: torch.Tensor) -> torch.Tensor:
    """No gradient flows to flash-attn's tables. (detach only where one could: each view op costs
    about a microsecond, a decode step's budget.)"""
    return table.detach() if table.requires_grad else table


def _rotate(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen):
    rotary_dim = _check_tables(cos, sin, x.shape[-1])
    cos, sin = _without_grad(cos), _without_grad(sin)
    cos_t, sin_t, positions = _positions_and_tables(x, cos, sin, seqlen_offsets, cu_seqlens,
                                                    max_seqlen)
    args = (positions, "interleave" if interleaved else "half", (), rotary_dim,
            "pairs" if interleaved else "halves", (), None, None)
    if torch.compiler.is_compiling():  # traced: the overloads; eager: their C++ entries
        rope_, rope = torch.ops.rome.rope_.default, torch.ops.rome.rope.default
    else:
        rope_, rope = ops._EAGER_ROPE_, ops._EAGER_ROPE
    if inplace and not (torch.is_grad_enabled() and x.requires_grad):
        rope_(x, None, cos_t, sin_t, *args)
        return x
    y = rope(x, None, cos_t, sin_t, *args)[0]
    if inplace:  # differentiable: the copy carries the rotation's gradient
        return x.copy_(y)
    return y


def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Union[int, torch.Tensor] = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> torch.Tensor:
    """flash-attn's ``apply_rotary_emb``.

    Args:
        x: [batch, seqlen, nheads, headdim], or [total_seqlen, nheads, headdim] with cu_seqlens.
        cos, sin: [seqlen_ro, rotary_dim / 2] (any float dtype; no gradient flows to them).
        interleaved: GPT-J pairs (True) or NeoX halves (False).
        inplace: rotate x itself and return it.
        seqlen_offsets: an int, or an int tensor [batch]: sequence b's token i has position
            seqlen_offsets[b] + i.
        cu_seqlens: int32/int64 [batch + 1] cumulative sequence lengths (packed sequences).
        max_seqlen: with cu_seqlens, at least the longest sequence (checked, else unused).

    Returns:
        The rotated tensor (x itself when ``inplace``). Differentiable in x.
    """
    return _rotate(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


def apply_rotary_emb_qkv_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cos_k: Optional[torch.Tensor] = None,
    sin_k: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    seqlen_offsets: Union[int, torch.Tensor] = 0,
    num_heads_q: Optional[int] = None,
) -> torch.Tensor:
    """flash-attn's ``apply_rotary_emb_qkv_``: rotates q and k of qkv in place, returns qkv.

    qkv: [batch, seqlen, 3, nheads, headdim], or [batch, seqlen, nheads_q + 2·nheads_k, headdim]
    with ``num_heads_q``. cos_k/sin_k: k's own tables (default: cos/sin)."""
    if num_heads_q is None:
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            _fail("qkv", "[batch, seqlen, 3, nheads, headdim] (or rank 4 with num_heads_q)",
                  list(qkv.shape))
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        if qkv.dim() != 4 or (qkv.shape[2] - num_heads_q) <= 0 or (qkv.shape[2] - num_heads_q) % 2:
            _fail("qkv", f"[batch, seqlen, num_heads_q ({num_heads_q}) + 2·nheads_k, headdim]",
                  list(qkv.shape))
        heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + heads_k]
    separate_k = cos_k is not None and (cos_k is not cos or sin_k is not sin)
    differentiable = torch.is_grad_enabled() and qkv.requires_grad
    if separate_k or differentiable:
        _rotate(q, cos, sin, interleaved, True, seqlen_offsets, None, None)
        _rotate(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, interleaved,
                True, seqlen_offsets, None, None)
        return qkv
    # One pass over q and k together.
    rotary_dim = _check_tables(cos, sin, qkv.shape[-1])
    cos, sin = _without_grad(cos), _without_grad(sin)
    cos_t, sin_t, positions = _positions_and_tables(q, cos, sin, seqlen_offsets, None, None)
    ops.rope_(q, k, cos_t, sin_t, positions=positions,
              rotation="interleave" if interleaved else "half", rotary_dim=rotary_dim,
              table_width="pairs" if interleaved else "halves")
    return qkv
