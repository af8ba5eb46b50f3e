"""The benchmark rows: shapes, RoPE variants, inputs and exact (float64) tables.

Every row is a bf16 BNSD input with head size 128. Tables are built here in float64 from their
definition (not by RoME), then rounded to whatever each method uses, so the fp64 reference used
for precision is independent of the code under test.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

THETA = 10000.0
HEAD = 128
HEADS = 24
LLM_Q_HEADS, LLM_K_HEADS = 32, 8
LLM_CACHE = 8192  # positions in the LLM cos/sin cache
DEFAULT_SEQ = 28800
QUICK_SEQ = 512
DEFAULT_LLM_SEQ = 4096
QUICK_LLM_SEQ = 512


@dataclass
class Row:
    key: str  # command-line name
    title: str  # table label
    mode: str  # 'half' (NeoX rotate_half) or 'interleave' (GPT-J rotate_every_two)
    dims: List[int]  # lanes per axis: [128], [64, 64], [44, 44, 40], ...
    grid: List[int]  # positions per axis; prod(grid) = S (direct tables)
    q_shape: Tuple[int, ...]
    k_shape: Optional[Tuple[int, ...]] = None
    cache: int = 0  # > 0: tables are a [cache, 128] cache gathered by positions
    positions_start: int = 0
    decode: bool = False  # report microseconds per call (overhead, not bandwidth)
    # 'rotate': the mode's signed permutation (every standard RoPE); 'orthogonal': random dense
    # orthogonal blocks of `dims` (a learned rotation: RoME's matrix path); 'forced': the mode's
    # permutation run through RoME's matrix path anyway (rotation="dense_forced"), to compare paths.
    matrix: str = "rotate"

    @property
    def seq(self) -> int:
        return self.q_shape[-2]

    @property
    def multi_axis(self) -> bool:
        return len(self.dims) > 1

    @property
    def dense(self) -> bool:
        """A row whose matrix is not a signed permutation (no small-ops form exists)."""
        return self.matrix == "orthogonal"

    @property
    def matrix_path(self) -> bool:
        """RoME runs this row as matrix products."""
        return self.matrix in ("orthogonal", "forced")

    def matrix_flops(self, whole: bool = False) -> int:
        """Flops of x·M on the diagonal blocks (2 per multiply-add), q and k; whole: of the full
        HEAD × HEAD matrix (what a plain matmul multiplies)."""
        rows = (math.prod(self.q_shape) + (math.prod(self.k_shape) if self.k_shape else 0)) // HEAD
        return rows * (2 * HEAD * HEAD if whole else sum(2 * d * d for d in self.dims))

    @property
    def shape_text(self) -> str:
        q = "x".join(str(s) for s in self.q_shape)
        if self.k_shape is None:
            return f"[{q}]"
        k = "x".join(str(s) for s in self.k_shape)
        return f"Q [{q}] + K [{k}]"

    def bytes_moved(self, x_bytes_per_elem: int = 2, table_bytes_per_elem: int = 4) -> int:
        """Bytes of the floor: read q (and k), write the outputs, read the table rows used."""
        elems = math.prod(self.q_shape) + (math.prod(self.k_shape) if self.k_shape else 0)
        table = 2 * self.seq * HEAD * table_bytes_per_elem
        return 2 * elems * x_bytes_per_elem + table + (self.seq * 8 if self.cache else 0)


def _grid_2d(s: int) -> List[int]:
    h = int(math.isqrt(s))
    while s % h:
        h -= 1
    return [h, s // h]


def _grid_3d(s: int) -> List[int]:
    for t in (8, 4, 2):
        if s % t == 0 and s // t >= 4:
            return [t] + _grid_2d(s // t)
    return [1] + _grid_2d(s)


def all_rows(seq: int = DEFAULT_SEQ, llm_seq: int = DEFAULT_LLM_SEQ) -> List[Row]:
    x = (1, HEADS, seq, HEAD)
    rows = []
    for mode in ("interleave", "half"):
        rows += [
            Row(f"{mode}_1d", f"{mode} 1D (128)", mode, [128], [seq], x),
            Row(f"{mode}_2d", f"{mode} 2D (64+64)", mode, [64, 64], _grid_2d(seq), x),
            Row(f"{mode}_3d", f"{mode} 3D (44+44+40)", mode, [44, 44, 40], _grid_3d(seq), x),
        ]
    rows.append(Row("wan_3d", "Wan interleave 3D (44+42+42)", "interleave", [44, 42, 42], _grid_3d(seq), x))
    rows.append(Row("llm_prefill", "LLM prefill, half, GQA, cache", "half", [128], [llm_seq],
                    (1, LLM_Q_HEADS, llm_seq, HEAD), (1, LLM_K_HEADS, llm_seq, HEAD), cache=LLM_CACHE))
    rows.append(Row("decode", "decode (1 token), half, GQA, cache", "half", [128], [1],
                    (1, LLM_Q_HEADS, 1, HEAD), (1, LLM_K_HEADS, 1, HEAD), cache=LLM_CACHE,
                    positions_start=llm_seq, decode=True))
    # The matrix path: learned (dense) rotations, and a standard one forced through it.
    rows.append(Row("dense_1d", "dense orthogonal 128", "half", [128], [seq], x, matrix="orthogonal"))
    rows.append(Row("dense_3d", "dense blocks 44+44+40", "half", [44, 44, 40], _grid_3d(seq), x,
                    matrix="orthogonal"))
    rows.append(Row("dense_llm", "dense orthogonal 128, LLM shape", "half", [128], [llm_seq],
                    (1, LLM_Q_HEADS, llm_seq, HEAD), matrix="orthogonal"))
    rows.append(Row("forced_half_1d", "half 1D forced through matrix path", "half", [128], [seq], x,
                    matrix="forced"))
    return rows


ROW_KEYS = [r.key for r in all_rows(QUICK_SEQ, QUICK_LLM_SEQ)]


# ------------------------------------------------------------------------------------------------
# Exact tables and matrices


def axis_angles(positions: torch.Tensor, dim: int, theta: float = THETA) -> torch.Tensor:
    """[len(positions), dim/2] float64 angles p * theta^(-2i/dim)."""
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return positions.to(torch.float64)[:, None] * inv[None, :]


def lane_layout(values: torch.Tensor, mode: str) -> torch.Tensor:
    """[..., d/2] per-frequency values -> [..., d] per-lane: half [f.., f..] or pairs [f0 f0 ..]."""
    if mode == "half":
        return torch.cat([values, values], dim=-1)
    return values.repeat_interleave(2, dim=-1)


def grid_positions(grid: Sequence[int]) -> torch.Tensor:
    """[prod(grid), n_axes] int64 row-major positions (last axis fastest)."""
    axes = [torch.arange(n) for n in grid]
    mesh = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], dim=-1)


def angles(row: Row, positions: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Per-axis angle blocks [rows, d_a/2] (float64). Direct rows: over the grid; cache rows:
    over `positions` (default: every cache row)."""
    if row.cache:
        pos = torch.arange(row.cache) if positions is None else positions
        return [axis_angles(pos, row.dims[0])]
    pos = grid_positions(row.grid)
    return [axis_angles(pos[:, a], d) for a, d in enumerate(row.dims)]


