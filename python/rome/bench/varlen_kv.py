"""Ragged batches and KV-cache re-rotation against the copy floor.

- varlen prefill: q [total, 32, 128] and k [total, 8, 128] bf16 of sequences of ragged lengths,
  through ``rome.flash_attn.apply_rotary_emb`` with ``cu_seqlens`` (in place), against the same
  call on the zero-padded batch [B, max_len, H, 128] and against the eager PyTorch formula on the
  packed tokens (gathered cos/sin, ``x1·c − x2·s``, ``cat``; flash-attn's own CPU fallback);
- re-rotation: cached keys [S, 8, 128] bf16 shifted by a position delta with ``rome.rerotate_``
  (contiguous, and paged [blocks, 16, 8, 128] through a block table), against re-applying RoPE to
  the keys at their new positions (``rome.ops.rope_`` with a [S, 64] cache and positions: what a
  re-prefill costs in RoPE alone, before the key projection it also needs) and the eager formula.

Each cell is timed round-robin with its floor, the faster of torch's ``copy_`` and memmove of the
bytes the packed call reads (the padded batch moves more; its ratio shows the waste). The Python
side of each call (building positions from cu_seqlens, the per-sequence table rows) is included;
allocation of the inputs is not. Threads with torch.set_num_threads.
"""

import time
from typing import Callable, Dict

import torch

import rome
from rome.flash_attn import apply_rotary_emb

from .layouts import Memmove, _median_round_robin

HEAD = 128


