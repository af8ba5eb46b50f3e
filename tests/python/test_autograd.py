"""Gradients: every differentiable input of the out-of-place ops against PyTorch autograd of an
eager float64 reference ((x·A) ⊙ C + (x·B) ⊙ S), plus gradcheck on float32 inputs.

Tolerances: float32 ops are compared at rtol/atol 1e-5 (relative to the gradient's scale);
bfloat16/float16 gradients are rounded once to the input's dtype (x: one rounding of an fp32
result; tables: sums over the broadcast axes in double, rounded once), so they are compared at
the dtype's resolution (rtol 2^-7 for bf16, 2^-10 for fp16, plus a small absolute floor).

gradcheck runs on float32 (the kernels take fp32/fp16/bf16 only, never float64) with eps 1e-3,
atol 1e-2, rtol 1e-2: the op is linear in each input separately, so central differences are exact
up to fp32 rounding (about 1e-7 * |y| / eps ~ 1e-4), well inside that tolerance.
"""

import math

import pytest
import torch

import rome
from conftest import dtype_id, rotation_mats, lane_tables

B, N, S, D = 2, 3, 5, 16


def tolerances(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5),
            torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2),
            torch.float16: dict(rtol=2 ** -10, atol=2e-3)}[dtype]


def assert_grad_close(ours, ref, dtype, name):
    assert ours is not None, f"no gradient for {name}"
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    scale = max(1.0, float(ref.abs().max()))
    tol = tolerances(dtype)
    torch.testing.assert_close(ours.double() / scale, ref.double() / scale,
                               rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{name}: {m}")


def leaf(t, dtype=None):
    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.clone().requires_grad_()


def reference_y(x, cos, sin, rotation="half", blocks=None, rotary_dim=-1, table_width="full",
                positions=None, column_axis=None, mat_a=None, mat_b=None):
    """float64, differentiable in every tensor argument."""
    d = x.shape[-1]
    rd = d if rotary_dim == -1 else rotary_dim
    if rotation == "dense":
        a = torch.eye(rd, dtype=torch.float64) if mat_a is None else mat_a
        b = mat_b
    else:
        a, b = rotation_mats(rotation, rd, blocks)
    c, s = lane_tables(cos, sin, rd, table_width, positions, column_axis)
    xr, rest = x[..., :rd], x[..., rd:]
    return torch.cat([(xr @ a) * c + (xr @ b) * s, rest], dim=-1)


def run_both(dtype, tensors, ours_fn, ref_fn, seed_shapes):
    """Backward of sum(y * g) through ours (inputs in their dtypes) and the float64 reference."""
    ours_in = {k: leaf(v) for k, v in tensors.items()}
    ref_in = {k: leaf(v, torch.float64) for k, v in tensors.items()}
    ys = ours_fn(**ours_in)
    ys = ys if isinstance(ys, tuple) else (ys,)
    grads = [torch.randn(shape).to(y.dtype) for y, shape in zip(ys, seed_shapes)]
    torch.autograd.backward(ys, grads)
    refs = ref_fn(**ref_in)
    refs = refs if isinstance(refs, tuple) else (refs,)
    torch.autograd.backward(refs, [g.double() for g in grads])
    for k in tensors:
        assert_grad_close(ours_in[k].grad, ref_in[k].grad, ours_in[k].dtype, k)


TABLE_SHAPES = {
    "11SD": (1, 1, S, D), "B1SD": (B, 1, S, D), "BNSD": (B, N, S, D), "SD": (S, D), "D": (D,),
}


def table_pair(shape, dtype):
    angle = torch.rand(shape) * 6.0
    return angle.cos().to(dtype), angle.sin().to(dtype)


# ------------------------------------------------------------------------------------------------
# rope_matrix


@pytest.mark.parametrize("matrix", ("half", "interleave", "dense"))
@pytest.mark.parametrize("tables", sorted(TABLE_SHAPES) + ["expanded", "rank_above_x", "mixed"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_rope_matrix_gradients(dtype, tables, matrix):
    x = torch.randn(B, N, S, D).to(dtype)
    if tables in TABLE_SHAPES:
        cos, sin = table_pair(TABLE_SHAPES[tables], dtype)
    elif tables == "expanded":  # stride-0 views [B, N, S, D] of [1, 1, S, D] tables
        cos, sin = table_pair((1, 1, S, D), dtype)
    elif tables == "rank_above_x":  # [1, 1, S, D] tables on x [N, S, D]
        x = x[0]
        cos, sin = table_pair((1, 1, S, D), dtype)
    else:  # cos and sin of different broadcastable shapes
        cos, _ = table_pair((1, 1, S, D), dtype)
        _, sin = table_pair((B, 1, S, D), dtype)
    mat = {"half": rome.matrices.half(D), "interleave": rome.matrices.interleave(D),
           "dense": torch.randn(D, D) / math.sqrt(D)}[matrix].to(dtype)
    grow = (lambda t: t.expand(B, N, S, D)) if tables == "expanded" else (lambda t: t)
    run_both(dtype, dict(x=x, mat=mat, sin=sin, cos=cos),
             lambda x, mat, sin, cos: rome.rope_matrix(x, mat, grow(sin), grow(cos)),
             lambda x, mat, sin, cos: (x * grow(cos) + (x @ mat) * grow(sin)).reshape(x.shape),
             [x.shape])


def test_rope_matrix_partial_requires_grad():
    x = torch.randn(B, N, S, D, requires_grad=True)
    cos, sin = table_pair((S, D), torch.float32)
    cos.requires_grad_()
    y = rome.rope_matrix(x, rome.matrices.half(D), sin, cos)
    gx, gc = torch.autograd.grad(y.sum(), [x, cos])
    x64, c64 = leaf(x, torch.float64), leaf(cos, torch.float64)
    y64 = x64 * c64 + (x64 @ rome.matrices.half(D, torch.float64)) * sin.double()
    rx, rc = torch.autograd.grad(y64.sum(), [x64, c64])
    assert_grad_close(gx, rx, torch.float32, "x")
    assert_grad_close(gc, rc, torch.float32, "cos")


# ------------------------------------------------------------------------------------------------
# rope


ROPE_VARIANTS = {
    "half": dict(),
    "interleave": dict(rotation="interleave"),
    "quarter": dict(rotation="quarter"),
    "interleave_half": dict(rotation="interleave_half"),
    "blocks": dict(blocks=[4, 8, 4]),
    "partial": dict(rotary_dim=8),
    "halves": dict(table_width="halves"),
    "pairs": dict(rotation="interleave", table_width="pairs"),
    "dense": dict(rotation="dense", mat_b=True),
    "dense_ab": dict(rotation="dense", mat_a=True, mat_b=True),
    "dense_partial": dict(rotation="dense", rotary_dim=8, mat_b=True),
}


@pytest.mark.parametrize("tables", ("11SD", "B1SD", "SD", "positions"))
@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_rope_gradients(dtype, variant, tables):
    kw = dict(ROPE_VARIANTS[variant])
    rd = kw.get("rotary_dim", D)
    width = rd // 2 if kw.get("table_width") in ("halves", "pairs") else rd
    inputs = dict(q=torch.randn(B, N, S, D).to(dtype), k=torch.randn(B, 1, S, D).to(dtype))  # GQA
    for m in ("mat_a", "mat_b"):
        if kw.pop(m, False):
            inputs[m] = torch.randn(rd, rd) / math.sqrt(rd)
    fixed = {}
    if tables == "positions":  # cache tables: gradients for q, k and matrices only
        fixed["cos"], fixed["sin"] = table_pair((20, width), torch.float32)
        fixed["positions"] = torch.randint(0, 20, (B, 1, S))
    else:
        shape = TABLE_SHAPES[tables][:-1] + (width,)
        inputs["cos"], inputs["sin"] = table_pair(shape, dtype)

    def ours(q, k, **rest):
        args = {**fixed, **rest}
        return rome.rope(q, k, args.pop("cos"), args.pop("sin"), positions=args.pop("positions", None),
                         **kw, **args)

    def ref(q, k, **rest):
        args = {**fixed, **rest}
        if "cos" in fixed:
            args["cos"], args["sin"] = args["cos"].double(), args["sin"].double()
        return (reference_y(q, **kw, **args), reference_y(k, **kw, **args))

    run_both(dtype, inputs, ours, ref, [(B, N, S, D), (B, 1, S, D)])


def test_rope_mrope_gradients():
    cos, sin, column_axis = rome.tables.mrope_cache(40, D, [2, 3, 3])
    positions = torch.randint(0, 40, (B, 1, S, 3))
    run_both(torch.float32, dict(q=torch.randn(B, N, S, D)),
             lambda q: rome.rope(q, None, cos, sin, positions=positions, column_axis=column_axis)[0],
             lambda q: reference_y(q, cos.double(), sin.double(), positions=positions, column_axis=column_axis),
             [(B, N, S, D)])


def test_rope_only_k_output_used():
    q, k = torch.randn(B, N, S, D, requires_grad=True), torch.randn(B, 1, S, D, requires_grad=True)
    cos, sin = table_pair((S, D), torch.float32)
    cos.requires_grad_()
    _, ko = rome.rope(q, k, cos, sin)
    gq, gk, gc = torch.autograd.grad(ko.sum(), [q, k, cos], allow_unused=True)
    assert gq is None or not gq.any()
    k64, c64 = leaf(k, torch.float64), leaf(cos, torch.float64)
    rk, rc = torch.autograd.grad(reference_y(k64, c64, sin.double()).sum(), [k64, c64])
    assert_grad_close(gk, rk, torch.float32, "k")
    assert_grad_close(gc, rc, torch.float32, "cos")


def test_rope_without_k_second_output_is_not_differentiable():
    q = torch.randn(B, N, S, D, requires_grad=True)
    qo, empty = rome.rope(q, None, *table_pair((S, D), torch.float32))
    assert qo.requires_grad and not empty.requires_grad and empty.shape == (0,)


# ------------------------------------------------------------------------------------------------
# apply_rotary_emb_interleaved


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_apply_rotary_emb_interleaved_gradients(dtype):
    b, n, c = 2, 5, 24
    x = torch.randn(b, n, c).to(dtype)
    freqs = torch.randn(1, n, c // 2, 2)

    def ref(x, freqs):
        a_real, a_imag = x.view(b, n, c // 2, 2).unbind(-1)
        cs = freqs.reshape(n, c // 2, 2)
        b_real, b_imag = cs[..., 0], cs[..., 1]
        return torch.stack((a_real * b_real - a_imag * b_imag, a_real * b_imag + a_imag * b_real), -1).view(b, n, c)

    run_both(dtype, dict(x=x, freqs=freqs), lambda x, freqs: rome.apply_rotary_emb_interleaved(x, freqs),
             ref, [(b, n, c)])


# ------------------------------------------------------------------------------------------------
# gradcheck (float32; see the module docstring for the tolerance)

GRADCHECK = dict(eps=1e-3, atol=1e-2, rtol=1e-2)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_rope_matrix():
    x = torch.randn(2, 2, 3, 8, requires_grad=True)
    mat = (torch.randn(8, 8) / 3).requires_grad_()
    cos, sin = (t.requires_grad_() for t in table_pair((2, 1, 3, 8), torch.float32))
    assert torch.autograd.gradcheck(rome.rope_matrix, (x, mat, sin, cos), **GRADCHECK)


@pytest.mark.filterwarnings("ignore:Input #")
@pytest.mark.parametrize("variant", ("half", "halves", "dense_ab", "partial"))
def test_gradcheck_rope(variant):
    kw = dict(ROPE_VARIANTS[variant])
    if "rotary_dim" in kw:
        kw["rotary_dim"] = 8
    rd = kw.get("rotary_dim", 16)
    width = rd // 2 if kw.get("table_width") == "halves" else rd
    q = torch.randn(2, 2, 3, 16, requires_grad=True)
    k = torch.randn(2, 1, 3, 16, requires_grad=True)
    cos, sin = (t.requires_grad_() for t in table_pair((3, width), torch.float32))
    mats = {m: (torch.randn(rd, rd) / 3).requires_grad_() for m in ("mat_a", "mat_b") if kw.pop(m, False)}
    names = list(mats)

    def fn(q, k, cos, sin, *ms):
        return rome.rope(q, k, cos, sin, **kw, **dict(zip(names, ms)))

    assert torch.autograd.gradcheck(fn, (q, k, cos, sin, *mats.values()), **GRADCHECK)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_apply_rotary_emb_interleaved():
    x = torch.randn(2, 3, 8, requires_grad=True)
    freqs = torch.randn(1, 3, 4, 2, requires_grad=True)
    assert torch.autograd.gradcheck(rome.apply_rotary_emb_interleaved, (x, freqs), **GRADCHECK)