def tables64(row: Row) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float64 per lane, [S, 128] (direct) or [cache, 128] (cache rows); axis a owns
    dims[a] consecutive lanes, each block in the row's layout (half or pairs)."""
    blocks = angles(row)
    cos = torch.cat([lane_layout(torch.cos(b), row.mode) for b in blocks], dim=-1)
    sin = torch.cat([lane_layout(torch.sin(b), row.mode) for b in blocks], dim=-1)
    return cos, sin


def half_width64(row: Row) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per-axis (cos, sin) of one value per frequency, [rows, d_a/2] (ONNX caches)."""
    return [(torch.cos(b), torch.sin(b)) for b in angles(row)]


def rotate_matrix(mode: str, dim: int, dtype=torch.float64) -> torch.Tensor:
    """M with (x @ M) = rotate_half(x) (half) or rotate_every_two(x) (interleave)."""
    m = torch.zeros(dim, dim, dtype=dtype)
    if mode == "half":
        h = dim // 2
        idx = torch.arange(h)
        m[idx + h, idx] = -1.0  # out[j] = -x[j + h]
        m[idx, idx + h] = 1.0  # out[j + h] = x[j]
    else:
        idx = torch.arange(0, dim, 2)
        m[idx + 1, idx] = -1.0  # out[2i] = -x[2i + 1]
        m[idx, idx + 1] = 1.0  # out[2i + 1] = x[2i]
    return m


def block_matrix(mode: str, dims: Sequence[int], dtype=torch.float64) -> torch.Tensor:
    return torch.block_diag(*[rotate_matrix(mode, d, dtype) for d in dims])


def random_orthogonal(dim: int, seed: int) -> torch.Tensor:
    """A random orthogonal [dim, dim] matrix (QR of a Gaussian one), rounded to float32 and held
    in float64: the float32 matrix is exactly the one every method is given."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return q.float().double()


def matrix64(row: Row) -> torch.Tensor:
    """The row's [128, 128] matrix M (B; A = I) in float64."""
    if row.matrix == "orthogonal":
        return torch.block_diag(*[random_orthogonal(d, 100 + i) for i, d in enumerate(row.dims)])
    return block_matrix(row.mode, row.dims)


# ------------------------------------------------------------------------------------------------
# Inputs


@dataclass
class Inputs:
    row: Row
    q: torch.Tensor  # bf16
    k: Optional[torch.Tensor]
    cos64: torch.Tensor  # [S, 128] direct, or [cache, 128]
    sin64: torch.Tensor
    positions: Optional[torch.Tensor]  # [S] int64 for cache rows
    _cache: Dict = field(default_factory=dict)

    def tables(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        key = ("tables", dtype)
        if key not in self._cache:
            self._cache[key] = (self.cos64.to(dtype), self.sin64.to(dtype))
        return self._cache[key]

    def axis_tables(self, dtype: torch.dtype) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per-axis contiguous (cos, sin) [S, d_a] (how multi-axis models keep them)."""
        key = ("axis", dtype)
        if key not in self._cache:
            cos, sin = self.tables(dtype)
            out, at = [], 0
            for d in self.row.dims:
                out.append((cos[:, at:at + d].contiguous(), sin[:, at:at + d].contiguous()))
                at += d
            self._cache[key] = out
        return self._cache[key]

    def lane_tables64(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables [S, 128] float64 (cache rows: gathered by positions)."""
        if self.positions is None:
            return self.cos64, self.sin64
        return self.cos64[self.positions], self.sin64[self.positions]

    def operands(self) -> List[torch.Tensor]:
        return [self.q] + ([self.k] if self.k is not None else [])


def make_inputs(row: Row, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(row.q_shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    k = None
    if row.k_shape is not None:
        k = torch.randn(row.k_shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    cos, sin = tables64(row)
    positions = None
    if row.cache:
        positions = torch.arange(row.positions_start, row.positions_start + row.seq, dtype=torch.int64)
    return Inputs(row, q, k, cos, sin, positions)
