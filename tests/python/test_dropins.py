"""The drop-ins (rome.hf, rome.diffusers, rome.vllm, rome.executorch) against the libraries they
replace.

transformers and diffusers are installed here, so their own functions are the references.
vLLM and ExecuTorch are not installable here: their formulas are transcribed below from their
sources (files cited at each reference).

Tolerances. RoME computes in fp32 and rounds once to the output dtype. Comparing with a library
result `lib` of the same formula y = a + b (a = x·cos, b = rotate(x)·sin), |a| + |b| = `terms`:

- libraries that compute in fp32 and round once (diffusers, Wan, ExecuTorch's Llama RoPE):
  |rome - lib| <= 1 ulp(lib) + 4·2^-24·terms (1 ulp in bf16/fp16, a few fp32 ulps of the terms
  in fp32).
- libraries that compute in the low-precision dtype (transformers and vLLM in bf16/fp16: a and b
  are rounded to bf16 before the add): the library's own error is up to half an ulp of each
  product plus half an ulp of the sum, so |rome - lib| <= 1 ulp(lib) + u·terms + 4·2^-24·terms
  (u = eps/2 of the dtype). When a and b nearly cancel, u·terms is many ulps of the small result:
  there transformers is the inexact one. The same tests check RoME against the exact (float64)
  value: within half an ulp plus the fp32 term error, i.e. correctly rounded up to fp32 noise.
"""

import importlib
import inspect
import re
import sys

import pytest
import torch

import rome
import rome.diffusers
import rome.executorch
import rome.hf
import rome.vllm
from conftest import need_module

U32 = 2.0 ** -24
LOW = (torch.bfloat16, torch.float16)




def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    mag = values.abs().double().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def assert_matches_library(out, lib, terms, products_rounded, what=""):
    """out (RoME) equals lib (the library's result) within the bound in the module docstring.
    Returns the fraction of bit-identical elements."""
    assert out.dtype == lib.dtype, f"{what}: dtype {out.dtype} != library's {lib.dtype}"
    assert out.shape == lib.shape, f"{what}: shape {tuple(out.shape)} != {tuple(lib.shape)}"
    d = out.dtype
    fi = torch.finfo(d)
    terms = terms.double().expand(out.shape)
    lib64 = lib.detach().double()
    err = (out.detach().double() - lib64).abs()
    tol = _ulp(lib64, d) + 4 * U32 * terms + fi.tiny
    if products_rounded and d in LOW:
        tol = tol + (fi.eps / 2) * terms
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {out.numel()} elements off: max error "
        f"{float(err.max()):.3g} (max in ulps of lib {float((err / _ulp(lib64, d)).max()):.2f})")
    return float((err == 0).double().mean())


def assert_correctly_rounded(out, exact, terms, what=""):
    """out within half an ulp of the exact (float64) value plus fp32 noise of the terms."""
    d = out.dtype
    exact = exact.double().expand(out.shape)
    err = (out.detach().double() - exact).abs()
    tol = 0.5 * _ulp(exact, d) + 4 * U32 * terms.double().expand(out.shape) + torch.finfo(d).tiny
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {out.numel()} elements not correctly rounded: max error "
        f"{float(err.max()):.3g}")


def rotate_half64(x):
    x = x.double()
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_pairs64(x):
    x = x.double()
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def exact_and_terms(x, cos, sin, rotate):
    """float64 y = x·cos + rotate(x)·sin and |x·cos| + |rotate(x)·sin|."""
    a = x.double() * cos.double()
    b = rotate(x) * sin.double()
    return a + b, a.abs() + b.abs()


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


# ================================================================================================
# transformers


