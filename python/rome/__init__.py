"""RoME: fused rotary position embedding (RoPE) for CPUs.

One fused operation for every RoPE variant::

    y = (x @ A) * cos + (x @ B) * sin          (A = I except for interleave_half)

Importing ``rome`` loads the native extension ``rome._C``, which registers the operators
``torch.ops.rome.*`` (CPU, Meta, Autograd), usable from eager mode, ``torch.compile`` and
``torch.export``. Python entry points:

- :mod:`rome.ops` — the operators (``rope``, ``rope_``, ``rope_matrix``, ``rope_matrix_``,
  ``rotary_embedding`` (vLLM), ``apply_rotary_emb_interleaved`` (ExecuTorch)).
- :mod:`rome.matrices` — the rotate matrices as dense tensors.
- :mod:`rome.tables` — cos/sin table builders (1D, grids, MRoPE, scalings, vLLM caches).
- :mod:`rome.modules` — :class:`~rome.modules.RotaryEmbedding`.
- :mod:`rome.flash_attn` — flash-attn's ``apply_rotary_emb`` (ragged batches, per-sequence
  offsets) and ``apply_rotary_emb_qkv_``.
- :mod:`rome.kv_cache` — :func:`~rome.kv_cache.rerotate_`: cached keys moved to new positions
  (context shift, prefix reuse), contiguous or paged.
"""

import torch  # noqa: F401  (the extension links against torch's libraries)

from . import _C
from . import flash_attn, kv_cache, matrices, modules, ops, tables
from .kv_cache import rerotate_
from .modules import RotaryEmbedding
from .ops import (
    apply_rotary_emb_interleaved,
    rope,
    rope_,
    rope_matrix,
    rope_matrix_,
    rope_from_positions,
    rope_from_positions_,
    rotary_embedding,
)

__version__ = "0.1.0"

ISAS = ("scalar", "avx2", "avx512", "amx")


def cpu_info() -> dict:
    """What the library sees and uses: ``detected_isa`` (CPU + OS), ``active_isa`` (after
    ``ROME_MAX_ISA`` and :func:`set_max_isa`), ``compiled_isas`` (kernels in this build) and
    ``default_num_threads`` (``ROME_NUM_THREADS``, else every core)."""
    return dict(_C.cpu_info())


def active_isa() -> str:
    """The instruction set the kernels use now: 'scalar', 'avx2', 'avx512' or 'amx'."""
    return _C.active_isa()


def set_max_isa(isa: str) -> str:
    """Caps the instruction set for later calls and returns the one now active. Never goes above
    what the CPU, the build and ``ROME_MAX_ISA`` allow; ``set_max_isa('amx')`` returns to that
    ceiling. Meant for tests and benchmarks."""
    return _C.set_max_isa(isa)


def set_num_threads(threads: int) -> None:
    """Runs RoME's ops on RoME's own pool with this many threads. 0 (the default) returns to
    following torch: ``torch.set_num_threads`` / ``OMP_NUM_THREADS`` through ``at::parallel_for``
    (unless ``ROME_NUM_THREADS`` is set)."""
    _C.set_num_threads(int(threads))


def last_call_threads() -> int:
    """How many distinct threads ran this thread's last RoME forward call (0: it had no work).
    A diagnostic: shows which thread setting took effect."""
    return int(_C.last_call_threads())


__all__ = [
    "ISAS",
    "RotaryEmbedding",
    "active_isa",
    "apply_rotary_emb_interleaved",
    "cpu_info",
    "flash_attn",
    "kv_cache",
    "last_call_threads",
    "matrices",
    "modules",
    "ops",
    "rerotate_",
    "rope",
    "rope_",
    "rope_matrix",
    "rope_matrix_",
    "rope_from_positions",
    "rope_from_positions_",
    "rotary_embedding",
    "set_max_isa",
    "set_num_threads",
    "tables",
]
