"""One decode step through transformers' ``apply_rotary_pos_emb`` and its RoME drop-in.

q [1, 32, 1, 128] and k [1, 8, 1, 128] bf16 with bf16 cos/sin [1, 1, 128] (Llama-style shapes,
what a decode step hands over), in inference mode: transformers' own formula
(``q * cos + rotate_half(q) * sin``), ``rome.hf.apply_rotary_pos_emb`` (its checks, the dtype
promotion and the op), ``torch.ops.rome.rope`` alone, ``rome.ops.rope`` (the op's eager entry)
and a ``torch.add`` of q (the floor of any op call from Python). Medians of samples of 500 calls
each, 1 and 2 threads with torch.set_num_threads; output allocation (as in the model) included.

Then the same step through each RoPE form rome.hf.patch_module serves beyond Llama's (one
transformers modeling module per form: up-casting, interleaved, half-width tables, MLA, ...):
the module's own function against the function patch_module puts in its place.

Then one decode step through each of RoME's other drop-ins against what it replaces: diffusers'
own ``apply_rotary_emb`` (pairs and halves) and Qwen-Image's ``apply_rotary_emb_qwen`` where
diffusers is installed; vLLM's ``RotaryEmbedding.forward_native`` formula (vLLM is not installed
here: its gather + rotate written out), flash-attn's ``apply_rotary_emb`` reference formula
(gather the offset's row, rotate_half) and ExecuTorch's ``apply_rotary_emb`` (fp32 pair math)
and ``apply_rotary_emb_interleaved`` (RoME's copy of ExecuTorch's reference) likewise.
"""

import importlib
import warnings
from typing import Callable, Dict, List, Tuple

import torch

import rome
import rome.hf

