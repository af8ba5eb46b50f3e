"""Operators: opcheck (schema, fake tensors, autograd registration, AOT dispatch), forward results
against a float64 reference, the drop-in contracts (vLLM, ExecuTorch), tables, matrices, the
module, and error cases (exception type, message, untouched outputs)."""

import math

import pytest
import torch
from torch.library import opcheck

import rome
from conftest import DTYPES, assert_rounded, dtype_id, reference

B, N, S, D = 2, 3, 5, 16

# ------------------------------------------------------------------------------------------------
# Inputs


def make_x(layout, dtype, shape=(B, N, S, D), requires_grad=False):
    """A BNSD-shaped tensor in one of several memory layouts."""
    b, n, s, d = shape
    if layout == "bnsd":
        x = torch.randn(b, n, s, d)
    elif layout == "bsnd":  # [B, S, N, D] memory seen as BNSD
        x = torch.randn(b, s, n, d).transpose(1, 2)
    elif layout == "qkv":  # the q slice of a fused [B, S, 3*N*D] projection
        x = torch.randn(b, s, 3 * n * d)[..., : n * d].view(b, s, n, d).transpose(1, 2)
    else:
        raise ValueError(layout)
    x = x.to(dtype)
    if requires_grad:
        x = x.detach().requires_grad_()
    return x


def make_tables(kind, dtype=torch.float32, shape=(B, N, S, D), width=None, requires_grad=False):
    """(cos, sin, positions): direct tables of a broadcast pattern, or a cache with positions."""
    b, n, s, d = shape
    width = width or d
    shapes = {"11SD": (1, 1, s, width), "B1SD": (b, 1, s, width), "BNSD": (b, n, s, width),
              "SD": (s, width), "1S1D": (1, s, 1, width)}
    if kind in shapes:
        angle = torch.rand(shapes[kind]) * 6.0
        cos, sin, positions = angle.cos().to(dtype), angle.sin().to(dtype), None
    elif kind in ("pos_S", "pos_B1S"):
        angle = torch.rand(3 * s, width) * 6.0
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        positions = torch.randint(0, 3 * s, (s,) if kind == "pos_S" else (b, 1, s))
    else:
        raise ValueError(kind)
    if requires_grad and positions is None:
        cos, sin = cos.requires_grad_(), sin.requires_grad_()
    return cos, sin, positions


LAYOUTS = ("bnsd", "bsnd", "qkv")
TABLES = ("11SD", "B1SD", "BNSD", "SD", "pos_S", "pos_B1S")


# ------------------------------------------------------------------------------------------------
# Matrices


