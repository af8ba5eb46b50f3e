"""Table-free RoPE (rope_from_positions, rome.tables.cos_sin): against an fp64 reference at
positions up to 10^7 for every rotation, dtype and layout, in place and out of place, on every
ISA present; autograd; opcheck and torch.compile; bad input; the 2-rank context-parallel check."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.library import opcheck

import rome
import rome.hf
from conftest import on_meta

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BIG = [0, 1, 4095, 131071, 1000003, 10000019]


def llama_inv_freq(rd, theta=500000.0):
    return 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)


def lane_frequency(rotation, rd, blocks=()):
    """Frequency index of each rotated lane, written out from the documented pairing."""
    if blocks:
        out, base = [], 0
        for b in blocks:
            out += [base + i for i in lane_frequency(rotation, b)]
            base += b // 2
        return out
    if rotation in ("half", "interleave_half"):
        return [j % (rd // 2) for j in range(rd)]
    if rotation == "interleave":
        return [j // 2 for j in range(rd)]
    if rotation == "quarter":
        return [j // (rd // 2) * (rd // 4) + j % (rd // 4) for j in range(rd)]
    raise AssertionError(rotation)


def rotate_b(x, rotation, blocks=()):
    """x·B (after x·A) in float64 over the rotated lanes; returns (xa, xb)."""
    if blocks:
        pieces, o = [], 0
        for b in blocks:
            pieces.append(rotate_b(x[..., o:o + b], rotation))
            o += b
        return torch.cat([p[0] for p in pieces], -1), torch.cat([p[1] for p in pieces], -1)
    if rotation == "half":
        x1, x2 = x.chunk(2, -1)
        return x, torch.cat([-x2, x1], -1)
    if rotation == "interleave":
        xb = torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)
        return x, xb
    if rotation == "quarter":
        h = x.shape[-1] // 2
        return rotate_b(x, "half", (h, h))
    if rotation == "interleave_half":
        xa = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
        return rotate_b(xa, "half")
    raise AssertionError(rotation)


def reference(x, positions_b, inv_freq, rotation, rd, blocks=(), amplitude=1.0, inverse=False):
    """positions_b: positions broadcast to x.shape[:-1] (int64)."""
    lanes = torch.tensor(lane_frequency(rotation, rd, blocks))
    angle = positions_b.double()[..., None] * inv_freq.double()[lanes]
    c, s = amplitude * torch.cos(angle), amplitude * torch.sin(angle) * (-1 if inverse else 1)
    xd = x.double()
    xa, xb = rotate_b(xd[..., :rd], rotation, blocks)
    return torch.cat([xa * c + xb * s, xd[..., rd:]], -1)


def close(out, ref, dtype):
    # One ulp of the output dtype plus the reference's own angle rounding (~1e-9 at 10^7).
    ulp = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    tol = 1.01 * ulp * ref.abs().clamp_min(2.0 ** -6) + 1e-6
    assert ((out.double() - ref).abs() <= tol).all(), (out.double() - ref).abs().max()


ROTATIONS = [("half", (), 64), ("interleave", (), 64), ("quarter", (), 64),
             ("half", (22, 22, 20), 64), ("interleave_half", (), 64), ("half", (), 32)]
LAYOUTS = ["bnsd", "bsnd", "packed"]


def make(layout, dtype, D, S=9, B=2, Hq=4, Hk=2):
    g = torch.Generator().manual_seed(1)
    pos = torch.tensor(BIG + [7, 99, 12345])[:S] if S <= 9 else torch.randint(0, 10**7, (S,))
    if layout == "bnsd":
        q = torch.randn(B, Hq, S, D, generator=g).to(dtype)
        k = torch.randn(B, Hk, S, D, generator=g).to(dtype)
        p, pq, pk = pos, pos.expand(B, Hq, S), pos.expand(B, Hk, S)
    elif layout == "bsnd":
        q = torch.randn(B, S, Hq, D, generator=g).to(dtype)
        k = torch.randn(B, S, Hk, D, generator=g).to(dtype)
        p = torch.stack([pos, pos + 3])[:, :, None]
        pq, pk = p.expand(B, S, Hq), p.expand(B, S, Hk)
    else:
        q = torch.randn(S, Hq, D, generator=g).to(dtype)
        k = torch.randn(S, Hk, D, generator=g).to(dtype)
        p = pos[:, None]
        pq, pk = p.expand(S, Hq), p.expand(S, Hk)
    return q, k, p, pq, pk


@pytest.mark.parametrize("rotation,blocks,rd", ROTATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_fp64_reference(isa, rotation, blocks, rd, layout, dtype):
    D = 80
    q, k, p, pq, pk = make(layout, dtype, D)
    inv = llama_inv_freq(rd)
    args = dict(rotation=rotation, blocks=blocks, rotary_dim=rd, amplitude=1.25)
    yq, yk = rome.ops.rope_from_positions(q, k, p, inv, **args)
    close(yq, reference(q, pq, inv, rotation, rd, blocks, 1.25), dtype)
    close(yk, reference(k, pk, inv, rotation, rd, blocks, 1.25), dtype)
    # In place: the same bits.
    q2, k2 = q.clone(), k.clone()
    rome.ops.rope_from_positions_(q2, k2, p, inv, **args)
    assert torch.equal(q2, yq) and torch.equal(k2, yk)
    # inverse undoes (up to rounding) and matches the reference with −θ.
    zq, _ = rome.ops.rope_from_positions(q, None, p, inv, inverse=True, **args)
    close(zq, reference(q, pq, inv, rotation, rd, blocks, 1.25, inverse=True), dtype)


def test_same_bits_on_every_isa():
    q, k, p, _, _ = make("bsnd", torch.bfloat16, 128)
    inv = llama_inv_freq(128)
    results = []
    for name in rome.ISAS:
        if rome.set_max_isa(name) != name:
            continue
        results.append(rome.ops.rope_from_positions(q, k, p, inv))
    rome.set_max_isa("amx")
    for yq, yk in results[1:]:
        assert torch.equal(yq, results[0][0]) and torch.equal(yk, results[0][1])


def test_strided_views_and_fp32_inv_freq(isa):
    qkv = torch.randn(12, 3 * 4 * 64)
    q = qkv[:, :256].view(12, 4, 64)  # row-strided slices of a fused buffer
    k = qkv[:, 256:512].view(12, 4, 64)
    pos = torch.arange(12, dtype=torch.int32) * 1000003
    inv = llama_inv_freq(64).float()
    want_q = reference(q, pos[:, None].expand(12, 4).long(), inv, "half", 64)
    want_k = reference(k, pos[:, None].expand(12, 4).long(), inv, "half", 64)
    rome.ops.rope_from_positions_(q, k, pos[:, None], inv)
    close(q, want_q, torch.float32)
    close(k, want_k, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mrope_column_axis(isa, layout, dtype):
    """MRoPE sections (t, h, w positions per token, up to 10^7) on q and GQA k, partial rotary,
    in place and out of place, against fp64."""
    sections = [8, 12, 12]
    rd, D = 64, 80
    column_axis = rome.tables.mrope_frequency_axis(sections)
    q, k, p, pq, pk = make(layout, dtype, D)
    # Three position axes per token from the layout's one: the last axis picks t, h or w.
    p3 = torch.stack([p, p // 3 + 5, (p * 7 + 11) % 10**7], -1)
    inv = llama_inv_freq(rd)
    per_lane = torch.tensor([column_axis[f] for f in lane_frequency("half", rd)])

    def want(x, pb):
        pb3 = torch.stack([pb, pb // 3 + 5, (pb * 7 + 11) % 10**7], -1)
        angle = pb3[..., per_lane].double() * inv[lane_frequency("half", rd)]
        xd = x.double()
        xa, xb = rotate_b(xd[..., :rd], "half")
        return torch.cat([xa * torch.cos(angle) + xb * torch.sin(angle), xd[..., rd:]], -1)

    args = dict(rotary_dim=rd, column_axis=column_axis)
    yq, yk = rome.ops.rope_from_positions(q, k, p3, inv, **args)
    close(yq, want(q, pq), dtype)
    close(yk, want(k, pk), dtype)
    q2, k2 = q.clone(), k.clone()
    rome.ops.rope_from_positions_(q2, k2, p3, inv, **args)
    assert torch.equal(q2, yq) and torch.equal(k2, yk)


@pytest.mark.parametrize("layout", ["half", "pairs"])
def test_cos_sin_builder_is_exact_where_fp32_tables_are_not(isa, layout):
    inv = llama_inv_freq(128)
    pos = torch.tensor(BIG)
    c, s = rome.tables.cos_sin(pos, inv, layout=layout)
    assert c.shape == (len(BIG), 128) and c.dtype == torch.float32
    lanes = lane_frequency("half" if layout == "half" else "interleave", 128)
    angle = pos.double()[:, None] * inv[lanes]
    assert (c.double() - torch.cos(angle)).abs().max() <= 3e-7
    assert (s.double() - torch.sin(angle)).abs().max() <= 3e-7
    # transformers' way: fp32 inv_freq @ positions, then cos in fp32.
    fp32 = (pos.float()[:, None] * inv.float()[None])
    assert (torch.cos(fp32).double() - torch.cos(pos.double()[:, None] * inv.float().double())
            ).abs().max() > 1e-2
    c2, s2 = rome.tables.cos_sin(pos.view(2, 3), inv, amplitude=0.5, dtype=torch.bfloat16)
    assert c2.shape == (2, 3, 128) and c2.dtype == torch.bfloat16


@pytest.mark.parametrize("rd", [8, 24, 72, 128])
def test_cos_sin_builder_every_width_and_layout(isa, rd):
    """Half rows with a multiple of 8 frequencies are written in place, others (and pairs)
    through staging rows: both within 3e-7 of fp64 at positions up to 10^7, each layout the
    other's columns, at θ = 500000 and 10000, amplitudes 1 and 1.3."""
    pos = torch.tensor(BIG + [-7777777, 9999999])
    for theta in (500000.0, 10000.0):
        inv = llama_inv_freq(rd, theta)
        n = rd // 2
        angle = pos.double()[:, None] * inv[None]
        for amplitude in (1.0, 1.3):
            ch, sh = rome.tables.cos_sin(pos, inv, "half", amplitude)
            cp, sp = rome.tables.cos_sin(pos, inv, "pairs", amplitude)
            for got, ref in ((ch, torch.cos(angle)), (sh, torch.sin(angle))):
                assert (got[:, :n].double() - amplitude * ref).abs().max() <= 3e-7 * amplitude
                assert torch.equal(got[:, :n], got[:, n:])
            assert torch.equal(cp[:, 0::2], ch[:, :n]) and torch.equal(cp[:, 1::2], ch[:, :n])
            assert torch.equal(sp[:, 0::2], sh[:, :n]) and torch.equal(sp[:, 1::2], sh[:, :n])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_cos_sin_in_other_dtypes_is_the_fp32_result_rounded(isa, dtype):
    """16-bit tables are written directly (not through fp32 tensors): the same bits as
    Tensor.to of the fp32 ones, over enough positions to meet every rounding case."""
    inv = llama_inv_freq(128)
    pos = torch.randint(-10**7, 10**7, (600,), generator=torch.Generator().manual_seed(3))
    for layout in ("half", "pairs"):
        c32, s32 = rome.tables.cos_sin(pos, inv, layout=layout, amplitude=0.75)
        c, s = rome.tables.cos_sin(pos, inv, layout=layout, amplitude=0.75, dtype=dtype)
        assert c.dtype == dtype and s.dtype == dtype
        assert torch.equal(c, c32.to(dtype)) and torch.equal(s, s32.to(dtype))