from .measure import median_per_call_s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _transformers(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _median_us(fn: Callable[[], object], samples: int, inner: int = 500) -> float:
    return median_per_call_s(fn, samples, inner) * 1e6


# (modeling module, function, table width as a fraction of D): one module per form.
_FORM_MODULES: Tuple[Tuple[str, str, int], ...] = (
    ("olmo2", "apply_rotary_pos_emb", 1),             # Llama's, each result in its own dtype
    ("modernbert", "apply_rotary_pos_emb", 1),        # fp32 math, q's dtype
    ("cohere", "apply_rotary_pos_emb", 1),            # pairs, fp32 math
    ("helium", "apply_rotary_pos_emb", 1),            # pairs from a NeoX-layout table
    ("glm", "apply_rotary_pos_emb", 2),               # the same, partial rotary
    ("gpt_oss", "apply_rotary_pos_emb", 2),           # half rotation, D/2-wide tables
    ("nanochat", "apply_rotary_pos_emb", 1),          # rotation by -angle
    ("deepseek_v3", "apply_rotary_pos_emb_interleave", 1),  # MLA de-interleave
)


def _form_rows(q, k, cos, sin, samples: int, inner: int) -> List[Dict]:
    rows = []
    for family, name, narrow in _FORM_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except Exception as exc:  # another transformers version
            rows.append({"module": family, "error": f"{type(exc).__name__}: {exc}"[:120]})
            continue
        original = module.__dict__.get(name)
        width = cos.shape[-1] // narrow
        args = (q, k, cos[..., :width], sin[..., :width])
        handle = rome.hf.patch_module(module)
        try:
            replacement = module.__dict__.get(name)
            if original is None or replacement is original:
                rows.append({"module": family, "error": f"{name} not patched ({handle.skipped})"})
                continue
            rows.append({"module": family, "function": name,
                         "transformers": _median_us(lambda: original(*args), samples, inner),
                         "rome": _median_us(lambda: replacement(*args), samples, inner)})
        finally:
            handle.undo()
    return rows


def _dropin_cases(g: torch.Generator) -> List[Tuple[str, Callable[[], object], Callable[[], object]]]:
    """(name, the replaced code, the RoME drop-in) for one decode token of each drop-in."""
    import rome.executorch
    import rome.flash_attn
    import rome.vllm

    bf = torch.bfloat16
    cases = []
    try:
        import diffusers.models.embeddings as embeddings
        from diffusers.models.transformers import transformer_qwenimage as qwenimage

        import rome.diffusers
    except Exception:  # diffusers not installed, or another version
        embeddings = None
    if embeddings is not None:
        x = torch.randn(1, 24, 1, 128, generator=g).to(bf)  # FLUX: [B, H, S, D], one token
        cos, sin = torch.randn(1, 128, generator=g), torch.randn(1, 128, generator=g)
        for unbind, label in ((-1, "pairs"), (-2, "halves")):
            cases.append((f"diffusers apply_rotary_emb ({label})",
                          lambda u=unbind: embeddings.apply_rotary_emb(
                              x, (cos, sin), use_real_unbind_dim=u),
                          lambda u=unbind: rome.diffusers.apply_rotary_emb(
                              x, (cos, sin), use_real_unbind_dim=u)))
        xq = torch.randn(1, 1, 24, 128, generator=g).to(bf)  # Qwen-Image: [B, S, H, D]
        freqs = torch.polar(torch.ones(1, 64), torch.randn(1, 64, generator=g))
        cases.append(("diffusers apply_rotary_emb_qwen",
                      lambda: qwenimage.apply_rotary_emb_qwen(xq, freqs, use_real=False),
                      lambda: rome.diffusers.apply_rotary_emb_qwen(xq, freqs, use_real=False)))

    emb = rome.vllm.RotaryEmbedding(128, 128, 4096, 10000.0, True, bf)
    pos = torch.tensor([7])
    qv = torch.randn(1, 32 * 128, generator=g).to(bf)
    kv = torch.randn(1, 8 * 128, generator=g).to(bf)

    def vllm_native():  # vLLM's forward_native for NeoX: gather, split, rotate, cat
        cos_sin = emb.cos_sin_cache.index_select(0, pos)
        c, s = cos_sin.chunk(2, dim=-1)

        def rotate(x):
            shape = x.shape
            x = x.view(pos.shape[0], -1, 128)
            c2, s2 = c.unsqueeze(-2).to(x.dtype), s.unsqueeze(-2).to(x.dtype)
            x1, x2 = torch.chunk(x, 2, dim=-1)
            return torch.cat((x1 * c2 - x2 * s2, x2 * c2 + x1 * s2), dim=-1).reshape(shape)

        return rotate(qv), rotate(kv)

    cases.append(("vllm RotaryEmbedding.forward (in place)", vllm_native,
                  lambda: emb.forward(pos, qv, kv)))

    xf = torch.randn(1, 1, 32, 128, generator=g).to(bf)  # flash-attn: [B, S, H, D]
    cf, sf = torch.randn(16, 64, generator=g).to(bf), torch.randn(16, 64, generator=g).to(bf)

    def flash_attn_reference(offset=5):  # flash-attn's apply_rotary_emb_torch at an offset
        c, s = cf[offset:offset + 1], sf[offset:offset + 1]
        c, s = torch.cat([c, c], -1)[None, :, None, :], torch.cat([s, s], -1)[None, :, None, :]
        return xf * c + _rotate_half(xf) * s

    cases.append(("flash_attn apply_rotary_emb", flash_attn_reference,
                  lambda: rome.flash_attn.apply_rotary_emb(xf, cf, sf, seqlen_offsets=5)))

    xe = torch.randn(1, 1, 32, 128, generator=g).to(bf)  # ExecuTorch llama: [B, S, H, D]
    ke = torch.randn(1, 1, 8, 128, generator=g).to(bf)
    fc, fs = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)

    def executorch_reference():  # ExecuTorch's apply_rotary_emb: fp32 (real, imag) pairs
        def one(x):
            xr, xi = x.float().reshape(x.shape[:-1] + (-1, 2)).unbind(-1)
            c, s = fc.view(1, 1, 1, 64), fs.view(1, 1, 1, 64)
            return torch.stack([xr * c - xi * s, xr * s + xi * c], -1).flatten(3).type_as(x)

        return one(xe), one(ke)

    cases.append(("executorch apply_rotary_emb", executorch_reference,
                  lambda: rome.executorch.apply_rotary_emb(xe, ke, fc, fs)))
    xi = torch.randn(1, 1, 128, generator=g).to(bf)
    fci = torch.randn(1, 64, 2, generator=g)
    cases.append(("executorch apply_rotary_emb_interleaved",
                  lambda: rome.executorch._interleaved_reference(xi, fci),
                  lambda: rome.executorch.apply_rotary_emb_interleaved(xi, fci)))
    return cases


