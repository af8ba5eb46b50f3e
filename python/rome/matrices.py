"""Rotate matrices as dense tensors, built by the C++ library (``Rotation::to_dense_*``).

Conventions: ``(x @ B)`` is x's "rotated partner" with signs, so RoPE is
``x * cos + (x @ B) * sin`` (and ``(x @ A) * cos + (x @ B) * sin`` for interleave_half). Every
matrix here is a signed permutation: passing it to :func:`rome.ops.rope_matrix` takes the
permute fast path.
"""

from typing import Optional, Sequence, Tuple

import torch

from . import _C

__all__ = ["half", "interleave", "quarter", "interleave_half", "block_diag", "partial", "rotation"]


def rotation(
    kind: str,
    rotary_dim: int,
    blocks: Optional[Sequence[int]] = None,
    head_dim: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)``, each [head_dim, head_dim], of a rotation ``kind`` ('half', 'interleave',
    'quarter', 'interleave_half') on the first ``rotary_dim`` lanes, optionally block diagonal
    (``blocks`` summing to rotary_dim). Past rotary_dim, A is the identity and B is zero: use
    tables with cos = 1, sin = 0 there (partial rotary)."""
    a, b = _C.rotation_matrices(
        kind, int(rotary_dim), [int(s) for s in (blocks or [])], -1 if head_dim is None else int(head_dim)
    )
    return a.to(dtype), b.to(dtype)


def half(dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NeoX rotate_half: ``(x @ M)[j] = -x[j + D/2]`` for j < D/2, ``+x[j - D/2]`` otherwise."""
    return rotation("half", dim, dtype=dtype)[1]


def interleave(dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GPT-J rotate_every_two: ``(x @ M)[2i] = -x[2i+1]``, ``(x @ M)[2i+1] = x[2i]``."""
    return rotation("interleave", dim, dtype=dtype)[1]


def quarter(dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Half rotation inside each half: rotated = cat(-x2, x1, -x4, x3) over four D/4 chunks."""
    return rotation("quarter", dim, dtype=dtype)[1]


def interleave_half(dim: int, dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek MLA: ``(A, B)`` with A the de-interleave permutation and B = A @ half;
    ``y = (x @ A) * cos + (x @ B) * sin`` in de-interleaved order."""
    return rotation("interleave_half", dim, dtype=dtype)


def block_diag(sizes: Sequence[int], kind: str = "half", dtype: torch.dtype = torch.float32):
    """Block diagonal of ``kind`` blocks, e.g. ``block_diag([44, 44, 40])`` for 3D RoPE with half
    blocks. Returns B (or ``(A, B)`` for kind 'interleave_half')."""
    a, b = rotation(kind, sum(int(s) for s in sizes), blocks=sizes, dtype=dtype)
    return (a, b) if kind == "interleave_half" else b


def partial(
    kind: str,
    rotary_dim: int,
    head_dim: int,
    blocks: Optional[Sequence[int]] = None,
    dtype: torch.dtype = torch.float32,
):
    """A rotation of the first ``rotary_dim`` of ``head_dim`` lanes as a [head_dim, head_dim]
    matrix (zero past rotary_dim; the tables must hold cos = 1, sin = 0 on those lanes). Returns B
    (or ``(A, B)`` for kind 'interleave_half')."""
    a, b = rotation(kind, rotary_dim, blocks=blocks, head_dim=head_dim, dtype=dtype)
    return (a, b) if kind == "interleave_half" else b
