"""Fused QK-norm + RoPE (vLLM's fused_qk_norm_rope schema) and RoPE + paged KV-cache write:
float64 references from the separate steps (RMSNorm, rotate, scatter), every ISA under test,
head dims 64, 80, 96, 128, 256, partial rotary, GQA, Gemma's (1 + w), padding slots; opcheck,
torch.compile(fullgraph=True); bad input raises naming the argument and writes nothing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import rome
from conftest import on_meta

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def cache_table(rows, rd, dtype=torch.float32):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(rows, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], -1).to(dtype)


def ref_norm_rope(x, weight, eps, cache, positions, is_neox, normalise=True):
    """x [T, H, D] in float64: RMSNorm over D, then the rotation of the first rd lanes."""
    x = x.double()
    if normalise:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    rd = cache.shape[1]
    c = cache.double()[positions, : rd // 2][:, None]
    s = cache.double()[positions, rd // 2:][:, None]
    out = x.clone()
    if is_neox:
        a, b = x[..., : rd // 2], x[..., rd // 2: rd]
        out[..., : rd // 2], out[..., rd // 2: rd] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2], out[..., 1:rd:2] = a * c - b * s, b * c + a * s
    return out


def assert_close(got, want, dtype):
    # One rounding of the result plus the fp32 arithmetic of the norm (a few fp32 ulps).
    tol = ULP[dtype] * want.abs() + 8 * ULP[torch.float32] * (want.abs() + 1)
    bad = (got.double() - want).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} lanes off; worst {(got.double() - want).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,rd", [(64, 64), (80, 80), (96, 96), (128, 128), (128, 64), (256, 256)])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_qk_norm_rope(isa, dtype, D, rd, is_neox, gemma):
    T, hq, hk, hv = 19, 4, 2, 2
    cache = cache_table(64, rd, dtype)
    positions = torch.randint(0, 64, (T,))
    qkv = torch.randn(T, (hq + hk + hv) * D).to(dtype)
    qw = (torch.rand(D) + 0.5).to(dtype)
    kw = (torch.rand(D) - 0.5).to(dtype)
    before = qkv.clone()
    rome.ops.fused_qk_norm_rope(qkv, hq, hk, hv, D, 1e-6, qw, kw, cache, is_neox, positions, gemma)
    off = 1.0 if gemma else 0.0
    q0 = before[:, : hq * D].view(T, hq, D)
    k0 = before[:, hq * D:(hq + hk) * D].view(T, hk, D)
    assert_close(qkv[:, : hq * D].view(T, hq, D),
                 ref_norm_rope(q0, qw.double() + off, 1e-6, cache, positions, is_neox), dtype)
    assert_close(qkv[:, hq * D:(hq + hk) * D].view(T, hk, D),
                 ref_norm_rope(k0, kw.double() + off, 1e-6, cache, positions, is_neox), dtype)
    assert torch.equal(qkv[:, (hq + hk) * D:], before[:, (hq + hk) * D:])


def test_fused_row_strided_qkv_and_threads(isa):
    """A qkv slice with a row stride larger than its width; 1 and 2 threads give the same bits."""
    T, hq, hk, hv, D = 300, 8, 2, 2, 128
    cache = cache_table(512, D)
    positions = torch.randint(0, 512, (T,))
    big = torch.randn(T, (hq + hk + hv) * D + 64).bfloat16()
    w = torch.rand(D) + 0.5
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        buf = big.clone()
        qkv = buf[:, : (hq + hk + hv) * D]
        rome.ops.fused_qk_norm_rope(qkv, hq, hk, hv, D, 1e-5, w, w, cache, True, positions)
        assert torch.equal(buf[:, (hq + hk + hv) * D:], big[:, (hq + hk + hv) * D:])
        results.append(buf)
    assert torch.equal(results[0], results[1])


def test_fused_errors_write_nothing(isa):
    T, hq, hk, hv, D = 3, 2, 1, 1, 64
    cache = cache_table(8, D)
    qkv = torch.randn(T, (hq + hk + hv) * D)
    w = torch.ones(D)
    before = qkv.clone()
    bad = [
        (dict(position_ids=torch.tensor([0, 8, 1])), "position_ids"),
        (dict(q_weight=torch.ones(D + 1)), "q_weight"),
        (dict(k_weight=torch.ones(D, dtype=torch.int32)), "k_weight.dtype"),
        (dict(num_heads_q=3), "qkv"),
        (dict(cos_sin_cache=cache_table(8, D + 2)), "cos_sin_cache"),
        (dict(eps=-1.0), "eps"),
    ]
    base = dict(qkv=qkv, num_heads_q=hq, num_heads_k=hk, num_heads_v=hv, head_dim=D, eps=1e-6,
                q_weight=w, k_weight=w, cos_sin_cache=cache, is_neox=True,
                position_ids=torch.tensor([0, 1, 2]))
    for change, argument in bad:
        with pytest.raises((ValueError, IndexError), match=f"rome: {argument}") as cpu:
            rome.ops.fused_qk_norm_rope(**{**base, **change})
        assert torch.equal(qkv, before)
        if argument != "position_ids":  # a value: the Meta kernel checks shapes only
            expect_same_error_on_meta(torch.ops.rome.fused_qk_norm_rope, {**base, **change}, cpu)


def expect_same_error_on_meta(op, kwargs, cpu):
    """The Meta kernel refuses the call with the CPU kernel's error (the same checking code), so
    torch.compile refuses it while tracing."""
    with pytest.raises(cpu.type) as meta:
        op(**{k: on_meta(v) for k, v in kwargs.items()})
    assert str(meta.value) == str(cpu.value)


def test_fused_opcheck_and_compile(isa):
    T, hq, hk, hv, D = 5, 2, 1, 1, 64
    cache = cache_table(16, D)
    positions = torch.randint(0, 16, (T,))
    w = torch.rand(D) + 0.5
    opcheck(torch.ops.rome.fused_qk_norm_rope.default,
            (torch.randn(T, (hq + hk + hv) * D), hq, hk, hv, D, 1e-6, w, w, cache, True, positions))
    kc, vc = torch.zeros(4, 4, hk, D), torch.zeros(4, 4, hk, D)
    opcheck(torch.ops.rome.rotary_embedding_with_cache.default,
            (positions, torch.randn(T, hq * D), torch.randn(T, hk * D), torch.randn(T, hk * D), D,
             cache, True, kc, vc, torch.tensor([3, -1, 0, 9, 15])))

    def layer(qkv, positions, kc, vc, slots):
        rome.ops.fused_qk_norm_rope(qkv, hq, hk, hv, D, 1e-6, w, w, cache, True, positions)
        q, k, v = qkv.split([hq * D, hk * D, hv * D], dim=-1)
        rome.ops.rotary_embedding_with_cache(positions, q.contiguous(), k.contiguous(),
                                             v.contiguous(), D, cache, False, kc, vc, slots)
        return qkv * 2

    qkv = torch.randn(T, (hq + hk + hv) * D)
    slots = torch.tensor([1, 2, 3, 4, 5])
    args_eager = (qkv.clone(), positions, kc.clone(), vc.clone(), slots)
    args_comp = (qkv.clone(), positions, kc.clone(), vc.clone(), slots)
    want = layer(*args_eager)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(*args_comp)
    assert torch.equal(got, want)
    assert torch.equal(args_comp[2], args_eager[2]) and torch.equal(args_comp[3], args_eager[3])


# --------------------------------------------------------------------------------------------
# RoPE + paged KV-cache write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_with_cache(isa, dtype, with_norm, is_neox):
    T, hq, hk, D, blocks, bs = 13, 4, 2, 96, 6, 4
    cache = cache_table(40, 64, dtype)  # partial rotary: 64 of 96
    positions = torch.randint(0, 40, (T,))
    query = torch.randn(T, hq * D).to(dtype)
    key = torch.randn(T, hk * D).to(dtype)
    value = torch.randn(T, hk * D).to(dtype)
    kc = torch.randn(blocks, bs, hk, D).to(dtype)
    vc = torch.randn(blocks, bs, hk, D).to(dtype)
    slots = torch.tensor([5, -1, 0, 23, 7, 12, -1, 3, 18, 1, 9, 22, 14])
    q0, k0, kc0, vc0 = query.clone(), key.clone(), kc.clone(), vc.clone()
    w = (torch.rand(D) + 0.5) if with_norm else None
    rome.ops.rotary_embedding_with_cache(positions, query, key, value, D, cache, is_neox, kc, vc,
                                         slots, w, w, 1e-6)
    assert_close(query.view(T, hq, D),
                 ref_norm_rope(q0.view(T, hq, D), w, 1e-6, cache, positions, is_neox, with_norm),
                 dtype)
    assert_close(key.view(T, hk, D),
                 ref_norm_rope(k0.view(T, hk, D), w, 1e-6, cache, positions, is_neox, with_norm),
                 dtype)
    flat_k, flat_v = kc.view(-1, hk, D), vc.view(-1, hk, D)
    written = set()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written.add(s)
        assert torch.equal(flat_k[s], key.view(T, hk, D)[t])
        assert torch.equal(flat_v[s], value.view(T, hk, D)[t])
    for s in range(blocks * bs):
        if s not in written:
            assert torch.equal(flat_k[s], kc0.view(-1, hk, D)[s])
            assert torch.equal(flat_v[s], vc0.view(-1, hk, D)[s])


def test_rope_with_cache_matches_separate_ops(isa):
    """rotary_embedding + index_put into the cache gives the same bits."""
    T, hq, hk, D = 33, 8, 2, 128
    cache = cache_table(64, D)
    positions = torch.randint(0, 64, (T,))
    query = torch.randn(T, hq * D).bfloat16()
    key = torch.randn(T, hk * D).bfloat16()
    value = torch.randn(T, hk * D).bfloat16()
    kc = torch.zeros(10, 16, hk, D, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(160)[:T]
    q2, k2, kc2, vc2 = query.clone(), key.clone(), kc.clone(), vc.clone()
    rome.ops.rotary_embedding_with_cache(positions, query, key, value, D, cache, True, kc, vc, slots)
    rome.ops.rotary_embedding(positions, q2, k2, D, cache, True)
    kc2.view(-1, hk, D)[slots] = k2.view(T, hk, D)
    vc2.view(-1, hk, D)[slots] = value.view(T, hk, D)
    assert torch.equal(query, q2) and torch.equal(key, k2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_rope_with_cache_errors_write_nothing(isa):
    T, hq, hk, D = 4, 2, 1, 32
    cache = cache_table(8, D)
    base = dict(positions=torch.tensor([0, 1, 2, 3]), query=torch.randn(T, hq * D),
                key=torch.randn(T, hk * D), value=torch.randn(T, hk * D), head_size=D,
                cos_sin_cache=cache, is_neox=True, key_cache=torch.randn(2, 2, hk, D),
                value_cache=torch.randn(2, 2, hk, D), slot_mapping=torch.tensor([0, 1, 2, 3]))
    snapshot = {k: v.clone() for k, v in base.items() if isinstance(v, torch.Tensor)}
    bad = [
        (dict(slot_mapping=torch.tensor([0, 1, 4, 3])), r"slot_mapping\[2\]"),
        (dict(slot_mapping=torch.tensor([0, 1, 1, 3])), "slot_mapping"),
        (dict(slot_mapping=torch.tensor([0, 1, 2])), "slot_mapping"),
        (dict(slot_mapping=torch.tensor([0.0, 1, 2, 3])), "slot_mapping.dtype"),
        (dict(key_cache=torch.randn(2, 2, hk, D).bfloat16()), "key_cache.dtype"),
        (dict(value_cache=torch.randn(2, 2, hk + 1, D)), "value_cache"),
        (dict(value=torch.randn(T, 2 * D)), "value"),
        (dict(positions=torch.tensor([0, 1, 2, 8])), "positions"),
        (dict(q_weight=torch.ones(D)), "k_weight"),
    ]
    values = {r"slot_mapping\[2\]", "positions"}  # value errors: left to the CPU kernel
    for i, (change, argument) in enumerate(bad):
        with pytest.raises((ValueError, IndexError), match=f"rome: {argument}") as cpu:
            rome.ops.rotary_embedding_with_cache(**{**base, **change})
        for k, v in snapshot.items():
            assert torch.equal(base[k], v), (argument, k)
        if argument not in values and i != 1:  # i == 1: a slot named twice, also a value
            expect_same_error_on_meta(torch.ops.rome.rotary_embedding_with_cache,
                                      {**base, **change}, cpu)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(tokens=st.integers(0, 12), hq=st.integers(1, 4), hk=st.integers(1, 3),
       half_d=st.sampled_from([4, 16, 32, 40, 48, 64]), rot_frac=st.sampled_from([1.0, 0.5]),
       is_neox=st.booleans(), gemma=st.booleans(), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_fused_property(tokens, hq, hk, half_d, rot_frac, is_neox, gemma, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    D = 2 * half_d
    rd = max(2, int(D * rot_frac) // 2 * 2)
    cache = cache_table(20, rd)
    positions = torch.randint(0, 20, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (hq + 2 * hk) * D, generator=gen).to(dtype)
    w = (torch.rand(D, generator=gen) + 0.5).to(dtype)
    before = qkv.clone()
    rome.ops.fused_qk_norm_rope(qkv, hq, hk, hk, D, 1e-6, w, w, cache, is_neox, positions, gemma)
    wd = w.double() + (1.0 if gemma else 0.0)
    for first, heads in ((0, hq), (hq, hk)):
        sl = slice(first * D, (first + heads) * D)
        assert_close(qkv[:, sl].view(tokens, heads, D),
                     ref_norm_rope(before[:, sl].view(tokens, heads, D), wd, 1e-6, cache,
                                   positions, is_neox), dtype)
