"""Drop-ins for HuggingFace transformers, built on :func:`rome.ops.rope`.

- :func:`apply_rotary_pos_emb` — transformers' Llama ``apply_rotary_pos_emb`` (NeoX
  ``rotate_half`` RoPE; cos/sin [B, S, D]; q/k [B, H, S, D] with ``unsqueeze_dim=1`` or
  [B, S, H, D] with ``unsqueeze_dim=2``).
- :func:`apply_multimodal_rotary_pos_emb` — Qwen2-VL's MRoPE (transformers 4.x signature; cos/sin
  [3, B, S, D] per position axis, ``mrope_section`` e.g. [16, 24, 24]). transformers 5.x folds the
  section selection into ``Qwen2VLRotaryEmbedding`` and calls plain ``apply_rotary_pos_emb``, so
  :func:`patch_model` covers Qwen2-VL's text model there.
- :func:`patch_model` / :func:`patch_module` — make a loaded model's attention layers use RoME.
  They recognise every RoPE function transformers 5.24's modeling modules define under the names
  they patch (all 202 modules that define ``apply_rotary_pos_emb``, DeepSeek-V3's MLA
  ``apply_rotary_pos_emb_interleave``, Llama-4's and DeepSeek-V2's complex ``apply_rotary_emb`` or
  a vision tower's ``apply_rotary_pos_emb_vision``): Llama's, partial rotary, the fp32 up-casting
  forms (OLMo, ModernBERT, Cohere, Ernie), the interleaved ones (GPT-J, Cohere, GLM, Helium,
  DeepSeek-V4's trailing rope lanes), MLA's de-interleave, complex frequencies, vision towers,
  single-tensor (Gemma-3n/4), q/k/v (CLVP), prefix tokens (DINOv3) and the rest; see
  rome/_hf_forms.py and OTHER_FUNCTIONS_NOT_SERVED for the functions under other names.
  :func:`patch_model` also replaces the forward of the model's Llama-style rotary embedding
  modules (``inv_freq`` + ``attention_scaling``: rope types default, linear, dynamic, yarn,
  longrope, llama3 and every other type whose module computes ``cos/sin(position × inv_freq) ·
  attention_scaling``) by RoME's exact table builder (:func:`rome.tables.cos_sin`):
  the module's ``inv_freq`` values taken exactly, the angle without fp32 rounding, cos/sin within
  2 fp32 ulp at any position; dynamic / longrope updates of ``inv_freq`` still run first. MRoPE
  rotary modules (Qwen2-VL and Qwen2.5-VL sections, Qwen3-VL's interleave) get the same builder on
  their three position axes, each column taken from the axis the module's own
  ``recomposition_frequencies`` selects for it; other rotary modules are listed in ``skipped``.
  A module whose ``inv_freq`` requires grad, called with grad enabled, runs its own forward (the
  op gives no gradient for the frequencies), so training sees transformers' tables there.

Results equal transformers' function: same output shapes and dtypes (for Llama's, the promoted
dtype of q and the tables, as ``q * cos`` gives; for up-casting forms, q's), with the values of
the same formula (tests/python/test_hf_coverage.py checks every module's against float64). RoME
computes in fp32 and rounds once, where transformers rounds ``q * cos``, ``rotate_half(q) * sin``
and their sum to the output dtype: in fp32 the two agree to a few fp32 ulps, in bf16/fp16 to one
ulp of the result plus half an ulp of each product (see tests/python/test_dropins.py). Inputs RoME
does not take (not on the CPU, float64, rank above 5, tables that broadcast q to a larger shape)
run transformers' formula in eager PyTorch instead, so the drop-in never fails where transformers
would not. Under ``torch.compile`` the forms beyond Llama's and the partial one run the module's
own function (a refusal would raise while tracing, where nothing can fall back).
"""

import sys
import threading
import warnings
from types import ModuleType
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _hf_forms as forms
from . import ops
from .ops import _broadcasts_to
from . import tables as rome_tables

__all__ = [
    "apply_rotary_pos_emb",
    "apply_multimodal_rotary_pos_emb",
    "patch_model",
    "patch_module",
    "HFPatch",
]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# Reference math (transformers' own formulas), used where RoME's kernels do not apply.