def test_autograd_is_the_transposed_rotation(isa):
    # q and k (GQA: fewer heads) together, also with blocks (quarter: two halves; a 3-axis split)
    # and a partial rotation.
    cases = [("half", [], -1), ("interleave", [], -1), ("interleave_half", [], -1),
             ("quarter", [], -1), ("half", [12, 12, 8], -1), ("half", [], 16)]
    for rotation, blocks, rotary_dim in cases:
        x = torch.randn(2, 4, 5, 32, requires_grad=True)
        k = torch.randn(2, 2, 5, 32, requires_grad=True)
        gx, gk = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
        pos = torch.arange(5) * 999983
        rd = 32 if rotary_dim < 0 else rotary_dim
        inv = llama_inv_freq(rd) if not blocks else torch.cat([llama_inv_freq(b) for b in blocks])
        y, yk = rome.ops.rope_from_positions(x, k, pos, inv, rotation=rotation, blocks=blocks,
                                             rotary_dim=rotary_dim, amplitude=0.75)
        torch.autograd.backward((y, yk), (gx, gk))
        # dx = g·Rᵀ: <y(x), g> is linear in x, so autograd of the fp64 reference gives it.
        for t, g in ((x, gx), (k, gk)):
            td = t.detach().double().requires_grad_()
            ref = reference(td, pos.expand(*t.shape[:3]), inv, rotation, rd, amplitude=0.75,
                            blocks=blocks)
            ref.backward(g.double())
            assert torch.allclose(t.grad.double(), td.grad, atol=1e-6), (rotation, blocks, rd)


