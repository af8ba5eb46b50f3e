"""Table-free RoPE: precision of cos/sin at long positions, and speed against the table path.

Precision: max |error| of cos and sin (θ = 500000, D = 128, as Llama 3.1) against float64
(whose own angle error is < 2e-9 at 10^7) for transformers' rotary-module formula (fp32
``inv_freq @ position_ids``, then fp32 cos/sin; reproduced here, transformers not imported),
vLLM's ``_compute_cos_sin_cache`` formula (fp32 ``einsum(t, inv_freq)``; only the rows measured
are built), RoME's table builders (``rome.tables.rope_table``, math in double) and RoME table-free
(``rome.tables.cos_sin``: the kernel of ``rope_from_positions``).

Speed (same process, same threads, medians): the seed tensor x [1, 24, S, 128] bf16, half, in
place, with a precomputed fp32 table [S, 128] (``rope_``) and table-free (``rope_from_positions_``
with positions ``arange(S)``), against a copy of x, the three round-robin (one sample of each
per round; the ratios are medians of the rounds' ratios, so a burst of other work on a shared
machine hits both sides of a ratio); and one Llama-3.1-8B decode step (q [1, 32,
1, 128] + k [1, 8, 1, 128] bf16 at position 10^6) both ways, round-robin as well (500 calls a
sample); and a transformers Llama rotary
module (head_dim 128, θ = 500000) at S = 1, 4096, 32768, unpatched and with ``rome.hf.patch_model``
(``rome.tables.cos_sin``; its outputs are allocated on every call, as the module's are), the
two alternately, one sample each per round.
Left out: building the table
(transformers rebuilds it every forward, vLLM once at start-up), allocation (in place), thread
start-up (pools warm).
"""

import statistics
from typing import Callable, Dict

import torch

import rome

from .measure import median_per_call_s, round_robin_samples

THETA = 500000.0
POSITIONS = [4096, 131072, 1048576, 10485760]


