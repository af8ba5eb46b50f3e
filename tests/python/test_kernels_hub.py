"""RoME behind transformers' ``rotary_pos_emb`` hub-kernel hook (rome.hf_kernels), through the
Hugging Face ``kernels`` package: kernels.kernelize with rome.hf.kernel_mapping() on CPU, no hub.

transformers 5.23/5.24 activate their hub decorators only with 0.18.2 <= kernels < 0.19; the
registry here has kernels 0.17.2 at most, whose kernelize API is the same. The tiny-model tests
therefore run in a child process that lifts transformers' version gate before any modeling module
is imported (a no-op where a compatible kernels is installed): lifting it in this process would
turn every later-imported modeling module's apply_rotary_pos_emb into a hook object for the other
test files.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

kernels = pytest.importorskip(
    "kernels", reason="the Hugging Face `kernels` package is not installed (pip install kernels)")

import rome  # noqa: E402
import rome.hf  # noqa: E402


def _rome_op_calls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("rome::"))


# ------------------------------------------------------------------------------------------------
# In process: a hooked function of our own, decorated as transformers decorates its.

def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _llama_rope(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed


def _unknown_rope(q, k, cos, sin, unsqueeze_dim=1):
    # No form RoME knows (the tables enter squared): the hook must keep running this.
    cos = cos.unsqueeze(unsqueeze_dim) ** 2
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _hooked_attention(function):
    hooked = kernels.use_kernel_forward_from_hub(rome.hf_kernels.LAYER_NAME)(function)

    @kernels.use_kernelized_func(hooked)
    class Attention(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return hooked(q, k, cos, sin)

    return Attention()


def _tables(b, s, d):
    angles = torch.randn(b, s, d // 2).repeat(1, 1, 2)
    return angles.cos(), angles.sin()


@pytest.mark.one_isa
def test_kernelize_routes_a_hooked_llama_function_to_rome():
    attention = _hooked_attention(_llama_rope)
    q, k = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
    cos, sin = _tables(2, 5, 32)
    expected = _llama_rope(q, k, cos, sin)
    assert _rome_op_calls(lambda: attention(q, k, cos, sin)) == 0

    with kernels.use_kernel_mapping(rome.hf.kernel_mapping()):
        kernels.kernelize(attention, device="cpu", mode=kernels.Mode.INFERENCE)
    assert rome.hf.kernelized_functions(attention) == [__name__]
    got = []
    assert _rome_op_calls(lambda: got.extend(attention(q, k, cos, sin))) >= 1
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)

    rome.hf.unkernelize(attention)
    assert rome.hf.kernelized_functions(attention) == []
    assert _rome_op_calls(lambda: attention(q, k, cos, sin)) == 0


@pytest.mark.one_isa
def test_a_form_rome_does_not_know_keeps_its_own_function():
    attention = _hooked_attention(_unknown_rope)
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    cos, sin = _tables(1, 3, 16)
    rome.hf.kernelize(attention)
    got = []
    assert _rome_op_calls(lambda: got.extend(attention(q, k, cos, sin))) == 0
    for g, e in zip(got, _unknown_rope(q, k, cos, sin)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    rome.hf.unkernelize(attention)


@pytest.mark.one_isa
def test_kernelize_warns_when_nothing_is_hooked():
    with pytest.warns(UserWarning, match="serves no rotary_pos_emb hook"):
        rome.hf.kernelize(torch.nn.Linear(2, 2))


@pytest.mark.one_isa
def test_the_mapping_serves_cpu_in_every_mode_from_this_package():
    repo = rome.hf.kernel_mapping()["rotary_pos_emb"]["cpu"]
    assert repo.load() is rome.hf_kernels.RotaryPosEmb  # a class in this package: no hub
    for mode in (kernels.Mode.INFERENCE, kernels.Mode.TRAINING):
        attention = _hooked_attention(_llama_rope)
        rome.hf.kernelize(attention, mode=mode)
        assert rome.hf.kernelized_functions(attention) == [__name__]
        rome.hf.unkernelize(attention)


# ------------------------------------------------------------------------------------------------
# transformers' tiny models, in a child process (see the module docstring).

def _child() -> dict:
    import transformers.utils as transformers_utils
    import transformers.utils.import_utils as import_utils

    gate_lifted = not import_utils.is_kernels_available()
    if gate_lifted:
        import_utils.is_kernels_available = lambda *args, **kwargs: True
        transformers_utils.is_kernels_available = import_utils.is_kernels_available

    import copy

    from transformers import (AutoModelForCausalLM, GptOssConfig, LlamaConfig,
                              Qwen3Config)

    small = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    configs = {
        "llama": LlamaConfig(**small),
        "qwen3": Qwen3Config(head_dim=16, **small),
        # gpt-oss: RoPE on half-width tables, a form beyond Llama's
        "gpt_oss": GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                **small),
    }
    ids = torch.randint(0, small["vocab_size"], (2, 16))
    report = {"gate_lifted": gate_lifted}
    for name, config in configs.items():
        torch.manual_seed(0)
        fp32 = AutoModelForCausalLM.from_config(config).eval()
        bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
        with torch.no_grad():
            ref = fp32(ids).logits
            torch_bf16 = bf16(ids).logits.float()
        rome.hf.kernelize(fp32)  # switches bf16 too: the hook is per modeling module
        out = {}
        with torch.no_grad():
            out["rome_calls"] = _rome_op_calls(lambda: out.update(fp32=fp32(ids).logits))
            rome_bf16 = bf16(ids).logits.float()
        report[name] = {
            "kernelized": rome.hf.kernelized_functions(fp32),
            "rome_calls": out["rome_calls"],
            "fp32_rel": ((out["fp32"] - ref).abs().max() / ref.abs().max()).item(),
            "bf16_torch_err": (torch_bf16 - ref).abs().max().item(),
            "bf16_rome_err": (rome_bf16 - ref).abs().max().item(),
        }
        rome.hf.unkernelize(fp32)
        with torch.no_grad():
            report[name]["calls_after_unkernelize"] = _rome_op_calls(lambda: fp32(ids))

    # transformers' own switch, with RoME's CPU entry registered beside transformers' mapping
    llama = AutoModelForCausalLM.from_config(configs["llama"]).eval()
    kernels.register_kernel_mapping(rome.hf.kernel_mapping())
    llama.use_kernels = True
    with torch.no_grad():
        report["use_kernels"] = {"kernelized": rome.hf.kernelized_functions(llama),
                                 "rome_calls": _rome_op_calls(lambda: llama(ids))}
    return report


@pytest.fixture(scope="module")
def child_report():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1])


@pytest.mark.one_isa
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_tiny_model_kernelized_runs_rome_and_matches(child_report, arch):
    pytest.importorskip("transformers")
    got = child_report[arch]
    assert got["kernelized"] == [f"transformers.models.{arch}.modeling_{arch}"]
    assert got["rome_calls"] == 2  # one per decoder layer
    assert got["fp32_rel"] <= 1e-5
    # bf16: RoME rounds once where transformers rounds each product; both against fp32
    assert got["bf16_rome_err"] <= 2 * got["bf16_torch_err"] + 1e-3
    assert got["calls_after_unkernelize"] == 0


@pytest.mark.one_isa
def test_transformers_use_kernels_picks_rome_on_cpu(child_report):
    assert child_report["use_kernels"]["kernelized"] == ["transformers.models.llama.modeling_llama"]
    assert child_report["use_kernels"]["rome_calls"] == 2


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(_child()))


@pytest.mark.one_isa
def test_patch_model_reads_the_function_inside_a_hub_kernel_hook():
    # With a kernels version transformers accepts, each modeling module's apply_rotary_pos_emb is a
    # hook layer, not a function: rome.hf still recognises its form.
    import types

    module = types.ModuleType("hooked_modeling")
    module.apply_rotary_pos_emb = kernels.use_kernel_forward_from_hub(
        rome.hf_kernels.LAYER_NAME)(_llama_rope)
    assert isinstance(module.apply_rotary_pos_emb, torch.nn.Module)
    replacement, reason = rome.hf._contract(module)
    assert replacement is not None, reason
    q, k = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 3, 32)
    cos, sin = _tables(1, 3, 32)
    for got, want in zip(replacement(q, k, cos, sin), _llama_rope(q, k, cos, sin)):
        torch.testing.assert_close(got, want)
