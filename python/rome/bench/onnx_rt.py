"""ONNX Runtime's fused RotaryEmbedding (ONNX opset 23) on the CPU execution provider.

onnxruntime's CPU kernel has float and float16 only (a bfloat16 model falls back to the op's
function body, which has no CPU kernels for bf16 Mul), so the row runs in float16: the same bytes
as bf16. Shapes: X is BNSD (4D); without position_ids the caches are [B, S, D/2] (direct rows),
with position_ids they are [P, D/2] (LLM rows). One node applies one rotation over the head:

- interleave rows with several axes are still one node (a block diagonal of interleave rotations
  is the interleave rotation; the per-axis frequencies go into the cache columns);
- half rows with several axes need Split + one node per axis + Concat (like the vendor op "with
  slice+concat" in the original work).
"""

from typing import List, Optional

import torch

from .methods import NotApplicable, Prepared
from .rows import Inputs, half_width64

ORT_DTYPE = torch.float16


def available() -> Optional[str]:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except Exception as e:
        return f"onnx/onnxruntime not installed ({e.__class__.__name__})"
    return None


def version() -> str:
    try:
        import onnxruntime

        return onnxruntime.__version__
    except Exception:
        return "not installed"


def _session(nodes, inputs, outputs, threads: int):
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph(nodes, "rope", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10  # what onnxruntime 1.2x/1.3x loads
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # The columns are timed round-robin: idle ORT threads must not spin on the cores while the
    # next column runs.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def build_ort(inp: Inputs, threads: int) -> Prepared:
    why = available()
    if why:
        raise NotApplicable(why)
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    row = inp.row
    if row.dense:
        raise NotApplicable("RotaryEmbedding has no matrix form")
    if row.matrix == "forced":
        raise NotApplicable("same computation as the half 1D row")
    fp16 = TensorProto.FLOAT16
    interleaved = 1 if row.mode == "interleave" else 0
    feeds = {}
    nodes: List = []
    inputs, outputs = [], []
    out_arrays = {}

    def add_input(name, array, elem):
        inputs.append(helper.make_tensor_value_info(name, elem, list(array.shape)))
        feeds[name] = array

    def add_output(name, shape):
        outputs.append(helper.make_tensor_value_info(name, fp16, list(shape)))
        out_arrays[name] = np.empty(shape, dtype=np.float16)

    if row.cache:
        cos, sin = half_width64(row)[0]
        add_input("cos", cos.to(ORT_DTYPE).numpy(), fp16)
        add_input("sin", sin.to(ORT_DTYPE).numpy(), fp16)
        add_input("pos", inp.positions.view(1, -1).numpy().copy(), TensorProto.INT64)
        for name, t in (("q", inp.q), ("k", inp.k)):
            add_input(name, t.to(ORT_DTYPE).numpy(), fp16)
            add_output(name + "_out", tuple(t.shape))
            nodes.append(helper.make_node("RotaryEmbedding", [name, "cos", "sin", "pos"], [name + "_out"],
                                          interleaved=interleaved))
        note = "fp16 (no bf16 CPU kernel); position_ids + [P, 64] caches; 2 nodes (Q, K)"
    else:
        x = inp.q
        add_input("x", x.to(ORT_DTYPE).numpy(), fp16)
        add_output("y", tuple(x.shape))
        blocks = half_width64(row)  # per axis [S, d/2]
        if row.mode == "interleave" or not row.multi_axis:
            cos = torch.cat([c for c, _ in blocks], dim=-1)[None]
            sin = torch.cat([s for _, s in blocks], dim=-1)[None]
            add_input("cos", cos.to(ORT_DTYPE).numpy(), fp16)
            add_input("sin", sin.to(ORT_DTYPE).numpy(), fp16)
            nodes.append(helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"],
                                          interleaved=interleaved))
            note = "fp16 (no bf16 CPU kernel)"
            if row.multi_axis:
                note += "; 1 node, per-axis frequencies in the cache"
        else:
            names = [f"x{a}" for a in range(len(row.dims))]
            add_input("split", np.array(row.dims, dtype=np.int64), TensorProto.INT64)
            nodes.append(helper.make_node("Split", ["x", "split"], names, axis=3))
            for a, (c, s) in enumerate(blocks):
                add_input(f"cos{a}", c[None].to(ORT_DTYPE).numpy(), fp16)
                add_input(f"sin{a}", s[None].to(ORT_DTYPE).numpy(), fp16)
                nodes.append(helper.make_node("RotaryEmbedding", [names[a], f"cos{a}", f"sin{a}"],
                                              [f"y{a}"], interleaved=0))
            nodes.append(helper.make_node("Concat", [f"y{a}" for a in range(len(blocks))], ["y"], axis=3))
            note = f"fp16 (no bf16 CPU kernel); Split + {len(blocks)} RotaryEmbedding + Concat"

    sess = _session(nodes, inputs, outputs, threads)
    binding = sess.io_binding()
    keep = []
    for name, array in feeds.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        keep.append(value)
        binding.bind_ortvalue_input(name, value)
    for name, array in out_arrays.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        keep.append(value)
        binding.bind_ortvalue_output(name, value)
    results = [torch.from_numpy(a) for a in out_arrays.values()]

    def fn():
        sess.run_with_iobinding(binding)
        return tuple(results)

    prep = Prepared(fn, note + "; preallocated outputs (IOBinding)", dtype=ORT_DTYPE, out_dtype=ORT_DTYPE)
    prep.keepalive = (sess, binding, keep, feeds)
    return prep
