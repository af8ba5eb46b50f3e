"""The dense (matrix) path against PyTorch's best matmul (issue 17's shape: x [1, 24, S, 128]
bf16, S = 8192; a random orthogonal M given in bf16; bf16 tables).

- Forward: PyTorch's bare ``torch.matmul(x, M, out=)`` (the faster of bf16 and fp32 on copies
  converted beforehand; on CPUs without bf16 hardware torch's bf16 matmul is ~10x slower than its
  sgemm) against RoME one-matrix in place (``rope_matrix_``), one-matrix into a preallocated
  output (``rope(..., out=)``) and two-matrix (dense A and B) into a preallocated output.
- Forward + backward with x and M requiring grad: ``rope_matrix`` against torch autograd of
  ``x*cos + (x@M)*sin`` (the faster of bf16 and fp32 on pre-converted copies).

GFLOP/s counts the x·M product (2·rows·128² flops; two-matrix: the same count, as it costs two
products). Timed round-robin in one process with torch.set_num_threads; the forward calls
allocate nothing, the forward + backward ones allocate their outputs and gradients (as
training does). The faster dtype of each PyTorch baseline is picked from one trial call each.
"""

import time
from typing import Callable, Dict, List

import torch

import rome

from .layouts import _median_round_robin
from .measure import faster_of

HEADS, D = 24, 128


def cell(seq: int, threads: int, repeats: int) -> Dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seq)
    x = torch.randn(1, HEADS, seq, D, generator=g).to(torch.bfloat16)
    m = torch.linalg.qr(torch.randn(D, D, generator=g))[0].to(torch.bfloat16)
    a = torch.linalg.qr(torch.randn(D, D, generator=g))[0].to(torch.bfloat16)
    cos = torch.randn(seq, D, generator=g).to(torch.bfloat16)
    sin = torch.randn(seq, D, generator=g).to(torch.bfloat16)
    x32, m32, out32, out16 = x.float(), m.float(), torch.empty(x.shape), torch.empty_like(x)
    work, out = x.clone(), torch.empty_like(x)
    mm = {"bf16": lambda: torch.matmul(x, m, out=out16),
          "fp32": lambda: torch.matmul(x32, m32, out=out32)}
    mm_dtype = faster_of(mm)[0]

    grad = torch.randn(x.shape, generator=g).to(torch.bfloat16)
    xg, mg = x.clone().requires_grad_(), m.clone().requires_grad_()

    def rome_train():
        rome.rope_matrix(xg, mg, sin, cos).backward(grad)
        xg.grad = mg.grad = None

    def torch_train(xt, mt, ct, st, gt):
        (xt * ct + (xt @ mt) * st).backward(gt)
        xt.grad = mt.grad = None

    leaves = {"bf16": (x.clone().requires_grad_(), m.clone().requires_grad_(), cos, sin, grad),
              "fp32": (x32.clone().requires_grad_(), m32.clone().requires_grad_(), cos.float(),
                       sin.float(), grad.float())}
    train = {k: (lambda v=v: torch_train(*v)) for k, v in leaves.items()}
    train_dtype = faster_of(train)[0]

    fns = {
        "bare_mm": mm[mm_dtype],
        "rope_matrix_": lambda: torch.ops.rome.rope_matrix_(work, m, sin, cos),
        "one_matrix": lambda: rome.rope(x, None, cos, sin, rotation="dense", mat_b=m,
                                        out=(out, None)),
        "two_matrix": lambda: rome.rope(x, None, cos, sin, rotation="dense", mat_a=a, mat_b=m,
                                        out=(out, None)),
        "rome_train": rome_train,
        "torch_train": train[train_dtype],
    }
    t = _median_round_robin(fns, repeats, warmup=1)
    flops = 2 * x.numel() * D
    return {"seq": seq, "threads": threads, "flops": flops, "bare_mm_dtype": mm_dtype,
            "torch_train_dtype": train_dtype, **t}


def run(quick: bool = False, threads_list=(1, 2), repeats: int = 0,
        progress: Callable[[str], None] = print) -> Dict:
    seq = 512 if quick else 8192
    repeats = repeats or (3 if quick else 5)
    saved = torch.get_num_threads()
    start = time.perf_counter()
    cells: List[Dict] = []
    try:
        for threads in threads_list:
            progress(f"dense path: S={seq}, {threads} thread(s)")
            cells.append(cell(seq, threads, repeats))
    finally:
        torch.set_num_threads(saved)
    return {"cells": cells, "isa": rome.active_isa(), "wall_s": round(time.perf_counter() - start, 1)}


def markdown(res: Dict) -> str:
    def ms(t: float) -> str:
        return f"{t * 1e3:.1f} ms"

    def ratio(t: float, base: float) -> str:
        return f"{t / base:.2f}x ({ms(t)})"

    lines = [
        f"### Dense path vs PyTorch's best matmul ({res['isa']}; x [1, 24, S, 128] bf16, "
        "orthogonal M in bf16, bf16 tables)",
        "",
        "Forward, ratio to the bare matmul x @ M (time in brackets); GFLOP/s of x·M.",
        "",
        "| S | threads | bare matmul | GFLOP/s bare | rope_matrix_ (in place) | GFLOP/s | "
        "one matrix, out= | two matrices, out= |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["cells"]:
        b = c["bare_mm"]
        lines.append(
            f"| {c['seq']} | {c['threads']} | {ms(b)} ({c['bare_mm_dtype']}) | "
            f"{c['flops'] / b / 1e9:.1f} | {ratio(c['rope_matrix_'], b)} | "
            f"{c['flops'] / c['rope_matrix_'] / 1e9:.1f} | {ratio(c['one_matrix'], b)} | "
            f"{ratio(c['two_matrix'], b)} |")
    lines += [
        "",
        "Forward + backward (x and M require grad): RoME's rope_matrix against torch autograd of "
        "x*cos + (x@M)*sin.",
        "",
        "| S | threads | torch autograd | RoME | RoME / torch |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c in res["cells"]:
        lines.append(f"| {c['seq']} | {c['threads']} | {ms(c['torch_train'])} "
                     f"({c['torch_train_dtype']}) | {ms(c['rome_train'])} | "
                     f"{c['rome_train'] / c['torch_train']:.2f}x |")
    return "\n".join(lines) + "\n"
