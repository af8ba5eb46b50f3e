"""Drop-in for vLLM's rotary embedding, built on ``torch.ops.rome.rotary_embedding``.

- :func:`rotary_embedding` — ``vllm._custom_ops.rotary_embedding(positions, query, key,
  head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False)``: in place on query/key
  [T, H·D], [T, H, D] or [B, S, H·D]; ``cos_sin_cache`` [max_position, rotary_dim] = cat(cos,
  sin) of rotary_dim/2 columns each; rotary_dim < head_size is partial rotary, on lanes
  [rope_dim_offset, rope_dim_offset + rotary_dim) of each head (the other lanes are not
  touched); ``inverse`` rotates by −θ.
- :class:`RotaryEmbedding` — vLLM's ``RotaryEmbedding(head_size, rotary_dim,
  max_position_embeddings, base, is_neox_style, dtype)`` layer (vllm/model_executor/layers/
  rotary_embedding/base.py): the same cache, ``forward_native(positions, query, key=None)`` with
  the same results (out of place), and ``forward`` working in place like vLLM's fused kernels.

vLLM's native path rounds the cache to the query's dtype and computes in it
(``x1 * cos - x2 * sin``, three roundings in bf16); RoME reads the cache in its own dtype and
computes in fp32 with one rounding. With vLLM's usual setup (cache dtype = model dtype) the two
agree to one ulp of the result plus half an ulp of each product in bf16/fp16, and to a few fp32
ulps in fp32. A position outside the cache raises ``IndexError``.
"""

from typing import Optional, Tuple

import torch

from . import ops
from . import tables as rome_tables

__all__ = ["RotaryEmbedding", "fused_qk_norm_rope", "rotary_embedding",
           "rotary_embedding_with_cache"]

# vLLM's fused op (same schema, plus Gemma's (1 + w) norm) and RoPE + the paged cache write.
fused_qk_norm_rope = ops.fused_qk_norm_rope
rotary_embedding_with_cache = ops.rotary_embedding_with_cache


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
    """``vllm._custom_ops.rotary_embedding``: rotates query (and key) in place; returns None."""
    ops.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox,
                         rope_dim_offset, inverse)


def _frequencies_of(module, rotary_dim: int) -> Tuple[torch.Tensor, float]:
    """(inv_freq, amplitude) of a vLLM rotary module, checked against its own cache."""
    cache = module.cos_sin_cache
    compute = getattr(module, "_compute_inv_freq", None)
    try:
        inv_freq = compute(module.base).detach().to(torch.float32).reshape(-1)
    except Exception as e:  # no such method, another signature, ...
        raise ValueError(
            "rome.vllm.RotaryEmbedding.from_module: table_free: expected a module whose "
            "_compute_inv_freq(base) gives its frequencies, got "
            f"{type(module).__name__} ({type(e).__name__}: {e}); keep its cache "
            "(table_free=False)") from None
    if inv_freq.numel() != rotary_dim // 2 or cache.dim() != 2 or cache.shape[1] != rotary_dim:
        raise ValueError(
            "rome.vllm.RotaryEmbedding.from_module: table_free: expected rotary_dim / 2 = "
            f"{rotary_dim // 2} frequencies and a cache [P, {rotary_dim}], got "
            f"{inv_freq.numel()} and {list(cache.shape)}")
    amplitude = float(cache[0, 0])
    rows = min(int(cache.shape[0]), 256)
    cos, sin = rome_tables.cos_sin(torch.arange(rows), inv_freq, "half", amplitude)
    h = rotary_dim // 2
    built = torch.cat([cos[:, :h], sin[:, :h]], -1)
    # The module's fp32 angles are off by up to rows·|f|·2^-24 (~1.5e-5 here), plus its dtype's
    # rounding; a cache of other frequencies or another scale is off by far more.
    eps = torch.finfo(cache.dtype).eps
    tolerance = abs(amplitude) * (4 * rows * 2.0 ** -24 + 2 * eps)
    error = float((built - cache[:rows].float()).abs().max())
    if not error <= tolerance:
        raise ValueError(
            "rome.vllm.RotaryEmbedding.from_module: table_free: expected the module's cache to "
            "hold cos/sin of _compute_inv_freq(base) (scaled by its row 0), got an error of "
            f"{error:.3g} (> {tolerance:.3g}) in its first {rows} rows: {type(module).__name__} "
            "builds its cache from other frequencies; keep its cache (table_free=False)")
    return inv_freq, amplitude