def _llama_tables(batch, seq, head_dim, dtype, offset=0):
    """cos/sin [B, S, D] from transformers' own LlamaRotaryEmbedding (in `dtype`, as the model
    hands them to attention)."""
    need_module("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=512)
    rotary = LlamaRotaryEmbedding(config=config)
    positions = torch.arange(offset, offset + seq).unsqueeze(0).expand(batch, seq)
    positions = positions + torch.arange(batch).unsqueeze(1) * 3  # rows differ
    return rotary(torch.empty(1, dtype=dtype), positions)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_hf_apply_rotary_pos_emb(dtype, layout):
    modeling_llama = need_module("transformers.models.llama.modeling_llama")
    b, s, hq, hk, d = 2, 9, 4, 2, 64
    cos, sin = _llama_tables(b, s, d, dtype)
    # Projections viewed [B, S, H, D] (then transposed to BHSD, as LlamaAttention does).
    q = torch.randn(b, s, hq * d).to(dtype).view(b, s, hq, d)
    k = torch.randn(b, s, hk * d).to(dtype).view(b, s, hk, d)
    unsqueeze_dim = 2
    if layout == "bhsd":
        q, k, unsqueeze_dim = q.transpose(1, 2), k.transpose(1, 2), 1
    q_lib, k_lib = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    q_out, k_out = rome.hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    c, s_ = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    for name, x, out, lib in (("q", q, q_out, q_lib), ("k", k, k_out, k_lib)):
        exact, terms = exact_and_terms(x, c, s_, rotate_half64)
        same = assert_matches_library(out, lib, terms, products_rounded=True, what=name)
        assert_correctly_rounded(out, exact, terms, what=name)
        if dtype == torch.float32:
            torch.testing.assert_close(out, lib, rtol=1e-6, atol=1e-6)
        print(f"{name}: {same:.1%} bit-identical to transformers")
    if dtype in LOW:  # transformers' worst error (three roundings) is never below RoME's (one)
        exact, _ = exact_and_terms(q, c, s_, rotate_half64)
        assert (q_out.double() - exact).abs().max() <= (q_lib.double() - exact).abs().max()


def test_hf_positional_and_signature():
    modeling_llama = need_module("transformers.models.llama.modeling_llama")
    params = list(inspect.signature(rome.hf.apply_rotary_pos_emb).parameters)
    assert params == ["q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"]
    cos, sin = _llama_tables(1, 5, 32, torch.float32)
    q = torch.randn(1, 5, 3, 32)
    k = torch.randn(1, 5, 1, 32)
    ref = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, 2)
    for out in (rome.hf.apply_rotary_pos_emb(q, k, cos, sin, 2),  # 5.x positional unsqueeze_dim
                rome.hf.apply_rotary_pos_emb(q, k, cos, sin, None, 2),
                rome.hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)):
        torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[1], ref[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("q_dtype,table_dtype", [(torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.bfloat16),
                                                 (torch.float16, torch.bfloat16)])
def test_hf_promoted_dtype(q_dtype, table_dtype):
    """transformers computes q * cos in the promoted dtype and returns it; so does RoME."""
    modeling_llama = need_module("transformers.models.llama.modeling_llama")
    cos, sin = _llama_tables(2, 6, 64, table_dtype)
    q = torch.randn(2, 4, 6, 64).to(q_dtype)
    k = torch.randn(2, 4, 6, 64).to(q_dtype)
    q_lib, k_lib = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = rome.hf.apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.dtype == q_lib.dtype == torch.promote_types(q_dtype, table_dtype)
    exact, terms = exact_and_terms(q, cos.unsqueeze(1), sin.unsqueeze(1), rotate_half64)
    assert_matches_library(q_out, q_lib, terms, products_rounded=True, what="q")
    exact, terms = exact_and_terms(k, cos.unsqueeze(1), sin.unsqueeze(1), rotate_half64)
    assert_matches_library(k_out, k_lib, terms, products_rounded=True, what="k")


def test_hf_autograd_matches_transformers():
    modeling_llama = need_module("transformers.models.llama.modeling_llama")
    cos, sin = _llama_tables(2, 5, 32, torch.float32)
    q = torch.randn(2, 4, 5, 32, requires_grad=True)
    k = torch.randn(2, 2, 5, 32, requires_grad=True)
    c = cos.clone().requires_grad_()
    s = sin.clone().requires_grad_()
    gq, gk = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
    grads = []
    for fn in (modeling_llama.apply_rotary_pos_emb, rome.hf.apply_rotary_pos_emb):
        qo, ko = fn(q, k, c, s)
        grads.append(torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), (q, k, c, s)))
    for lib, ours, name in zip(grads[0], grads[1], ("q", "k", "cos", "sin")):
        torch.testing.assert_close(ours, lib, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_hf_partial_rotary_gpt_neox(dtype):
    """The partial-rotary form (GPT-NeoX, Phi-3): cos narrower than q."""
    modeling = need_module("transformers.models.gpt_neox.modeling_gpt_neox")
    cos, sin = _llama_tables(2, 7, 16, dtype)
    q = torch.randn(2, 3, 7, 64).to(dtype)
    k = torch.randn(2, 3, 7, 64).to(dtype)
    q_lib, k_lib = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = rome.hf._apply_partial_rotary_pos_emb(q, k, cos, sin)
    for x, out, lib in ((q, q_out, q_lib), (k, k_out, k_lib)):
        xr = x[..., :16]
        exact, terms = exact_and_terms(xr, cos.unsqueeze(1), sin.unsqueeze(1), rotate_half64)
        assert_matches_library(out[..., :16], lib[..., :16], terms, products_rounded=True)
        assert torch.equal(out[..., 16:], lib[..., 16:])


def _qwen2vl_inputs(dtype, batch=2, seq=11, head_dim=128):
    """3D MRoPE position ids (text tokens then a 2x3 image grid), and the per-axis cos/sin
    [3, B, S, D] of transformers 4.x (cat(freqs, freqs) per axis)."""
    need_module("transformers")
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig

    config = Qwen2VLTextConfig(
        hidden_size=head_dim * 2, num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [16, 24, 24]})
    text = torch.arange(5)
    t = torch.full((6,), 5)
    h = 5 + torch.arange(2).repeat_interleave(3)
    w = 5 + torch.arange(3).repeat(2)
    pos = torch.stack([torch.cat([text, t]), torch.cat([text, h]), torch.cat([text, w])])
    pos = pos[:, :seq].unsqueeze(1).repeat(1, batch, 1)  # [3, B, S]
    pos[:, 1] += 7  # second row at other positions
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return config, pos, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_hf_qwen2vl_mrope(dtype, layout):
    modeling = need_module("transformers.models.qwen2_vl.modeling_qwen2_vl")
    config, pos, cos, sin = _qwen2vl_inputs(dtype)
    b, s, d = 2, pos.shape[-1], 128
    q = torch.randn(b, 4, s, d).to(dtype)
    k = torch.randn(b, 2, s, d).to(dtype)
    unsqueeze_dim = 1
    if layout == "bshd":
        q, k, unsqueeze_dim = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), 2
    if hasattr(modeling, "apply_multimodal_rotary_pos_emb"):  # transformers 4.x
        q_lib, k_lib = modeling.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [16, 24, 24],
                                                                unsqueeze_dim)
        merged_cos = merged_sin = None
    else:  # transformers 5.x: Qwen2VLRotaryEmbedding merges the sections, then the 1D function
        rotary = modeling.Qwen2VLRotaryEmbedding(config)
        merged_cos, merged_sin = rotary(torch.empty(1, dtype=dtype), pos)
        q_lib, k_lib = modeling.apply_rotary_pos_emb(q, k, merged_cos, merged_sin, unsqueeze_dim)
    q_out, k_out = rome.hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [16, 24, 24],
                                                           unsqueeze_dim)
    if merged_cos is None:
        sections = [16, 24, 24] * 2
        merged_cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, -1))], -1)
        merged_sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, -1))], -1)
    c, sn = merged_cos.unsqueeze(unsqueeze_dim), merged_sin.unsqueeze(unsqueeze_dim)
    for name, x, out, lib in (("q", q, q_out, q_lib), ("k", k, k_out, k_lib)):
        exact, terms = exact_and_terms(x, c, sn, rotate_half64)
        assert_matches_library(out, lib, terms, products_rounded=True, what=name)
        assert_correctly_rounded(out, exact, terms, what=name)
    # With tables requiring grad the drop-in merges the sections in PyTorch (differentiable).
    cg = cos.clone().requires_grad_()
    q_g, _ = rome.hf.apply_multimodal_rotary_pos_emb(q, None, cg, sin, [16, 24, 24], unsqueeze_dim)
    torch.testing.assert_close(q_g.detach(), q_out, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(q_g.float().sum(), cg)
    assert grad.shape == cos.shape


# ------------------------------------------------------------------------------------------------
# patch_model on tiny randomly initialised models.

def _tiny_model(arch):
    transformers = need_module("transformers")
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128)
    if arch == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=2, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(num_key_value_heads=2, **common)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(num_key_value_heads=2, **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "gpt_neox":
        config = transformers.GPTNeoXConfig(rotary_pct=0.5, **common)
        cls = transformers.GPTNeoXForCausalLM
    else:
        raise AssertionError(arch)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_patch_model_same_logits(arch):
    model = _tiny_model(arch)
    module = sys.modules[type(model.model if hasattr(model, "model") else model.gpt_neox)
                         .__module__]
    original = module.apply_rotary_pos_emb
    ids = torch.randint(0, 128, (2, 13))
    with torch.no_grad():
        ref = model(ids).logits

    handle = rome.hf.patch_model(model)
    try:
        assert handle.active and module.__name__ in handle.patched, handle
        assert module.apply_rotary_pos_emb is not original
        with torch.no_grad(), torch.profiler.profile() as prof:
            out = model(ids).logits
        calls = [e for e in prof.events() if e.name == "rome::rope"]
        assert len(calls) == model.config.num_hidden_layers  # one RoME call (q and k) per layer
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finally:
        handle.undo()
    assert module.apply_rotary_pos_emb is original and not handle.active
    with torch.no_grad():
        again = model(ids).logits
    assert torch.equal(again, ref)
    handle.undo()  # harmless


def test_patch_model_generate_and_context_manager():
    """Greedy decoding with the KV cache (prefill, then one token at positions 13, 14, ...)."""
    model = _tiny_model("llama")
    modeling_llama = sys.modules[type(model.model).__module__]
    original = modeling_llama.apply_rotary_pos_emb
    ids = torch.randint(0, 128, (1, 13))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        with rome.hf.patch_model(model) as handle:
            assert handle.patched == [modeling_llama.__name__]
            # Nested patches of the same module: restored only when the last one is undone.
            inner = rome.hf.patch_model(model)
            inner.undo()
            assert modeling_llama.apply_rotary_pos_emb is not original
            out = model.generate(ids, **kwargs)
    assert modeling_llama.apply_rotary_pos_emb is original
    assert torch.equal(out, ref)


_NOT_A_FORM = """
import torch

def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) - (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""


def test_patch_leaves_other_variants_alone(tmp_path, monkeypatch):
    """A function RoME has no form for (here Llama's with one sign flipped, or Llama's calling a
    rotate_half with other math) is left alone, with the reason in `skipped`."""
    (tmp_path / "rome_not_a_form.py").write_text(_NOT_A_FORM)
    (tmp_path / "rome_other_helper.py").write_text(
        _NOT_A_FORM.replace("(q * cos) - (rotate_half(q)", "(q * cos) + (rotate_half(q)")
        .replace("torch.cat((-x2, x1)", "torch.cat((x1, -x2)"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("rome_not_a_form", "rome_other_helper"):
        module = importlib.import_module(name)
        before = module.apply_rotary_pos_emb
        handle = rome.hf.patch_module(module)
        assert handle.patched == [] and "no form RoME serves" in handle.skipped[name], handle
        assert module.apply_rotary_pos_emb is before
        handle.undo()
    with pytest.warns(UserWarning, match="nothing patched"):
        rome.hf.patch_model(torch.nn.Linear(2, 2))


# ================================================================================================
# diffusers


def _flux_tables():
    """cos/sin [S, 128] from diffusers' own FluxPosEmbed (axes 16/56/56): 4 text tokens (ids 0)
    then a 3x5 image grid."""
    flux = need_module("diffusers.models.transformers.transformer_flux")
    txt = torch.zeros(4, 3)
    hh, ww = torch.meshgrid(torch.arange(3), torch.arange(5), indexing="ij")
    img = torch.stack([torch.zeros(15), hh.flatten().float(), ww.flatten().float()], dim=-1)
    ids = torch.cat([txt, img])
    return flux.FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_diffusers_flux_interleaved(dtype, sequence_dim):
    embeddings = need_module("diffusers.models.embeddings")
    cos, sin = _flux_tables()
    assert cos.dtype == torch.float32 and cos.shape == (19, 128)
    x = torch.randn(2, 19, 3, 128).to(dtype)
    if sequence_dim == 2:
        x = x.transpose(1, 2)  # BHSD view
    lib = embeddings.apply_rotary_emb(x, (cos, sin), sequence_dim=sequence_dim)
    with torch.profiler.profile() as prof:
        out = rome.diffusers.apply_rotary_emb(x, (cos, sin), sequence_dim=sequence_dim)
    assert any(e.name == "rome::rope" for e in prof.events()), "took the PyTorch fallback"
    c = cos[None, :, None, :] if sequence_dim == 1 else cos[None, None]
    s = sin[None, :, None, :] if sequence_dim == 1 else sin[None, None]
    exact, terms = exact_and_terms(x, c, s, rotate_pairs64)
    same = assert_matches_library(out, lib, terms, products_rounded=False)
    assert_correctly_rounded(out, exact, terms)
    print(f"{same:.2%} bit-identical to diffusers")
    if dtype in LOW:  # one fp32 rounding apart at most: nearly always the same bits
        assert same > 0.99


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_diffusers_wan_3d(dtype):
    """Wan 2.x 3D RoPE (t/h/w lanes 44/42/42 interleaved) with the tables of diffusers'
    WanRotaryPosEmbed; checked against diffusers' apply_rotary_emb and against the formula of
    Wan's attention processor (diffusers/models/transformers/transformer_wan.py,
    WanAttnProcessor.__call__'s nested apply_rotary_emb, transcribed)."""
    embeddings = need_module("diffusers.models.embeddings")
    wan = need_module("diffusers.models.transformers.transformer_wan")
    rope = wan.WanRotaryPosEmbed(attention_head_dim=128, patch_size=(1, 2, 2), max_seq_len=1024)
    freqs_cos, freqs_sin = rope(torch.empty(1, 16, 3, 4, 6))  # [1, S, 1, D], S = 3*2*3
    s_len = freqs_cos.shape[1]
    x = torch.randn(1, s_len, 2, 128).to(dtype)

    # The transcription the models bench times Wan's inline RoPE with (checked here too).
    from rome.bench.models import _wan_inline_rope as wan_processor_rope

    cos, sin = freqs_cos[0, :, 0], freqs_sin[0, :, 0]
    out = rome.diffusers.apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    exact, terms = exact_and_terms(x, freqs_cos, freqs_sin, rotate_pairs64)
    lib = embeddings.apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    assert_matches_library(out, lib, terms, products_rounded=False, what="diffusers")
    wan_out = wan_processor_rope(x, freqs_cos.to(torch.float32), freqs_sin.to(torch.float32))
    assert_matches_library(out, wan_out, terms, products_rounded=False, what="Wan processor")
    assert_correctly_rounded(out, exact, terms)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_diffusers_half(dtype):
    """use_real_unbind_dim=-2 (CogView4, Cosmos, Stable Audio), tables concatenated halves."""
    embeddings = need_module("diffusers.models.embeddings")
    cos, sin = embeddings.get_1d_rotary_pos_embed(64, 23, use_real=True,
                                                  repeat_interleave_real=False)
    x = torch.randn(2, 3, 23, 64).to(dtype)
    lib = embeddings.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-2)
    out = rome.diffusers.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-2)
    exact, terms = exact_and_terms(x, cos, sin, rotate_half64)
    assert_matches_library(out, lib, terms, products_rounded=False)
    assert_correctly_rounded(out, exact, terms)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_diffusers_complex(dtype):
    """use_real=False (Lumina): complex freqs_cis [B, S, D/2], x [B, S, H, D]."""
    embeddings = need_module("diffusers.models.embeddings")
    freqs = torch.stack([embeddings.get_1d_rotary_pos_embed(48, torch.arange(10) + 5 * i)
                         for i in range(2)])  # complex64 [2, 10, 24]
    x = torch.randn(2, 10, 3, 48).to(dtype)
    lib = embeddings.apply_rotary_emb(x, freqs, use_real=False)
    out = rome.diffusers.apply_rotary_emb(x, freqs, use_real=False)
    c = freqs.real.unsqueeze(2).repeat_interleave(2, dim=-1)
    s = freqs.imag.unsqueeze(2).repeat_interleave(2, dim=-1)
    exact, terms = exact_and_terms(x, c, s, rotate_pairs64)
    assert_matches_library(out, lib, terms, products_rounded=False)
    assert_correctly_rounded(out, exact, terms)