def test_opcheck_and_compile(isa):
    q, k, p, _, _ = make("bsnd", torch.float32, 64)
    inv = llama_inv_freq(64)
    opcheck(torch.ops.rome.rope_from_positions.default,
            (q, k, p, inv, "half", [], -1, 1.5, [], False))
    opcheck(torch.ops.rome.rope_from_positions_.default,
            (q.clone(), k.clone(), p, llama_inv_freq(32), "interleave", [], 32, 1.0, [], True))

    def step(q, k, p):
        return rome.ops.rope_from_positions(q, k, p, inv)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    a, b = compiled(q, k, p)
    c, d = step(q, k, p)
    assert torch.equal(a, c) and torch.equal(b, d)


def test_bad_input_raises_and_writes_nothing(isa):
    q = torch.randn(2, 4, 6, 64)
    q0 = q.clone()
    inv = llama_inv_freq(64)
    pos = torch.arange(6)
    cases = [
        (dict(inv_freq=inv[:10]), "inv_freq"),
        (dict(inv_freq=torch.where(torch.arange(32) == 3, math.nan, inv)), "inv_freq"),
        (dict(inv_freq=torch.where(torch.arange(32) == 3, math.inf, inv)), "inv_freq"),
        (dict(inv_freq=inv.view(4, 8)), "inv_freq"),
        (dict(positions=pos.float()), "positions.dtype"),
        (dict(positions=torch.arange(7)), "positions"),
        (dict(positions=torch.full((6,), 2**51)), "positions"),  # IndexError, as off a cache
        (dict(amplitude=math.inf), "amplitude"),
        (dict(rotation="dense"), "mat_b"),
        (dict(column_axis=[7] * 32), "column_axis"),  # positions [6] read as 6 axes: 7 is past them
        (dict(column_axis=[0] * 31), "column_axis"),
    ]
    # Values (NaN / inf frequencies, a position past the exact range) need memory: the Meta
    # kernel checks shapes, dtypes and strides only.
    values = {1, 2, 6}
    for i, (change, name) in enumerate(cases):
        args = dict(positions=pos, inv_freq=inv)
        args.update(change)
        p, f = args.pop("positions"), args.pop("inv_freq")
        with pytest.raises((ValueError, IndexError), match=f"rome: {name}") as cpu:
            rome.ops.rope_from_positions_(q, None, p, f, **args)
        assert torch.equal(q, q0), change
        if i not in values:  # the same error from the Meta kernel (the same checking code)
            with pytest.raises(cpu.type) as meta:
                rome.ops.rope_from_positions_(on_meta(q), None, on_meta(p), on_meta(f), **args)
            assert str(meta.value) == str(cpu.value), change