def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, partial when cos is narrower than x."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat([(x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass], dim=-1)


# ------------------------------------------------------------------------------------------------
# The RoME path.

def _out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    # x * cos + rotate_half(x) * sin: the promoted dtype of the three (tensors of any rank > 0).
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def _kernel_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether RoME's kernel takes x with direct tables cos/sin (already unsqueezed)."""
    out = _out_dtype(x, cos, sin)
    d, rd = x.shape[-1] if x.dim() else 0, cos.shape[-1] if cos.dim() else 0
    return (
        x.device.type == "cpu" and cos.device.type == "cpu" and sin.device.type == "cpu"
        and out in _KERNEL_DTYPES and cos.dtype in _KERNEL_DTYPES and sin.dtype in _KERNEL_DTYPES
        and 2 <= x.dim() <= 5 and cos.shape == sin.shape
        and rd > 0 and rd % 2 == 0 and rd <= d
        and _broadcasts_to(cos.shape[:-1], x.shape[:-1])
    )


def _rope_qk(
    q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' ``(q * cos + rotate_half(q) * sin, k * cos + ...)`` for tables broadcastable
    to q and k (already unsqueezed); cos narrower than q means partial rotary (GPT-NeoX, Phi)."""
    rd = cos.shape[-1] if cos.dim() else 0
    if not torch.compiler.is_compiling():
        # Eager: ask the kernel itself (it validates everything before writing anything) and
        # fall back to transformers' formula on its refusal; the Python checks below cost more
        # than a decode step's RoPE. Under torch.compile a refusal raises while tracing (the
        # Meta kernel checks as the CPU one does), where nothing can catch it: the checks below
        # decide there.
        try:
            return _rope_kernel(q, k, cos, sin, rd)
        except (ValueError, IndexError, NotImplementedError):
            pass
    q_ok = _kernel_ok(q, cos, sin)
    k_ok = k is None or _kernel_ok(k, cos, sin)
    if not q_ok:
        q_out = _eager(q, cos, sin)
    if k is not None and not k_ok:
        k_out = _eager(k, cos, sin)
    if q_ok or (k is not None and k_ok):
        q_in = q.to(_out_dtype(q, cos, sin)) if q_ok else None
        k_in = k.to(_out_dtype(k, cos, sin)) if (k is not None and k_ok) else None
        # The op's default overload with every argument positional: the Python wrapper and
        # overload resolution cost a few µs per decode step.
        rope = torch.ops.rome.rope.default
        if q_in is not None and k_in is not None and q_in.dtype == k_in.dtype:
            q_out, k_out = rope(q_in, k_in, cos, sin, None, "half", [], rd, "full", [], None, None)
        else:
            if q_in is not None:
                q_out = rope(q_in, None, cos, sin, None, "half", [], rd, "full", [], None, None)[0]
            if k_in is not None:
                k_out = rope(k_in, None, cos, sin, None, "half", [], rd, "full", [], None, None)[0]
    return q_out, (None if k is None else k_out)


_ROPE = ops._EAGER_ROPE  # eager only (see _rope_qk)


def _rope_kernel(q, k, cos, sin, rd):
    """RoME's op on q and k (promoted to transformers' result dtype); raises what the op raises."""
    if cos.dim() > q.dim() or (k is not None and cos.dim() > k.dim()):
        # transformers' broadcast gives a result of the tables' rank; the op keeps q's.
        raise ValueError("rome.hf: tables of a higher rank than q")
    same = cos.dtype == q.dtype and sin.dtype == q.dtype
    q_in = q if same else q.to(_out_dtype(q, cos, sin))
    if k is None:
        return _ROPE(q_in, None, cos, sin, None, "half", (), rd, "full", (), None, None)[0], None
    k_in = k if same and k.dtype == q.dtype else k.to(_out_dtype(k, cos, sin))
    if q_in.dtype == k_in.dtype:
        return _ROPE(q_in, k_in, cos, sin, None, "half", (), rd, "full", (), None, None)
    return (_ROPE(q_in, None, cos, sin, None, "half", (), rd, "full", (), None, None)[0],
            _ROPE(k_in, None, cos, sin, None, "half", (), rd, "full", (), None, None)[0])


# ------------------------------------------------------------------------------------------------
# The drop-ins.

def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2, ...) through RoME.

    Args:
        q: [B, H, S, D] (``unsqueeze_dim=1``) or [B, S, H, D] (``unsqueeze_dim=2``); strided
            views (the transposed output of a projection) are read in place.
        k: like q, may have fewer heads (GQA/MQA), or None (returned as None).
        cos, sin: [B, S, D] (any float dtype; fp32 tables with bf16 q give an fp32 result, as in
            transformers).
        position_ids: unused, as in transformers (kept for the 4.x signature). An int here is
            read as ``unsqueeze_dim`` (a 5.x caller passing ``unsqueeze_dim`` positionally).
        unsqueeze_dim: the axis of q holding the heads.

    Returns:
        ``(q_embed, k_embed)`` = ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) *
        sin)``, new tensors in the promoted dtype of q (k) and the tables. Differentiable in q, k,
        cos and sin.
    """
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        unsqueeze_dim = position_ids
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    if cos.shape[-1] != q.shape[-1]:
        # transformers' Llama formula does not broadcast a narrower table either.
        raise ValueError(
            f"rome.hf.apply_rotary_pos_emb: cos: expected last axis {q.shape[-1]} (q's head "
            f"dim), got {cos.shape[-1]}")
    return _rope_qk(q, k, cos, sin)


