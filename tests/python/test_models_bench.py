"""The real-model table's newer rows on tiny configurations (the bench builds the real ones, too
slow for the suite): HunyuanVideo through the rome.diffusers name patch, InternVL's language model
through rome.hf.patch_model, and the table's csv/png output."""

import csv
import json

import pytest
import torch

import rome.hf
from rome.bench import models
from conftest import need_module




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hunyuan_video_patch(dtype):
    """A tiny HunyuanVideo (3D RoPE 8/8/8 of head dim 24, one double- and one single-stream
    block): its processor imports apply_rotary_emb at call time, so the bench's patch of
    diffusers.models.embeddings reaches it; RoME's op runs on q and k of both blocks (the single
    block's are slices of the joint sequence), the output is diffusers', the name is restored."""
    diffusers = need_module("diffusers")
    embeddings = need_module("diffusers.models.embeddings")
    original = embeddings.apply_rotary_emb
    torch.manual_seed(0)
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=24, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(8, 8, 8)).eval().to(dtype)
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 6, 8).to(dtype),  # 3 x 3 x 4 tokens
                  timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 5, 32).to(dtype),
                  encoder_attention_mask=torch.ones(1, 5, dtype=torch.long),
                  pooled_projections=torch.randn(1, 16).to(dtype),
                  guidance=torch.tensor([6000.0]).to(dtype), return_dict=False)
    with torch.no_grad():
        ref = model(**inputs)[0]
        with models._patch_hunyuan_video(model) as patched:
            assert patched and embeddings.apply_rotary_emb is not original
            with torch.profiler.profile() as prof:
                got = model(**inputs)[0]
    assert embeddings.apply_rotary_emb is original
    assert sum(e.name == "rome::rope" for e in prof.events()) == 4
    # diffusers' RoPE is fp32 math with one rounding, as RoME's (bf16: an ulp where they differ).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_internvl_language_model_patch():
    """InternVL builds its language model with AutoModel.from_config(text_config) (a qwen2
    config): patch_model patches it and keeps its output."""
    transformers = need_module("transformers")
    if not hasattr(transformers, "InternVLConfig"):
        pytest.skip("this transformers has no InternVL")
    cfg = transformers.InternVLConfig(text_config={
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 128, "rope_theta": 1000000.0, "bos_token_id": 0, "eos_token_id": 1})
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg.text_config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 128, (1, 11))
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
        with rome.hf.patch_model(model, warn=False) as handle:
            assert handle.patched
            with torch.profiler.profile() as prof:
                got = model(input_ids=ids).last_hidden_state
    assert any(e.name.startswith("rome::") for e in prof.events())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.one_isa
def test_save_writes_csv_and_png(tmp_path):
    def row(key, title, inline=False):
        return {"key": key, "title": title, "seq": 64, "dtype": "bfloat16", "threads": 2,
                "layers": 1, "patched": True, "torch_s": 0.5, "rome_s": 0.4, "speedup_pct": 25.0,
                "rope_s_torch": 0.05, "rope_s_rome": 0.01,
                "rope_share_torch": 0.1, "rope_inline": inline, "max_rel_diff": 1e-2,
                "torch_error_vs_fp32": 1e-2, "rome_error_vs_fp32": 1e-2}

    res = {"rows": [row("a", "Model A (x)"), row("w", "Wan (y)", inline=True),
                    {"key": "b", "title": "Model B", "seq": 64, "threads": 2,
                     "error": "ValueError: no"}],
           "decode": None, "isa": "avx2", "dtype": "torch.bfloat16", "wall_s": 1.0}
    paths = models.save(res, tmp_path)
    assert sorted(paths) == ["csv", "json", "md", "png"]
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](models.png)" in paths["md"].read_text()
    assert json.loads(paths["json"].read_text())["rows"][0]["key"] == "a"
    with open(paths["csv"]) as f:
        lines = list(csv.DictReader(f))
    assert [r["key"] for r in lines] == ["a", "w", "b"]
    assert float(lines[0]["torch_ms"]) == 500.0 and float(lines[0]["rome_ms"]) == 400.0
    assert float(lines[1]["rope_ms_torch"]) == 50.0 and lines[1]["rope_inline"] == "True"
    assert "| 10.00%* | 50.00* / 10.00 ms |" in paths["md"].read_text()  # inline: an estimate
    assert lines[2]["error"] == "ValueError: no" and lines[2]["torch_ms"] == ""


@pytest.mark.one_isa
def test_sequence_length_options(monkeypatch):
    """--seq sets every model's length; --seed-lengths takes each model's SEED_LENGTHS entry
    times --seq-scale (the models themselves are not built here)."""
    seen = []

    def fake_row(spec, seq, dtype, repeats, threads):
        seen.append((spec[0], seq))
        return {"key": spec[0], "seq": seq}

    monkeypatch.setattr(models, "model_row", fake_row)
    quiet = dict(threads_list=(1,), only=["llama31_8b", "flux1"], decode=False,
                 progress=lambda _: None)
    res = models.run(seed_lengths=True, seq_scale=0.5, **quiet)
    assert seen == [("llama31_8b", 4096), ("flux1", round(models.SEED_LENGTHS["flux1"] / 2))]
    assert res["seq_note"] == "the seed's sequence lengths x 0.5"
    seen.clear()
    models.run(seq=100, **quiet)
    assert seen == [("llama31_8b", 100), ("flux1", 100)]
    seen.clear()
    models.run(**quiet)
    assert seen == [("llama31_8b", 256), ("flux1", 256)]


@pytest.mark.one_isa
def test_fp32_columns_say_when_not_run():
    row = {"torch_error_vs_fp32": None, "rome_error_vs_fp32": None}
    assert models._fp32_errors(row) == f"not run (S > {models.FP32_CHECK_MAX_SEQ})"
    row = {"torch_error_vs_fp32": 1e-2, "rome_error_vs_fp32": 2e-2}
    assert models._fp32_errors(row) == "1.0e-02 / 2.0e-02"


@pytest.mark.one_isa
def test_wan_inline_rope_timer_sees_the_rotated_tensors():
    """The Wan row's RoPE time without RoME: the hooks keep q and k of every self-attention (as
    the processor splits them into heads) and the tables, and the transcribed inline formula on
    them gives what the processor's own rotation gives (RoME's Wan processor, the same math)."""
    need_module("diffusers")
    from diffusers import WanTransformer3DModel

    import rome.diffusers

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2,
                                  attention_head_dim=32, in_channels=4, out_channels=4,
                                  text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                  eps=1e-6, rope_max_seq_len=64).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 4, 4), timestep=torch.tensor([10]),
                  encoder_hidden_states=torch.randn(1, 3, 16), return_dict=False)
    timer = models._InlineRopeTimer(model)
    with torch.no_grad(), timer.active():
        model(**inputs)
    assert len(timer.rotated) == 4 and timer.seconds() > 0  # q and k of 2 blocks
    assert not model.rope._forward_hooks and not model.blocks[0].attn1.norm_q._forward_hooks
    cos, sin = timer.tables
    for x in timer.rotated:
        assert x.shape == (1, 2 * 2 * 2, 2, 32)  # [B, S, heads, head_dim]
        want = rome.ops.rope(x, None, cos[..., 0::2], sin[..., 1::2], rotation="interleave",
                             table_width="pairs")[0]
        torch.testing.assert_close(models._wan_inline_rope(x, cos, sin), want, rtol=1e-5,
                                   atol=1e-5)