def _rank_main(rank, world, port, result_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        # A shard of 2.5 MiB moved: well past the 256 KiB from which RoME takes a second thread,
        # so the thread check below can fail (the control run shows it would).
        S, shard = 1024, 512
        q = torch.randn(1, 8, S, 128).to(torch.bfloat16)
        k = torch.randn(1, 2, S, 128).to(torch.bfloat16)
        positions = torch.arange(S) + 10**7  # one long sequence, split along S
        inv = llama_inv_freq(128)
        lo = rank * shard
        q_shard = q[:, :, lo:lo + shard].contiguous()
        k_shard = k[:, :, lo:lo + shard].contiguous()
        torch.set_num_threads(2)  # control: the same call given two threads takes both
        rome.ops.rope_from_positions(q_shard, k_shard, positions[lo:lo + shard], inv)
        control = rome.last_call_threads()
        torch.set_num_threads(1)
        rome.ops.rope_from_positions_(q_shard, k_shard, positions[lo:lo + shard], inv)
        threads = rome.last_call_threads()
        gathered_q = [torch.empty_like(q_shard) for _ in range(world)]
        gathered_k = [torch.empty_like(k_shard) for _ in range(world)]
        dist.all_gather(gathered_q, q_shard)
        dist.all_gather(gathered_k, k_shard)
        t = torch.tensor([threads, control])
        all_threads = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(all_threads, t)
        if rank == 0:
            whole_q, whole_k = rome.ops.rope_from_positions(q, k, positions, inv)
            torch.save(dict(same_q=torch.equal(torch.cat(gathered_q, 2), whole_q),
                            same_k=torch.equal(torch.cat(gathered_k, 2), whole_k),
                            threads=[int(x[0]) for x in all_threads],
                            control=[int(x[1]) for x in all_threads]), result_path)
    finally:
        dist.destroy_process_group()


def test_two_ranks_context_parallel_match_one_process(tmp_path):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = tmp_path / "result.pt"
    mp.start_processes(_rank_main, args=(2, port, str(result)), nprocs=2, join=True,
                       start_method="spawn")
    out = torch.load(result)
    assert out["same_q"] and out["same_k"]
    assert out["control"] == [2, 2]
    assert out["threads"] == [1, 1]


@pytest.mark.parametrize("neox", [True, False])
def test_vllm_table_free_mode(isa, neox):
    import rome.vllm

    layer = rome.vllm.RotaryEmbedding(128, 64, 4096, 500000.0, neox, torch.bfloat16,
                                      table_free=True)
    assert layer.cos_sin_cache is None
    qkv = torch.randn(7, 3 * 4 * 128).bfloat16()
    q, k = qkv[:, :512], qkv[:, 512:1024]  # row-strided slices of a fused qkv buffer
    pos = torch.tensor([0, 5, 4095, 10**6, 3 * 10**6, 10**7, 17])  # past max_position too
    yq, yk = layer.forward_native(pos, q, k)
    rotation = "half" if neox else "interleave"
    inv = layer.inv_freq.double()
    want_q = reference(q.view(7, 4, 128), pos[:, None].expand(7, 4), inv, rotation, 64)
    close(yq.view(7, 4, 128), want_q, torch.bfloat16)
    want_k = reference(k.view(7, 4, 128), pos[:, None].expand(7, 4), inv, rotation, 64)
    close(yk.view(7, 4, 128), want_k, torch.bfloat16)
    # In place, the same bits; inverse undoes it to within rounding.
    q2, k2 = q.clone(), k.clone()
    layer.forward(pos, q2, k2)
    assert torch.equal(q2, yq) and torch.equal(k2, yk)
    layer.forward(pos, q2, k2, inverse=True)
    back = reference(yq.view(7, 4, 128), pos[:, None].expand(7, 4), inv, rotation, 64, inverse=True)
    close(q2.view(7, 4, 128), back, torch.bfloat16)
    back_k = reference(yk.view(7, 4, 128), pos[:, None].expand(7, 4), inv, rotation, 64, inverse=True)
    close(k2.view(7, 4, 128), back_k, torch.bfloat16)
    assert (q2.float() - q.float()).abs().max() <= 0.05 * q.float().abs().max()
    # MLA: [T, H, D] with D > head_size rotates the last rotary_dim lanes only.
    mla = rome.vllm.RotaryEmbedding(64, 64, 4096, 10000.0, neox, torch.float32, table_free=True)
    x = torch.randn(5, 4, 192)
    x0 = x.clone()
    mla.forward(torch.arange(5) * 100000, x, None)
    assert torch.equal(x[..., :128], x0[..., :128])
    assert not torch.equal(x[..., 128:], x0[..., 128:])


class _YarnLike(torch.nn.Module):
    """A vLLM rotary module whose cache holds other frequencies than _compute_inv_freq(base)
    gives, scaled by mscale (as vLLM's YaRN builds it: its _compute_inv_freq takes the scaling
    factor)."""

    def __init__(self, mscale, scale_frequencies):
        super().__init__()
        self.head_size, self.rotary_dim, self.base, self.is_neox_style = 128, 64, 10000.0, True
        inv = self._compute_inv_freq(self.base)
        if scale_frequencies:
            inv = torch.where(torch.arange(32) >= 16, inv / 8, inv)
        ang = torch.arange(4096, dtype=torch.float)[:, None] * inv
        self.cos_sin_cache = torch.cat([ang.cos() * mscale, ang.sin() * mscale], -1)

    def _compute_inv_freq(self, base):
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float)
                               / self.rotary_dim))


