"""nn.Module front of RoME."""

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import ops, tables

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """1D, 2D or 3D (any number of axes) rotary embedding through :func:`rome.ops.rope`.

    Args:
        head_dim: D, the last axis of q and k.
        axes_dims: lanes of each position axis, e.g. ``[64, 64]`` (2D) or ``[44, 44, 40]`` (3D);
            default ``[head_dim]`` (1D). Their sum is the rotary dim (< head_dim: partial rotary).
        theta: base, one for all axes or one per axis.
        mode: ``"half"`` (NeoX rotate_half, one half block per axis) or ``"interleave"``
            (GPT-J pairs).
        max_positions: rows of the cos/sin cache (positions must be below it).
        seq_dim: the axis of q holding the sequence: -2 for BNSD [B, N, S, D] (default), -3 for
            BSND [B, S, N, D], 0 for packed [T, N, D].
        scaling: optional :class:`rome.tables.Scaling` (1D only).

    ``forward(q, k=None, positions=None, grid=None)`` returns ``q_out`` or ``(q_out, k_out)``:

    - 1D: ``positions`` [S] or [B, S] (default ``arange(S)``).
    - multi-axis: ``grid=(T, H, W)`` (tokens in row-major grid order, S = T*H*W), or
      ``positions`` [S, n_axes] / [B, S, n_axes].

    The cache is float32 (buffers ``cos_cache``/``sin_cache``, not saved in state dicts);
    gradients flow to q and k.
    """

    def __init__(
        self,
        head_dim: int,
        axes_dims: Optional[Sequence[int]] = None,
        theta: Union[float, Sequence[float]] = 10000.0,
        mode: str = "half",
        max_positions: int = 4096,
        seq_dim: int = -2,
        scaling: Optional[tables.Scaling] = None,
    ) -> None:
        super().__init__()
        if mode not in ("half", "interleave"):
            raise ValueError(f"rome: mode: expected 'half' or 'interleave', got {mode!r}")
        self.head_dim = int(head_dim)
        self.axes_dims = [int(d) for d in (axes_dims or [head_dim])]
        self.rotary_dim = sum(self.axes_dims)
        if self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rome: axes_dims: expected dims summing to at most head_dim {self.head_dim}, "
                f"got {self.axes_dims} (sum {self.rotary_dim})")
        self.mode = mode
        self.seq_dim = int(seq_dim)
        self.max_positions = int(max_positions)
        layout = "half" if mode == "half" else "pairs"
        if len(self.axes_dims) == 1:
            if not isinstance(theta, (int, float)):
                (theta,) = theta
            cos, sin = tables.rope_table(self.max_positions, self.rotary_dim, float(theta), layout, scaling)
            self.column_axis = []
        else:
            if scaling is not None:
                raise ValueError("rome: scaling: expected None for multi-axis RoPE, got a Scaling")
            cos, sin, self.column_axis = tables.axes_cache(self.max_positions, self.axes_dims, theta, layout)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, axes_dims={self.axes_dims}, mode={self.mode!r}, "
                f"max_positions={self.max_positions}, seq_dim={self.seq_dim}")

    def _positions(self, q: torch.Tensor, positions: Optional[torch.Tensor], grid) -> torch.Tensor:
        n_axes = len(self.axes_dims)
        rank = q.dim()
        seq = self.seq_dim % rank
        if seq == rank - 1:
            raise ValueError("rome: seq_dim: expected an axis before the head axis")
        if grid is not None:
            if len(grid) != n_axes:
                raise ValueError(f"rome: grid: expected {n_axes} sizes, got {list(grid)}")
            aranges = [torch.arange(int(s), device=q.device) for s in grid]
            mesh = torch.meshgrid(*aranges, indexing="ij")
            positions = torch.stack([m.reshape(-1) for m in mesh], dim=-1)
            if n_axes == 1:
                positions = positions[:, 0]
        elif positions is None:
            if n_axes != 1:
                raise ValueError("rome: positions: expected positions [S, n_axes] or a grid for "
                                 f"{n_axes}-axis RoPE, got None")
            positions = torch.arange(q.shape[seq], device=q.device)
        token_rank = positions.dim() - (1 if n_axes > 1 else 0)
        if token_rank not in (1, 2):
            raise ValueError(
                f"rome: positions: expected [S] or [B, S]{' plus an axis of ' + str(n_axes) if n_axes > 1 else ''}"
                f", got {list(positions.shape)}")
        shape = [1] * (rank - 1)
        shape[seq] = positions.shape[token_rank - 1]
        if token_rank == 2:
            if seq == 0:
                raise ValueError("rome: positions: [B, S] positions need a batch axis before seq_dim")
            shape[0] = positions.shape[0]
        if n_axes > 1:
            shape.append(n_axes)
        return positions.reshape(shape)

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        grid: Optional[Sequence[int]] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        pos = self._positions(q, positions, grid)
        q_out, k_out = ops.rope(
            q, k, self.cos_cache, self.sin_cache, positions=pos, rotation=self.mode,
            blocks=self.axes_dims if len(self.axes_dims) > 1 else None,
            rotary_dim=self.rotary_dim, column_axis=self.column_axis or None,
        )
        return q_out if k is None else (q_out, k_out)