def _cos_sin(rows: int, rd: int = HEAD):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(rows, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float(), ang.sin().float(), inv


def _torch_formula(x, cos, sin, positions):
    c = cos[positions].unsqueeze(-2).to(x.dtype)
    s = sin[positions].unsqueeze(-2).to(x.dtype)
    x1, x2 = x[..., : HEAD // 2], x[..., HEAD // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def varlen_cell(lengths, threads: int, repeats: int, memmove: Memmove) -> Dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    total, batch, longest = sum(lengths), len(lengths), max(lengths)
    cos, sin, _ = _cos_sin(8192)
    q = torch.randn(total, 32, HEAD, generator=g).to(torch.bfloat16)
    k = torch.randn(total, 8, HEAD, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q_pad = torch.zeros(batch, longest, 32, HEAD, dtype=torch.bfloat16)
    k_pad = torch.zeros(batch, longest, 8, HEAD, dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(n) for n in lengths])
    nbytes = (q.numel() + k.numel()) * 2
    qo, ko = torch.empty_like(q), torch.empty_like(k)

    def packed():
        apply_rotary_emb(q, cos, sin, inplace=True, cu_seqlens=cu, max_seqlen=longest)
        apply_rotary_emb(k, cos, sin, inplace=True, cu_seqlens=cu, max_seqlen=longest)

    def padded():
        apply_rotary_emb(q_pad, cos, sin, inplace=True)
        apply_rotary_emb(k_pad, cos, sin, inplace=True)

    def formula():
        _torch_formula(q, cos, sin, positions)
        _torch_formula(k, cos, sin, positions)

    def copy():
        qo.copy_(q)
        ko.copy_(k)

    fns = {"packed": packed, "padded": padded, "formula": formula, "copy": copy,
           "memmove": memmove.copier(nbytes, threads)}
    t = _median_round_robin(fns, repeats, warmup=2)
    t["floor"] = min(t["copy"], t["memmove"])
    return {"threads": threads, "tokens": total, "padded_tokens": batch * longest, **t}


def rerotate_cell(tokens: int, threads: int, repeats: int, memmove: Memmove) -> Dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    cos, sin, inv = _cos_sin(tokens + 64)
    keys = torch.randn(tokens, 8, HEAD, generator=g).to(torch.bfloat16)
    block = 16
    blocks = tokens // block
    paged = torch.randn(2 * blocks, block, 8, HEAD, generator=g).to(torch.bfloat16)
    # One sequence owning every other block (the rest belong to others and stay untouched).
    block_table = torch.arange(0, 2 * blocks, 2, dtype=torch.int32)[None]
    seq_lens = torch.tensor([tokens])
    new_positions = torch.arange(tokens)[:, None] + 37
    nbytes = keys.numel() * 2
    out = torch.empty_like(keys)

    def contiguous():
        rome.rerotate_(keys, 1, inv)
        rome.rerotate_(keys, -1, inv)

    def paged_call():
        rome.rerotate_(paged, 1, inv, block_table=block_table, seq_lens=seq_lens)
        rome.rerotate_(paged, -1, inv, block_table=block_table, seq_lens=seq_lens)

    def reapply():
        rome.ops.rope_(keys, None, cos, sin, positions=new_positions, table_width="halves",
                       rotary_dim=HEAD)
        rome.ops.rope_(keys, None, cos, sin, positions=new_positions, table_width="halves",
                       rotary_dim=HEAD)

    def formula():
        _torch_formula(keys, cos, sin, new_positions[:, 0])
        _torch_formula(keys, cos, sin, new_positions[:, 0])

    def copy():
        out.copy_(keys)
        out.copy_(keys)

    mm = memmove.copier(nbytes, threads)
    fns = {"contiguous": contiguous, "paged": paged_call, "reapply": reapply, "formula": formula,
           "copy": copy, "memmove": lambda: (mm(), mm())}
    t = _median_round_robin(fns, repeats, warmup=2)
    # Each function does two passes (there and back: the keys stay bounded).
    t = {key: value / 2 for key, value in t.items()}
    t["floor"] = min(t["copy"], t["memmove"])
    return {"threads": threads, "tokens": tokens, **t}


def run(quick: bool = False, threads_list=(1, 2), repeats: int = 0,
        progress: Callable[[str], None] = print) -> Dict:
    lengths = [300, 50, 150, 13, 1, 206] if quick else [3000, 500, 1500, 128, 1, 2059]
    tokens = 1024 if quick else 16384
    repeats = repeats or (3 if quick else 9)
    memmove = Memmove()
    saved = torch.get_num_threads()
    start = time.perf_counter()
    varlen, rerotate = [], []
    try:
        for threads in threads_list:
            progress(f"varlen prefill, {threads} thread(s)")
            varlen.append(varlen_cell(lengths, threads, repeats, memmove))
            progress(f"KV re-rotation, {threads} thread(s)")
            rerotate.append(rerotate_cell(tokens, threads, repeats, memmove))
    finally:
        torch.set_num_threads(saved)
    return {"lengths": lengths, "rerotate_tokens": tokens, "varlen": varlen, "rerotate": rerotate,
            "isa": rome.active_isa(), "wall_s": round(time.perf_counter() - start, 1)}


def _r(t: float, floor: float) -> str:
    return f"{t / floor:.2f}x" if floor > 0 else "n/a"


def markdown(res: Dict) -> str:
    lines = [
        f"### Ragged batches and KV-cache re-rotation ({res['isa']})",
        "",
        f"Varlen prefill: q [total, 32, 128] + k [total, 8, 128] bf16, sequence lengths "
        f"{res['lengths']} (total {res['varlen'][0]['tokens']}, padded batch "
        f"{res['varlen'][0]['padded_tokens']} tokens), in place, fp32 tables [8192, 64]. "
        "Ratios to the copy of the packed q and k.",
        "",
        "| threads | floor ms | RoME varlen (cu_seqlens) | RoME padded batch | torch formula (packed) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c in res["varlen"]:
        lines.append(f"| {c['threads']} | {c['floor'] * 1e3:.2f} | {_r(c['packed'], c['floor'])} "
                     f"({c['packed'] * 1e3:.2f} ms) | {_r(c['padded'], c['floor'])} | "
                     f"{_r(c['formula'], c['floor'])} |")
    lines += [
        "",
        f"Re-rotation of {res['rerotate_tokens']} cached keys [S, 8, 128] bf16 by a position delta, "
        "in place. Ratios to the copy of the keys.",
        "",
        "| threads | floor ms | rerotate_ contiguous | rerotate_ paged (16-slot blocks) | "
        "RoPE re-applied at new positions | torch formula |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["rerotate"]:
        lines.append(f"| {c['threads']} | {c['floor'] * 1e3:.2f} | {_r(c['contiguous'], c['floor'])} "
                     f"({c['contiguous'] * 1e3:.2f} ms) | {_r(c['paged'], c['floor'])} | "
                     f"{_r(c['reapply'], c['floor'])} | {_r(c['formula'], c['floor'])} |")
    return "\n".join(lines) + "\n"