@pytest.mark.parametrize("neox", [True, False])
def test_vllm_from_module_table_free(isa, neox):
    """from_module(table_free=True) keeps no cache, rotates by the module's own frequencies and
    amplitude exactly (any position), and refuses a module whose cache says otherwise."""
    import rome.vllm

    layer = rome.vllm.RotaryEmbedding(128, 64, 4096, 500000.0, neox, torch.bfloat16)
    free = rome.vllm.RotaryEmbedding.from_module(layer, table_free=True)
    assert free.cos_sin_cache is None and free.table_free and free.amplitude == 1.0
    assert torch.equal(free.inv_freq, layer._compute_inv_freq(500000.0))
    qkv = torch.randn(6, 3 * 4 * 128).bfloat16()
    q, k = qkv[:, :512], qkv[:, 512:1024]
    pos = torch.tensor([0, 5, 4095, 10**6, 10**7, 17])  # past the module's cache too
    yq, yk = free.forward_native(pos, q, k)
    rotation = "half" if neox else "interleave"
    inv = free.inv_freq.double()
    close(yq.view(6, 4, 128), reference(q.view(6, 4, 128), pos[:, None].expand(6, 4), inv,
                                        rotation, 64), torch.bfloat16)
    close(yk.view(6, 4, 128), reference(k.view(6, 4, 128), pos[:, None].expand(6, 4), inv,
                                        rotation, 64), torch.bfloat16)
    # Inside the cache, the module's own (cached, fp32-angle) rotation within bf16 rounding.
    small = pos[pos < 4096]
    mine, _ = free.forward_native(small, q[: len(small)])
    theirs, _ = layer.forward_native(small, q[: len(small)])
    assert (mine.float() - theirs.float()).abs().max() <= 0.03 * theirs.float().abs().max()
    # A YaRN-style mscale on the same frequencies: the amplitude.
    scaled = _YarnLike(1.25, False)
    free = rome.vllm.RotaryEmbedding.from_module(scaled, table_free=True)
    assert free.amplitude == 1.25
    x = torch.randn(3, 2, 128)
    y, _ = free.forward_native(torch.tensor([1, 300, 2 * 10**6]), x.clone())
    close(y, reference(x, torch.tensor([1, 300, 2 * 10**6])[:, None].expand(3, 2),
                       free.inv_freq.double(), "half", 64, amplitude=1.25), torch.float32)
    # Other frequencies in the cache, or no frequencies to take: ValueError, nothing built.
    with pytest.raises(ValueError, match="other frequencies"):
        rome.vllm.RotaryEmbedding.from_module(_YarnLike(1.0, True), table_free=True)
    bare = _YarnLike(1.0, False)
    bare._compute_inv_freq = None
    with pytest.raises(ValueError, match="_compute_inv_freq"):
        rome.vllm.RotaryEmbedding.from_module(bare, table_free=True)
    # The default still shares the cache.
    assert rome.vllm.RotaryEmbedding.from_module(scaled).cos_sin_cache is scaled.cos_sin_cache


def test_cos_sin_op_opcheck_and_errors(isa):
    inv = llama_inv_freq(64)
    opcheck(torch.ops.rome.cos_sin.default, (torch.randint(0, 10**6, (3, 5)), inv, "pairs", 0.5, torch.bfloat16))
    with pytest.raises(ValueError, match="rome: inv_freq"):
        rome.tables.cos_sin(torch.arange(3), torch.tensor([1.0, math.nan]))
    with pytest.raises(ValueError, match="rome: positions.dtype"):
        rome.tables.cos_sin(torch.arange(3.0), inv)
    with pytest.raises(ValueError, match="rome: layout"):
        rome.tables.cos_sin(torch.arange(3), inv, layout="diagonal")