def _dropin_rows(samples: int, inner: int) -> List[Dict]:
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = _dropin_cases(g)
    return [{"dropin": name, "replaced": _median_us(ref, samples, inner),
             "rome": _median_us(ours, samples, inner)} for name, ref, ours in cases]


def run(quick: bool = False, threads_list=(1, 2), progress: Callable[[str], None] = print) -> Dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g).bfloat16()
    k = torch.randn(1, 8, 1, 128, generator=g).bfloat16()
    cos = torch.randn(1, 1, 128, generator=g).bfloat16()
    sin = torch.randn(1, 1, 128, generator=g).bfloat16()
    c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)
    samples = 3 if quick else 9
    saved = torch.get_num_threads()
    rows = []
    try:
        with torch.inference_mode():
            for threads in threads_list:
                torch.set_num_threads(threads)
                progress(f"HF decode step, {threads} thread(s)")
                rows.append({
                    "threads": threads,
                    "transformers": _median_us(lambda: _transformers(q, k, cos, sin), samples),
                    "rome_hf": _median_us(lambda: rome.hf.apply_rotary_pos_emb(q, k, cos, sin),
                                          samples),
                    "op": _median_us(lambda: torch.ops.rome.rope.default(
                        q, k, c4, s4, None, "half", [], 128, "full", [], None, None), samples),
                    "entry": _median_us(lambda: rome.ops.rope(q, k, c4, s4), samples),
                    "add": _median_us(lambda: torch.add(q, q), samples),
                    # --quick (CI): the forms on the first thread count, shorter samples.
                    "forms": ([] if quick and threads != threads_list[0] else
                              _form_rows(q, k, cos, sin, samples, 100 if quick else 500)),
                    "dropins": ([] if quick and threads != threads_list[0] else
                                _dropin_rows(samples, 100 if quick else 500)),
                })
    finally:
        torch.set_num_threads(saved)
    return {"rows": rows, "isa": rome.active_isa()}


def markdown(res: Dict) -> str:
    lines = [
        f"### One decode step through the transformers drop-in ({res['isa']}; q [1, 32, 1, 128] + "
        "k [1, 8, 1, 128] bf16, µs per call)",
        "",
        "| threads | transformers' formula | rome.hf.apply_rotary_pos_emb | "
        "torch.ops.rome.rope alone | rome.ops.rope (eager entry) | torch.add of q | "
        "rome.ops.rope / torch.add |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['threads']} | {r['transformers']:.1f} | {r['rome_hf']:.1f} | "
                     f"{r['op']:.1f} | {r['entry']:.1f} | {r['add']:.1f} | "
                     f"{r['entry'] / r['add']:.2f}x |")
    lines += [
        "",
        "torch.ops.rome.rope goes through torch's generic Python path for custom ops (schema "
        "parsing, the dispatcher); rome.ops.rope and the drop-ins take the op's eager entry, which "
        "runs the CPU kernel's call from C++ when nothing else would have run "
        "(bindings/torch/eager.cpp).",
        "",
        "The same step through the other forms rome.hf.patch_module serves (the module's own "
        "function vs its replacement; µs per call, ratio = RoME / transformers, target ≤ 0.5):",
        "",
        "| module (function) | threads | transformers | RoME | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        for f in r.get("forms", []):
            if "error" in f:
                lines.append(f"| {f['module']} | {r['threads']} | {f['error']} | | |")
                continue
            lines.append(f"| {f['module']} ({f['function']}) | {r['threads']} | "
                         f"{f['transformers']:.1f} | {f['rome']:.1f} | "
                         f"{f['rome'] / f['transformers']:.2f} |")
    lines += [
        "",
        "RoME's other drop-ins, one decode token each, against the code they replace (µs per "
        "call, ratio = RoME / replaced, target ≤ 0.5):",
        "",
        "| drop-in | threads | replaced | RoME | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        for d in r.get("dropins", []):
            lines.append(f"| {d['dropin']} | {r['threads']} | {d['replaced']:.1f} | "
                         f"{d['rome']:.1f} | {d['rome'] / d['replaced']:.2f} |")
    return "\n".join(lines) + "\n"
