"""Drop-in for diffusers' ``apply_rotary_emb`` (``diffusers.models.embeddings``), built on
:func:`rome.ops.rope`.

diffusers computes ``(x.float() * cos + x_rotated.float() * sin).to(x.dtype)``: math in fp32,
one rounding to x's dtype — as RoME does, so the results agree to the last bit except where fp32
rounding of the sum differs (at most one ulp of x's dtype; see tests/python/test_dropins.py).

- ``use_real_unbind_dim=-1`` (Flux, CogVideoX, HunyuanDiT, Wan-style tables): pairs
  ``(x[2i], x[2i+1])`` rotate — RoME's ``"interleave"`` rotation, tables
  ``[c0, c0, c1, c1, ...]`` (``get_1d_rotary_pos_embed(..., repeat_interleave_real=True)``).
- ``use_real_unbind_dim=-2`` (Stable Audio, OmniGen, CogView4, Cosmos): halves rotate — RoME's
  ``"half"`` rotation, tables ``[c0..c(n-1), c0..c(n-1)]``.
- ``use_real=False`` (Lumina): complex ``freqs_cis`` [..., S, D/2] multiplying the (real, imag)
  pairs of x [B, S, H, D] — also RoME's ``"interleave"`` rotation, reading cos = real part,
  sin = imaginary part with ``table_width="pairs"``. Implemented (complex128 tables run
  diffusers' own complex math, as do inputs RoME's kernels do not take).

The tables are used as given (per-lane values, no pair symmetry assumed), in their own dtype.

- :func:`apply_rotary_emb_qwen`: Qwen-Image's ``apply_rotary_emb_qwen`` (complex ``freqs_cis``
  [S, D/2] unsqueezed at axis 1 against x [B, S, H, D]; its ``use_real`` form is
  :func:`apply_rotary_emb`'s with ``sequence_dim=2``). Put it in place of the name in
  ``diffusers.models.transformers.transformer_qwenimage``.
- :class:`WanAttnProcessor` / :func:`patch_wan`: Wan 2.1/2.2's attention processor applies its
  3D RoPE with a function local to its ``__call__``, out of reach of a name patch. RoME's
  processor does Wan's self-attention with RoME's interleaved RoPE on q and k in one call, through
  diffusers' own projection and attention helpers; cross-attention, image-to-video blocks (added
  k/v projections) and anything else run diffusers' processor.
"""

import weakref
from typing import Tuple, Union

import torch

from . import ops
from .ops import _broadcasts_to