def _assert_exact_tables(patched, unpatched, angle, scale, unpatched_off,
                         unpatched_close_first=0):
    """A patched rotary module's (cos, sin) [1, S, D] against amplitude·cos/sin(angle) [S, D]
    in fp64, with the unpatched module's shapes and dtypes; unpatched_off: transformers' fp32
    angle is off at the large positions; unpatched_close_first: its first rows agree."""
    for got, old, ref in ((patched[0], unpatched[0], scale * torch.cos(angle)),
                          (patched[1], unpatched[1], scale * torch.sin(angle))):
        assert got.shape == old.shape and got.dtype == old.dtype
        assert (got[0].double() - ref).abs().max() <= 3e-7 * max(scale, 1.0)
        if unpatched_off:
            assert (old[0].double() - ref).abs().max() > 1e-3
        if unpatched_close_first:
            rows = unpatched_close_first
            assert (old[0, :rows].double() - ref[:rows]).abs().max() <= 1e-5


def _rotary_module(rope_parameters):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                      max_position_embeddings=4096,
                                      rope_parameters=rope_parameters)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    # Phi-3's: the long factors (positions past the original 512) replace inv_freq before the
    # forward, and attention_scaling grows with the context ratio.
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 32,
     "long_factor": [1.0 + 0.25 * i for i in range(32)], "original_max_position_embeddings": 512},
])
def test_hf_rotary_module_patched_is_exact(rope_parameters):
    model = _rotary_module(rope_parameters)
    rotary = model.model.rotary_emb
    x = torch.randn(1, 1, 128)
    pid = torch.tensor([[0, 7, 4095, 10**6, 10**7]])
    cos0, sin0 = rotary(x, pid)
    handle = rome.hf.patch_model(model)
    try:
        assert handle.rotary_patched == ["model.rotary_emb"], handle.skipped
        cos1, sin1 = rotary(x, pid)
        # Grad mode is on here: like the original (a no_grad forward) nothing requires grad.
        assert not cos1.requires_grad and not sin1.requires_grad
        # After the call: dynamic types have updated inv_freq for the sequence, as unpatched.
        inv = rotary.inv_freq.double()
        scale = float(rotary.attention_scaling)
        if rope_parameters["rope_type"] == "longrope":  # the long factors are in use
            assert not torch.equal(rotary.inv_freq, rotary.original_inv_freq) and scale > 1.0
        angle = pid[0].double()[:, None] * torch.cat([inv, inv])[None]
        # dynamic rescales past 4096, so its unpatched tables are not the reference's
        _assert_exact_tables((cos1, sin1), (cos0, sin0), angle, scale,
                             unpatched_off=rope_parameters["rope_type"] != "dynamic")
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 6)))  # the model still runs end to end
    finally:
        handle.undo()
    assert "forward" not in rotary.__dict__
    cos2, _ = rotary(x, pid)
    assert torch.equal(cos2, cos0)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 32,
     "long_factor": [1.0 + 0.25 * i for i in range(32)], "original_max_position_embeddings": 512},
])
def test_hf_rotary_module_patched_before_its_first_call_updates_as_unpatched(rope_parameters):
    """Dynamic rope types change inv_freq (and attention_scaling) with the sequence length: a
    module patched before it ever ran follows the same updates as an unpatched twin, call by call
    (a long sequence, then a short one that goes back to the original frequencies), and its tables
    are exact for the frequencies in use."""
    torch.manual_seed(0)
    patched_model = _rotary_module(rope_parameters)
    torch.manual_seed(0)
    twin = _rotary_module(rope_parameters).model.rotary_emb
    rotary = patched_model.model.rotary_emb
    x = torch.randn(1, 1, 128)
    handle = rome.hf.patch_model(patched_model)
    try:
        assert handle.rotary_patched == ["model.rotary_emb"], handle.skipped
        for pid in (torch.arange(9000)[None], torch.tensor([[0, 3, 200, 511]])):
            before = rotary.inv_freq.clone()
            cos, sin = rotary(x, pid)
            twin(x, pid)
            assert torch.equal(rotary.inv_freq, twin.inv_freq)
            assert float(rotary.attention_scaling) == float(twin.attention_scaling)
            if pid.shape[1] > 512:  # the long sequence changed the frequencies
                assert not torch.equal(rotary.inv_freq, before)
            inv = rotary.inv_freq.double()
            angle = pid[0].double()[:, None] * torch.cat([inv, inv])[None]
            scale = float(rotary.attention_scaling)
            assert (cos[0].double() - angle.cos() * scale).abs().max() <= 3e-7 * max(scale, 1.0)
            assert (sin[0].double() - angle.sin() * scale).abs().max() <= 3e-7 * max(scale, 1.0)
    finally:
        handle.undo()


