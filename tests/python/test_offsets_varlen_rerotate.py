"""vLLM's full rotary schema (rope_dim_offset, inverse), flash-attn's apply_rotary_emb (ragged
batches, per-sequence offsets, qkv in place) and KV-cache re-rotation, against float64
references, on every ISA under test; bad input raises an error naming the argument and writes
nothing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import rome
import rome.vllm
from rome.flash_attn import apply_rotary_emb, apply_rotary_emb_qkv_

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tolerances against the float64 reference: one rounding of the result, fp32 math.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def inv_freq(rd, base=10000.0):
    return 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)


def cos_sin(rows, rd):
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq(rd)[None]
    return angles.cos(), angles.sin()


def rotate_ref(x, cos, sin, interleaved):
    """x [..., rd] in float64 by cos/sin [..., rd/2] (broadcast)."""
    rd = x.shape[-1]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    a, b = x[..., : rd // 2], x[..., rd // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def close(got, want, dtype):
    if want.numel() == 0:
        assert got.numel() == 0
        return
    scale = want.abs().clamp(min=1.0)
    assert ((got.double() - want).abs() / scale).max() <= TOL[dtype]


# --------------------------------------------------------------------------------------------
# vLLM: rope_dim_offset and inverse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("offset", [0, 64, 128])
@pytest.mark.parametrize("inverse", [False, True])
def test_vllm_offset_and_inverse(isa, dtype, is_neox, offset, inverse):
    T, Hq, Hk, D, rd = 9, 4, 2, 192, 64
    c, s = cos_sin(100, rd)
    cache = torch.cat([c, s], -1).to(dtype)
    positions = torch.randint(0, 100, (T,))
    q = torch.randn(T, Hq * D).to(dtype)
    k = torch.randn(T, Hk * D).to(dtype)
    q0, k0 = q.clone(), k.clone()
    rome.ops.rotary_embedding(positions, q, k, D, cache, is_neox, offset, inverse)
    cc = cache.double()[positions, : rd // 2][:, None]
    ss = cache.double()[positions, rd // 2:][:, None] * (-1 if inverse else 1)
    for got, before, heads in ((q, q0, Hq), (k, k0, Hk)):
        g, b = got.view(T, heads, D), before.view(T, heads, D)
        close(g[..., offset:offset + rd], rotate_ref(b[..., offset:offset + rd].double(), cc, ss,
                                                     not is_neox), dtype)
        assert torch.equal(g[..., :offset], b[..., :offset])
        assert torch.equal(g[..., offset + rd:], b[..., offset + rd:])


@pytest.mark.parametrize("is_neox", [True, False])
def test_vllm_inverse_undoes_forward(isa, is_neox):
    T, D, rd = 17, 128, 64
    c, s = cos_sin(64, rd)
    cache = torch.cat([c, s], -1).float()
    positions = torch.randint(0, 64, (T,))
    q = torch.randn(T, 3 * D)
    q0 = q.clone()
    rome.vllm.rotary_embedding(positions, q, None, D, cache, is_neox, D - rd, False)
    assert not torch.equal(q, q0)
    rome.vllm.rotary_embedding(positions, q, None, D, cache, is_neox, D - rd, True)
    torch.testing.assert_close(q, q0, atol=1e-6, rtol=0)


def test_vllm_layer_mla_head_and_inverse(isa):
    """vLLM's layer with a [T, H, D] query whose D exceeds head_size: the last rotary_dim lanes
    rotate ([nope | rope]); inverse=True undoes it."""
    layer = rome.vllm.RotaryEmbedding(64, 64, 256, 10000.0, False, torch.float32)
    positions = torch.randint(0, 256, (5,))
    q = torch.randn(5, 4, 192)
    q0 = q.clone()
    layer.forward(positions, q)
    assert torch.equal(q[..., :128], q0[..., :128])
    table = layer.cos_sin_cache.double()[positions][:, None]  # the layer's own fp32 cache
    close(q[..., 128:], rotate_ref(q0[..., 128:].double(), table[..., :32], table[..., 32:], True),
          torch.float32)
    layer.forward(positions, q, inverse=True)
    torch.testing.assert_close(q, q0, atol=1e-6, rtol=0)


def test_vllm_odd_head_size_names_head_size(isa):
    cache = torch.cat(cos_sin(4, 2), -1).float()
    with pytest.raises(ValueError, match="rome: head_size: expected an even size"):
        rome.ops.rotary_embedding(torch.zeros(2, dtype=torch.long), torch.randn(2, 3), None, 3,
                                  cache, True)


def test_vllm_bad_offset_writes_nothing(isa):
    D, rd = 128, 64
    c, s = cos_sin(10, rd)
    cache = torch.cat([c, s], -1).float()
    q = torch.randn(3, 2 * D)
    q0 = q.clone()
    for offset, argument in ((-1, "rope_dim_offset"), (65, "cos_sin_cache"), (129, "rope_dim_offset")):
        with pytest.raises(ValueError, match=f"rome: {argument}: expected"):
            rome.ops.rotary_embedding(torch.zeros(3, dtype=torch.long), q, None, D, cache, True,
                                      offset)
        assert torch.equal(q, q0)


def test_opcheck_new_schemas(isa):
    D, rd = 96, 32
    c, s = cos_sin(20, rd)
    cache = torch.cat([c, s], -1).float()
    positions = torch.randint(0, 20, (4,))
    opcheck(torch.ops.rome.rotary_embedding.default,
            (positions, torch.randn(4, 2 * D), torch.randn(4, D), D, cache, True, 32, True))
    kc = torch.randn(6, 4, 2, 48)
    cs, sn = rome.kv_cache.shift_tables(torch.tensor([3, -1]), inv_freq(32))
    opcheck(torch.ops.rome.rerotate_paged_.default,
            (kc, cs, sn, torch.tensor([[0, 2], [5, 1]], dtype=torch.int32), torch.tensor([6, 3]),
             "half", 16))


# --------------------------------------------------------------------------------------------
# flash-attn's apply_rotary_emb


def flash_ref(x, cos, sin, interleaved, positions):
    rd = 2 * cos.shape[1]
    out = x.double().clone()
    c = cos.double()[positions].unsqueeze(-2)
    s = sin.double()[positions].unsqueeze(-2)
    out[..., :rd] = rotate_ref(out[..., :rd], c, s, interleaved)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", [0, 7, "tensor"])
@pytest.mark.parametrize("inplace", [False, True])
def test_flash_batched(isa, dtype, interleaved, offsets, inplace):
    B, S, H, D, rd = 3, 11, 4, 80, 48
    c, s = cos_sin(64, rd)
    cos, sin = c.float(), s.float()
    offs = torch.tensor([0, 5, 53]) if offsets == "tensor" else offsets
    x = torch.randn(B, S, H, D).to(dtype)
    x0 = x.clone()
    y = apply_rotary_emb(x, cos, sin, interleaved, inplace, seqlen_offsets=offs)
    positions = torch.arange(S)[None] + (offs[:, None] if torch.is_tensor(offs) else offs)
    close(y, flash_ref(x0, cos, sin, interleaved, positions), dtype)
    assert torch.equal(y[..., rd:], x0[..., rd:])
    assert (y is x) == inplace
    if not inplace:
        assert torch.equal(x, x0)


@pytest.mark.parametrize("inplace", [False, True])
def test_flash_compiles_to_the_eager_result(inplace):
    """Traced (fullgraph), apply_rotary_emb keeps the op overloads (eager calls take their C++
    entries): the same bits as eager, in place and out of place."""
    c, s = cos_sin(64, 48)
    x = torch.randn(2, 5, 3, 64).bfloat16()

    def step(x):
        return apply_rotary_emb(x, c.float(), s.float(), False, inplace, seqlen_offsets=7) * 1

    torch._dynamo.reset()
    want = step(x.clone())
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x.clone())
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", [0, 3, "tensor"])
def test_flash_varlen_with_empty_and_single_sequences(isa, dtype, interleaved, offsets):
    lengths = [0, 5, 1, 0, 9, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total, H, D, rd = sum(lengths), 3, 64, 64
    c, s = cos_sin(50, rd)
    cos, sin = c.to(dtype), s.to(dtype)  # tables in the model dtype work too
    offs = torch.tensor([4, 0, 40, 49, 2, 48], dtype=torch.int32) if offsets == "tensor" else offsets
    x = torch.randn(total, H, D).to(dtype)
    y = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offs, cu_seqlens=cu,
                         max_seqlen=max(lengths))
    positions = torch.cat([torch.arange(n) + (int(offs[b]) if torch.is_tensor(offs) else offs)
                           for b, n in enumerate(lengths)])
    close(y, flash_ref(x, cos, sin, interleaved, positions), dtype)


def test_flash_varlen_matches_padded_batch(isa):
    lengths = [7, 3, 12]
    H, D = 4, 64
    c, s = cos_sin(32, D)
    cos, sin = c.float(), s.float()
    padded = torch.randn(3, 12, H, D)
    packed = torch.cat([padded[b, :n] for b, n in enumerate(lengths)])
    cu = torch.tensor([0, 7, 10, 22], dtype=torch.int32)
    y_packed = apply_rotary_emb(packed, cos, sin, cu_seqlens=cu)
    y_padded = apply_rotary_emb(padded, cos, sin)
    assert torch.equal(y_packed, torch.cat([y_padded[b, :n] for b, n in enumerate(lengths)]))


def test_flash_autograd(isa):
    B, S, H, D, rd = 2, 6, 3, 32, 32
    c, s = cos_sin(16, rd)
    cos, sin = c.float(), s.float()
    offs = torch.tensor([1, 9])
    x = torch.randn(B, S, H, D, requires_grad=True)
    g = torch.randn(B, S, H, D)
    apply_rotary_emb(x, cos, sin, seqlen_offsets=offs).backward(g)
    x64 = x.detach().double().requires_grad_()
    positions = torch.arange(S)[None] + offs[:, None]
    out = x64.clone()
    out = torch.cat([rotate_ref(x64[..., :rd], c[positions].unsqueeze(-2),
                                s[positions].unsqueeze(-2), False), x64[..., rd:]], -1)
    out.backward(g.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=0)
    # In place on a non-leaf, as flash-attn allows in training.
    x2 = x.detach().clone().requires_grad_()
    h = x2 * 1.0
    apply_rotary_emb(h, cos, sin, inplace=True, seqlen_offsets=offs).backward(g)
    torch.testing.assert_close(x2.grad, x.grad)


def test_flash_errors_write_nothing(isa):
    c, s = cos_sin(10, 32)
    cos, sin = c.float(), s.float()
    x = torch.randn(2, 6, 2, 32)
    x0 = x.clone()
    cases = [
        (dict(seqlen_offsets=5), "seqlen_offsets"),            # 5 + 6 > 10 rows
        (dict(seqlen_offsets=torch.tensor([0, 5])), "seqlen_offsets"),
        (dict(seqlen_offsets=-1), "seqlen_offsets"),
        (dict(seqlen_offsets=torch.tensor([0, 1, 2])), "seqlen_offsets"),
    ]
    for kwargs, argument in cases:
        with pytest.raises(ValueError, match=f"^{argument}: expected"):
            apply_rotary_emb(x, cos, sin, inplace=True, **kwargs)
        assert torch.equal(x, x0)
    xv = torch.randn(8, 2, 32)
    xv0 = xv.clone()
    for cu, argument in ((torch.tensor([0, 3, 7], dtype=torch.int32), "cu_seqlens"),
                         (torch.tensor([1, 3, 8], dtype=torch.int32), "cu_seqlens"),
                         (torch.tensor([0, 5, 3, 8], dtype=torch.int32), "cu_seqlens"),
                         (torch.tensor([0.0, 8.0]), "cu_seqlens")):
        with pytest.raises(ValueError, match=f"^{argument}: expected"):
            apply_rotary_emb(xv, cos, sin, inplace=True, cu_seqlens=cu)
        assert torch.equal(xv, xv0)
    with pytest.raises(ValueError, match="^max_seqlen: expected"):
        apply_rotary_emb(xv, cos, sin, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32),
                         max_seqlen=4)
    with pytest.raises(ValueError, match="^cos: expected"):
        apply_rotary_emb(x, torch.randn(10, 20), torch.randn(10, 20))


@pytest.mark.parametrize("gqa", [False, True])
def test_flash_qkv_in_place(isa, gqa):
    B, S, H, D = 2, 5, 4, 64
    c, s = cos_sin(16, D)
    cos, sin = c.float(), s.float()
    if gqa:
        qkv = torch.randn(B, S, H + 2 * 2, D)
        q_sl, k_sl, v_sl = slice(0, H), slice(H, H + 2), slice(H + 2, H + 4)
        get = lambda t, sl: t[:, :, sl]  # noqa: E731
        kwargs = dict(num_heads_q=H)
    else:
        qkv = torch.randn(B, S, 3, H, D)
        q_sl, k_sl, v_sl = 0, 1, 2
        get = lambda t, i: t[:, :, i]  # noqa: E731
        kwargs = {}
    qkv0 = qkv.clone()
    assert apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=3, **kwargs) is qkv
    positions = torch.arange(S)[None].expand(B, S) + 3
    for sl in (q_sl, k_sl):
        close(get(qkv, sl), flash_ref(get(qkv0, sl), cos, sin, False, positions), torch.float32)
    assert torch.equal(get(qkv, v_sl), get(qkv0, v_sl))


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
       heads=st.integers(1, 4), half_rd=st.integers(1, 24), extra=st.integers(0, 8),
       interleaved=st.booleans(), offset_kind=st.sampled_from(["int", "tensor"]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_flash_varlen_property(lengths, heads, half_rd, extra, interleaved, offset_kind, dtype,
                               seed):
    gen = torch.Generator().manual_seed(seed)
    rd = 2 * half_rd
    D = rd + 2 * extra
    rows = 40
    c, s = cos_sin(rows, rd)
    if offset_kind == "int":
        offs = int(torch.randint(0, rows - max(lengths), (), generator=gen))
    else:
        offs = torch.stack([torch.randint(0, rows - n + 1, (), generator=gen) for n in lengths])
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(sum(lengths), heads, D, generator=gen).to(dtype)
    y = apply_rotary_emb(x, c.float(), s.float(), interleaved, seqlen_offsets=offs, cu_seqlens=cu)
    positions = torch.cat([torch.arange(n) + (int(offs[b]) if torch.is_tensor(offs) else offs)
                           for b, n in enumerate(lengths)]).long()
    close(y, flash_ref(x, c.float(), s.float(), interleaved, positions), dtype)


# --------------------------------------------------------------------------------------------
# KV-cache re-rotation


def rotated_keys(k, positions, rd, offset=0, is_neox=True):
    """float64 keys rotated at positions [..., S] broadcast over heads (k [..., S, H, D])."""
    angles = positions.double()[..., None] * inv_freq(rd)
    c, s = angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)
    out = k.double().clone()
    out[..., offset:offset + rd] = rotate_ref(out[..., offset:offset + rd], c, s, not is_neox)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rerotate_contiguous(isa, dtype, layout, is_neox):
    B, S, H, D, rd, off = 3, 10, 2, 96, 64, 16
    k = torch.randn(B, S, H, D)
    positions = torch.arange(S)[None].expand(B, S)
    cached = rotated_keys(k, positions, rd, off, is_neox).to(dtype)
    delta = torch.tensor([5, -3, 1000])
    cache = cached if layout == "bshd" else cached.transpose(1, 2).contiguous().transpose(1, 2)
    before = cache.clone()
    out = rome.rerotate_(cache if layout == "bshd" else cache.transpose(1, 2), delta,
                         inv_freq(rd), is_neox=is_neox, rope_dim_offset=off)
    assert out.data_ptr() == cache.data_ptr()
    want = rotated_keys(k, positions + delta[:, None], rd, off, is_neox)
    # One extra rounding of the stored keys, then the rotation's own.
    tol = {torch.float32: 4e-6, torch.bfloat16: 3.2e-2, torch.float16: 4e-3}[dtype]
    assert (cache.double() - want).abs().max() <= tol * 4
    assert torch.equal(cache[..., :off], before[..., :off])
    assert torch.equal(cache[..., off + rd:], before[..., off + rd:])


def test_rerotate_matches_reprefill_and_back(isa):
    S, H, D = 33, 4, 128
    k = torch.randn(S, H, D)
    cached = rotated_keys(k, torch.arange(S), D).float()
    shifted = cached.clone()
    rome.rerotate_(shifted, 77, base=10000.0, rotary_dim=D)
    torch.testing.assert_close(shifted.double(), rotated_keys(k, torch.arange(S) + 77, D),
                               atol=2e-5, rtol=0)
    rome.rerotate_(shifted, -77, inv_freq(D))
    torch.testing.assert_close(shifted, cached, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_major", [False, True])
def test_rerotate_paged_leaves_other_blocks(isa, dtype, head_major):
    num_blocks, bs, H, D = 10, 4, 2, 64
    memory = torch.randn(num_blocks, H, bs, D) if head_major else torch.randn(num_blocks, bs, H, D)
    cache = (memory.transpose(1, 2) if head_major else memory).to(dtype)
    before = cache.clone()
    block_table = torch.tensor([[3, 8, 0], [5, 0, 0], [1, 2, 9]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 0, 12])
    delta = torch.tensor([2, 9, -4])
    rome.rerotate_(cache, delta, inv_freq(D), block_table=block_table, seq_lens=seq_lens)
    touched = set()
    for b in range(3):
        for t in range(int(seq_lens[b])):
            blk, slot = int(block_table[b, t // bs]), t % bs
            touched.add((blk, slot))
            want = rotated_keys(before[blk, slot][None].double(), torch.tensor([int(delta[b])]), D)
            close(cache[blk, slot], want[0], dtype)
    for blk in range(num_blocks):
        for slot in range(bs):
            if (blk, slot) not in touched:
                assert torch.equal(cache[blk, slot], before[blk, slot]), (blk, slot)


def test_rerotate_errors_write_nothing(isa):
    cache = torch.randn(4, 2, 1, 32)
    before = cache.clone()
    bad = [
        (dict(block_table=torch.tensor([[0, 1], [1, 2]]), seq_lens=torch.tensor([3, 2])),
         r"block_table\[1, 0\]"),
        (dict(block_table=torch.tensor([[0, 4]]), seq_lens=torch.tensor([4])),
         r"block_table\[0, 1\]"),
        (dict(block_table=torch.tensor([[0, 1]]), seq_lens=torch.tensor([5])), r"seq_lens\[0\]"),
        (dict(block_table=torch.tensor([[0, 1]]), seq_lens=torch.tensor([[2]])), "seq_lens"),
        (dict(block_table=torch.tensor([[0.0, 1.0]]), seq_lens=torch.tensor([2])),
         "block_table.dtype"),
    ]
    for kwargs, argument in bad:
        with pytest.raises((ValueError, IndexError), match=f"rome: {argument}"):
            rome.rerotate_(cache, 3, inv_freq(32), **kwargs)
        assert torch.equal(cache, before)
    with pytest.raises(ValueError, match="^delta: expected"):
        rome.rerotate_(torch.randn(2, 5, 1, 32), torch.tensor([1, 2, 3]), inv_freq(32))
    with pytest.raises(ValueError, match="^rope_dim_offset: expected"):
        rome.rerotate_(torch.randn(2, 5, 1, 32), 1, inv_freq(32), rope_dim_offset=2)
    with pytest.raises(ValueError, match="rome: rope_dim_offset"):
        rome.rerotate_(cache, 1, inv_freq(32), rope_dim_offset=2,
                       block_table=torch.tensor([[0]]), seq_lens=torch.tensor([1]))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(tokens=st.integers(0, 9), heads_q=st.integers(1, 5), heads_k=st.integers(0, 3),
       half_rd=st.integers(1, 20), before=st.integers(0, 40), after=st.integers(0, 10),
       is_neox=st.booleans(), inverse=st.booleans(), dtype=st.sampled_from(DTYPES),
       cache_dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_vllm_offset_property(tokens, heads_q, heads_k, half_rd, before, after, is_neox, inverse,
                              dtype, cache_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rd = 2 * half_rd
    after = 2 * after + before % 2  # head sizes are even
    D = before + rd + after
    c, s = cos_sin(30, rd)
    cache = torch.cat([c, s], -1).to(cache_dtype)
    positions = torch.randint(0, 30, (tokens,), generator=gen)
    q = torch.randn(tokens, heads_q * D, generator=gen).to(dtype)
    k = torch.randn(tokens, heads_k * D, generator=gen).to(dtype) if heads_k else None
    q0 = q.clone()
    rome.ops.rotary_embedding(positions, q, k, D, cache, is_neox, before, inverse)
    cc = cache.double()[positions, :half_rd][:, None]
    ss = cache.double()[positions, half_rd:][:, None] * (-1 if inverse else 1)
    g, b = q.view(tokens, heads_q, D), q0.view(tokens, heads_q, D)
    close(g[..., before:before + rd], rotate_ref(b[..., before:before + rd].double(), cc, ss,
                                                 not is_neox), dtype)
    assert torch.equal(g[..., :before], b[..., :before])
    assert torch.equal(g[..., before + rd:], b[..., before + rd:])
