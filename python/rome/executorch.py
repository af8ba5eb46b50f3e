"""Drop-ins for ExecuTorch's RoPE functions, built on the RoME operators.

- :func:`apply_rotary_emb_interleaved` — ``et_vk::apply_rotary_emb_interleaved(x, freqs_cis)``
  (pytorch/executorch, backends/vulkan/custom_ops_lib.py; EdgeTAM's pair-interleaved complex
  RoPE): x [B, N, C] with (real, imag) pairs along C, freqs_cis any shape with N·C elements laid
  out as [N, C/2, 2] (cos, sin) pairs.
- :func:`apply_rotary_emb` — the stock Llama ``apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)``
  (extension/llm/modeling/text_decoder/rope.py): GPT-J pairs, x [B, S, H, D], tables
  [S, D/2] or [S, H, D/2], math in fp32, outputs in the inputs' dtypes.
- :func:`hf_apply_rotary_emb` — the same file's HuggingFace-style ``hf_apply_rotary_emb(q, k,
  cos, sin, position_ids=None, unsqueeze_dim=1)`` (rotate_half, partial rotary when cos is
  narrower than q).
"""

from typing import Tuple

import torch

from . import hf, ops

__all__ = ["apply_rotary_emb_interleaved", "apply_rotary_emb", "hf_apply_rotary_emb"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply_rotary_emb_interleaved(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """ExecuTorch's ``apply_rotary_emb_interleaved``:
    ``out[2k] = x[2k] cos[k] - x[2k+1] sin[k]``, ``out[2k+1] = x[2k] sin[k] + x[2k+1] cos[k]``.

    ExecuTorch's reference computes in the promoted dtype of x and freqs_cis and returns that
    dtype (bf16 x with fp32 freqs_cis gives fp32); so does this wrapper. RoME's math is fp32 with
    one rounding. Differentiable in x and freqs_cis.
    """
    dtype = torch.promote_types(x.dtype, freqs_cis.dtype)
    if dtype not in _KERNEL_DTYPES or x.device.type != "cpu" or freqs_cis.device.type != "cpu":
        return _interleaved_reference(x, freqs_cis)
    return ops.apply_rotary_emb_interleaved(x.to(dtype), freqs_cis)


def _interleaved_reference(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # ExecuTorch's formula (backends/vulkan/custom_ops_lib.py), for inputs the kernel does not take.
    b, n, c = x.shape
    a_real, a_imag = x.reshape(b, n, c // 2, 2).unbind(-1)
    cs = freqs_cis.reshape(n, c // 2, 2)
    b_real, b_imag = cs[..., 0], cs[..., 1]
    out = torch.stack(
        (a_real * b_real - a_imag * b_imag, a_real * b_imag + a_imag * b_real), dim=-1)
    return out.reshape(b, n, c)


def _freqs_view(freqs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """ExecuTorch's reshape_for_broadcast, for x [B, S, H, D] and half-width tables."""
    half = x.shape[-1] // 2
    if freqs.dim() == 3:
        if tuple(freqs.shape) != (x.shape[-3], x.shape[-2], half):
            raise ValueError(
                f"rome.executorch.apply_rotary_emb: freqs: expected shape "
                f"{(x.shape[-3], x.shape[-2], half)}, got {tuple(freqs.shape)}")
        shape = [d if i >= x.dim() - 3 else 1 for i, d in enumerate(x.shape[:-1])] + [half]
    else:
        if tuple(freqs.shape) != (x.shape[1], half):
            raise ValueError(
                f"rome.executorch.apply_rotary_emb: freqs: expected shape {(x.shape[1], half)}, "
                f"got {tuple(freqs.shape)}")
        shape = [d if i == 1 else 1 for i, d in enumerate(x.shape[:-1])] + [half]
    return freqs.view(shape)


def _pairs_reference(x, cos, sin):
    xr, xi = x.float().reshape(x.shape[:-1] + (-1, 2)).unbind(-1)
    out = torch.stack([xr * cos - xi * sin, xr * sin + xi * cos], dim=-1).flatten(3)
    return out.type_as(x)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """ExecuTorch's stock Llama ``apply_rotary_emb``: GPT-J pair rotation of xq, xk
    [B, S, H, D] by freqs_cos/freqs_sin [S, D/2] (or [S, H, D/2]); fp32 math, results in xq's and
    xk's dtypes."""
    cos = _freqs_view(freqs_cos, xq)
    sin = _freqs_view(freqs_sin, xq)

    def kernel(x, k=None):
        return ops.rope(x, k, cos, sin, rotation="interleave", table_width="pairs")

    if not torch.compiler.is_compiling():
        def eager_kernel(x, k=None):  # the op's eager entry, every argument positional
            return ops._EAGER_ROPE(x, k, cos, sin, None, "interleave", (), -1, "pairs", (), None,
                                   None)

        # Eager: the kernel's checks decide (before anything is computed); ExecuTorch's formula
        # takes what they refuse.
        refused = (ValueError, IndexError, NotImplementedError)

        def contract(x):  # ExecuTorch's layout, on the CPU (a refusal costs an exception)
            return x.dim() == 4 and x.device.type == "cpu"

        def one(x):
            if not contract(x):
                return _pairs_reference(x, cos, sin)
            try:
                return eager_kernel(x)[0]
            except refused:
                return _pairs_reference(x, cos, sin)

        if xq.dtype == xk.dtype and contract(xq) and contract(xk):
            try:
                return eager_kernel(xq, xk)
            except refused:
                pass
        return one(xq), one(xk)

    # Traced: a refusal would raise while tracing, where nothing falls back; these checks mirror
    # the kernel's for what ExecuTorch passes.
    def ok(x):
        return (x.device.type == "cpu" and cos.device.type == "cpu" and sin.device.type == "cpu"
                and x.dim() == 4 and x.dtype in _KERNEL_DTYPES and cos.dtype in _KERNEL_DTYPES
                and sin.dtype in _KERNEL_DTYPES and x.shape[-1] % 2 == 0 and x.shape[-1] > 0
                and ops._broadcasts_to(cos.shape[:-1], x.shape[:-1]))

    def traced_one(x):
        return kernel(x)[0] if ok(x) else _pairs_reference(x, cos, sin)

    if ok(xq) and ok(xk) and xq.dtype == xk.dtype:
        return kernel(xq, xk)
    return traced_one(xq), traced_one(xk)


def hf_apply_rotary_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """ExecuTorch's ``hf_apply_rotary_emb``: transformers' rotate_half RoPE with partial rotary
    (the first ``cos.shape[-1]`` lanes rotate); ``position_ids`` is unused."""
    return hf._apply_partial_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