def test_hf_rotary_module_patched_frequencies_that_require_grad():
    """Trainable frequencies: the op has no gradient for them, so the patched module runs the
    original forward, and whatever this transformers version gives (a gradient, or a no_grad
    forward's tables without one) is what the user gets."""
    model = _rotary_module({"rope_type": "default", "rope_theta": 10000.0})
    rotary = model.model.rotary_emb
    rotary.inv_freq.requires_grad_(True)
    x, pid = torch.randn(1, 1, 128), torch.tensor([[3, 9]])
    cos0, sin0 = rotary(x, pid)
    handle = rome.hf.patch_model(model)
    try:
        assert handle.rotary_patched == ["model.rotary_emb"], handle.skipped
        cos1, sin1 = rotary(x, pid)
        with torch.no_grad():  # no gradient asked for: RoME's exact tables
            cos2, _ = rotary(x, pid)
    finally:
        handle.undo()
    assert (cos1.requires_grad, sin1.requires_grad) == (cos0.requires_grad, sin0.requires_grad)
    assert torch.equal(cos1, cos0) and torch.equal(sin1, sin0)
    if cos0.requires_grad:
        (cos1.sum() + sin1.sum()).backward()
        assert rotary.inv_freq.grad is not None and rotary.inv_freq.grad.abs().sum() > 0
    assert not cos2.requires_grad
    torch.testing.assert_close(cos2, cos0.detach(), rtol=0, atol=1e-6)


def _mrope_axis_reference(kind, mrope_section, half):
    """The position axis of each frequency, written out independently of transformers."""
    if kind == "qwen2_vl":  # sections in order: t, then h, then w
        return [a for a, n in enumerate(mrope_section) for _ in range(n)]
    axes = [0] * half  # qwen3_vl: interleaved t h w t h w ..., t past the h/w sections
    for a in (1, 2):
        for i in range(a, 3 * mrope_section[a], 3):
            axes[i] = a
    return axes


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_hf_mrope_rotary_module_patched_is_exact(kind):
    transformers = pytest.importorskip("transformers")
    if kind == "qwen2_vl":
        from transformers.models.qwen2_vl import modeling_qwen2_vl as modeling
        config = transformers.Qwen2VLTextConfig(hidden_size=256, num_attention_heads=2,
                                                num_key_value_heads=1, num_hidden_layers=1)
        rotary = modeling.Qwen2VLRotaryEmbedding(config)
    else:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as modeling
        config = transformers.Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2,
                                                num_key_value_heads=1, num_hidden_layers=1,
                                                head_dim=128)
        rotary = modeling.Qwen3VLTextRotaryEmbedding(config)
    model = torch.nn.ModuleDict({"rotary_emb": rotary})
    x = torch.randn(1, 1, 256)
    # Different t, h and w positions per token, up to 10^7.
    pid = torch.tensor([[[0, 7, 4095, 10**6, 10**7]], [[1, 3, 100, 2000, 9_999_999]],
                        [[2, 5, 17, 123_456, 5_000_001]]])
    cos0, sin0 = rotary(x, pid)
    handle = rome.hf.patch_model(model)
    try:
        assert handle.rotary_patched == ["rotary_emb"], handle.skipped
        cos1, sin1 = rotary(x, pid)
        inv = rotary.inv_freq.double()
        axes = _mrope_axis_reference(kind, list(rotary.mrope_section), inv.numel()) * 2
        angle = torch.stack([pid[a, 0].double() * f for a, f in zip(axes, torch.cat([inv, inv]))],
                            dim=-1)
        scale = float(rotary.attention_scaling)
        # At positions below 8 the unpatched tables agree too (so the reference picks the axes
        # as transformers does).
        _assert_exact_tables((cos1, sin1), (cos0, sin0), angle, scale, unpatched_off=True,
                             unpatched_close_first=2)
    finally:
        handle.undo()
    assert "forward" not in rotary.__dict__ and "_rome_mrope_axes" not in rotary.__dict__
    cos2, _ = rotary(x, pid)
    assert torch.equal(cos2, cos0)

    # Trainable frequencies with grad on: the module's own forward (the op has no gradient for
    # them), exactly the unpatched result, gradient included where transformers gives one.
    rotary.inv_freq.requires_grad_(True)
    cos3, sin3 = rotary(x, pid)
    with rome.hf.patch_model(model, warn=False):
        cos4, sin4 = rotary(x, pid)
    assert torch.equal(cos4, cos3) and torch.equal(sin4, sin3)
    assert cos4.requires_grad == cos3.requires_grad