@pytest.mark.parametrize("case", ["batch_rank3", "shared_rank3", "complex128", "rank2", "rank4",
                                  "odd_width"])
def test_diffusers_complex_takes_the_kernel_only_where_it_can(case, monkeypatch):
    """Lumina's form (use_real=False) runs RoME's kernel for complex64 freqs_cis [B or 1, S, D/2]
    and hands everything else to diffusers' own math (complex128, another rank, a width that is
    not D/2), with diffusers' results either way."""
    embeddings = need_module("diffusers.models.embeddings")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 3, 16, generator=g)
    angle = torch.rand(2, 6, 8, generator=g) * 9
    freqs = {"batch_rank3": torch.polar(torch.ones_like(angle), angle),
             "shared_rank3": torch.polar(torch.ones_like(angle[:1]), angle[:1]),
             "complex128": torch.polar(torch.ones_like(angle), angle).to(torch.complex128),
             "rank2": torch.polar(torch.ones_like(angle[0]), angle[0]),
             "rank4": torch.polar(torch.ones_like(angle), angle)[:, :, None],
             "odd_width": torch.polar(torch.ones_like(angle[..., :6]), angle[..., :6])}[case]
    fallbacks = []
    original = rome.diffusers._reference
    monkeypatch.setattr(rome.diffusers, "_reference",
                        lambda *args: fallbacks.append(1) or original(*args))
    try:
        lib = embeddings.apply_rotary_emb(x, freqs, use_real=False)
    except RuntimeError as error:  # shapes diffusers' own math does not take either
        assert case in ("rank2", "rank4", "odd_width")
        with pytest.raises(RuntimeError, match=re.escape(str(error)[:40])):
            rome.diffusers.apply_rotary_emb(x, freqs, use_real=False)
        assert fallbacks
        return
    out = rome.diffusers.apply_rotary_emb(x, freqs, use_real=False)
    assert bool(fallbacks) == (case not in ("batch_rank3", "shared_rank3"))
    torch.testing.assert_close(out, lib, rtol=2e-6, atol=2e-6)