__all__ = ["apply_rotary_emb", "apply_rotary_emb_qwen", "WanAttnProcessor", "patch_wan"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _reference(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim):
    """diffusers' formula (diffusers/models/embeddings.py, apply_rotary_emb), for inputs the
    kernels do not take."""
    if use_real:
        cos, sin = freqs_cis
        if sequence_dim == 2:
            cos, sin = cos[None, None, :, :], sin[None, None, :, :]
        else:
            cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        cos, sin = cos.to(x.device), sin.to(x.device)
        if use_real_unbind_dim == -1:
            x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
            x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
        else:
            x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
            x_rotated = torch.cat([-x_imag, x_real], dim=-1)
        return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(2)
    x_out = torch.view_as_real(x_rotated * freqs_cis).flatten(3)
    return x_out.type_as(x)


# Per unsqueeze axis: the last few complex freqs_cis seen (weakly; a tensor's data pointer, shape
# and strides are its key too) and the real and imaginary parts of freqs_cis.unsqueeze(axis) as
# strided views. Qwen-Image alternates two tensors (image and text frequencies, each for q then
# k) through every block, Lumina one; building the views took a third of a small call. The views
# see in-place changes of values (they share the storage); a new tensor, storage, shape or
# strides builds them again. They keep the storage of the last few tensors alive.
_complex_views = {}
_COMPLEX_VIEWS_KEPT = 4


def _real_imag(freqs_cis: torch.Tensor, axis: int):
    if type(freqs_cis) is not torch.Tensor or torch.compiler.is_compiling():
        # Subclasses (fake tensors while tracing, ...): no data pointers, nothing to cache.
        freqs = freqs_cis.unsqueeze(axis)
        return freqs.real, freqs.imag
    key = (freqs_cis.data_ptr(), freqs_cis.shape, freqs_cis.stride())
    entries = _complex_views.setdefault(axis, [])
    for ref, entry_key, real, imag in entries:
        if ref() is freqs_cis and entry_key == key:
            return real, imag
    freqs = freqs_cis.unsqueeze(axis)
    real, imag = freqs.real, freqs.imag
    entries.insert(0, (weakref.ref(freqs_cis), key, real, imag))
    del entries[_COMPLEX_VIEWS_KEPT:]
    return real, imag


def _kernel_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> bool:
    return (
        x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES and x.dim() == 4
        and cos.dtype in _KERNEL_DTYPES and sin.dtype in _KERNEL_DTYPES
        and cos.shape == sin.shape and cos.dim() <= 4 and cos.shape[-1] == width
        and x.shape[-1] % 2 == 0 and x.shape[-1] > 0
    )


def apply_rotary_emb(
    x: torch.Tensor,
    freqs_cis: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    use_real: bool = True,
    use_real_unbind_dim: int = -1,
    sequence_dim: int = 2,
) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` through RoME (same signature, same results).

    Args:
        x: [B, H, S, D] (``sequence_dim=2``) or [B, S, H, D] (``sequence_dim=1``); with
            ``use_real=False``, [B, S, H, D].
        freqs_cis: ``(cos, sin)`` [S, D] when ``use_real``; else complex [S, D/2] or
            [B, S, D/2] (unsqueezed at axis 2, as diffusers does).
        use_real: real (cos, sin) tables, or complex frequencies.
        use_real_unbind_dim: -1 interleaved pairs, -2 halves.
        sequence_dim: 2 or 1 (the axis of x holding the sequence).

    Returns:
        A new tensor with x's shape and dtype. Differentiable in x and (real) cos/sin.
    """
    if use_real:
        if sequence_dim not in (1, 2):
            raise ValueError(f"`sequence_dim={sequence_dim}` but should be 1 or 2.")
        if use_real_unbind_dim not in (-1, -2):
            raise ValueError(
                f"`use_real_unbind_dim={use_real_unbind_dim}` but should be -1 or -2.")
        cos, sin = freqs_cis  # [S, D]
        # The layouts diffusers' broadcast gives meaning to (a sin of another shape broadcasts
        # to another result shape there); RoME runs on the CPU (a refusal costs an exception).
        if (x.dim() != 4 or cos.dim() != 2 or sin.shape != cos.shape
                or x.device.type != "cpu"):
            return _reference(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        # [S, D] tables broadcast to [B, H, S, D] as they are; [B, S, H, D] takes them as
        # [S, 1, D]. (Each view op costs about a microsecond in eager mode: a decode step.)
        if sequence_dim == 2:
            cos_b, sin_b, lead = cos, sin, (1, 1, cos.shape[0])
        else:
            cos_b, sin_b, lead = cos[:, None], sin[:, None], (1, cos.shape[0], 1)
        rotation = "interleave" if use_real_unbind_dim == -1 else "half"
        if not torch.compiler.is_compiling():
            # Eager: the kernel's own checks decide (they run before anything is computed);
            # diffusers' formula takes what they refuse.
            try:
                return ops._EAGER_ROPE(x, None, cos_b, sin_b, None, rotation, (), -1, "full",
                                       (), None, None)[0]
            except (ValueError, IndexError, NotImplementedError):
                return _reference(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        # Traced: a refusal would raise while tracing, where nothing falls back; these checks
        # mirror the kernel's for what diffusers passes.
        if (not _kernel_ok(x, cos, sin, x.shape[-1]) or cos.device.type != "cpu"
                or sin.device.type != "cpu" or not _broadcasts_to(lead, x.shape[:-1])):
            return _reference(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        return torch.ops.rome.rope.default(x, None, cos_b, sin_b, None, rotation, [], -1, "full",
                                           [], None, None)[0]

    # Complex frequencies (Lumina): freqs_cis.unsqueeze(2) multiplies x's (real, imag) pairs,
    # in fp32 for complex64 (complex128 runs diffusers' math, as do gradients of freqs_cis).
    if (not torch.is_tensor(freqs_cis) or freqs_cis.dtype != torch.complex64
            or freqs_cis.device.type != "cpu" or x.device.type != "cpu" or x.dim() != 4
            or freqs_cis.dim() < 2 or (torch.is_grad_enabled() and freqs_cis.requires_grad)):
        return _reference(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
    if torch.compiler.is_compiling():
        # Traced: the kernel's checks, mirrored (a refusal would raise while tracing).
        freqs_shape = (*freqs_cis.shape[:2], 1, *freqs_cis.shape[2:])  # without the view
        if (x.dtype not in _KERNEL_DTYPES or x.shape[-1] % 2 or x.shape[-1] == 0
                or freqs_shape[-1] != x.shape[-1] // 2
                or not _broadcasts_to(freqs_shape[:-1], x.shape[:-1])):
            return _reference(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        cos, sin = _real_imag(freqs_cis, 2)
        return torch.ops.rome.rope.default(x, None, cos, sin, None, "interleave", [], -1,
                                           "pairs", [], None, None)[0]
    cos, sin = _real_imag(freqs_cis, 2)  # strided views: the kernel reads their columns
    try:  # eager: the kernel's checks decide
        return ops._EAGER_ROPE(x, None, cos, sin, None, "interleave", (), -1, "pairs", (),
                               None, None)[0]
    except (ValueError, IndexError, NotImplementedError):
        return _reference(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)


def apply_rotary_emb_qwen(x: torch.Tensor, freqs_cis, use_real: bool = True,
                          use_real_unbind_dim: int = -1) -> torch.Tensor:
    """Qwen-Image's ``apply_rotary_emb_qwen`` through RoME (same signature, same results).

    With ``use_real=False`` (what Qwen-Image calls): x [B, S, H, D] as (real, imag) pairs times
    complex64 ``freqs_cis`` [S, D/2] (or [B, S, D/2]) unsqueezed at axis 1, in fp32, rounded once
    to x's dtype: RoME's interleave rotation with cos = real part, sin = imaginary part as
    "pairs" tables. Other inputs (complex128, not on the CPU, gradients of freqs_cis) run the same
    complex math in PyTorch.
    """
    if use_real:
        return apply_rotary_emb(x, freqs_cis, True, use_real_unbind_dim, sequence_dim=2)
    if (not isinstance(freqs_cis, torch.Tensor) or freqs_cis.dtype != torch.complex64
            or not freqs_cis.is_cpu or not x.is_cpu or x.dtype not in _KERNEL_DTYPES
            or x.dim() != 4 or (freqs_cis.requires_grad and torch.is_grad_enabled())
            or torch.compiler.is_compiling()):
        return _qwen_reference(x, freqs_cis)
    cos, sin = _real_imag(freqs_cis, 1)  # strided views: the kernel reads their columns
    try:  # eager only (traced calls took the reference above)
        return ops._EAGER_ROPE(x, None, cos, sin, None, "interleave", (), -1, "pairs", (),
                               None, None)[0]
    except (ValueError, IndexError):  # shapes the kernel does not take: PyTorch says why
        return _qwen_reference(x, freqs_cis)


def _qwen_reference(x, freqs_cis):
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(rotated * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)


class WanAttnProcessor:
    """diffusers' ``WanAttnProcessor`` with the rotary embedding on RoME.

    Wan's tables are ``(freqs_cos, freqs_sin)`` [1, S, 1, D] in its pairs layout
    (``repeat_interleave_real=True``: lane 2i and 2i + 1 hold angle i), of which Wan reads the
    even columns of cos and the odd columns of sin; RoME reads the same columns as "pairs"
    tables, so the math is Wan's (fp32, one rounding to q's dtype).
    """

    def __init__(self, original):
        self.original = original

    def __getattr__(self, name):  # _attention_backend, _parallel_config, ... of the original
        if name == "original":
            raise AttributeError(name)
        return getattr(self.original, name)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        if (rotary_emb is None or encoder_hidden_states is not None
                or getattr(attn, "add_k_proj", None) is not None
                or torch.compiler.is_compiling()):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 rotary_emb)
        from diffusers.models.transformers import transformer_wan as wan

        query, key, value = wan._get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        freqs_cos, freqs_sin = rotary_emb
        try:
            query, key = ops.rope(query, key, freqs_cos[..., 0::2], freqs_sin[..., 1::2],
                                  rotation="interleave", table_width="pairs")
        except (ValueError, IndexError, NotImplementedError):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 rotary_emb)
        # Set on this processor by set_attention_backend / enable_parallelism, else the
        # original's (see __getattr__).
        out = wan.dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class _WanPatch:
    def __init__(self, swapped):
        self.swapped = swapped  # (attention module, original processor)

    @property
    def active(self) -> bool:
        return bool(self.swapped)

    def undo(self) -> None:
        for attn, original in self.swapped:
            # Settings diffusers made on RoME's processor while it was in place go back with it.
            for name in ("_attention_backend", "_parallel_config"):
                if name in vars(attn.processor):
                    setattr(original, name, vars(attn.processor)[name])
            attn.processor = original
        self.swapped = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def patch_wan(model: torch.nn.Module) -> _WanPatch:
    """Gives every Wan attention module of `model` (e.g. a ``WanTransformer3DModel``) RoME's
    processor; ``handle.undo()`` (or leaving ``with patch_wan(model):``) restores diffusers'."""
    swapped = []
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if type(processor).__name__ == "WanAttnProcessor" and \
                not isinstance(processor, WanAttnProcessor):
            swapped.append((module, processor))
            module.processor = WanAttnProcessor(processor)
    return _WanPatch(swapped)