def _apply_rotary_pos_emb_v5(q, k, cos, sin, unsqueeze_dim=1):
    """RoME's replacement for transformers 5.x ``apply_rotary_pos_emb(q, k, cos, sin,
    unsqueeze_dim=1)`` (see :func:`apply_rotary_pos_emb`)."""
    return apply_rotary_pos_emb(q, k, cos, sin, None, unsqueeze_dim)


def _apply_partial_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """RoME's replacement for the partial-rotary form (GPT-NeoX, Phi-3, ...): the first
    ``cos.shape[-1]`` lanes rotate, the others pass through."""
    return _rope_qk(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


def _apply_partial_rotary_pos_emb_v4(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The partial-rotary form with transformers 4.x's (unused) ``position_ids`` argument."""
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        unsqueeze_dim = position_ids
    return _apply_partial_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def _mrope_column_axis(mrope_section: Sequence[int], width: int) -> List[int]:
    sections = [int(s) for s in mrope_section] * 2
    if sum(sections) != width:
        raise ValueError(
            f"rome.hf.apply_multimodal_rotary_pos_emb: mrope_section: expected sections summing "
            f"to {width // 2} (half of cos' last axis {width}), got {list(mrope_section)}")
    return [i % 3 for i, n in enumerate(sections) for _ in range(n)]


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL's multimodal RoPE (transformers 4.x ``apply_multimodal_rotary_pos_emb``).

    Args:
        q, k: [B, H, S, D] (``unsqueeze_dim=1``) or [B, S, H, D] (``unsqueeze_dim=2``).
        cos, sin: [3, B, S, D] — the tables of the temporal, height and width positions.
        mrope_section: lanes per axis in one half, e.g. [16, 24, 24] (sum D/2). Column j of the
            output's tables comes from axis ``i % 3`` of section i of ``mrope_section * 2``.
        unsqueeze_dim: the axis of q holding the heads.

    Returns:
        ``(q_embed, k_embed)`` as transformers computes them, in the promoted dtype.

    The section selection happens inside the kernel: cos/sin are read as one position cache of
    3·B·S rows, and each table column gathers its row from its own axis (``column_axis``), with
    no merged [B, S, D] table built in between.
    """
    width = cos.shape[-1]
    column_axis = _mrope_column_axis(mrope_section, width)
    head_axis = unsqueeze_dim + 4 if unsqueeze_dim < 0 else unsqueeze_dim
    grads = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    merged_needed = (
        grads or cos.dim() != 4 or cos.shape != sin.shape or cos.shape[0] < 3
        or head_axis not in (0, 1, 2) or q.dim() != 4 or (k is not None and k.dim() != 4)
        or not _kernel_ok(q, cos[0].unsqueeze(head_axis), sin[0].unsqueeze(head_axis))
        or (k is not None and not _kernel_ok(k, cos[0].unsqueeze(head_axis),
                                             sin[0].unsqueeze(head_axis)))
        or width != q.shape[-1]
    )
    if merged_needed:
        # The selection as transformers writes it, then the 1D path (differentiable in cos/sin).
        sections = [int(s) for s in mrope_section] * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)
        return apply_rotary_pos_emb(q, k, cos, sin, None, unsqueeze_dim)

    axes, b, s = cos.shape[0], cos.shape[1], cos.shape[2]
    cache_cos = cos.reshape(axes * b * s, width)
    cache_sin = sin.reshape(axes * b * s, width)
    rows = torch.arange(b * s, dtype=torch.int64, device=cos.device).view(b, s)
    positions = torch.stack([rows + a * b * s for a in range(3)], dim=-1)  # [B, S, 3]
    positions = positions.unsqueeze(head_axis)  # [B, 1, S, 3] or [B, S, 1, 3]

    def run(x, other=None):
        dtype = _out_dtype(x, cos, sin)
        x = x.to(dtype)
        if other is not None:
            other = other.to(dtype)
        return ops.rope(x, other, cache_cos, cache_sin, positions=positions, rotation="half",
                        column_axis=column_axis)

    if k is None:
        return run(q)[0], None
    if _out_dtype(q, cos, sin) == _out_dtype(k, cos, sin):
        return run(q, k)
    return run(q)[0], run(k)[0]


# ------------------------------------------------------------------------------------------------
# Patching a loaded model.

# The Llama function and its partial-rotary form, as transformers writes them (compared as syntax
# trees with each helper named by its kind, so formatting, comments, docstrings, decorators and
# the helper's own name do not matter; see rome._hf_forms). The other forms live there.
_LLAMA_BODY = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (ROTATE_HALF(q) * sin)
    k_embed = (k * cos) + (ROTATE_HALF(k) * sin)
    return q_embed, k_embed
"""

# Partial rotary (rotary_dim = cos.shape[-1]): GPT-NeoX, Phi-3 and dots spell it three ways.
_PARTIAL_BODIES = (
    """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = q_rot * cos + ROTATE_HALF(q_rot) * sin
    k_embed = k_rot * cos + ROTATE_HALF(k_rot) * sin
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
""",
    """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (ROTATE_HALF(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (ROTATE_HALF(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed
""",
    """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    q, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_embed = q * cos + ROTATE_HALF(q) * sin
    k_embed = k * cos + ROTATE_HALF(k) * sin
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)
""",
)

# Llama-style rotary embedding forwards (transformers 5.x and 4.4x spellings).
_ROTARY_FORWARD_BODIES = (
    """
def forward(self, x, position_ids):
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling

    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
""",
    """
def forward(self, x, position_ids):
    inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
    position_ids_expanded = position_ids[:, None, :].float()

    device_type = x.device.type if isinstance(x.device.type, str) and x.device.type != "mps" else "cpu"
    with torch.autocast(device_type=device_type, enabled=False):  # Force float32
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling

    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
""",
)

# MRoPE rotary embedding forwards (Qwen2-VL, Qwen2.5-VL, Qwen3-VL text in transformers 5.x): the
# Llama formula per position axis (t, h, w), then recomposition_frequencies picks for every
# frequency the axis it follows (sections, or Qwen3-VL's interleave) and repeats the half.
_MROPE_FORWARD_BODIES = (
    """
def forward(self, x, position_ids):
    position_ids = position_ids.expand(3, -1, -1)
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    cos = freqs.cos() * self.attention_scaling
    sin = freqs.sin() * self.attention_scaling

    sin = self.recomposition_frequencies(sin)
    cos = self.recomposition_frequencies(cos)
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
""",
)

# transformers modeling modules (by file name) whose apply_rotary_pos_emb (or one of
# _OTHER_FUNCTIONS) RoME does not serve, with why. Empty for transformers 5.24: all 202 of its
# modules defining one of them are served.
NOT_SERVED: Dict[str, str] = {}

# RoPE functions under other names, which patch_model leaves as they are (transformers 5.24; the
# README lists them too).
OTHER_FUNCTIONS_NOT_SERVED: Dict[str, str] = {
    "vision_apply_rotary_emb (llama4)": "the vision tower's complex form: not recognised yet",
    "apply_rotary_time_emb (musicflamingo)": "an audio time embedding: not recognised yet",
    "apply_rotary_pos_emb_2d (sam2_video, sam3, sam3_tracker_video)":
        "2D RoPE of the video trackers' memory attention: not recognised yet",
    "apply_rotary_pos_emb_2d_self_attn, apply_rotary_pos_emb_2d_cross_attn (edgetam_video)":
        "the same trackers' 2D forms: not recognised yet",
}

_SIG_V5 = (["q", "k", "cos", "sin", "unsqueeze_dim"], [1], None)
_SIG_V4 = (["q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"], [None, 1], None)

_key_of = forms.key_of
_source_of = forms.source_of
_LLAMA_KEY = _key_of(_LLAMA_BODY)
_ROTARY_FORWARD_KEYS = {_key_of(src) for src in _ROTARY_FORWARD_BODIES}
_MROPE_FORWARD_KEYS = {_key_of(src) for src in _MROPE_FORWARD_BODIES}
_PARTIAL_KEYS = {_key_of(src) for src in _PARTIAL_BODIES}


def _contract(module: ModuleType):
    """(replacement, None) when `module`'s apply_rotary_pos_emb is a form RoME serves, else
    (None, reason)."""
    original = module.__dict__.get("apply_rotary_pos_emb")
    if original is None:
        return None, "no apply_rotary_pos_emb"
    if not callable(original):
        return None, "apply_rotary_pos_emb is not callable"
    if isinstance(original, torch.nn.Module):
        # transformers' hub-kernel decorator (active with a kernels version it accepts) turns the
        # function into a hook layer: read the function it wraps.
        from .hf_kernels import _hooked_function

        original = _hooked_function(type(original)) or original
    fn = forms.function_def(_source_of(original) or "")
    if fn is None:
        return None, "source of apply_rotary_pos_emb unavailable"
    namespace = forms.namespace_of(original)
    if namespace is None or namespace.get("torch") is not torch:
        return None, "'torch' where apply_rotary_pos_emb is defined is not torch"
    signature = forms.signature(fn)
    key = forms.canonical_key(fn, namespace)
    if key == _LLAMA_KEY:
        if signature == _SIG_V5:
            return _apply_rotary_pos_emb_v5, None
        if signature == _SIG_V4:
            return apply_rotary_pos_emb, None
    elif key in _PARTIAL_KEYS:
        if signature == _SIG_V5:
            return _apply_partial_rotary_pos_emb, None
        if signature == _SIG_V4:
            return _apply_partial_rotary_pos_emb_v4, None
    form = forms.FORM_BY_KEY.get(key)
    if form is not None and signature == form.signature:
        return forms.make_replacement(form, original), None
    return None, "apply_rotary_pos_emb (with the helpers it calls) is no form RoME serves"


# The module-level functions patch_module replaces beside apply_rotary_pos_emb (MLA's, Llama-4's
# and DeepSeek-V2's complex one, the vision towers'), each with the forms it may take.
_OTHER_FUNCTIONS: Dict[str, Dict[str, "forms.Form"]] = {
    "apply_rotary_pos_emb_interleave": forms.INTERLEAVE_FORM_BY_KEY,
    "apply_rotary_emb": forms.COMPLEX_FORM_BY_KEY,
    "apply_rotary_pos_emb_vision": forms.VISION_FORM_BY_KEY,
}


def _named_contract(module: ModuleType, name: str):
    """For a module defining `name` (one of _OTHER_FUNCTIONS): (replacement, None), or (None,
    reason). (None, None) for modules without it."""
    original = module.__dict__.get(name)
    if original is None:
        return None, None
    fn = forms.function_def(_source_of(original) or "") if callable(original) else None
    namespace = forms.namespace_of(original)
    if fn is not None and namespace is not None and namespace.get("torch") is torch:
        form = _OTHER_FUNCTIONS[name].get(forms.canonical_key(fn, namespace))
        if form is not None and forms.signature(fn) == form.signature:
            return forms.make_replacement(form, original), None
    return None, f"{name} is no form RoME serves"


# The module-level functions patch_module replaces (attention layers look them up at call time).
_PATCHED_NAMES = ("apply_rotary_pos_emb", *_OTHER_FUNCTIONS)
_REPLACEMENTS = (_apply_rotary_pos_emb_v5, apply_rotary_pos_emb, _apply_partial_rotary_pos_emb,
                 _apply_partial_rotary_pos_emb_v4)
_LOCK = threading.Lock()
_COS_SIN = torch.ops.rome.cos_sin.default
# module name -> [{function name: (original, replacement)}, reference count]
_ACTIVE: Dict[str, list] = {}


def _is_current(module: ModuleType, swaps: dict) -> bool:
    return all(module.__dict__.get(fn) is new for fn, (_, new) in swaps.items())


def _exact_rotary_forward(self, x, position_ids):
    """A Llama-style rotary module's forward on RoME's exact table builder."""
    if not (x.is_cpu and position_ids.is_cpu):
        return self._rome_original_forward(x, position_ids)
    # rome.tables.cos_sin's op called directly (it checks its arguments itself) and the buffer
    # read without Module.__getattr__: at one decode position this Python took as long as the op.
    inv_freq = self._buffers.get("inv_freq")
    if inv_freq is None:
        inv_freq = self.inv_freq
    if inv_freq.requires_grad and torch.is_grad_enabled():
        # Trainable frequencies: the op has no gradient for them, and some transformers versions'
        # forward gives one (others are no_grad): the original decides.
        return self._rome_original_forward(x, position_ids)
    return _COS_SIN(position_ids, inv_freq, "half", float(getattr(self, "attention_scaling", 1.0)),
                    x.dtype)


def _mrope_axes(module: torch.nn.Module) -> torch.Tensor:
    """For every output column of an MRoPE module, the position axis (0, 1, 2: t, h, w) it takes,
    found by running the module's own recomposition_frequencies on the axis numbers: whatever
    sections or interleave it applies, the same selection comes out."""
    half = module.inv_freq.numel()
    probe = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, half).clone()
    axes = module.recomposition_frequencies(probe).reshape(-1)
    if axes.numel() != 2 * half or not bool(((axes == 0) | (axes == 1) | (axes == 2)).all()):
        raise ValueError("recomposition_frequencies does not select one axis per column")
    return axes.to(torch.int64)


def _exact_mrope_forward(self, x, position_ids):
    """An MRoPE rotary module's forward on RoME's exact table builder: cos/sin of every axis's
    positions (one call for the three axes), then each column from its axis."""
    if x.device.type != "cpu" or position_ids.device.type != "cpu" or (
            self.inv_freq.requires_grad and torch.is_grad_enabled()):
        return self._rome_original_forward(x, position_ids)  # see _exact_rotary_forward
    scaling = float(getattr(self, "attention_scaling", 1.0))
    positions = position_ids.expand(3, -1, -1)
    # Rounded to x's dtype before the selection: picking a column commutes with rounding it.
    cos, sin = rome_tables.cos_sin(positions, self.inv_freq, "half", amplitude=scaling,
                                   dtype=x.dtype)
    index = self._rome_mrope_axes.view(1, 1, 1, -1).expand(1, *cos.shape[1:])
    return torch.gather(cos, 0, index)[0], torch.gather(sin, 0, index)[0]


def _rotary_kind(sub: torch.nn.Module):
    """("llama" | "mrope", None) when `sub` is a rotary module RoME serves, else (None, why)."""
    if not isinstance(getattr(sub, "inv_freq", None), torch.Tensor):
        return None, "no inv_freq buffer"
    key = _key_of(_source_of(type(sub).forward) or "")
    if key in _ROTARY_FORWARD_KEYS:
        return "llama", None
    if key in _MROPE_FORWARD_KEYS and callable(getattr(sub, "recomposition_frequencies", None)):
        return "mrope", None
    return None, "forward differs from the Llama and MRoPE rotary modules' (other math)"


def _patch_rotary(model: torch.nn.Module):
    patched, skipped = [], {}
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:  # transformers without dynamic RoPE: no update step to keep
        dynamic_rope_update = None
    for name, sub in model.named_modules():
        if not type(sub).__name__.endswith("RotaryEmbedding") or "_rome_original_forward" in \
                sub.__dict__:
            continue
        kind, reason = _rotary_kind(sub)
        if kind == "mrope":
            try:
                axes = _mrope_axes(sub)
            except Exception as e:  # noqa: BLE001 - any failure: leave the module alone
                kind, reason = None, f"MRoPE recomposition not understood ({e})"
        if kind is None:
            skipped[type(sub).__module__ + "." + type(sub).__name__] = reason
            continue
        original = sub.forward
        # A static rope type skips the update wrapper (it would only test rope_type every call).
        rope_type = getattr(sub, "rope_type", None)
        static = isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"
        updates = (hasattr(type(sub).forward, "__wrapped__") and dynamic_rope_update is not None
                   and not static)
        exact = _exact_mrope_forward if kind == "mrope" else _exact_rotary_forward
        forward = dynamic_rope_update(exact) if updates else exact
        if kind == "mrope":
            sub._rome_mrope_axes = axes
        sub._rome_original_forward = original
        sub.forward = forward.__get__(sub)
        patched.append((name, sub))
    return patched, skipped


class HFPatch:
    """What :func:`patch_model` / :func:`patch_module` changed; undo with :meth:`undo` (or use as
    a context manager). Undoing twice is harmless.

    Attributes:
        patched: names of the modeling modules whose ``apply_rotary_pos_emb`` now runs RoME.
        skipped: {module name: reason} for modules of the model left alone.
    """

    def __init__(self, patched: List[str], skipped: Dict[str, str], rotary=(), entries=None):
        self.patched = list(patched)
        self.skipped = dict(skipped)
        # The _ACTIVE entry each patched name counted on: one replaced since (the module restored
        # by hand, then patched again) belongs to other handles.
        self._entries = dict(entries or {})
        self._rotary = list(rotary)  # (qualified name, module) of each patched rotary module
        self._undone = False

    @property
    def rotary_patched(self) -> List[str]:
        """Names of the rotary embedding modules whose forward now runs RoME's exact builder."""
        return [name or "(model)" for name, _ in self._rotary]

    @property
    def active(self) -> bool:
        return not self._undone and bool(self.patched or self._rotary)

    def undo(self) -> None:
        """Restores the original functions (once every patch of a module is undone)."""
        with _LOCK:
            if self._undone:
                return
            self._undone = True
            for _, sub in self._rotary:
                sub.__dict__.pop("forward", None)
                sub.__dict__.pop("_rome_original_forward", None)
                sub.__dict__.pop("_rome_mrope_axes", None)
            for name in self.patched:
                entry = _ACTIVE.get(name)
                if entry is None or entry is not self._entries.get(name):
                    continue
                entry[1] -= 1
                if entry[1] == 0:
                    module = sys.modules.get(name)
                    for fn, (old, new) in entry[0].items():
                        if module is not None and module.__dict__.get(fn) is new:
                            setattr(module, fn, old)
                    del _ACTIVE[name]

    remove = undo

    def __enter__(self) -> "HFPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "undone" if self._undone else "active"
        return f"HFPatch({state}, patched={self.patched}, skipped={len(self.skipped)} modules)"


def _patch_modules(modules: Sequence[ModuleType]) -> HFPatch:
    patched, skipped = [], {}
    with _LOCK:
        for module in modules:
            name = module.__name__
            entry = _ACTIVE.get(name)
            if entry is not None and _is_current(module, entry[0]):
                entry[1] += 1
                patched.append(name)
                continue
            if any(f in _REPLACEMENTS or hasattr(f, "rome_form")
                   for f in (module.__dict__.get(n) for n in _PATCHED_NAMES)):
                skipped[name] = "already RoME's function (set outside patch_model)"
                continue
            swaps = {}
            replacement, reason = _contract(module)
            if replacement is not None:
                swaps["apply_rotary_pos_emb"] = (module.apply_rotary_pos_emb, replacement)
            reasons = {}
            for fn_name in _OTHER_FUNCTIONS:
                other, reasons[fn_name] = _named_contract(module, fn_name)
                if other is not None:
                    swaps[fn_name] = (module.__dict__[fn_name], other)
            if not swaps:
                skipped[name] = "; ".join(r for r in (reason, *reasons.values()) if r is not None)
                continue
            if replacement is None and "apply_rotary_pos_emb" in module.__dict__:
                skipped[name + ".apply_rotary_pos_emb"] = reason
            for fn_name, why in reasons.items():
                if why is not None:
                    skipped[f"{name}.{fn_name}"] = why
            _ACTIVE[name] = [swaps, 1]
            for fn, (_, new) in swaps.items():
                setattr(module, fn, new)
            patched.append(name)
    return HFPatch(patched, skipped, entries={name: _ACTIVE[name] for name in patched})


def patch_module(module: ModuleType) -> HFPatch:
    """Replaces ``module.apply_rotary_pos_emb`` and the other RoPE functions RoME patches
    (``_PATCHED_NAMES``) of a transformers modeling module (e.g.
    ``transformers.models.llama.modeling_llama``) by RoME's, each where it is a form RoME serves;
    the attention layers look the names up at call time. Returns an :class:`HFPatch`
    (``patched`` is empty, with the reasons in ``skipped``, when none of them is)."""
    return _patch_modules([module])


def patch_model(model: torch.nn.Module, warn: bool = True, rotary: bool = True) -> HFPatch:
    """Makes a loaded transformers model compute RoPE with RoME.

    transformers' attention layers call the module-level ``apply_rotary_pos_emb`` (and, in
    DeepSeek-V3-style MLA, ``apply_rotary_pos_emb_interleave``; in Llama-4 and DeepSeek-V2 the
    complex-frequency ``apply_rotary_emb``; in vision towers ``apply_rotary_pos_emb_vision``) of
    their modeling module, looked up at call time.
    This replaces those names in each modeling module the model's layers (and their base classes)
    come from, when the function there is one of the forms RoME serves (its syntax
    tree, with the helpers it calls, equals a known transformers form: see rome/_hf_forms.py);
    anything else is left alone and listed in ``skipped``. A replaced function still runs the
    module's own where RoME's kernel refuses the inputs (float64, not on the CPU, ...).

    The patch is per modeling module, so it affects every model of that architecture in the
    process until undone. Patches nest (a module is restored when its last patch is undone).

    With ``rotary=True`` the model's own Llama-style and MRoPE rotary embedding modules (this
    model only) compute cos/sin with :func:`rome.tables.cos_sin` (within 2 fp32 ulp at any position;
    see the module docstring); ``handle.rotary_patched`` names them.

    Returns:
        :class:`HFPatch`: ``handle.undo()`` restores the originals; ``with patch_model(m): ...``
        undoes on exit. Warns when nothing could be patched (unless ``warn=False``).
    """
    names = []
    for sub in model.modules():
        for cls in type(sub).__mro__:
            name = getattr(cls, "__module__", None)
            if not name or name.startswith("torch.") or name == "builtins" or name in names:
                continue
            names.append(name)
    modules = [sys.modules[n] for n in names
               if n in sys.modules and any(f in sys.modules[n].__dict__ for f in _PATCHED_NAMES)]
    handle = _patch_modules(modules)
    if rotary:
        with _LOCK:
            patched, skipped = _patch_rotary(model)
        handle._rotary = patched
        handle.skipped.update(skipped)
    if warn and not handle.patched and not handle._rotary:
        reasons = "; ".join(f"{k}: {v}" for k, v in handle.skipped.items()) or \
            f"no modeling module of the model defines one of {', '.join(_PATCHED_NAMES)}"
        warnings.warn(f"rome.hf.patch_model: nothing patched ({reasons})", stacklevel=2)
    return handle

from .hf_kernels import kernel_mapping, kernelize, kernelized_functions, unkernelize  # noqa: E402,F401