def test_diffusers_complex_views_follow_their_tensor():
    """The real/imaginary views the complex drop-ins keep per freqs_cis see in-place changes of
    it, and a new tensor, a new storage, a new shape or new strides get views of their own.
    Lumina's form takes freqs_cis [B, S, D/2], Qwen-Image's [S, D/2] (here a view of the same
    tensor, kept across calls)."""
    qwen = need_module("diffusers.models.transformers.transformer_qwenimage")
    embeddings = need_module("diffusers.models.embeddings")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 6, 2, 16, generator=g)

    def freqs_of(rows, seed):
        angle = torch.rand(1, rows, 8, generator=torch.Generator().manual_seed(seed)) * 9
        return torch.polar(torch.ones_like(angle), angle)

    def check(lumina, qwen_freqs):
        ours = rome.diffusers.apply_rotary_emb(x, lumina, use_real=False)
        torch.testing.assert_close(ours, embeddings.apply_rotary_emb(x, lumina, use_real=False),
                                   rtol=2e-6, atol=2e-6)
        ours = rome.diffusers.apply_rotary_emb_qwen(x, qwen_freqs, use_real=False)
        torch.testing.assert_close(ours,
                                   qwen.apply_rotary_emb_qwen(x, qwen_freqs, use_real=False),
                                   rtol=2e-6, atol=2e-6)

    freqs = freqs_of(6, 1)
    rows = freqs[0]
    check(freqs, rows)
    freqs.mul_(torch.polar(torch.ones(6, 8), torch.full((6, 8), 0.7)))  # new values in place
    check(freqs, rows)
    del freqs, rows
    for seed in range(2, 6):  # new tensors
        freqs = freqs_of(6, seed)
        check(freqs, freqs[0])
        del freqs
    wide = freqs_of(12, 7)
    check(wide[:, ::2], wide[0, ::2])  # strided rows
    freqs = freqs_of(6, 8)
    rows = freqs[0]
    check(freqs, rows)
    freqs.set_(freqs_of(6, 9))  # the same tensor objects, new storage
    rows.set_(freqs[0].clone())
    check(freqs, rows)
    # Square frequencies: the same data pointer and shape, other strides.
    x = torch.randn(1, 8, 2, 16, generator=g)
    square = freqs_of(8, 10)
    rows = square[0]
    check(square, rows)
    check(square.transpose(1, 2), rows.t())  # new tensors
    square.transpose_(1, 2)  # the same objects, transposed in place
    rows.t_()
    check(square, rows)
    for seed in range(11, 17):  # more tensors than the cache keeps, then the first again
        other = freqs_of(8, seed)
        check(other, other[0])
    check(square, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_diffusers_wan_processor(dtype):
    """A tiny Wan transformer (3D RoPE 8/8/8 of head dim 24) with RoME's processor: diffusers'
    output, RoME's op ran once per self-attention, and undo restores diffusers' processors."""
    diffusers = need_module("diffusers")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64).eval().to(dtype)
    x = torch.randn(1, 4, 3, 6, 8).to(dtype)  # 3 x 3 x 4 tokens
    t, text = torch.tensor([500]), torch.randn(1, 7, 32).to(dtype)
    processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
    with torch.no_grad():
        ref = model(x, t, text, return_dict=False)[0]
        with rome.diffusers.patch_wan(model) as handle:
            assert len(handle.swapped) == 4  # self- and cross-attention of each block
            with torch.profiler.profile() as prof:
                out = model(x, t, text, return_dict=False)[0]
        again = model(x, t, text, return_dict=False)[0]
    assert sum(e.name == "rome::rope" for e in prof.events()) == 2
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == processors
    assert torch.equal(again, ref)
    # An attention backend set while RoME's processor is in place is used, and kept on undo.
    with rome.diffusers.patch_wan(model):
        model.set_attention_backend("native")
        with torch.no_grad():
            torch.testing.assert_close(model(x, t, text, return_dict=False)[0], out,
                                       rtol=0, atol=0)
    assert all(p._attention_backend is not None for p in processors)
    # Wan's RoPE is fp32 math with one rounding, as RoME's: the blocks see the same q and k up to
    # fp32 noise (bf16: an ulp where the fp32 sums round differently).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_diffusers_qwen_image(dtype, monkeypatch):
    """rome.diffusers.apply_rotary_emb_qwen against Qwen-Image's own function (complex
    frequencies; correctly rounded against float64), then in place of it in a tiny
    QwenImageTransformer2DModel (RoPE axes 4/6/6)."""
    qwen = need_module("diffusers.models.transformers.transformer_qwenimage")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 3, 16, generator=g).to(dtype)
    angle = torch.rand(7, 8, generator=g, dtype=torch.float64) * 40
    freqs = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)
    lib = qwen.apply_rotary_emb_qwen(x, freqs, use_real=False)
    with torch.profiler.profile() as prof:
        out = rome.diffusers.apply_rotary_emb_qwen(x, freqs, use_real=False)
    assert any(e.name == "rome::rope" for e in prof.events())
    assert out.dtype == lib.dtype and out.shape == lib.shape
    pairs = x.double().reshape(2, 7, 3, 8, 2)
    c, s_ = freqs.real.double()[None, :, None, :], freqs.imag.double()[None, :, None, :]
    exact = torch.stack([pairs[..., 0] * c - pairs[..., 1] * s_,
                         pairs[..., 0] * s_ + pairs[..., 1] * c], dim=-1).flatten(3)
    terms = (pairs.abs() * (c.abs() + s_.abs()).unsqueeze(-1)).flatten(3)
    assert_correctly_rounded(out, exact, terms, what="qwen")
    assert torch.equal(rome.diffusers.apply_rotary_emb_qwen(x, freqs.to(torch.complex128),
                                                            use_real=False),
                       qwen.apply_rotary_emb_qwen(x, freqs.to(torch.complex128), use_real=False))

    torch.manual_seed(0)
    model = qwen.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6)).eval().to(dtype)
    inputs = dict(hidden_states=torch.randn(1, 12, 16).to(dtype),
                  encoder_hidden_states=torch.randn(1, 5, 24).to(dtype),
                  encoder_hidden_states_mask=torch.ones(1, 5, dtype=torch.long),
                  timestep=torch.tensor([0.5]).to(dtype), img_shapes=[(1, 3, 4)],
                  return_dict=False)
    with torch.no_grad():
        ref = model(**inputs)[0]
        monkeypatch.setattr(qwen, "apply_rotary_emb_qwen", rome.diffusers.apply_rotary_emb_qwen)
        with torch.profiler.profile() as prof:
            got = model(**inputs)[0]
    assert sum(e.name == "rome::rope" for e in prof.events()) == 8  # img/txt q and k, 2 blocks
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_diffusers_signature_errors_and_fallback():
    embeddings = need_module("diffusers.models.embeddings")
    ours = inspect.signature(rome.diffusers.apply_rotary_emb).parameters
    theirs = inspect.signature(embeddings.apply_rotary_emb).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]
    cos, sin = embeddings.get_1d_rotary_pos_embed(16, 5, use_real=True)
    x = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="sequence_dim"):
        rome.diffusers.apply_rotary_emb(x, (cos, sin), sequence_dim=3)
    with pytest.raises(ValueError, match="use_real_unbind_dim"):
        rome.diffusers.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=0)
    # float64 is not a kernel dtype: diffusers' formula runs, same result.
    x64 = x.double()
    assert torch.equal(rome.diffusers.apply_rotary_emb(x64, (cos, sin)),
                       embeddings.apply_rotary_emb(x64, (cos, sin)))
    # Gradients reach x and the tables.
    xg = x.clone().requires_grad_()
    cg = cos.clone().requires_grad_()
    rome.diffusers.apply_rotary_emb(xg, (cg, sin)).sum().backward()
    xr = x.clone().requires_grad_()
    cr = cos.clone().requires_grad_()
    embeddings.apply_rotary_emb(xr, (cr, sin)).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    torch.testing.assert_close(cg.grad, cr.grad)


