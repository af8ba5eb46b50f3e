"""Real transformers and diffusers model classes with and without RoME (issue 12's whole-network
table): each model is built from its real configuration (hidden size, heads, head dim, RoPE
settings), one decoder layer or transformer block, random init, no downloads, and run forward on
one input; then one decode row (a 2-layer Llama-3.1-8B-shaped model generating 32 tokens; --quick:
1 layer, 8 tokens).

Per model: forward time without and with RoME (``rome.hf.patch_model`` or the rome.diffusers
drop-in; timed alternately, median), RoPE's share of the unpatched forward (the time spent inside
the modeling module's RoPE function and the rotary embedding module, measured by wrapping them in
a timed run of its own; for Wan, whose RoPE is inline in its attention processor, the rotary
module plus a transcribed copy of the inline rotation re-run on the same q and k), the
speed-up, and the largest output difference relative to the largest output.

:func:`save` writes models.{md,json,csv,png} (the chart: time per layer or block without and with
RoME); ``python -m rome.bench.models [--only KEYS] [--no-decode] --out DIR`` runs this table alone.

The vocabulary is cut to 1024 entries (the embedding and LM head are not what is measured; the
real 128K-152K vocabularies would dominate a one-layer model). The dtype is bf16 where the CPU
has bf16 matrix hardware (AVX512-BF16 or AMX) and fp32 elsewhere: without it torch's bf16 matmul
runs about 10x slower than its sgemm and no user would run a model that way.
"""

import contextlib
import csv
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

import rome
import rome.hf

VOCAB = 1024


def _bf16_hardware() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _llama31_8b(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, num_hidden_layers=layers, vocab_size=VOCAB,
                      max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192},
                      rope_theta=500000.0, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg), "transformers.models.llama.modeling_llama"


def _qwen3_8b(layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, num_hidden_layers=layers,
                      vocab_size=VOCAB, max_position_embeddings=40960, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg), "transformers.models.qwen3.modeling_qwen3"


def _qwen2vl_7b_text(layers: int):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

    cfg = Qwen2VLTextConfig(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                            num_key_value_heads=4, num_hidden_layers=layers, vocab_size=VOCAB,
                            max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=0,
                            eos_token_id=1,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                             "mrope_section": [16, 24, 24]},
                            attn_implementation="sdpa")
    return Qwen2VLTextModel(cfg), "transformers.models.qwen2_vl.modeling_qwen2_vl"


def _internvl3_8b_text(layers: int):
    from transformers import AutoModel, InternVLConfig

    # InternVL3-8B's language model, built as InternVLModel builds it
    # (AutoModel.from_config(config.text_config), a qwen2 text config by default): Qwen2.5-7B's
    # shape, 28 heads / 4 KV heads of 128, FFN 18944, RoPE theta 1e6, half rotation.
    cfg = InternVLConfig(text_config={
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": layers,
        "vocab_size": VOCAB, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "bos_token_id": 0, "eos_token_id": 1})
    model = AutoModel.from_config(cfg.text_config, attn_implementation="sdpa")
    return model, type(model).__module__


def _mrope_positions(seq: int) -> torch.Tensor:
    """[3, 1, seq] temporal/height/width positions as Qwen2-VL assigns them: 16 text tokens, an
    image of side x side patches (one temporal position, its row and column), then text."""
    side = 8 if seq >= 16 + 64 + 1 else 2
    image = side * side
    t, h, w = (torch.arange(seq) for _ in range(3))
    grid = torch.arange(image)
    t[16:16 + image], h[16:16 + image], w[16:16 + image] = 16, 16 + grid // side, 16 + grid % side
    rest = seq - 16 - image
    next_position = 16 + side
    for axis in (t, h, w):
        axis[16 + image:] = next_position + torch.arange(rest)
    return torch.stack([t, h, w])[:, None, :]


def _flux1(layers: int):
    from diffusers import FluxTransformer2DModel

    # FLUX.1-dev: 24 heads of 128, joint attention 4096, pooled 768, RoPE axes 16/56/56.
    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=layers,
                                   num_single_layers=0, attention_head_dim=128,
                                   num_attention_heads=24, joint_attention_dim=4096,
                                   pooled_projection_dim=768, guidance_embeds=True,
                                   axes_dims_rope=(16, 56, 56))
    return model, "diffusers.models.transformers.transformer_flux"