def test_matrices_match_definitions():
    x = torch.randn(3, 16, dtype=torch.float64)
    x1, x2 = x.chunk(2, -1)
    assert torch.equal(x @ rome.matrices.half(16, torch.float64), torch.cat([-x2, x1], -1))
    inter = torch.stack([-x[:, 1::2], x[:, 0::2]], -1).flatten(-2)
    assert torch.equal(x @ rome.matrices.interleave(16, torch.float64), inter)
    q1, q2, q3, q4 = x.chunk(4, -1)
    assert torch.equal(x @ rome.matrices.quarter(16, torch.float64), torch.cat([-q2, q1, -q4, q3], -1))
    a, b = rome.matrices.interleave_half(16, torch.float64)
    deinterleaved = torch.cat([x[:, 0::2], x[:, 1::2]], -1)
    assert torch.equal(x @ a, deinterleaved)
    assert torch.equal(b, a @ rome.matrices.half(16, torch.float64))
    h = rome.matrices.half
    assert torch.equal(rome.matrices.block_diag([44, 44, 40]), torch.block_diag(h(44), h(44), h(40)))
    p = rome.matrices.partial("half", 64, 128)
    assert p.shape == (128, 128)
    assert torch.equal(p[:64, :64], h(64)) and not p[64:].any() and not p[:, 64:].any()
    pa, pb = rome.matrices.rotation("half", 64, head_dim=128)
    assert torch.equal(pa, torch.eye(128))
    assert rome.matrices.half(8, torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.one_isa
@pytest.mark.parametrize("tables", TABLES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_opcheck_rope(dtype, layout, tables):
    q = make_x(layout, dtype, requires_grad=True)
    heads_k = N if tables == "BNSD" else 1  # GQA (one K head) unless the tables vary over heads
    k = make_x(layout, dtype, (B, heads_k, S, D), requires_grad=True)
    cos, sin, positions = make_tables(tables, torch.float32 if dtype == torch.float32 else dtype,
                                      requires_grad=True)
    opcheck(torch.ops.rome.rope.default, (q, k, cos, sin), {"positions": positions})
    opcheck(torch.ops.rome.rope.default, (q, None, cos, sin), {"positions": positions})


@pytest.mark.one_isa
@pytest.mark.parametrize("tables", ("11SD", "BNSD", "SD", "pos_B1S"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_opcheck_rope_inplace(dtype, layout, tables):
    q = make_x(layout, dtype)
    k = make_x(layout, dtype, (B, N if tables == "BNSD" else 1, S, D))
    cos, sin, positions = make_tables(tables)
    opcheck(torch.ops.rome.rope_.default, (q, k, cos, sin), {"positions": positions})
    opcheck(torch.ops.rome.rope_.default, (q, None, cos, sin), {"positions": positions})


@pytest.mark.one_isa
@pytest.mark.parametrize("tables", ("T1D", "positions"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_opcheck_rope_packed_tokens(dtype, tables):
    """Packed tokens [T, N, D] (and a q slice of a fused [T, (N + 2)*D] buffer)."""
    t = 7
    q = torch.randn(t, N, D).to(dtype).requires_grad_()
    k = torch.randn(t, (N + 2) * D).to(dtype)[:, N * D: (N + 1) * D].view(t, 1, D).requires_grad_()
    if tables == "positions":
        cos, sin, _ = make_tables("SD", shape=(1, 1, 30, D))
        kw = {"positions": torch.randint(0, 30, (t, 1))}
    else:
        cos, sin, _ = make_tables("SD", shape=(1, 1, t, D))
        cos, sin = cos.unsqueeze(1).requires_grad_(), sin.unsqueeze(1).requires_grad_()
        kw = {}
    opcheck(torch.ops.rome.rope.default, (q, k, cos, sin), kw)
    qo, ko = rome.rope(q, k, cos, sin, **kw)
    ref, scale = reference(q, cos, sin, kw.get("positions"))
    assert_rounded(qo, ref, scale)


VARIANTS = {
    "interleave": dict(rotation="interleave"),
    "quarter": dict(rotation="quarter"),
    "interleave_half": dict(rotation="interleave_half"),
    "blocks": dict(rotation="half", blocks=[4, 8, 4]),
    "partial": dict(rotation="half", rotary_dim=8),
    "partial_interleave": dict(rotation="interleave", rotary_dim=12),
    "halves": dict(rotation="half", table_width="halves"),
    "pairs": dict(rotation="interleave", table_width="pairs"),
    "dense": dict(rotation="dense", mat_b=True),
    "dense_ab": dict(rotation="dense", mat_a=True, mat_b=True),
    "dense_partial": dict(rotation="dense", rotary_dim=8, mat_b=True),
}


def variant_args(name, requires_grad=True):
    kw = dict(VARIANTS[name])
    rd = kw.get("rotary_dim", D)
    for m in ("mat_a", "mat_b"):
        if kw.get(m):
            kw[m] = (torch.randn(rd, rd) / math.sqrt(rd)).requires_grad_(requires_grad)
    width = rd // 2 if kw.get("table_width") in ("halves", "pairs") else rd
    return kw, width


@pytest.mark.one_isa
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=dtype_id)
def test_opcheck_rope_variants(dtype, variant):
    kw, width = variant_args(variant)
    q = make_x("bsnd", dtype, requires_grad=True)
    k = make_x("bsnd", dtype, (B, 1, S, D), requires_grad=True)
    cos, sin, _ = make_tables("B1SD", width=width, requires_grad=True)
    opcheck(torch.ops.rome.rope.default, (q, k, cos, sin), kw)
    cache_cos, cache_sin, positions = make_tables("pos_B1S", width=width)
    opcheck(torch.ops.rome.rope.default, (q, k, cache_cos, cache_sin), dict(kw, positions=positions))


@pytest.mark.one_isa
def test_opcheck_rope_mrope():
    sections = [2, 3, 3]  # D = 16
    cos, sin, column_axis = rome.tables.mrope_cache(40, D, sections)
    positions = torch.randint(0, 40, (B, 1, S, 3))
    q = make_x("bnsd", torch.bfloat16, requires_grad=True)
    k = make_x("bnsd", torch.bfloat16, (B, 1, S, D), requires_grad=True)
    opcheck(torch.ops.rome.rope.default, (q, k, cos, sin),
            {"positions": positions, "column_axis": column_axis})


@pytest.mark.one_isa
@pytest.mark.parametrize("tables", ("11SD", "B1SD", "BNSD", "SD"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_opcheck_rope_matrix(dtype, layout, tables):
    x = make_x(layout, dtype, requires_grad=True)
    cos, sin, _ = make_tables(tables, dtype, requires_grad=True)
    mat = rome.matrices.half(D).requires_grad_()
    dense = (torch.randn(D, D) / 4).requires_grad_()
    opcheck(torch.ops.rome.rope_matrix.default, (x, mat, sin, cos))
    opcheck(torch.ops.rome.rope_matrix.default, (x, dense, sin, cos))
    y = make_x(layout, dtype)
    opcheck(torch.ops.rome.rope_matrix_.default, (y, mat.detach(), sin.detach(), cos.detach()))


def vllm_inputs(dtype, shape, rotary_dim, heads=4, kv_heads=2, head=D, max_pos=64):
    """(positions, query, key, cache, qkv) with query/key slices of one fused qkv buffer."""
    lead = (7,) if shape != "bsd" else (2, 4)
    width = (heads + 2 * kv_heads) * head
    qkv = torch.randn(*lead, width).to(dtype)
    query = qkv[..., : heads * head]
    key = qkv[..., heads * head: (heads + kv_heads) * head]
    if shape == "thd":
        qkv = torch.randn(*lead, heads + 2 * kv_heads, head).to(dtype)
        query, key = qkv[:, :heads], qkv[:, heads: heads + kv_heads]
    positions = torch.randint(0, max_pos, lead)
    cache = rome.tables.cos_sin_cache(max_pos, rotary_dim).to(dtype)
    return positions, query, key, cache, qkv


@pytest.mark.one_isa
@pytest.mark.parametrize("rotary_dim", (D, D // 2))
@pytest.mark.parametrize("is_neox", (True, False))
@pytest.mark.parametrize("shape", ("t_hd", "thd", "bsd"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_opcheck_rotary_embedding(dtype, shape, is_neox, rotary_dim):
    positions, query, key, cache, _ = vllm_inputs(dtype, shape, rotary_dim)
    opcheck(torch.ops.rome.rotary_embedding.default, (positions, query, key, D, cache, is_neox))
    opcheck(torch.ops.rome.rotary_embedding.default, (positions, query, None, D, cache, is_neox))


@pytest.mark.one_isa
@pytest.mark.parametrize("freqs_shape", ("1NC2", "NC"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_opcheck_apply_rotary_emb_interleaved(dtype, freqs_shape):
    x = torch.randn(2, S, 3 * D).to(dtype).requires_grad_()
    freqs = torch.randn(1, S, 3 * D // 2, 2)
    if freqs_shape == "NC":
        freqs = freqs.reshape(S, 3 * D)
    opcheck(torch.ops.rome.apply_rotary_emb_interleaved.default, (x, freqs.requires_grad_()))


# ------------------------------------------------------------------------------------------------
# Forward results


@pytest.mark.parametrize("tables", TABLES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rope_matches_reference(dtype, layout, tables):
    q = make_x(layout, dtype, (2, 4, 33, 64))
    k = make_x(layout, dtype, (2, 2, 33, 64))
    cos, sin, positions = make_tables(tables, shape=(2, 4, 33, 64))
    if positions is None and tables == "BNSD":  # tables varying over heads need k's heads
        k = make_x(layout, dtype, (2, 4, 33, 64))
    qo, ko = rome.rope(q, k, cos, sin, positions=positions)
    for x, y in ((q, qo), (k, ko)):
        assert y.dtype == dtype and y.shape == x.shape
        ref, scale = reference(x, cos, sin, positions)
        assert_rounded(y, ref, scale)
    qo2, empty = rome.rope(q, None, cos, sin, positions=positions)
    assert torch.equal(qo2, qo) and empty.shape == (0,)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rope_variants_match_reference(dtype, variant):
    kw, width = variant_args(variant, requires_grad=False)
    q = make_x("qkv", dtype, (2, 4, 9, D))
    for tables in ("1S1D", "pos_B1S"):
        x = q.transpose(1, 2) if tables == "1S1D" else q  # 1S1D: BSND-shaped x
        cos, sin, positions = make_tables(tables, shape=(2, 4, 9, D), width=width)
        out, _ = rome.rope(x, None, cos, sin, positions=positions, **kw)
        ref, scale = reference(x, cos, sin, positions, **kw)
        assert_rounded(out, ref, scale, dense_dim=D if "dense" in variant else 0)
        if kw.get("rotary_dim", D) < D:  # pass-through lanes copied exactly
            assert torch.equal(out[..., kw["rotary_dim"]:], x[..., kw["rotary_dim"]:])


@pytest.mark.parametrize("variant", ("half", "interleave", "partial", "dense", "halves"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rope_inplace_equals_out_of_place(dtype, variant):
    kw, width = variant_args(variant, requires_grad=False) if variant in VARIANTS else (dict(rotation=variant), D)
    q = make_x("qkv", dtype)
    k = make_x("bnsd", dtype, (B, 1, S, D))
    cos, sin, positions = make_tables("pos_S", width=width)
    qo, ko = rome.rope(q, k, cos, sin, positions=positions, **kw)
    q2, k2 = q.clone(), k.clone()
    rome.rope_(q2, k2, cos, sin, positions=positions, **kw)
    assert torch.equal(q2, qo) and torch.equal(k2, ko)


@pytest.mark.parametrize("matrix", ("half", "interleave", "block3d", "dense"))
@pytest.mark.parametrize("tables", ("11SD", "B1SD", "BNSD", "SD"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rope_matrix_matches_reference(dtype, tables, matrix):
    d = 128 if matrix == "block3d" else D
    x = make_x("bnsd", dtype, (B, N, S, d))
    cos, sin, _ = make_tables(tables, dtype, shape=(B, N, S, d))
    mat = {"half": lambda: rome.matrices.half(d), "interleave": lambda: rome.matrices.interleave(d),
           "block3d": lambda: rome.matrices.block_diag([44, 44, 40]),
           "dense": lambda: torch.randn(d, d) / 4}[matrix]()
    out = rome.rope_matrix(x, mat, sin, cos)
    ref, scale = reference(x, cos, sin, rotation="dense", mat_b=mat)
    assert_rounded(out, ref, scale, dense_dim=d if matrix == "dense" else 0)
    y = x.clone()
    assert rome.rope_matrix_(y, mat, sin, cos) is y
    assert torch.equal(y, out)


@pytest.mark.parametrize("matrix", ("half", "interleave", "block3d"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dense_forced_matches_permute_path(dtype, matrix, isa):
    """rotation='dense_forced' runs a signed permutation as matrix products (the benchmark's
    comparison row): on the vector paths each output sums one ±x term, so it equals the permute
    path bit for bit; gradients flow to q and mat_b as for 'dense'."""
    d = 128 if matrix == "block3d" else D
    mat = {"half": lambda: rome.matrices.half(d), "interleave": lambda: rome.matrices.interleave(d),
           "block3d": lambda: rome.matrices.block_diag([44, 44, 40])}[matrix]()
    x = make_x("bnsd", dtype, (B, N, S, d))
    cos, sin, _ = make_tables("SD", torch.float32, shape=(B, N, S, d))
    permuted = rome.rope(x, None, cos, sin, rotation="dense", mat_b=mat)[0]
    forced = rome.rope(x, None, cos, sin, rotation="dense_forced", mat_b=mat)[0]
    if isa == "amx":  # the tile path splits fp32 x into bf16 hi + lo: within its bound instead
        ref, scale = reference(x, cos, sin, rotation="dense", mat_b=mat)
        assert_rounded(forced, ref, scale, dense_dim=d)
    else:
        assert torch.equal(forced, permuted)
    q = x.float().detach().requires_grad_()
    m = mat.clone().requires_grad_()
    rome.rope(q, None, cos, sin, rotation="dense_forced", mat_b=m)[0].sum().backward()
    q2 = x.float().detach().requires_grad_()
    m2 = mat.clone().requires_grad_()
    rome.rope(q2, None, cos, sin, rotation="dense", mat_b=m2)[0].sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(m.grad, m2.grad)


def test_rope_matrix_table_rank_above_x():
    x = torch.randn(S, D)
    cos, sin, _ = make_tables("11SD")
    out = rome.rope_matrix(x, rome.matrices.half(D), sin, cos)
    ref, scale = reference(x, cos[0, 0], sin[0, 0])
    assert_rounded(out, ref, scale)


def vllm_reference(positions, x, head, cache, is_neox):
    """vLLM's forward_native on [..., H*D] or [..., H, D]."""
    rd = cache.shape[-1]
    cos, sin = cache[positions.long()].double().chunk(2, dim=-1)
    shape = x.shape
    x = x.double().reshape(*positions.shape, -1, head)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot, rest = x[..., :rd], x[..., rd:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([rot, rest], -1).reshape(shape)


@pytest.mark.parametrize("rotary_dim", (D, D // 2))
@pytest.mark.parametrize("is_neox", (True, False))
@pytest.mark.parametrize("shape", ("t_hd", "thd", "bsd"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rotary_embedding_matches_vllm(dtype, shape, is_neox, rotary_dim):
    positions, query, key, cache, qkv = vllm_inputs(dtype, shape, rotary_dim)
    before = qkv.clone()
    ref_q = vllm_reference(positions, query, D, cache, is_neox)
    ref_k = vllm_reference(positions, key, D, cache, is_neox)
    rome.rotary_embedding(positions, query, key, D, cache, is_neox)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(query.double(), ref_q, **tol)
    torch.testing.assert_close(key.double(), ref_k, **tol)
    # The value slice of the fused buffer (and nothing else) is untouched.
    if shape == "thd":
        assert torch.equal(qkv[:, 6:], before[:, 6:])
    else:
        assert torch.equal(qkv[..., 6 * D:], before[..., 6 * D:])


def test_apply_rotary_emb_interleaved_matches_executorch():
    b, n, c = 2, 7, 48
    x = torch.randn(b, n, c)
    freqs = torch.view_as_real(torch.polar(torch.ones(n, c // 2), torch.rand(n, c // 2) * 6)).unsqueeze(0)
    out = rome.apply_rotary_emb_interleaved(x, freqs)
    # ExecuTorch's reference semantics.
    a_real, a_imag = x.view(b, n, c // 2, 2).unbind(-1)
    cs = freqs.reshape(n, c // 2, 2)
    b_real, b_imag = cs[..., 0], cs[..., 1]
    ref = torch.stack((a_real * b_real - a_imag * b_imag, a_real * b_imag + a_imag * b_real), -1).view(b, n, c)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    out16 = rome.apply_rotary_emb_interleaved(x.bfloat16(), freqs)
    torch.testing.assert_close(out16.float(), ref, atol=2e-2, rtol=1e-2)


def test_zero_sized_and_decode_shapes():
    q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16)
    cos, sin = rome.tables.rope_table(torch.tensor([77]), 128)
    out, _ = rome.rope(q, None, cos, sin)
    ref, scale = reference(q, cos, sin)
    assert_rounded(out, ref, scale)
    empty = torch.randn(0, 4, 3, 16)
    out, _ = rome.rope(empty, None, torch.ones(3, 16), torch.zeros(3, 16))
    assert out.shape == empty.shape


# ------------------------------------------------------------------------------------------------
# Tables and the module


def test_rope_table_matches_torch():
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    angle = torch.arange(50, dtype=torch.float64)[:, None] * inv
    cos, sin = rome.tables.rope_table(50, 64)
    torch.testing.assert_close(cos.double(), torch.cat([angle.cos()] * 2, -1), atol=1e-7, rtol=0)
    torch.testing.assert_close(sin.double(), torch.cat([angle.sin()] * 2, -1), atol=1e-7, rtol=0)
    cos, sin = rome.tables.rope_table(50, 64, layout="pairs", dtype=torch.bfloat16)
    assert cos.dtype == torch.bfloat16
    torch.testing.assert_close(cos.double(), angle.cos().repeat_interleave(2, -1), atol=4e-3, rtol=0)
    half_cos, half_sin = rome.tables.frequency_table(50, 64)
    cache = rome.tables.cos_sin_cache(50, 64)
    assert torch.equal(cache, torch.cat([half_cos, half_sin], -1))
    lin_cos, _ = rome.tables.rope_table(torch.arange(0, 100, 2), 64, scaling=rome.tables.Scaling.linear(2.0))
    torch.testing.assert_close(lin_cos, rome.tables.rope_table(50, 64)[0])
    _, amplitude = rome.tables.inverse_frequencies(64, 10000.0, rome.tables.Scaling.yarn(4.0, 4096))
    assert amplitude > 1.0
    inv3, _ = rome.tables.inverse_frequencies(128, 500000.0, rome.tables.Scaling.llama3(8.0))
    assert inv3.shape == (64,) and inv3.dtype == torch.float64


def test_grid_table_blocks():
    cos, sin = rome.tables.table_2d(3, 4, [8, 8])
    ch, _ = rome.tables.rope_table(3, 8)
    cw, _ = rome.tables.rope_table(4, 8)
    for i in range(3):
        for j in range(4):
            assert torch.equal(cos[i * 4 + j], torch.cat([ch[i], cw[j]]))
    cos3, sin3 = rome.tables.table_3d(2, 3, 4, [44, 44, 40])
    assert cos3.shape == (24, 128)
    pos = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(4), indexing="ij"), -1)
    ac, as_ = rome.tables.axes_table(pos.reshape(-1, 3), [44, 44, 40])
    assert torch.equal(ac, cos3) and torch.equal(as_, sin3)


@pytest.mark.parametrize("mode", ("sectioned", "interleaved"))
def test_mrope_cache_equals_direct_table(mode):
    sections, dim = [16, 24, 24], 128
    positions = torch.randint(0, 50, (3, 20))
    cos, sin = rome.tables.mrope_table(positions, dim, sections, mode=mode)
    q = torch.randn(1, 4, 20, dim)
    direct, _ = rome.rope(q, None, cos, sin)
    ccos, csin, column_axis = rome.tables.mrope_cache(64, dim, sections, mode=mode)
    cached, _ = rome.rope(q, None, ccos, csin, positions=positions.T.reshape(1, 1, 20, 3),
                          column_axis=column_axis)
    torch.testing.assert_close(cached, direct, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ("half", "interleave"))
def test_module_1d_2d_3d(mode):
    layout = "half" if mode == "half" else "pairs"
    q = torch.randn(2, 4, 24, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 24, 128, dtype=torch.bfloat16)
    m1 = rome.RotaryEmbedding(128, mode=mode, max_positions=64)
    cos, sin = rome.tables.rope_table(24, 128, layout=layout)
    qo, ko = m1(q, k)
    assert torch.equal(qo, rome.rope(q, None, cos, sin, rotation=mode)[0])
    assert torch.equal(ko, rome.rope(k, None, cos, sin, rotation=mode)[0])
    m3 = rome.RotaryEmbedding(128, axes_dims=[44, 44, 40], mode=mode, max_positions=16)
    cos3, sin3 = rome.tables.table_3d(2, 3, 4, [44, 44, 40], layout=layout)
    expected, _ = rome.rope(q, None, cos3, sin3, rotation=mode, blocks=[44, 44, 40])
    torch.testing.assert_close(m3(q, grid=(2, 3, 4)), expected, atol=0, rtol=0)
    m2 = rome.RotaryEmbedding(128, axes_dims=[64, 64], mode=mode, max_positions=16, seq_dim=-3)
    cos2, sin2 = rome.tables.table_2d(4, 6, [64, 64], layout=layout)
    qs = q.transpose(1, 2)  # BSND
    expected, _ = rome.rope(qs, None, cos2[:, None], sin2[:, None], rotation=mode, blocks=[64, 64])
    assert torch.equal(m2(qs, grid=(4, 6)), expected)


def test_cpu_info_and_controls():
    info = rome.cpu_info()
    assert info["active_isa"] in rome.ISAS and "scalar" in info["compiled_isas"]
    assert rome.set_max_isa("scalar") == "scalar"
    assert rome.active_isa() == "scalar"
    rome.set_num_threads(1)
    rome.set_num_threads(0)
    with pytest.raises(ValueError, match="threads"):
        rome.set_num_threads(-1)
    with pytest.raises(ValueError, match="isa"):
        rome.set_max_isa("sse9")


# ------------------------------------------------------------------------------------------------
# Errors: type, message, and nothing written


@pytest.mark.parametrize("bad", (torch.int32, torch.float64, torch.complex64))
def test_wrong_dtype(bad):
    cos, sin, _ = make_tables("SD")
    q = torch.randn(B, N, S, D).to(bad)
    before = q.clone()
    with pytest.raises(ValueError, match=r"rome: q\.dtype: expected float32, float16 or bfloat16"):
        rome.rope(q, None, cos, sin)
    with pytest.raises(ValueError, match=r"q\.dtype"):
        rome.rope_(q, None, cos, sin)
    assert torch.equal(q, before)
    with pytest.raises(ValueError, match=r"x\.dtype"):
        rome.rope_matrix(q, rome.matrices.half(D), sin, cos)
    with pytest.raises(ValueError, match=r"x\.dtype"):
        rome.apply_rotary_emb_interleaved(q[0], torch.randn(S, D))
    with pytest.raises(ValueError, match=r"cos\.dtype"):
        rome.rope(torch.randn(B, N, S, D), None, cos.to(bad), sin.to(bad))
    with pytest.raises(ValueError, match=r"positions\.dtype: expected int32 or int64"):
        rome.rope(torch.randn(B, N, S, D), None, cos, sin, positions=torch.zeros(S))
    with pytest.raises(ValueError, match=r"query\.dtype"):
        rome.rotary_embedding(torch.zeros(S, dtype=torch.long), q[0, 0].clone(), None, D, torch.randn(8, D), True)


def _misaligned(shape, dtype, fill):
    """A tensor whose data pointer is one byte past an element boundary (torch.frombuffer allows it)."""
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    buf = bytearray(n * size + 1)
    t = torch.frombuffer(buf, dtype=dtype, offset=1, count=n).view(shape)
    t.copy_(fill)
    assert t.data_ptr() % size != 0
    return t, buf


def test_misaligned_pointers():
    cos, sin, _ = make_tables("SD")
    x, _buf = _misaligned((B, N, S, D), torch.float32, torch.randn(B, N, S, D))
    before = x.clone()
    with pytest.raises(ValueError, match=r"rome: q: expected a data pointer aligned to 4 bytes \(float32 elements\), got address 0x"):
        rome.rope(x, None, cos, sin)
    with pytest.raises(ValueError, match=r"rome: q: expected a data pointer aligned to 4 bytes"):
        rome.rope_(x, None, cos, sin)
    assert torch.equal(x, before)
    bad_cos, _buf2 = _misaligned(tuple(cos.shape), cos.dtype, cos)
    q = torch.randn(B, N, S, D)
    q_before = q.clone()
    with pytest.raises(ValueError, match=r"rome: cos: expected a data pointer aligned to 4 bytes"):
        rome.rope_(q, None, bad_cos, sin)
    assert torch.equal(q, q_before)
    cache = torch.randn(64, D)
    pos, _buf3 = _misaligned((S,), torch.int64, torch.arange(S))
    with pytest.raises(ValueError, match=r"rome: positions: expected a data pointer aligned to 8 bytes \(int64 elements\)"):
        rome.rotary_embedding(pos, q[0, 0].clone(), None, D, cache, True)


def test_wrong_head_dim():
    q = torch.randn(B, N, S, D)
    before = q.clone()
    cos, sin, _ = make_tables("SD", width=D // 2)
    with pytest.raises(ValueError, match=r"rome: cos: expected a last axis of 16 \(full width for rotary_dim 16\), got \[5, 8\]"):
        rome.rope_(q, None, cos, sin)
    assert torch.equal(q, before)
    with pytest.raises(ValueError, match=r"mat: expected a \[16, 16\] matrix"):
        rome.rope_matrix(q, rome.matrices.half(8), *make_tables("SD")[:2])
    with pytest.raises(ValueError, match=r"rome: k: expected a last axis of 16"):
        rome.rope(q, torch.randn(B, N, S, 8), *make_tables("SD")[:2])
    with pytest.raises(ValueError, match=r"rotary_dim"):
        rome.rope(q, None, *make_tables("SD")[:2], rotary_dim=18)
    with pytest.raises(ValueError, match=r"blocks: expected block sizes summing to rotary_dim 16"):
        rome.rope(q, None, *make_tables("SD")[:2], blocks=[8, 4])
    with pytest.raises(ValueError, match=r"rotation: expected one of"):
        rome.rope(q, None, *make_tables("SD")[:2], rotation="sideways")
    with pytest.raises(ValueError, match=r"table_width"):
        rome.rope(q, None, *make_tables("SD")[:2], table_width="quarter")
    with pytest.raises(ValueError, match=r"mat_b: expected a \[16, 16\] matrix for rotation 'dense', got None"):
        rome.rope(q, None, *make_tables("SD")[:2], rotation="dense")
    with pytest.raises(ValueError, match=r"rank"):
        rome.rope(torch.randn(1, 1, 1, 1, S, D), None, *make_tables("SD")[:2])


@pytest.mark.parametrize("value", (15, -1, 1 << 40))
def test_out_of_range_positions(value):
    cos, sin, positions = make_tables("pos_B1S")
    positions = positions.clone()
    positions[1, 0, 3] = value
    q = torch.randn(B, N, S, D, dtype=torch.bfloat16)
    before = q.clone()
    msg = rf"rome: positions: expected values in \[0, 15\) \(rows of the cos/sin cache\), got {value} at index \[1, 0, 3\]"
    with pytest.raises(IndexError, match=msg):
        rome.rope(q, None, cos, sin, positions=positions)
    with pytest.raises(IndexError, match=msg):
        rome.rope_(q, None, cos, sin, positions=positions)
    assert torch.equal(q, before)
    # vLLM: a position outside the cache is an error, never an out-of-bounds read.
    pos, query, key, cache, qkv = vllm_inputs(torch.bfloat16, "t_hd", D, max_pos=15)
    pos[4] = value
    before = qkv.clone()
    with pytest.raises(IndexError, match=r"rome: positions: expected values in \[0, 15\)"):
        rome.rotary_embedding(pos, query, key, D, cache, True)
    assert torch.equal(qkv, before)


def test_non_broadcastable_tables():
    q = torch.randn(B, N, S, D)
    before = q.clone()
    cos, sin, _ = make_tables("11SD", shape=(3, N, S, D))
    cos, sin = cos.expand(3, 1, S, D), sin.expand(3, 1, S, D)
    with pytest.raises(ValueError, match=r"rome: cos: expected a shape broadcastable to q \[2, 3, 5, 16\], got \[3, 1, 5, 16\]"):
        rome.rope_(q, None, cos, sin)
    with pytest.raises(ValueError, match=r"broadcastable"):
        rome.rope_matrix_(q, rome.matrices.half(D), sin, cos)
    assert torch.equal(q, before)
    with pytest.raises(ValueError, match=r"sin: expected the shape of cos"):
        rome.rope(q, None, torch.ones(S, D), torch.ones(S + 1, D))
    # Tables that vary over heads need k's heads to match.
    cos, sin, _ = make_tables("BNSD")
    with pytest.raises(ValueError, match=r"rome: cos: expected a shape broadcastable to k"):
        rome.rope(q, torch.randn(B, 1, S, D), cos, sin)


def test_vllm_shape_errors():
    pos, query, key, cache, _ = vllm_inputs(torch.float32, "t_hd", D)
    with pytest.raises(ValueError, match=r"query: expected a last axis that is a multiple of head_size 24"):
        rome.rotary_embedding(pos, query, key, 24, cache, True)
    with pytest.raises(ValueError, match=r"cos_sin_cache"):
        rome.rotary_embedding(pos, query, key, D, torch.randn(8, 2 * D), True)


def test_inplace_is_inference_only():
    q = torch.randn(B, N, S, D, requires_grad=True)
    cos, sin, _ = make_tables("SD")
    with pytest.raises(NotImplementedError, match="inference only"):
        rome.rope_(q, None, cos, sin)
    with pytest.raises(NotImplementedError, match="inference only"):
        rome.rope_matrix_(torch.randn(B, N, S, D), rome.matrices.half(D), sin.requires_grad_(), cos)
    with torch.no_grad():
        x = q.detach().clone()
        rome.rope_(x, None, cos, sin)
    version = x._version
    rome.rope_(x, None, cos.detach(), sin.detach())
    assert x._version > version  # ADInplaceOrView bumps the version counter


def test_cache_tables_have_no_gradient():
    cos, sin, positions = make_tables("pos_S")
    with pytest.raises(NotImplementedError, match="cache"):
        rome.rope(torch.randn(B, N, S, D), None, cos.requires_grad_(), sin, positions=positions)


def test_dense_rotation_cache_follows_the_matrix_values():
    """Rotations are cached by the matrices' values (compared in place when the matrix is
    contiguous): a matrix changed in place between calls, the same values in another dtype or
    layout, and a transposed view each give the rotation of their current values."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 5, 16, generator=g)
    cos, sin = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    m = torch.randn(16, 16, generator=g)

    def reference(mat):
        return x * cos + (x @ mat.float()) * sin

    first = torch.ops.rome.rope_matrix.default(x, m, sin, cos)
    torch.testing.assert_close(first, reference(m))
    m.mul_(-0.5)  # same tensor, same data pointer, new values
    torch.testing.assert_close(torch.ops.rome.rope_matrix.default(x, m, sin, cos), reference(m))
    m[3, 7] = 2.0
    torch.testing.assert_close(torch.ops.rome.rope_matrix.default(x, m, sin, cos), reference(m))
    for other in (m.half(), m.t().contiguous().t(), m.t()):
        torch.testing.assert_close(torch.ops.rome.rope_matrix.default(x, other, sin, cos),
                                   reference(other))
    # Column-major (as torch.linalg.qr returns Q), then changed in place.
    col = torch.randn(16, 16, generator=g).t()
    for _ in range(2):
        torch.testing.assert_close(torch.ops.rome.rope_matrix.default(x, col, sin, cos),
                                   reference(col))
        col.add_(1.0)