# --------------------------------------------------------------------------------------------
# Property test: random rotations, layouts (BSND, BNSD, packed tokens), GQA k, MRoPE position
# axes, dtypes, positions (negative, huge) and strided views against the fp64 reference; random
# corruptions must raise and write nothing.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_property_table_free_matches_reference(data):
    rotation, blocks, rd = data.draw(st.sampled_from(ROTATIONS))
    pad = data.draw(st.sampled_from([0, 8]))
    D = max(rd, 64) + pad
    dtype = data.draw(st.sampled_from(DTYPES))
    tokens = data.draw(st.integers(1, 7))
    heads = data.draw(st.integers(1, 5))
    batch = data.draw(st.integers(1, 3))
    limit = data.draw(st.sampled_from([10, 10**5, 10**7, 2**40]))
    positions = torch.tensor(data.draw(st.lists(st.integers(-limit, limit), min_size=batch * tokens,
                                                max_size=batch * tokens))).view(batch, tokens, 1)
    theta = data.draw(st.sampled_from([10000.0, 500000.0]))
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    if limit == 2**40:
        inv = inv * 1e-3  # keep |position × frequency| below 2^50
    amplitude = data.draw(st.sampled_from([1.0, 0.5, 1.3]))
    strided = data.draw(st.booleans())
    # BSND ([B, S, H, D], positions [B, S, 1]), BNSD ([B, H, S, D], positions [B, 1, S]) or
    # packed tokens ([B·S, H, D], positions [B·S, 1]); k with its own head count (GQA) rotates
    # in the same call, or is absent.
    layout = data.draw(st.sampled_from(["bsnd", "bnsd", "packed"]))
    k_heads = data.draw(st.sampled_from([0, 1, heads]))
    # MRoPE: one more trailing positions axis (t, h, w, ...), each frequency reading one of them.
    axes = data.draw(st.sampled_from([0, 0, 2, 3]))
    column_axis = [data.draw(st.integers(0, axes - 1)) for _ in range(rd // 2)] if axes else []
    if axes:
        positions = torch.stack([positions + 5 * a for a in range(axes)], -1)

    def operand(h):
        shape = {"bsnd": (batch, tokens, h), "bnsd": (batch, h, tokens),
                 "packed": (batch * tokens, h)}[layout]
        base = torch.randn(*shape, D + (16 if strided else 0)).to(dtype)
        return base[..., :D] if strided else base

    x = operand(heads)
    k = operand(k_heads) if k_heads else None
    tail = positions.shape[3:]  # the MRoPE axis
    if layout == "bnsd":
        positions = positions.view(batch, 1, tokens, *tail)
    elif layout == "packed":
        positions = positions.view(batch * tokens, 1, *tail)

    def expected(t):
        if not axes:
            return reference(t, positions.expand(*t.shape[:-1]), inv, rotation, rd, blocks,
                             amplitude)
        # Each lane's angle from its frequency's axis (the documented pairing, per block).
        lanes = torch.tensor(lane_frequency(rotation, rd, blocks))
        per_lane = torch.tensor(column_axis)[lanes]
        pb = positions.expand(*t.shape[:-1], axes)[..., per_lane].double()
        angle = pb * inv.double()[lanes]
        c, s = amplitude * torch.cos(angle), amplitude * torch.sin(angle)
        xd = t.double()
        xa, xb = rotate_b(xd[..., :rd], rotation, blocks)
        return torch.cat([xa * c + xb * s, xd[..., rd:]], -1)

    extra = dict(column_axis=column_axis) if axes else {}
    if limit == 2**40:  # the fp64 reference angle is off by up to 2^-14 there: compare loosely
        y, _ = rome.ops.rope_from_positions(x, None, positions, inv, rotation, blocks, rd,
                                            amplitude, **extra)
        assert (y.double() - expected(x)).abs().max() < 5e-2
        return
    in_place = data.draw(st.booleans())
    if in_place:
        y = x.clone() if not strided else x
        yk = None if k is None else (k.clone() if not strided else k)
        want, want_k = expected(y), None if k is None else expected(yk)
        rome.ops.rope_from_positions_(y, yk, positions, inv, rotation, blocks, rd, amplitude,
                                      **extra)
    else:
        want, want_k = expected(x), None if k is None else expected(k)
        y, yk = rome.ops.rope_from_positions(x, k, positions, inv, rotation, blocks, rd,
                                             amplitude, **extra)
    close(y, want, dtype)
    if k is not None:
        close(yk, want_k, dtype)
    # A corruption of one argument: an error, and the in-place tensors keep their bits.
    bad = data.draw(st.sampled_from(["count", "nan", "float_positions", "shape"]))
    z, zk = x.clone(), None if k is None else k.clone()
    z0, zk0 = z.clone(), None if k is None else k.clone()
    args = dict(positions=positions, inv_freq=inv)
    if bad == "count":
        args["inv_freq"] = inv[:-1]
    elif bad == "nan":
        args["inv_freq"] = torch.where(torch.arange(len(inv)) == 0, math.nan, inv)
    elif bad == "float_positions":
        args["positions"] = positions.double()
    else:  # one token too many
        grown = list(positions.shape)
        grown[{"bsnd": 1, "bnsd": 2, "packed": 0}[layout]] += 1
        args["positions"] = torch.zeros(grown, dtype=torch.long)
    with pytest.raises((ValueError, IndexError)):
        rome.ops.rope_from_positions_(z, zk, args["positions"], args["inv_freq"], rotation,
                                      blocks, rd, amplitude, **extra)
    assert torch.equal(z, z0)
    if k is not None:
        assert torch.equal(zk, zk0)