# An inputs dict's entry (removed before the forward): the tokens of the model's self-attention
# sequence those inputs make (grids round `seq` down to squares; text tokens join where the
# attention is joint).
_TOKENS = "_tokens"


def _flux_inputs(seq: int, dtype: torch.dtype) -> Dict:
    """seq image tokens (a square latent grid) and seq // 4 text tokens."""
    side = int(seq ** 0.5)
    text = seq // 4
    img_ids = torch.zeros(side * side, 3)
    img_ids[:, 1] = torch.arange(side).repeat_interleave(side)
    img_ids[:, 2] = torch.arange(side).repeat(side)
    return {"hidden_states": torch.randn(1, side * side, 64).to(dtype),
            "encoder_hidden_states": torch.randn(1, text, 4096).to(dtype),
            "pooled_projections": torch.randn(1, 768).to(dtype),
            "timestep": torch.tensor([0.5]).to(dtype), "guidance": torch.tensor([3.5]).to(dtype),
            "img_ids": img_ids, "txt_ids": torch.zeros(text, 3), "return_dict": False,
            _TOKENS: side * side + text}


@contextlib.contextmanager
def _module_name_replaced(module_name: str, name: str, replacement):
    """`name` in the (imported) module `module_name` is `replacement` inside the block: diffusers'
    attention processors look their RoPE function up by name at call time."""
    module = sys.modules[module_name]
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield True
    finally:
        setattr(module, name, original)


def _patch_flux(model):
    """diffusers has no hook for it: Flux's attention processors call the name
    `apply_rotary_emb` their module imported from diffusers.models.embeddings."""
    import rome.diffusers

    return _module_name_replaced("diffusers.models.transformers.transformer_flux",
                                 "apply_rotary_emb", rome.diffusers.apply_rotary_emb)


def _qwen_image(layers: int):
    from diffusers import QwenImageTransformer2DModel

    # Qwen-Image (its class defaults are the released config): 24 heads of 128, text 3584,
    # complex RoPE axes 16/56/56 through apply_rotary_emb_qwen.
    model = QwenImageTransformer2DModel(num_layers=layers)
    return model, "diffusers.models.transformers.transformer_qwenimage"


def _qwen_image_inputs(seq: int, dtype: torch.dtype) -> Dict:
    """seq image tokens (a square latent grid) and seq // 4 text tokens."""
    side = int(seq ** 0.5)
    text = seq // 4
    return {"hidden_states": torch.randn(1, side * side, 64).to(dtype),
            "encoder_hidden_states": torch.randn(1, text, 3584).to(dtype),
            "encoder_hidden_states_mask": torch.ones(1, text, dtype=torch.long),
            "timestep": torch.tensor([0.5]).to(dtype), "img_shapes": [(1, side, side)],
            "return_dict": False, _TOKENS: side * side + text}


def _patch_qwen_image(model):
    import rome.diffusers

    return _module_name_replaced("diffusers.models.transformers.transformer_qwenimage",
                                 "apply_rotary_emb_qwen", rome.diffusers.apply_rotary_emb_qwen)


def _wan21(layers: int):
    from diffusers import WanTransformer3DModel

    # Wan2.1-T2V-1.3B: 12 heads of 128, FFN 8960, text 4096, 3D RoPE t/h/w 44/42/42 (pairs).
    # Its RoPE runs inside the attention processor: RoME's time is that of rome.ops.rope there.
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12,
                                  attention_head_dim=128, in_channels=16, out_channels=16,
                                  text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=layers,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                  eps=1e-6, rope_max_seq_len=1024)
    return model, "rome.ops"


