"""RoME as the CPU kernel of transformers' `rotary_pos_emb` hub-kernel hook, through the Hugging
Face `kernels` package: a tiny random Llama, kernelized with RoME's mapping (no hub, no network),
generates a few tokens. Run from the repository root: .venv/bin/python examples/kernels_hub.py
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers.utils as transformers_utils  # noqa: E402
import transformers.utils.import_utils as import_utils  # noqa: E402

# transformers 5.23/5.24 activate their hub decorators only with 0.18.2 <= kernels < 0.19; the
# package index here stops at 0.17.2 (same kernelize API). Lift the gate before any modeling module
# is imported; with a compatible kernels this does nothing.
if not import_utils.is_kernels_available():
    print("note: lifting transformers' kernels version gate (kernels 0.18.2+ not installed)")
    import_utils.is_kernels_available = lambda *args, **kwargs: True
    transformers_utils.is_kernels_available = import_utils.is_kernels_available

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import rome.hf  # noqa: E402

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
prompt = torch.randint(0, config.vocab_size, (1, 8))

with torch.no_grad():
    reference = model.generate(prompt, max_new_tokens=8, do_sample=False)

# = kernels.register_kernel_mapping(rome.hf.kernel_mapping()) and
#   kernels.kernelize(model, device="cpu", mode=kernels.Mode.INFERENCE), minus kernels' warnings
#   for the hooked layers RoME does not serve (RMSNorm, SiLU), and a warning if nothing was hooked.
rome.hf.kernelize(model)
print("rotary_pos_emb served by RoME in:", rome.hf.kernelized_functions(model))

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
        torch.no_grad():
    tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
rome_calls = sum(1 for event in prof.events() if event.name.startswith("rome::"))

print("generated:", tokens[0, prompt.shape[1]:].tolist())
print(f"rome:: op calls during generate: {rome_calls} "
      f"({config.num_hidden_layers} layers x 8 forward passes)")
print("same tokens as without RoME:", torch.equal(tokens, reference))
