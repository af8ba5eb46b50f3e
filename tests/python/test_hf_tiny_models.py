"""A tiny random-init causal LM of every transformers family whose modeling module defines
a function rome.hf patches: patched, its logits match transformers' own in fp32 and bf16.

Its own file (not test_hf_coverage.py's): the two are the longest test files, and pytest's
``--dist loadfile`` runs them on different workers.
"""

import sys
import warnings

import pytest
import torch

import rome.hf
from test_hf_coverage import _as_tuple, _defines_rope, _form_of

transformers = pytest.importorskip("transformers")


# Whole models: a tiny random-init causal LM of every family transformers can build from its
# default config shrunk (4 layers, so hybrid models reach an attention layer).

_SHRINK = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               moe_intermediate_size=32, num_experts=4, n_routed_experts=4,
               num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32,
               rotary_dim=8, pad_token_id=0, n_group=1, topk_group=1)
# Retried in turn where the shrunk config does not build or run (MLA heads, explicit head dims).
_MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1)
_VARIANTS = ({}, {"head_dim": 16}, {"num_key_value_heads": 4},
             {"num_key_value_heads": 4, "head_dim": 16}, _MLA, {**_MLA, "rope_interleave": True})
_MAX_PARAMS = 10_000_000


def _causal_lm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)


def _tiny_causal_lm(model_type: str, dtype: torch.dtype):
    """(model, None) or (None, why it cannot be built here)."""
    import transformers

    cls = _causal_lm_class(model_type)
    if cls is None:
        return None, "no causal-LM class"
    why = "no variant"
    for variant in _VARIANTS:
        try:
            config = transformers.AutoConfig.for_model(model_type)
            for key, value in {**_SHRINK, **variant}.items():
                if hasattr(config, key):
                    setattr(config, key, value)
            config._attn_implementation = "eager"
            with torch.device("meta"):
                params = sum(p.numel() for p in cls(config).parameters())
            if params > _MAX_PARAMS:
                return None, f"{params / 1e6:.0f}M parameters when shrunk"
            torch.manual_seed(0)
            model = cls(config).eval().to(dtype)
            with torch.no_grad():
                model(torch.randint(1, 100, (1, 7)), use_cache=False)
            return model, None
        except Exception as exc:  # a config this generic shrink does not fit
            why = f"{type(exc).__name__}: {str(exc)[:80]}"
    return None, why


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


@pytest.mark.one_isa
def test_tiny_model_of_every_family_same_logits():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ran, not_built, failures, forms_seen = [], {}, [], set()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                cls = _causal_lm_class(model_type)
            except Exception:  # a family that does not import here
                cls = None
            if cls is None or not _defines_rope(sys.modules[cls.__module__]):
                continue
            model, why = _tiny_causal_lm(model_type, torch.float32)
            if model is None:
                not_built[model_type] = why
                continue
            module = sys.modules[cls.__module__]
            originals = {n: module.__dict__[n] for n in rome.hf._PATCHED_NAMES
                         if n in module.__dict__}
            calls = []

            def counting(fn):
                def count(*args, **kwargs):
                    calls.append(1)
                    return fn(*args, **kwargs)
                return count

            for n, fn in originals.items():
                setattr(module, n, counting(fn))
            try:
                ref32 = _logits(model, ids)
            finally:
                for n, fn in originals.items():
                    setattr(module, n, fn)
            if not calls:
                continue  # this config's layers never call the function (no rotary attention)
            with rome.hf.patch_model(model, warn=False) as handle:
                if module.__name__ not in handle.patched:
                    failures.append(f"{model_type}: not patched ({handle.skipped})")
                    continue
                with torch.profiler.profile() as prof:
                    out32 = _logits(model, ids)
                forms_seen.add(tuple(_form_of(module.__dict__[n]) for n in sorted(originals)
                                     if module.__dict__[n] is not originals[n]))
                out16 = _logits(model.to(torch.bfloat16), ids)
            ref16 = _logits(model, ids)

            def exactly_rounded(fn):
                def rounded(*args, **kwargs):
                    wide = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a
                            for a in args]
                    like = fn(*args, **kwargs)
                    out = tuple(None if r is None else e.to(r.dtype) for e, r in zip(
                        _as_tuple(fn(*wide, **kwargs)), _as_tuple(like)))
                    return out if isinstance(like, tuple) else out[0]
                return rounded

            def exactly_rounded_logits():
                for n, fn in originals.items():
                    setattr(module, n, exactly_rounded(fn))
                try:
                    return _logits(model, ids)
                finally:
                    for n, fn in originals.items():
                        setattr(module, n, fn)
            if not any(e.name == "rome::rope" for e in prof.events()):
                failures.append(f"{model_type}: rome::rope did not run")
                continue
            scale = ref32.abs().max().item()
            err32 = (out32 - ref32).abs().max().item()
            if err32 > 1e-4 * scale + 1e-5:
                failures.append(f"{model_type}: fp32 logits differ by {err32:.3g}")
            # bf16: RoME rounds once where transformers rounds each product, and in MoE models
            # one ulp can flip a token's experts. So the reference is either transformers' bf16
            # model or the same model with RoPE exactly rounded, whichever is nearer; allowed:
            # transformers' own bf16 error (against fp32) twice over.
            ran.append(model_type)
            err16 = (out16 - ref16).abs().max().item()
            noise16 = (ref16 - ref32).abs().max().item()
            if err16 > 2 * noise16 + 1e-3 * scale:
                err16 = min(err16, (out16 - exactly_rounded_logits()).abs().max().item())
            if err16 > 2 * noise16 + 1e-3 * scale:
                failures.append(f"{model_type}: bf16 logits differ by {err16:.3g} "
                                f"(transformers' bf16 error {noise16:.3g})")
    print(f"{len(ran)} families ran through RoME in fp32 and bf16: {ran}; forms {forms_seen}",
          file=sys.stderr)
    assert len(forms_seen) >= 10, forms_seen
    print(f"not built here ({len(not_built)}): {not_built}", file=sys.stderr)
    assert not failures, "\n".join(failures)
    assert len(ran) >= 80, ran


@pytest.mark.one_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_qwen2_vl_vision_tower_same_output(dtype):
    """Qwen2-VL's vision tower (2 blocks, random init; its apply_rotary_pos_emb_vision) patched:
    RoME runs in every block and the output matches transformers' within its own bf16 noise."""
    try:
        from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    except Exception as exc:
        pytest.skip(f"no Qwen2-VL in this transformers: {exc}")
    config = Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2,
                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                 in_channels=3)
    torch.manual_seed(0)
    model = qwen2_vl.Qwen2VisionTransformerPretrainedModel._from_config(config).eval()
    grid = torch.tensor([[1, 4, 6]])  # t, h, w patches of one image
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14)

    def run(m, x):
        with torch.no_grad():
            out = m(x, grid_thw=grid)
        out = getattr(out, "last_hidden_state", out)
        return (out[0] if isinstance(out, tuple) else out).float()

    ref32 = run(model, pixels)
    model = model.to(dtype)
    ref = run(model, pixels.to(dtype))
    with rome.hf.patch_model(model, warn=False) as handle:
        assert qwen2_vl.__name__ in handle.patched, handle.skipped
        with torch.profiler.profile() as prof:
            out = run(model, pixels.to(dtype))
    assert sum(e.name == "rome::rope" for e in prof.events()) == config.depth
    noise = (ref - ref32).abs().max().item()
    assert (out - ref).abs().max().item() <= 2 * noise + 1e-5 * ref32.abs().max().item()