def _wan_inputs(seq: int, dtype: torch.dtype) -> Dict:
    """4 latent frames of a square grid: seq video tokens after the 1x2x2 patches; seq // 4 text
    tokens."""
    side = int((seq // 4) ** 0.5)
    return {"hidden_states": torch.randn(1, 16, 4, 2 * side, 2 * side).to(dtype),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, seq // 4, 4096).to(dtype),
            "return_dict": False, _TOKENS: 4 * side * side}  # the text is cross-attention


@contextlib.contextmanager
def _patch_wan(model):
    import rome.diffusers

    with rome.diffusers.patch_wan(model) as handle:
        yield handle.active


def _hunyuan_video(layers: int):
    from diffusers import HunyuanVideoTransformer3DModel

    # HunyuanVideo (hunyuanvideo-community/HunyuanVideo's transformer config, spelled out so a
    # change of diffusers' defaults cannot change the row): 24 heads of 128, text 4096 through a
    # 2-layer token refiner, pooled 768, 3D RoPE t/h/w 16/56/56 (theta 256, interleaved pairs).
    # One double-stream and one single-stream block: the single one rotates the video part of its
    # joint q/k, a slice of the sequence.
    model = HunyuanVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
        num_layers=layers, num_single_layers=layers, num_refiner_layers=2, mlp_ratio=4.0,
        patch_size=2, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True,
        text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
        rope_axes_dim=(16, 56, 56))
    # Its processor imports apply_rotary_emb from here inside __call__ (see _patch_hunyuan_video).
    return model, "diffusers.models.embeddings"


def _hunyuan_video_inputs(seq: int, dtype: torch.dtype) -> Dict:
    """4 latent frames of a square grid: seq video tokens after the 1x2x2 patches; seq // 4 text
    tokens; guidance as the pipeline scales it (x1000)."""
    side = int((seq // 4) ** 0.5)
    text = seq // 4
    return {"hidden_states": torch.randn(1, 16, 4, 2 * side, 2 * side).to(dtype),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, text, 4096).to(dtype),
            "encoder_attention_mask": torch.ones(1, text, dtype=torch.long),
            "pooled_projections": torch.randn(1, 768).to(dtype),
            "guidance": torch.tensor([6000.0]).to(dtype), "return_dict": False,
            _TOKENS: 4 * side * side + text}


def _patch_hunyuan_video(model):
    """HunyuanVideo's processor runs `from ..embeddings import apply_rotary_emb` at every call
    (sequence_dim=1, interleaved pairs): the name to replace is diffusers.models.embeddings'. That
    reaches every processor importing it that way, which is fine for the one model timed here."""
    import rome.diffusers

    return _module_name_replaced("diffusers.models.embeddings", "apply_rotary_emb",
                                 rome.diffusers.apply_rotary_emb)


@contextlib.contextmanager
def _patch_hf(model):
    with rome.hf.patch_model(model, warn=False) as handle:
        # A patched rotary module alone does not make RoME rotate: a modeling module must be.
        yield bool(handle.patched)


def _hf_inputs(positions_fn):
    def inputs(seq: int, dtype: torch.dtype) -> Dict:
        kw = {"input_ids": torch.randint(0, VOCAB, (1, seq))}
        if positions_fn is not None:
            kw["position_ids"] = positions_fn(seq)
        return kw
    return inputs


# key, title, build(layers) -> (model, modeling module), inputs(seq, dtype), patch context,
# the modeling module's RoPE function name.
MODELS = [
    ("llama31_8b", "Llama-3.1-8B (half, llama3 scaling, GQA 32/8)", _llama31_8b, _hf_inputs(None),
     _patch_hf, "apply_rotary_pos_emb"),
    ("qwen3_8b", "Qwen3-8B (QK-norm, half, GQA 32/8)", _qwen3_8b, _hf_inputs(None), _patch_hf,
     "apply_rotary_pos_emb"),
    ("qwen2vl_7b", "Qwen2-VL-7B text (MRoPE 16/24/24, GQA 28/4)", _qwen2vl_7b_text,
     _hf_inputs(_mrope_positions), _patch_hf, "apply_rotary_pos_emb"),
    ("flux1", "FLUX.1 double-stream block (interleaved 2D RoPE 16/56/56, 24 heads)", _flux1,
     _flux_inputs, _patch_flux, "apply_rotary_emb"),
    ("qwen_image", "Qwen-Image block (complex 2D RoPE 16/56/56, 24 heads)", _qwen_image,
     _qwen_image_inputs, _patch_qwen_image, "apply_rotary_emb_qwen"),
    ("wan21_1_3b", "Wan2.1-T2V-1.3B block (interleaved 3D RoPE 44/42/42, 12 heads)", _wan21,
     _wan_inputs, _patch_wan, "rope"),
    ("internvl3_8b", "InternVL3-8B text (Qwen2.5-7B-shaped, half, GQA 28/4)", _internvl3_8b_text,
     _hf_inputs(None), _patch_hf, "apply_rotary_pos_emb"),
    ("hunyuan_video", "HunyuanVideo double- + single-stream block (interleaved 3D RoPE "
     "16/56/56, 24 heads)", _hunyuan_video, _hunyuan_video_inputs, _patch_hunyuan_video,
     "apply_rotary_emb"),
]
# The seed's sequence lengths (SPEC.md's end-to-end table: tokens per RoPE call) as each model's
# `seq` argument: FLUX.1-Kontext's 8704 and Qwen-Image's 6032 tokens are seq image tokens plus
# seq // 4 text tokens here, Wan2.2's 6630 video tokens; the grids round down to squares, and the
# table reports the tokens that ran. Models the seed did not run take their nearest sibling's:
# Qwen3 and Qwen2-VL Llama's 8192, HunyuanVideo Wan's 6630.
SEED_LENGTHS = {"llama31_8b": 8192, "qwen3_8b": 8192, "qwen2vl_7b": 8192, "flux1": 6963,
                "qwen_image": 4826, "wan21_1_3b": 6630, "internvl3_8b": 1846,
                "hunyuan_video": 6630}
# Above this many tokens the fp32 copy of the model (the error columns) is not run: one fp32 layer
# at the seed's lengths takes minutes where bf16 has matrix hardware.
FP32_CHECK_MAX_SEQ = 2048
# The shortest scaled length: Qwen2-VL's positions hold 16 text tokens and an 8 x 8 image from 81.
_MIN_SEQ = 81

def _wan_inline_rope(hidden_states, freqs_cos, freqs_sin):
    """The rotation diffusers' WanAttnProcessor.__call__ defines inline (its nested
    apply_rotary_emb in transformer_wan.py, transcribed): it cannot be wrapped and timed where it
    runs, so _InlineRopeTimer runs this copy on the same q, k and tables."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


class _InlineRopeTimer:
    """RoPE that a model computes inline (Wan): forward hooks keep the tensors its self-attention
    rotates (the outputs of attn1.norm_q / norm_k, split into heads as the processor does) and the
    rotary module's tables; after the forward, `seconds()` times the transcribed formula on them,
    one call per tensor as the processor makes them. An estimate of the inline time (the same
    ops on the same tensors, in a separate run), not a measurement inside the forward."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rotated = []
        self.tables = None
        self.hooks = []

    @contextlib.contextmanager
    def active(self):
        def keep(heads):
            return lambda module, args, out: self.rotated.append(out.unflatten(2, (heads, -1)))

        def tables(module, args, out):
            self.tables = out

        self.hooks.append(self.model.rope.register_forward_hook(tables))
        for block in self.model.blocks:
            attn = block.attn1  # self-attention: the one handed rotary_emb
            self.hooks.append(attn.norm_q.register_forward_hook(keep(attn.heads)))
            self.hooks.append(attn.norm_k.register_forward_hook(keep(attn.heads)))
        try:
            yield self
        finally:
            for h in self.hooks:
                h.remove()
            self.hooks = []

    def seconds(self) -> float:
        total = 0.0
        for x in self.rotated:
            t0 = time.perf_counter()
            _wan_inline_rope(x, *self.tables)
            total += time.perf_counter() - t0
        return total


# Models whose RoPE diffusers computes inline (no function to wrap): without RoME its time is
# the rotary module's plus _InlineRopeTimer's estimate of the inline rotation.
_ROPE_INLINE = {"wan21_1_3b"}


class _RopeTimer:
    """Wraps a modeling module's RoPE function and the model's rotary/position embedding modules'
    forward to sum the time spent in them (and count the function's calls)."""

    def __init__(self, model: torch.nn.Module, module_name: str, function: str):
        self.seconds = 0.0
        self.calls = 0
        self.module = sys.modules[module_name]
        self.function = function
        self.rotary = [m for m in model.modules()
                       if type(m).__name__.endswith(("RotaryEmbedding", "PosEmbed"))]

    def _timed(self, fn, count: bool = False):
        def wrapper(*args, **kwargs):
            self.calls += count
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return out
        return wrapper

    @contextlib.contextmanager
    def active(self):
        original = getattr(self.module, self.function)
        setattr(self.module, self.function, self._timed(original, count=True))
        # An instance attribute `forward` may already be there (patch_model's rotary patch).
        saved = [(m, m.__dict__.get("forward")) for m in self.rotary]
        for m, _ in saved:
            m.forward = self._timed(m.forward)
        try:
            yield self
        finally:
            setattr(self.module, self.function, original)
            for m, own in saved:
                if own is None:
                    del m.forward
                else:
                    m.forward = own


def _to_float(value):
    if torch.is_tensor(value):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _to_float(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float(v) for v in value)
    return value


def _output(model, inputs: Dict) -> torch.Tensor:
    out = model(**inputs)
    if isinstance(out, tuple):
        return out[0]
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def model_row(spec, seq: int, dtype: torch.dtype, repeats: int, threads: int) -> Dict:
    key, title, build, inputs_fn, patch, function = spec
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, module_name = build(1)
    model = model.to(dtype).eval()
    inputs = inputs_fn(seq, dtype)
    tokens = inputs.pop(_TOKENS, seq)
    samples = {"torch": [], "rome": []}
    rope = {}
    with torch.inference_mode():
        reference = _output(model, inputs)
        with patch(model):
            with_rome = _output(model, inputs)
        for _ in range(repeats):
            t0 = time.perf_counter()
            _output(model, inputs)
            samples["torch"].append(time.perf_counter() - t0)
            with patch(model):
                t0 = time.perf_counter()
                _output(model, inputs)
                samples["rome"].append(time.perf_counter() - t0)
        for name in ("torch", "rome"):
            with patch(model) if name == "rome" else contextlib.nullcontext(False) as patched:
                timer = _RopeTimer(model, module_name, function)
                inline = _InlineRopeTimer(model) if name == "torch" and key in _ROPE_INLINE else None
                with timer.active(), (inline.active() if inline else contextlib.nullcontext()):
                    t0 = time.perf_counter()
                    _output(model, inputs)
                    total = time.perf_counter() - t0
                rope_s = timer.seconds + (inline.seconds() if inline else 0.0)
            rope[name] = {"rope_s": rope_s, "forward_s": total, "calls": timer.calls,
                          "patched": patched}
        # The same model in fp32, unpatched: how far each bf16 output is from it. RoME and torch
        # round RoPE differently (RoME once, torch after every small op), and a layer's bf16
        # matmuls carry such one-ulp differences to ~1% of the output on some CPUs: what matters
        # is that RoME's output is not further from the fp32 model than torch's own.
        exact = reference.float()
        if dtype != torch.float32 and seq <= FP32_CHECK_MAX_SEQ:
            exact = _output(model.float(), _to_float(inputs)).float()
            model.to(dtype)
        elif dtype != torch.float32:
            exact = None
    t_torch, t_rome = statistics.median(samples["torch"]), statistics.median(samples["rome"])
    scale = reference.float().abs().max().item() or 1.0
    exact_scale = 1.0 if exact is None else (exact.abs().max().item() or 1.0)
    return {
        "key": key, "title": title, "seq": seq, "tokens": tokens,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": threads, "layers": 1,
        # RoME ran: the patch took and the patched function was called in the forward.
        "patched": bool(rope["rome"]["patched"]) and rope["rome"]["calls"] > 0,
        "torch_s": t_torch, "rome_s": t_rome, "speedup_pct": (t_torch / t_rome - 1) * 100,
        "rope_s_torch": rope["torch"]["rope_s"], "rope_s_rome": rope["rome"]["rope_s"],
        "rope_share_torch": rope["torch"]["rope_s"] / rope["torch"]["forward_s"],
        "rope_inline": key in _ROPE_INLINE,
        "max_rel_diff": (with_rome.float() - reference.float()).abs().max().item() / scale,
        "torch_error_vs_fp32": (None if exact is None
                                else (reference.float() - exact).abs().max().item() / exact_scale),
        "rome_error_vs_fp32": (None if exact is None
                               else (with_rome.float() - exact).abs().max().item() / exact_scale),
    }


def decode_row(dtype: torch.dtype, tokens: int, prompt: int, repeats: int, threads: int,
               layers: int = 2) -> Dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, _ = _llama31_8b(layers)
    model = model.to(dtype).eval()
    ids = torch.randint(0, VOCAB, (1, prompt))
    gen = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    samples = {"torch": [], "rome": []}
    with torch.inference_mode():
        ref = model.generate(ids, **gen)
        with rome.hf.patch_model(model, warn=False):
            out = model.generate(ids, **gen)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(ids, **gen)
            samples["torch"].append(time.perf_counter() - t0)
            with rome.hf.patch_model(model, warn=False):
                t0 = time.perf_counter()
                model.generate(ids, **gen)
                samples["rome"].append(time.perf_counter() - t0)
    t_torch, t_rome = statistics.median(samples["torch"]), statistics.median(samples["rome"])
    return {"tokens": tokens, "prompt": prompt, "dtype": str(dtype).replace("torch.", ""),
            "threads": threads, "layers": layers, "torch_tok_s": tokens / t_torch,
            "rome_tok_s": tokens / t_rome,
            "same_tokens": bool(torch.equal(ref, out))}


def run(quick: bool = False, threads_list=(1, 2), repeats: int = 0,
        progress: Callable[[str], None] = print, only: Sequence[str] = (),
        decode: bool = True, seq: int = 0, seed_lengths: bool = False,
        seq_scale: float = 1.0) -> Dict:
    """`only`: model keys to run (default: every model; --quick: the first); `decode=False`
    skips the decode row. Sequence length: `seq` for every model, or with `seed_lengths` each
    model's SEED_LENGTHS entry times `seq_scale`; by default 256 (--quick: 64), the seed's
    thousands of tokens scaled down so that `make bench` stays short."""
    dtype = torch.bfloat16 if _bf16_hardware() else torch.float32
    default_seq = seq or (64 if quick else 256)

    def seq_of(key: str) -> int:
        return max(_MIN_SEQ, round(SEED_LENGTHS[key] * seq_scale)) if seed_lengths else default_seq

    repeats = repeats or (2 if quick else 3)
    threads = max(threads_list)
    saved = torch.get_num_threads()
    start = time.perf_counter()
    rows: List[Dict] = []
    try:
        specs = [s for s in MODELS if s[0] in only] if only else (MODELS[:1] if quick else MODELS)
        for spec in specs:
            model_seq = seq_of(spec[0])
            progress(f"models: {spec[1]}, S={model_seq}, {threads} thread(s)")
            try:
                rows.append(model_row(spec, model_seq, dtype, repeats, threads))
            except Exception as e:  # another library version's API must not stop the benchmark
                rows.append({"key": spec[0], "title": spec[1], "seq": model_seq, "threads": threads,
                             "error": f"{e.__class__.__name__}: {str(e).splitlines()[0][:200]}"})
        layers = 1 if quick else 2  # --quick (CI): one layer, as building the weights dominates
        decode_res = None
        if decode:
            progress(f"models: decode, {layers}-layer Llama-3.1-8B shape")
            try:
                decode_res = decode_row(dtype, 8 if quick else 32, 16, 2, threads, layers)
            except Exception as e:
                decode_res = {"error": f"{e.__class__.__name__}: {str(e).splitlines()[0][:200]}"}
    finally:
        torch.set_num_threads(saved)
    return {"rows": rows, "decode": decode_res, "isa": rome.active_isa(), "dtype": str(dtype),
            "wall_s": round(time.perf_counter() - start, 1),
            "seq_note": (f"the seed's sequence lengths x {seq_scale:g}" if seed_lengths else
                         f"S = {default_seq} for every model")}


def _fp32_errors(r: Dict) -> str:
    if r.get("torch_error_vs_fp32") is None:
        return f"not run (S > {FP32_CHECK_MAX_SEQ})"
    return f"{r['torch_error_vs_fp32']:.1e} / {r['rome_error_vs_fp32']:.1e}"


def _tokens_vs_seed(r: Dict) -> str:
    """The row's tokens, and the scale against the seed's sequence length for that model."""
    tokens = r.get("tokens", r["seq"])
    seed = SEED_LENGTHS.get(r.get("key", ""))
    if not seed or not isinstance(r.get("seq"), int):
        return f"{tokens}"
    return f"{tokens} (S {r['seq']} = {r['seq'] / seed:.3g}x the seed's {seed})"


def markdown(res: Dict, png_name: Optional[str] = None) -> str:
    lines = [
        f"### Real models with and without RoME ({res['isa']}; one decoder layer or block from the real "
        f"config, random init, vocabulary cut to {VOCAB}; {res['dtype'].replace('torch.', '')}; "
        f"{res.get('seq_note', 'S as given')})",
        "",
        "| model | tokens | threads | forward without RoME | with RoME | speed-up | RoPE's share "
        "(without) | RoPE time without / with | max diff with vs without (rel.) | error vs fp32 model: "
        "without / with | patched |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['title']} | {r['seq']} | {r['threads']} | failed: {r['error']} "
                         "| | | | | | | |")
            continue
        inline = "*" if r.get("rope_inline") else ""
        share = f"{r['rope_share_torch'] * 100:.2f}%{inline}"
        rope_torch = f"{r['rope_s_torch'] * 1e3:.2f}{inline}"
        lines.append(
            f"| {r['title']} | {_tokens_vs_seed(r)} | {r['threads']} | {r['torch_s'] * 1e3:.1f} ms | "
            f"{r['rome_s'] * 1e3:.1f} ms | {r['speedup_pct']:+.1f}% | {share} | {rope_torch} / "
            f"{r['rope_s_rome'] * 1e3:.2f} ms | {r['max_rel_diff']:.1e} | "
            f"{_fp32_errors(r)} | "
            f"{'yes' if r['patched'] else 'NO'} |")
    if any(r.get("rope_inline") for r in res["rows"] if "error" not in r):
        lines += ["", "\\* RoPE inline in the model's attention processor (Wan): its time without "
                  "RoME is the rotary module's plus the inline formula (transcribed) re-run after "
                  "the forward on the q and k the forward rotated, an estimate."]
    if png_name:
        lines += ["", f"![time per layer or block without and with RoME]({png_name})"]
    d = res["decode"]
    if d is None:
        return "\n".join(lines) + "\n"
    if "error" in d:
        return "\n".join(lines + ["", f"Decode: failed: {d['error']}"]) + "\n"
    lines += [
        "",
        f"Decode: a {d.get('layers', 2)}-layer Llama-3.1-8B-shaped model generating {d['tokens']} tokens after a "
        f"{d['prompt']}-token prompt (greedy, `model.generate`), {d['threads']} thread(s): "
        f"{d['torch_tok_s']:.2f} tokens/s without RoME, {d['rome_tok_s']:.2f} with "
        f"({(d['rome_tok_s'] / d['torch_tok_s'] - 1) * 100:+.1f}%); same tokens: "
        f"{'yes' if d['same_tokens'] else 'no'}.",
    ]
    return "\n".join(lines) + "\n"


CSV_FIELDS = ["key", "title", "seq", "tokens", "dtype", "threads", "layers", "patched", "torch_ms", "rome_ms",
              "speedup_pct", "rope_share_torch", "rope_inline", "rope_ms_torch", "rope_ms_rome",
              "max_rel_diff", "torch_error_vs_fp32", "rome_error_vs_fp32", "error"]


def write_csv(res: Dict, path: Path) -> None:
    """One line per model row (times in ms; the decode row has other columns: see the json)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in res["rows"]:
            line = dict(r)
            for name, key in (("torch_ms", "torch_s"), ("rome_ms", "rome_s"),
                              ("rope_ms_torch", "rope_s_torch"), ("rope_ms_rome", "rope_s_rome")):
                line[name] = None if r.get(key) is None else r[key] * 1e3
            w.writerow(line)


def write_png(res: Dict, path: Path) -> None:
    """Horizontal bars: forward time of each layer/block without and with RoME."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.75 * max(len(rows), 1)))
    ys = range(len(rows))
    # y grows downwards (inverted below): "without" above "with" in each pair.
    ax.barh([y - 0.2 for y in ys], [r["torch_s"] * 1e3 for r in rows], height=0.4,
            color="#d62728", label="without RoME")
    ax.barh([y + 0.2 for y in ys], [r["rome_s"] * 1e3 for r in rows], height=0.4,
            color="#1f77b4", label="with RoME (speed-up)")
    for y, r in zip(ys, rows):
        ax.text(max(r["torch_s"], r["rome_s"]) * 1e3, y, f" {r['speedup_pct']:+.1f}%",
                va="center", fontsize=8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["title"].split(" (")[0] for r in rows], fontsize=8)
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel("ms per forward of one layer or block (lower is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.margins(x=0.12)
    lengths = {r["seq"] for r in rows}
    seq = f"S={lengths.pop()}" if len(lengths) == 1 else "S per model"
    threads = rows[0]["threads"] if rows else "?"
    ax.set_title(f"Real models with and without RoME — {res['isa']}, "
                 f"{res['dtype'].replace('torch.', '')}, {seq}, {threads} thread(s)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(res: Dict, out_dir: Path) -> Dict[str, Path]:
    """models.{md,json,csv,png} in out_dir (the chart is skipped if matplotlib is missing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"models.{ext}" for ext in ("md", "json", "csv", "png")}
    try:
        write_png(res, paths["png"])
    except ImportError as e:
        paths.pop("png")
        res.setdefault("warnings", []).append(f"no chart: {e}")
    write_csv(res, paths["csv"])
    paths["json"].write_text(json.dumps(res, indent=1))
    paths["md"].write_text(markdown(res, paths["png"].name if "png" in paths else None))
    return paths


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m rome.bench.models",
                                description="The real-model table alone: models.{md,json,csv,png}.")
    p.add_argument("--quick", action="store_true", help="CI size (S=64, first model only)")
    p.add_argument("--only", default="",
                   help=f"comma-separated model keys: {', '.join(s[0] for s in MODELS)}")
    p.add_argument("--no-decode", action="store_true", help="skip the decode row")
    p.add_argument("--threads", type=int, default=0, help="threads (default: every core)")
    p.add_argument("--seq", type=int, default=0, help="sequence length of every model "
                   "(default 256, --quick 64)")
    p.add_argument("--seed-lengths", action="store_true",
                   help="each model at the seed's sequence length (SEED_LENGTHS; minutes per "
                   "model; the fp32 error columns only up to S = %d)" % FP32_CHECK_MAX_SEQ)
    p.add_argument("--seq-scale", type=float, default=1.0,
                   help="with --seed-lengths: scale every length (e.g. 0.25 on a slow CPU)")
    p.add_argument("--out", default="bench-results", help="output directory")
    args = p.parse_args(argv)
    if args.seq and args.seed_lengths:
        p.error("--seq and --seed-lengths choose the length two ways: give one")
    if args.seq_scale != 1.0 and not args.seed_lengths:
        p.error("--seq-scale scales --seed-lengths: give both")
    import os

    threads = args.threads or len(os.sched_getaffinity(0))
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = set(only) - {s[0] for s in MODELS}
    if unknown:
        p.error(f"unknown models: {', '.join(sorted(unknown))}")
    res = run(quick=args.quick, threads_list=sorted({1, threads}), only=only,
              decode=not args.no_decode, seq=args.seq, seed_lengths=args.seed_lengths,
              seq_scale=args.seq_scale,
              progress=lambda what: print(what, file=sys.stderr, flush=True))
    paths = save(res, Path(args.out))
    print(markdown(res))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
