"""The main RoME benchmark: ``python -m rome.bench [--quick] [--rows ...] [--threads N]
[--repeats N] [--out DIR] [--no-compile]``.

Rows (bf16, head size 128): interleave and half RoPE in 1D (128), 2D (64+64) and 3D (44+44+40)
on x = [1, 24, S, 128] (S = 28800), Wan 3D interleave (44+42+42), an LLM prefill (Q [1, 32, 4096,
128] + GQA K [1, 8, 4096, 128], positions into a cos/sin cache) and a decode step (one token).

Columns, timed in one process on the same threads (median of repeats after warm-up): PyTorch
small ops, per-axis and combined matrix forms in eager PyTorch, small ops and the matrix form
under torch.compile, ONNX Runtime's RotaryEmbedding (fp16), RoME through torch.ops.rome (out of
place and in place), RoME from C++ (the rome_timer program) and the floor: a copy of the same
bytes. Precision against a float64 reference. Results go to the terminal and to DIR/bench.{md,
csv,json,png}.
"""

from .cli import main

__all__ = ["main"]
