"""KV-cache re-rotation: move cached keys to new positions without recomputing them.

RoPE rotations compose, R(p + delta) = R(delta)·R(p), so keys already rotated at positions p
become keys at p + delta by one more rotation by delta — the context shift of llama.cpp
(``llama_kv_self_seq_add``) and prefix reuse at another offset. :func:`rerotate_` does that in
place in one pass over the touched keys, with one table row per sequence (angles delta·inv_freq
formed and reduced in float64): no table of the sequence length is built.
"""

from typing import Optional, Union

import torch

from . import ops

__all__ = ["rerotate_", "shift_tables"]


def _fail(argument: str, expected: str, given) -> None:
    raise ValueError(f"{argument}: expected {expected}, got {given}")


def shift_tables(delta: torch.Tensor, inv_freq: torch.Tensor):
    """cos/sin [num_seqs, rotary_dim/2] (float32) of the angles delta[b]·inv_freq[i], computed in
    float64 (exact products for |delta| < 2^53 / max inv_freq, one rounding at the end)."""
    angles = delta.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def rerotate_(
    key_cache: torch.Tensor,
    delta: Union[int, torch.Tensor],
    inv_freq: Optional[torch.Tensor] = None,
    *,
    base: Optional[float] = None,
    rotary_dim: Optional[int] = None,
    is_neox: bool = True,
    rope_dim_offset: int = 0,
    block_table: Optional[torch.Tensor] = None,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rotates cached keys in place by a position shift and returns ``key_cache``.

    Args:
        key_cache: a contiguous-sequence cache [num_seqs, S, H, D] or [num_seqs, H, S, D] (any
            strides but the last axis; slice it, e.g. ``cache[:, p0:p1]``, to shift a range), or
            [S, H, D] for one sequence; with ``block_table`` a paged cache
            [num_blocks, block_size, H, D] (a [num_blocks, H, block_size, D] cache as its
            ``.transpose(1, 2)`` view).
        delta: the position shift, an int or an int tensor [num_seqs] (may be negative).
        inv_freq: the model's inverse frequencies [rotary_dim/2] (YaRN/NTK-scaled ones
            included; the attention scaling of the tables is already in the keys and is not
            applied again). Or ``base`` (theta) and ``rotary_dim``.
        is_neox: NeoX halves (True) or GPT-J pairs (False).
        rope_dim_offset: the rotated lanes start at this lane of each head.
        block_table, seq_lens: paged cache: int32/int64 [num_seqs, max_blocks] and
            [num_seqs]; sequence b's slots [0, seq_lens[b]) of its blocks are re-rotated, nothing
            else is read or written. No block may belong to two sequences.
    """
    if inv_freq is None:
        if base is None or rotary_dim is None:
            _fail("inv_freq", "a tensor [rotary_dim/2], or base and rotary_dim", None)
        inv_freq = 1.0 / (float(base) ** (torch.arange(0, int(rotary_dim), 2,
                                                        dtype=torch.float64) / int(rotary_dim)))
    if inv_freq.dim() != 1 or inv_freq.numel() == 0:
        _fail("inv_freq", "a tensor [rotary_dim/2]", list(inv_freq.shape))
    paged = block_table is not None
    if paged and seq_lens is None:
        _fail("seq_lens", "an int tensor [num_seqs] with block_table", None)
    num_seqs = (block_table.shape[0] if paged
                else key_cache.shape[0] if key_cache.dim() == 4 else 1)
    if isinstance(delta, torch.Tensor) and delta.dim() > 0:
        if delta.shape != (num_seqs,) or delta.is_floating_point():
            _fail("delta", f"an int or an int tensor [{num_seqs}] (one shift per sequence)",
                  f"{delta.dtype} {list(delta.shape)}")
        deltas = delta.to(torch.int64)
    else:
        deltas = torch.full((num_seqs,), int(delta), dtype=torch.int64)
    cos, sin = shift_tables(deltas, inv_freq)
    rd = 2 * inv_freq.numel()
    rotation = "half" if is_neox else "interleave"
    if paged:
        torch.ops.rome.rerotate_paged_.default(key_cache, cos, sin, block_table, seq_lens,
                                               rotation, int(rope_dim_offset))
        return key_cache
    if key_cache.dim() not in (3, 4):
        _fail("key_cache", "[num_seqs, S, H, D], [num_seqs, H, S, D] or [S, H, D]",
              list(key_cache.shape))
    if rope_dim_offset < 0 or rope_dim_offset + rd > key_cache.shape[-1]:
        _fail("rope_dim_offset", f"an offset in [0, D - rotary_dim] = "
              f"[0, {key_cache.shape[-1] - rd}]", rope_dim_offset)
    # One row per sequence, broadcast over the two middle axes (tokens and heads, either order).
    shape = (num_seqs, 1, 1, rd // 2) if key_cache.dim() == 4 else (1, 1, rd // 2)
    keys = key_cache[..., rope_dim_offset:rope_dim_offset + rd]
    ops.rope_(keys, None, cos.reshape(shape), sin.reshape(shape), rotation=rotation,
              table_width="halves" if is_neox else "pairs")
    return key_cache