class RotaryEmbedding(torch.nn.Module):
    """vLLM's ``RotaryEmbedding`` layer on RoME.

    Args:
        head_size: D.
        rotary_dim: lanes rotated (<= head_size; smaller is partial rotary).
        max_position_embeddings: rows of the cache.
        base: theta.
        is_neox_style: NeoX rotate_half (True) or GPT-J pairs (False).
        dtype: dtype of the cache (vLLM: the model's dtype).
        table_free: keep no cache: each call computes its tokens' cos/sin from
            ``positions × inv_freq`` inside the kernel (:func:`rome.ops.rope_from_positions`),
            within 2 fp32 ulp at any position (vLLM's fp32 cache is off by ~3e-2 at 10^6). The
            frequencies are vLLM's own (``inv_freq``, fp32 values taken exactly); positions are
            not limited by ``max_position_embeddings``.

    Otherwise the buffer ``cos_sin_cache`` [max_position_embeddings, rotary_dim] is computed
    exactly as vLLM computes it (fp32 ``einsum`` of positions and inverse frequencies, then
    ``cat(cos, sin)``, cast to ``dtype``).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        table_free: bool = False,
    ) -> None:
        super().__init__()
        self.head_size = int(head_size)
        self.rotary_dim = int(rotary_dim)
        self.max_position_embeddings = int(max_position_embeddings)
        self.base = base
        self.is_neox_style = bool(is_neox_style)
        self.dtype = dtype
        self.table_free = bool(table_free)
        self.cos_sin_cache: Optional[torch.Tensor]
        self.amplitude = 1.0  # table_free: vLLM's plain cache has none
        if self.table_free:
            self.register_buffer("inv_freq", self._compute_inv_freq(base), persistent=False)
            self.cos_sin_cache = None
        else:
            cache = self._compute_cos_sin_cache().to(dtype)
            self.register_buffer("cos_sin_cache", cache, persistent=False)

    @classmethod
    def from_module(cls, module, table_free: bool = False) -> "RotaryEmbedding":
        """Wraps an existing vLLM ``RotaryEmbedding`` (any object with ``head_size``,
        ``rotary_dim``, ``max_position_embeddings``, ``base``, ``is_neox_style`` and
        ``cos_sin_cache``): shares its cache, so scaled variants (YaRN, Llama-3.1, ...) whose
        cache vLLM built keep working.

        ``table_free=True`` keeps no cache: the frequencies are the module's own
        (``module._compute_inv_freq(module.base)``, vLLM's fp32 values) and the amplitude its
        cache's row 0 (YaRN's mscale). They are checked against the module's cache first (rows
        up to 256, within the fp32 angle's error there), so a variant whose cache comes from other
        frequencies (YaRN, dynamic NTK, a Llama-3.1 subclass without that method) raises
        ``ValueError`` instead of rotating by other angles; keep its cache then."""
        self = cls.__new__(cls)
        torch.nn.Module.__init__(self)
        self.head_size = int(module.head_size)
        self.rotary_dim = int(module.rotary_dim)
        self.max_position_embeddings = int(module.cos_sin_cache.shape[0])
        self.base = getattr(module, "base", None)
        self.is_neox_style = bool(module.is_neox_style)
        self.dtype = module.cos_sin_cache.dtype
        self.table_free = bool(table_free)
        self.amplitude = 1.0
        if not self.table_free:
            self.register_buffer("cos_sin_cache", module.cos_sin_cache, persistent=False)
            return self
        inv_freq, amplitude = _frequencies_of(module, self.rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.amplitude = amplitude
        self.cos_sin_cache = None
        return self

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float)
                               / self.rotary_dim))

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def get_cos_sin(self, seqlen: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.table_free:
            cos, sin = rome_tables.cos_sin(torch.arange(seqlen), self.inv_freq, "half",
                                           self.amplitude)
            h = self.rotary_dim // 2
            return cos[:, :h].to(self.dtype), sin[:, :h].to(self.dtype)
        cos, sin = self.cos_sin_cache[:seqlen].chunk(2, dim=-1)
        return cos, sin

    def _rotate_table_free(self, positions, query, key, head_size, offset, inverse):
        # [T, H·D] / [T, H, D] / [B, S, H·D] -> [..., H, D] views; positions one per token.
        def heads(x):
            if x is None:
                return None
            lead = tuple(positions.shape)
            v = x.view(*lead, -1, head_size)
            return v[..., offset:] if offset else v

        rotation = "half" if self.is_neox_style else "interleave"
        ops.rope_from_positions_(heads(query), heads(key), positions.unsqueeze(-1), self.inv_freq,
                                 rotation=rotation, rotary_dim=self.rotary_dim,
                                 amplitude=self.amplitude, inverse=inverse)

    def _rotate(self, positions, query, key, offsets, inverse=False):
        if offsets is not None:  # older vLLM versions: positions + offsets
            positions = positions + offsets
        # A [T, H, D] query (positions [T]) whose D exceeds head_size is a [nope | rope] head:
        # its last rotary_dim lanes rotate (rope_dim_offset = D - rotary_dim), as vLLM's MLA
        # layers call the op. ([B, S, H·D] queries come with positions [B, S].)
        head_size = self.head_size
        offset = 0
        if positions.dim() == 1 and query.dim() == 3 and query.shape[-1] > head_size:
            head_size = int(query.shape[-1])
            offset = head_size - self.rotary_dim
        if self.table_free:
            self._rotate_table_free(positions, query, key, head_size, offset, inverse)
            return
        ops.rotary_embedding(positions, query, key, head_size, self.cos_sin_cache,
                             self.is_neox_style, offset, inverse)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
        inverse: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """In place, like vLLM's CUDA/CPU kernels: rotates query (and key) and returns them.
        ``inverse`` rotates by −θ (undoes a forward call)."""
        self._rotate(positions, query, key, offsets, inverse)
        return query, key

    def forward_native(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
        inverse: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """vLLM's ``forward_native``: new tensors of query's (key's) shape; inputs untouched."""
        query = query.clone()
        key = None if key is None else key.clone()
        self._rotate(positions, query, key, offsets, inverse)
        return query, key

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
                f"is_neox_style={self.is_neox_style}, table_free={self.table_free}")