def _inv_freq_fp64(dim: int) -> torch.Tensor:
    return 1.0 / THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _errors(pos: torch.Tensor, dim: int = 128) -> Dict[str, float]:
    inv64 = _inv_freq_fp64(dim)
    angle = pos.double()[:, None] * inv64[None]
    ref_c, ref_s = torch.cos(angle), torch.sin(angle)

    def err(c, s):
        c, s = c[:, : dim // 2].double(), s[:, : dim // 2].double()
        return max((c - ref_c).abs().max().item(), (s - ref_s).abs().max().item())

    # transformers (modeling_rope_utils default + LlamaRotaryEmbedding.forward): inv_freq in fp32
    # from an int64 arange, then inv_freq @ position_ids in fp32, cos/sin in fp32.
    inv32 = 1.0 / (THETA ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = (inv32[None, :, None] @ pos.float()[None, None, :]).transpose(1, 2)[0]
    out = {"transformers": err(freqs.cos(), freqs.sin())}
    # vLLM RotaryEmbedding._compute_cos_sin_cache: fp32 t ⊗ inv_freq (einsum), cos/sin in fp32.
    inv_v = 1.0 / (THETA ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    f = torch.einsum("i,j -> ij", pos.float(), inv_v)
    out["vllm"] = err(f.cos(), f.sin())
    c, s = rome.tables.rope_table(pos.tolist(), dim, theta=THETA)
    out["rome_tables"] = err(c, s)
    c, s = rome.tables.cos_sin(pos, inv64)
    out["rome_table_free"] = err(c, s)
    return out


def _median_ms(fn: Callable[[], object], samples: int, inner: int = 1) -> float:
    return median_per_call_s(fn, samples, inner) * 1e3


def _round_robin_ms(fns: Dict[str, Callable[[], object]], rounds: int,
                    inner: int = 1) -> Dict[str, list]:
    """Per name the ms per call of each of `rounds` rounds (round_robin_samples, `inner` calls a
    sample, after `inner` warm-up calls each)."""
    samples = round_robin_samples(fns, rounds, warmup=inner, inner=inner)
    return {k: [t * 1e3 for t in v] for k, v in samples.items()}


def _paired(ms: Dict[str, list], over: str, under: str) -> float:
    """The median of the rounds' ratios ms[over] / ms[under]."""
    return statistics.median(a / b for a, b in zip(ms[over], ms[under]))


def run(quick: bool = False, threads_list=(1, 2), progress: Callable[[str], None] = print) -> Dict:
    progress("table-free: precision")
    precision = [dict(position=p - 1, **_errors(torch.tensor([p - 1]))) for p in POSITIONS]
    S = 2048 if quick else 28800
    samples = 3 if quick else 7
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 24, S, 128, generator=g).bfloat16()
    y = torch.empty_like(x)
    inv = _inv_freq_fp64(128)
    positions = torch.arange(S)
    cos, sin = rome.tables.rope_table(S, 128, theta=THETA)
    q1 = torch.randn(1, 32, 1, 128, generator=g).bfloat16()
    k1 = torch.randn(1, 8, 1, 128, generator=g).bfloat16()
    p1 = torch.tensor([1000000])
    c1, s1 = rome.tables.cos_sin(p1, inv)
    saved = torch.get_num_threads()
    speed = []
    try:
        with torch.inference_mode():
            for threads in threads_list:
                torch.set_num_threads(threads)
                progress(f"table-free: seed tensor S={S} and a decode step, {threads} thread(s)")
                row = {"threads": threads}
                ms = _round_robin_ms({
                    "copy": lambda: y.copy_(x),
                    "table": lambda: torch.ops.rome.rope_(x, None, cos, sin),
                    "table_free": lambda: torch.ops.rome.rope_from_positions_(
                        x, None, positions, inv),
                }, rounds=2 * samples + 1)
                row.update({k: statistics.median(v) for k, v in ms.items()})
                row["free_over_table"] = _paired(ms, "table_free", "table")
                row["free_over_copy"] = _paired(ms, "table_free", "copy")
                ms = _round_robin_ms({
                    "table": lambda: torch.ops.rome.rope_(q1, k1, c1, s1),
                    "table_free": lambda: torch.ops.rome.rope_from_positions_(q1, k1, p1, inv),
                }, rounds=2 * samples + 1, inner=500)
                row["decode_table_us"] = 1e3 * statistics.median(ms["table"])
                row["decode_table_free_us"] = 1e3 * statistics.median(ms["table_free"])
                row["decode_free_over_table"] = _paired(ms, "table_free", "table")
                row["rotary"] = _rotary_module_times(quick, samples)
                speed.append(row)
    finally:
        torch.set_num_threads(saved)
    return {"precision": precision, "speed": speed, "seq": S, "isa": rome.active_isa()}


def _rotary_module_times(quick: bool, samples: int) -> Dict:
    try:
        import transformers
        import rome.hf
    except ImportError:
        return {}
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=8,
                                      max_position_embeddings=1 << 20,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": THETA})
    rotary = transformers.LlamaForCausalLM(config).model.rotary_emb
    x = torch.zeros(1, 1, 1024, dtype=torch.bfloat16)
    out = {}
    for S in ([1, 4096] if quick else [1, 4096, 32768]):
        pid = torch.arange(S)[None]
        inner = 200 if S == 1 else 1
        # Unpatched and patched alternately, one sample each per round: on a shared machine a
        # burst of other work then hits both, not one side's whole series.
        before, after = [], []
        for _ in range(samples):
            before.append(_median_ms(lambda: rotary(x, pid), 1, inner))
            with rome.hf.patch_model(rotary, warn=False):  # the rotary module alone
                after.append(_median_ms(lambda: rotary(x, pid), 1, inner))
        out[str(S)] = [statistics.median(before), statistics.median(after)]
    return out


def markdown(res: Dict) -> str:
    lines = [
        "### Table-free RoPE: cos/sin precision (max |error| vs float64, θ = 500000, D = 128)",
        "",
        "| position | transformers' rotary module (fp32) | vLLM cos_sin_cache (fp32) | "
        "RoME table builders | RoME table-free |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in res["precision"]:
        lines.append(f"| {r['position']} | {r['transformers']:.1e} | {r['vllm']:.1e} | "
                     f"{r['rome_tables']:.1e} | {r['rome_table_free']:.1e} |")
    lines += [
        "",
        f"### Table-free RoPE: speed ({res['isa']}; x [1, 24, {res['seq']}, 128] bf16 half in place; "
        "decode: q [1, 32, 1, 128] + k [1, 8, 1, 128] bf16)",
        "",
        "| threads | copy ms | fp32 table ms | table-free ms | table-free / table (paired) | "
        "table-free / copy (paired) | decode, table µs | decode, table-free µs | "
        "decode, table-free / table (paired) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["speed"]:
        lines.append(
            f"| {r['threads']} | {r['copy']:.2f} | {r['table']:.2f} | {r['table_free']:.2f} | "
            f"{r['free_over_table']:.2f}x | {r['free_over_copy']:.2f}x | "
            f"{r['decode_table_us']:.1f} | {r['decode_table_free_us']:.1f} | "
            f"{r['decode_free_over_table']:.2f}x |")
    if res["speed"] and res["speed"][0].get("rotary"):
        lines += ["", "transformers' Llama rotary module (bf16 x, head_dim 128): ms per call, "
                  "unpatched / patched (speed-up)", "",
                  "| threads | " + " | ".join(f"S = {s}" for s in res["speed"][0]["rotary"]) + " |",
                  "|---:|" + "---:|" * len(res["speed"][0]["rotary"])]
        for r in res["speed"]:
            cells = [f"{b:.3f} / {a:.3f} ({b / a:.1f}x)" for b, a in r["rotary"].values()]
            lines.append(f"| {r['threads']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