# ================================================================================================
# vLLM (not installable here): reference transcribed from vLLM's source,
# vllm/model_executor/layers/rotary_embedding/base.py (RotaryEmbedding._compute_cos_sin_cache,
# forward_static / forward_native) and .../rotary_embedding/common.py
# (ApplyRotaryEmb.forward_static; apply_rotary_emb_torch in older versions).


def _vllm_apply_rotary_emb_torch(x, cos, sin, is_neox_style):
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _vllm_forward_native(positions, query, key, head_size, rotary_dim, cos_sin_cache,
                         is_neox_style):
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    query_shape = query.shape
    query = query.view(num_tokens, -1, head_size)
    query_rot = query[..., :rotary_dim]
    query_pass = query[..., rotary_dim:]
    query_rot = _vllm_apply_rotary_emb_torch(query_rot, cos, sin, is_neox_style)
    query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)
    if key is not None:
        key_shape = key.shape
        key = key.view(num_tokens, -1, head_size)
        key_rot = key[..., :rotary_dim]
        key_pass = key[..., rotary_dim:]
        key_rot = _vllm_apply_rotary_emb_torch(key_rot, cos, sin, is_neox_style)
        key = torch.cat((key_rot, key_pass), dim=-1).reshape(key_shape)
    return query, key


def _vllm_cache(rotary_dim, max_positions, base, dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    t = torch.arange(max_positions, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _vllm_terms(x, positions, cache, head_size, rotary_dim, is_neox):
    """Exact value and |terms| of the rotated lanes, [T, H, rotary_dim]."""
    cos, sin = cache.index_select(0, positions.flatten()).double().chunk(2, dim=-1)
    x = x.reshape(positions.numel(), -1, head_size)[..., :rotary_dim].double()
    if is_neox:
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        rotate = rotate_half64
    else:
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        rotate = rotate_pairs64
    return exact_and_terms(x, c.unsqueeze(1), s.unsqueeze(1), rotate)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("shape", ["T,HD", "T,H,D", "B,S,HD"])
def test_vllm_rotary_embedding(dtype, is_neox, rotary_dim, shape):
    head_size, hq, hk = 64, 4, 2
    layer = rome.vllm.RotaryEmbedding(head_size, rotary_dim, 512, 10000.0, is_neox, dtype)
    assert torch.equal(layer.cos_sin_cache, _vllm_cache(rotary_dim, 512, 10000.0, dtype))
    if shape == "B,S,HD":
        positions = torch.randint(0, 512, (2, 7))
        query = torch.randn(2, 7, hq * head_size).to(dtype)
        key = torch.randn(2, 7, hk * head_size).to(dtype)
    else:
        positions = torch.randint(0, 512, (14,))
        query = torch.randn(14, hq * head_size).to(dtype)
        key = torch.randn(14, hk * head_size).to(dtype)
        if shape == "T,H,D":
            query, key = query.view(14, hq, head_size), key.view(14, hk, head_size)
    q_ref, k_ref = _vllm_forward_native(positions, query, key, head_size, rotary_dim,
                                        layer.cos_sin_cache, is_neox)
    q_in, k_in = query.clone(), key.clone()
    q_nat, k_nat = layer.forward_native(positions, query, key)
    assert torch.equal(query, q_in) and torch.equal(key, k_in)  # forward_native: out of place
    q_fwd, k_fwd = layer(positions, query, key)  # forward: in place, like vLLM's kernels
    assert q_fwd is query and k_fwd is key
    cache = layer.cos_sin_cache
    for name, x, ref, outs in (("q", q_in, q_ref, (q_nat, q_fwd)),
                               ("k", k_in, k_ref, (k_nat, k_fwd))):
        exact, terms = _vllm_terms(x, positions, cache, head_size, rotary_dim, is_neox)
        for out in outs:
            assert out.shape == ref.shape and out.dtype == ref.dtype
            rot = out.reshape(positions.numel(), -1, head_size)
            ref_rot = ref.reshape(positions.numel(), -1, head_size)
            assert_matches_library(rot[..., :rotary_dim], ref_rot[..., :rotary_dim], terms,
                                   products_rounded=True, what=name)
            assert_correctly_rounded(rot[..., :rotary_dim], exact, terms, what=name)
            assert torch.equal(rot[..., rotary_dim:], ref_rot[..., rotary_dim:])


def test_vllm_key_none_errors_and_function():
    layer = rome.vllm.RotaryEmbedding(32, 32, 64, 10000.0, True, torch.float32)
    positions = torch.arange(5)
    query = torch.randn(5, 3 * 32)
    q_ref, _ = _vllm_forward_native(positions, query, None, 32, 32, layer.cos_sin_cache, True)
    q_out, k_out = layer.forward_native(positions, query)
    assert k_out is None
    torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-6)
    # vllm._custom_ops.rotary_embedding signature, in place, returns None.
    q2 = query.clone()
    assert rome.vllm.rotary_embedding(positions, q2, None, 32, layer.cos_sin_cache, True) is None
    torch.testing.assert_close(q2, q_ref, rtol=1e-6, atol=1e-6)
    # A position outside the cache: IndexError, query untouched.
    q3 = query.clone()
    with pytest.raises(IndexError):
        layer(torch.tensor([0, 1, 2, 3, 64]), q3)
    assert torch.equal(q3, query)
    # Older vLLM's offsets argument: positions + offsets.
    q4, _ = layer.forward_native(positions, query, None, offsets=torch.full((5,), 3))
    q_ref4, _ = _vllm_forward_native(positions + 3, query, None, 32, 32, layer.cos_sin_cache, True)
    torch.testing.assert_close(q4, q_ref4, rtol=1e-6, atol=1e-6)
    # Wrapping an existing vLLM layer shares its cache.
    wrapped = rome.vllm.RotaryEmbedding.from_module(layer)
    assert wrapped.cos_sin_cache is layer.cos_sin_cache and wrapped.rotary_dim == 32
    torch.testing.assert_close(wrapped.forward_native(positions, query)[0], q_ref,
                               rtol=1e-6, atol=1e-6)
    # Module methods that nn.Module relies on still work (e.g. .to()).
    assert layer.to(torch.float32) is layer


# ================================================================================================
# ExecuTorch (not installable here): references transcribed from pytorch/executorch,
# backends/vulkan/custom_ops_lib.py (apply_rotary_emb_interleaved_impl) and
# extension/llm/modeling/text_decoder/rope.py (apply_rotary_emb, hf_apply_rotary_emb).


def _et_interleaved(x, freqs_cis):
    b, n, c = x.shape
    a_real, a_imag = x.view(b, n, c // 2, 2).unbind(-1)
    cs = freqs_cis.reshape(n, c // 2, 2)
    b_real, b_imag = cs[..., 0], cs[..., 1]
    out = torch.stack(
        (a_real * b_real - a_imag * b_imag, a_real * b_imag + a_imag * b_real), dim=-1)
    return out.view(b, n, c)


def _et_reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    if freqs_cis.ndim == 3:
        shape = [d if (i == ndim - 3 or i == ndim - 2 or i == ndim - 1) else 1
                 for i, d in enumerate(x.shape)]
    else:
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(shape)


def _et_apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    xq_r, xq_i = xq.float().reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.float().reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)
    freqs_cos = _et_reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = _et_reshape_for_broadcast(freqs_sin, xq_r)
    xq_out = torch.stack([xq_r * freqs_cos - xq_i * freqs_sin,
                          xq_r * freqs_sin + xq_i * freqs_cos], dim=-1).flatten(3)
    xk_out = torch.stack([xk_r * freqs_cos - xk_i * freqs_sin,
                          xk_r * freqs_sin + xk_i * freqs_cos], dim=-1).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _pair_tables(n, half):
    angles = torch.arange(n).unsqueeze(1) * (10000.0 ** (-torch.arange(half) / half))
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("x_dtype,f_dtype", [(torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("freqs_shape", ["1,N,C/2,2", "N,C"])
def test_executorch_interleaved(x_dtype, f_dtype, freqs_shape):
    b, n, c = 2, 12, 64
    cos, sin = _pair_tables(n, c // 2)
    freqs = torch.stack([cos, sin], dim=-1).to(f_dtype)  # [N, C/2, 2]
    freqs = freqs.unsqueeze(0) if freqs_shape == "1,N,C/2,2" else freqs.reshape(n, c)
    x = torch.randn(b, n, c).to(x_dtype)
    ref = _et_interleaved(x, freqs)
    out = rome.executorch.apply_rotary_emb_interleaved(x, freqs)
    cs = freqs.reshape(n, c // 2, 2)
    exact, terms = exact_and_terms(x, cs[..., 0].repeat_interleave(2, -1),
                                   cs[..., 1].repeat_interleave(2, -1), rotate_pairs64)
    assert_matches_library(out, ref, terms, products_rounded=True)
    assert_correctly_rounded(out, exact, terms)
    # Differentiable in x and freqs_cis, like the reference.
    xg, fg = x.float().requires_grad_(), freqs.float().requires_grad_()
    xr, fr = x.float().requires_grad_(), freqs.float().requires_grad_()
    g = torch.randn(b, n, c)
    torch.autograd.backward((rome.executorch.apply_rotary_emb_interleaved(xg, fg) * g).sum())
    torch.autograd.backward((_et_interleaved(xr, fr) * g).sum())
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fg.grad, fr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("freqs_rank", [2, 3])
def test_executorch_llama_rope(dtype, freqs_rank):
    b, s, hq, hk, d = 2, 9, 4, 4, 32
    cos, sin = _pair_tables(s, d // 2)
    if freqs_rank == 3:  # per-head tables [S, H, D/2]
        cos = cos.unsqueeze(1) * torch.linspace(0.5, 1.0, hq).view(1, hq, 1)
        sin = sin.unsqueeze(1) * torch.linspace(0.5, 1.0, hq).view(1, hq, 1)
    xq = torch.randn(b, s, hq, d).to(dtype)
    xk = torch.randn(b, s, hk, d).to(dtype)
    q_ref, k_ref = _et_apply_rotary_emb(xq, xk, cos, sin)
    q_out, k_out = rome.executorch.apply_rotary_emb(xq, xk, cos, sin)
    c = _et_reshape_for_broadcast(cos, xq[..., ::2]).repeat_interleave(2, -1)
    sn = _et_reshape_for_broadcast(sin, xq[..., ::2]).repeat_interleave(2, -1)
    for x, out, ref in ((xq, q_out, q_ref), (xk, k_out, k_ref)):
        exact, terms = exact_and_terms(x, c, sn, rotate_pairs64)
        assert_matches_library(out, ref, terms, products_rounded=False)
        assert_correctly_rounded(out, exact, terms)


def test_executorch_hf_rope_partial():
    modeling = need_module("transformers.models.gpt_neox.modeling_gpt_neox")
    cos, sin = _llama_tables(2, 6, 16, torch.float32)
    q, k = torch.randn(2, 4, 6, 32), torch.randn(2, 2, 6, 32)
    q_out, k_out = rome.executorch.hf_apply_rotary_emb(q, k, cos, sin)
    q_ref, k_ref = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["float64", "growing_tables", "odd_rotary", "mixed_dtypes"])
def test_hf_falls_back_where_the_kernel_refuses(case):
    """rome.hf asks the kernel and, on its refusal, runs transformers' formula: same results."""
    q = torch.randn(2, 4, 5, 16)
    k = torch.randn(2, 2, 5, 16)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    if case == "float64":
        q, k, cos, sin = q.double(), k.double(), cos.double(), sin.double()
    elif case == "growing_tables":  # tables with a batch of 2 for a q batch of 1: q grows
        q, k = q[:1], k[:1]
    elif case == "odd_rotary":  # a 15-wide table: the kernel has no odd half rotation
        cos, sin = cos[..., :15], sin[..., :15]
    else:  # bf16 q, fp32 tables: transformers promotes to fp32
        q, k = q.bfloat16(), k.bfloat16()

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    def formula(x, c, s):
        c, s = c.unsqueeze(1), s.unsqueeze(1)
        rd = c.shape[-1]
        if rd == x.shape[-1]:
            return x * c + rotate_half(x) * s
        return torch.cat([x[..., :rd] * c + rotate_half(x[..., :rd]) * s, x[..., rd:]], dim=-1)

    q_out, k_out = rome.hf._rope_qk(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
    for got, x in ((q_out, q), (k_out, k)):
        want = formula(x, cos, sin)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Traced: in eager mode the drop-ins ask the kernel (its refusal falls back); under torch.compile a
# refusal would raise while tracing, so the drop-ins decide with checks that mirror the kernel's.


def _rome_ops_in(fn, *args):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return any(e.key.startswith("rome::") for e in prof.key_averages())


@pytest.mark.parametrize("dropin, case", [
    (dropin, case) for dropin in ("hf", "diffusers_real", "diffusers_complex", "executorch")
    for case in ("kernel", "float64_tables", "tables_grow_q", "sin_of_another_shape")
    # ExecuTorch's tables are [S, D/2] or [S, H, D/2] exactly: none grows q.
    if (dropin, case) != ("executorch", "tables_grow_q")
    and (case != "sin_of_another_shape" or dropin == "diffusers_real")])
def test_dropins_traced_decide_as_eager(dropin, case, monkeypatch):
    """Compiled (fullgraph, aot_eager) and eager calls of a drop-in give the same results and take
    the kernel on the same inputs: the traced checks agree with the kernel's own."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 4, 6, 16, generator=g).bfloat16()
    k = torch.randn(1, 2, 6, 16, generator=g).bfloat16()
    angle = torch.rand(2 if case == "tables_grow_q" else 1, 6, 8, generator=g) * 5
    if dropin == "hf":
        cos = torch.cat([angle.cos()] * 2, -1)
        sin = torch.cat([angle.sin()] * 2, -1)
        if case == "float64_tables":
            cos, sin = cos.double(), sin.double()
        fn, args = rome.hf.apply_rotary_pos_emb, (x, k, cos, sin)
    elif dropin == "diffusers_real":
        cos = angle.cos().repeat_interleave(2, -1)
        sin = angle.sin().repeat_interleave(2, -1)
        cos, sin = cos[0], sin[0]  # [S, D]
        if case == "tables_grow_q":  # one token against 6 table rows: diffusers broadcasts
            x = x[:, :, :1]
        if case == "sin_of_another_shape":  # [1, S, D]: diffusers' result gains an axis
            sin = sin[None]
        if case == "float64_tables":
            cos, sin = cos.double(), sin.double()
        fn, args = rome.diffusers.apply_rotary_emb, (x, (cos, sin))
    elif dropin == "executorch":
        cos, sin = angle[0].cos(), angle[0].sin()  # [S, D/2]
        if case == "float64_tables":
            cos, sin = cos.double(), sin.double()
        fn, args = rome.executorch.apply_rotary_emb, (x.transpose(1, 2), k.transpose(1, 2), cos, sin)
    else:
        freqs = torch.polar(torch.ones_like(angle), angle)
        if case == "float64_tables":
            freqs = freqs.to(torch.complex128)
        x = x.transpose(1, 2).contiguous()  # [B, S, H, D]
        fn, args = (lambda x, f: rome.diffusers.apply_rotary_emb(x, f, use_real=False)), (x, freqs)
    eager = fn(*args)
    torch._dynamo.reset()
    traced = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    for e, t in zip(eager if isinstance(eager, tuple) else (eager,),
                    traced if isinstance(traced, tuple) else (traced,)):
        torch.testing.assert_close(t, e, rtol=0, atol=0)
    takes_kernel = case == "kernel"
    module, name = {"hf": (rome.hf, "_eager"), "executorch": (rome.executorch, "_pairs_reference")
                    }.get(dropin, (rome.diffusers, "_reference"))
    fallbacks, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: fallbacks.append(1) or original(*a))
    fn(*args)
    assert bool(fallbacks) != takes_kernel
    monkeypatch.setattr(module, name, original)
    torch._dynamo.reset()
    assert _rome_ops_in(torch.compile(fn, fullgraph=True, backend="aot_eager"), *args) == \
        takes_kernel
