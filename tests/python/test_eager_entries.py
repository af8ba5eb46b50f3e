"""The eager entries of rome::rope, rope_, rope_from_positions(_), rotary_embedding and the fused
passes (bindings/torch/eager.cpp), which rome.ops' wrappers and the drop-ins call outside
torch.compile.

They run the CPU kernel's call straight from C++ when nothing but it would have run through the
dispatcher, and hand every other call to the op. Checked here: the same bits as the op on every
ISA for the calls they take (the op's own numbers are checked against fp64 elsewhere), that they
take them (the entries' per-thread counters), and that every call the op must see goes to it —
autograd, subclasses and their __torch_function__, torch function and dispatch modes, the
profiler, functorch, conjugate views, keyword arguments, arguments of other types — with the op's
results and errors; in place, version counters as the op bumps them and bad input leaving q and
k untouched.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import rome
from rome import _C, ops

ROPE = ops._EAGER_ROPE
ROPE_ = ops._EAGER_ROPE_
OP = torch.ops.rome.rope.default
OP_ = torch.ops.rome.rope_.default


def _counts():
    return _C._eager_counts()


def _took(fn):
    """(calls run directly, calls handed to the op) while fn ran, and fn's result."""
    d0, f0 = _counts()
    out = fn()
    d1, f1 = _counts()
    return (d1 - d0, f1 - f0), out


def _case(dtype=torch.bfloat16, rotation="half", width="full", S=5, H=3, D=64, k_heads=2,
          positions=False):
    q = torch.randn(2, H, S, D).to(dtype)
    k = torch.randn(2, k_heads, S, D).to(dtype) if k_heads else None
    w = {"full": D, "halves": D // 2, "pairs": D // 2}[width]
    rows = 11 if positions else S
    cos, sin = torch.randn(rows, w), torch.randn(rows, w)
    pos = torch.randint(0, rows, (2, 1, S)) if positions else None
    return q, k, cos, sin, pos, rotation, (), -1, width, (), None, None


CASES = {
    "half bf16 q+k": {},
    "interleave pairs fp16": dict(dtype=torch.float16, rotation="interleave", width="pairs"),
    "half halves fp32 q only": dict(dtype=torch.float32, width="halves", k_heads=0),
    "positions": dict(positions=True),
    "one token": dict(S=1, H=32, D=128, k_heads=8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_direct_calls_match_the_op_bit_for_bit(isa, name):
    args = _case(**CASES[name])
    (direct, handed), (q_out, k_out) = _took(lambda: ROPE(*args))
    assert (direct, handed) == (1, 0)
    want_q, want_k = OP(*args)
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
    assert q_out.data_ptr() != args[0].data_ptr()

    q, k = args[0].clone(), None if args[1] is None else args[1].clone()
    before = q._version
    (direct, handed), result = _took(lambda: ROPE_(q, k, *args[2:]))
    assert (direct, handed) == (1, 0) and result is None
    assert torch.equal(q, want_q) and (k is None or torch.equal(k, want_k))
    assert q._version == before + 1  # as the op's ADInplaceOrView kernel bumps it


def test_direct_calls_under_no_grad_and_inference_mode():
    q, k, *rest = _case()
    q.requires_grad_(True)
    with torch.no_grad():
        (direct, handed), (q_out, _) = _took(lambda: ROPE(q, k, *rest))
    assert (direct, handed) == (1, 0) and q_out.grad_fn is None and not q_out.requires_grad
    with torch.inference_mode():
        qi, ki = q.detach().clone(), k.clone()
        (direct, handed), _ = _took(lambda: ROPE_(qi, ki, *rest))
        assert (direct, handed) == (1, 0)
        assert torch.equal(qi, OP(q.detach(), k, *rest)[0])


def test_gradients_go_to_the_op():
    q, k, cos, sin, *rest = _case(dtype=torch.float32)
    q.requires_grad_(True)
    cos.requires_grad_(True)
    (direct, handed), (q_out, k_out) = _took(lambda: ROPE(q, k, cos, sin, *rest))
    assert (direct, handed) == (0, 1) and q_out.grad_fn is not None
    q_out.sum().backward()
    want_q = q.detach().requires_grad_(True)
    want_cos = cos.detach().requires_grad_(True)
    OP(want_q, k, want_cos, sin, *rest)[0].sum().backward()
    assert torch.equal(q.grad, want_q.grad) and torch.equal(cos.grad, want_cos.grad)
    # In place with a gradient to record: the op's error.
    with pytest.raises(NotImplementedError, match="inference only"):
        ROPE_(q, k, cos, sin, *rest)


class _Tagged(torch.Tensor):
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class _FunctionLog(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _DispatchLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_subclasses_and_modes_see_the_op():
    args = _case()
    want = OP(*args)[0]
    tagged = args[0].as_subclass(_Tagged)
    _Tagged.seen.clear()
    (direct, handed), out = _took(lambda: ROPE(tagged, *args[1:]))
    assert (direct, handed) == (0, 1) and OP in _Tagged.seen
    assert torch.equal(out[0].as_subclass(torch.Tensor), want)

    with _FunctionLog() as log:
        (direct, handed), out = _took(lambda: ROPE(*args))
    assert (direct, handed) == (0, 1) and OP in log.seen and torch.equal(out[0], want)

    with _DispatchLog() as log:
        (direct, handed), out = _took(lambda: ROPE(*args))
    assert (direct, handed) == (0, 1) and OP in log.seen and torch.equal(out[0], want)

    q = args[0].clone()
    with _DispatchLog() as log:
        (direct, handed), _ = _took(lambda: ROPE_(q, None, *args[2:]))
    assert (direct, handed) == (0, 1) and OP_ in log.seen


def test_the_profiler_records_the_op():
    args = _case()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (direct, handed), _ = _took(lambda: ROPE(*args))
    assert (direct, handed) == (0, 1)
    assert any(e.name == "rome::rope" for e in prof.events())


def test_conjugate_views_and_functorch_go_to_the_op():
    # A complex table cannot reach the op's real kernel; a conjugated real view of one can be
    # made with view_as_real(conj) only after resolve_conj, so test the key itself: a negative-bit
    # view (what conj of a real-viewed tensor leaves) is not a plain CPU tensor.
    q, k, cos, sin, *rest = _case(dtype=torch.float32)
    neg = torch._neg_view(sin)
    assert neg.is_neg()
    (direct, handed), out = _took(lambda: ROPE(q, k, cos, neg, *rest))
    assert (direct, handed) == (0, 1)
    assert torch.equal(out[0], OP(q, k, cos, -sin, *rest)[0])

    def one(x):
        return ROPE(x, None, cos, sin, *rest)[0]

    batched = torch.randn(2, *q.shape)
    d0, f0 = _counts()
    try:
        got = torch.vmap(one)(batched)
    except Exception as e:  # the op has no batching rule: its error, never the direct call's
        assert "rome" in str(e) or "vmap" in str(e) or "batch" in str(e).lower(), e
    else:
        assert torch.equal(got, torch.stack([OP(b, None, cos, sin, *rest)[0] for b in batched]))
    d1, f1 = _counts()
    assert d1 == d0 and f1 > f0


def test_tracers_record_the_op():
    """torch.jit.trace (its dispatch key) and torch.fx (proxies) see rome::rope through the
    public rome.ops.rope, which takes the eager entry outside torch.compile."""
    q, _, cos, sin, *_ = _case(dtype=torch.float32, k_heads=0)

    def f(q, cos, sin):
        return ops.rope(q, None, cos, sin)[0]

    d0, _ = _counts()
    traced = torch.jit.trace(f, (q, cos, sin), check_trace=False)
    assert _counts()[0] == d0
    assert "rome::rope" in [n.kind() for n in traced.graph.nodes()]
    assert torch.equal(traced(q, cos, sin), OP(q, None, cos, sin)[0])
    assert "torch.ops.rome.rope.default" in torch.fx.symbolic_trace(f).code
    (direct, handed), out = _took(lambda: f(q, cos, sin))
    assert (direct, handed) == (1, 0) and torch.equal(out, OP(q, None, cos, sin)[0])


def test_other_argument_forms_go_to_the_op():
    q, k, cos, sin, pos, rotation, blocks, rd, width, axis, a, b = _case()
    want = OP(q, k, cos, sin)[0]
    # Keyword arguments, lists, fewer arguments: the op parses them.
    for call in (
            lambda: ROPE(q, k, cos, sin, pos, rotation, blocks, rd, width, axis, a, mat_b=b),
            lambda: ROPE(q, k, cos, sin),
    ):
        (direct, handed), out = _took(call)
        assert (direct, handed) == (0, 1) and torch.equal(out[0], want)
    (direct, handed), out = _took(
        lambda: ROPE(q, k, cos, sin, pos, rotation, [], rd, width, [], a, b))
    assert (direct, handed) == (1, 0) and torch.equal(out[0], want)
    # Arguments of the wrong type: the op's TypeError-like error, whatever torch raises for it.
    for bad in ((q, k, cos, sin, pos, 1, blocks, rd, width, axis, a, b),
                (q, k, cos, sin, pos, rotation, blocks, 1.5, width, axis, a, b),
                (q, k, cos, sin, pos, rotation, blocks, True, width, axis, a, b),
                (q, k, cos, sin, pos, rotation, (1.0,), rd, width, axis, a, b),
                (q.numpy() if q.dtype == torch.float32 else 3, k, cos, sin, pos, rotation,
                 blocks, rd, width, axis, a, b)):
        with pytest.raises(Exception) as direct_error:
            ROPE(*bad)
        with pytest.raises(Exception) as op_error:
            OP(*bad)
        assert type(direct_error.value) is type(op_error.value)
        assert str(direct_error.value) == str(op_error.value)


def test_bad_input_gives_the_ops_error_and_writes_nothing():
    q, k, cos, sin, *rest = _case()
    short = cos[:, :-2]
    for fn, op in ((ROPE, OP), (ROPE_, OP_)):
        q_in, k_in = q.clone(), k.clone()
        with pytest.raises(ValueError) as direct_error:
            fn(q_in, k_in, short, sin, *rest)
        with pytest.raises(ValueError) as op_error:
            op(q.clone(), k.clone(), short, sin, *rest)
        assert str(direct_error.value) == str(op_error.value)
        assert "cos" in str(direct_error.value)
        assert torch.equal(q_in, q) and torch.equal(k_in, k)
    # A position past the table: IndexError, q and k untouched.
    q, k, cos, sin, pos, *rest = _case(positions=True)
    pos = pos.clone()
    pos[0, 0, 0] = cos.shape[0]
    q_in, k_in = q.clone(), k.clone()
    with pytest.raises(IndexError):
        ROPE_(q_in, k_in, cos, sin, pos, *rest)
    assert torch.equal(q_in, q) and torch.equal(k_in, k)


def test_long_calls_let_other_threads_run():
    """Calls above 64 KiB release the GIL as the op does: another Python thread keeps running
    through one. With the GIL held, the other thread stops for the whole kernel: a gap between
    its ticks as long as the call."""
    import bisect
    import sys
    import threading
    import time

    q = torch.randn(1, 16, 8192, 128)  # 64 MiB: milliseconds a call on one thread
    cos, sin = torch.randn(8192, 128), torch.randn(8192, 128)
    ticks = []
    stop = threading.Event()

    def ticker():  # a tick every 50 µs at most: a few hundred per call, all kept
        last = 0.0
        while not stop.is_set():
            now = time.perf_counter()
            if now - last >= 5e-5:
                ticks.append(now)
                last = now

    rome.set_num_threads(1)  # the other core is the ticker's
    # The main thread takes the GIL back within 10 µs of asking (default 5 ms, which with the GIL
    # held through the kernel let the ticker run for the first milliseconds of a call).
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread = threading.Thread(target=ticker)
    thread.start()
    through = False
    try:
        while not ticks:
            time.sleep(0.001)
        for _ in range(5):
            t0 = time.perf_counter()
            (direct, _), _ = _took(lambda: ROPE_(q, None, cos, sin, None, "half", (), -1, "full",
                                                 (), None, None))
            t1 = time.perf_counter()
            assert direct == 1
            inside = [t0] + [t for t in ticks[bisect.bisect_right(ticks, t0):]
                             if t < t1] + [t1]
            longest_gap = max(b - a for a, b in zip(inside, inside[1:]))
            if longest_gap < 0.5 * (t1 - t0):
                through = True
                break
    finally:
        stop.set()
        thread.join()
        rome.set_num_threads(0)  # back to torch's count
        sys.setswitchinterval(switch)
    assert through


FREE = ops._EAGER_FROM_POSITIONS
FREE_ = ops._EAGER_FROM_POSITIONS_
FREE_OP = torch.ops.rome.rope_from_positions.default
FREE_OP_ = torch.ops.rome.rope_from_positions_.default


def _free_case(dtype=torch.bfloat16, rotation="half", axes=0):
    q = torch.randn(2, 3, 5, 64).to(dtype)
    k = torch.randn(2, 1, 5, 64).to(dtype)
    inv = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    positions = torch.tensor([0, 7, 4095, 10**6, 10**7])
    column_axis = ()
    if axes:
        positions = torch.stack([positions + a for a in range(axes)], -1)
        column_axis = tuple(i % axes for i in range(32))
    return q, k, positions, inv, rotation, (), -1, 1.25, column_axis, False


@pytest.mark.parametrize("form", ["half", "interleave", "mrope", "inverse", "int amplitude"])
def test_table_free_entries_match_the_op(isa, form):
    args = list(_free_case(rotation="interleave" if form == "interleave" else "half",
                           axes=3 if form == "mrope" else 0))
    if form == "inverse":
        args[-1] = True
    if form == "int amplitude":
        args[7] = 2
    (direct, handed), (q_out, k_out) = _took(lambda: FREE(*args))
    assert (direct, handed) == (1, 0)
    want_q, want_k = FREE_OP(*args)
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
    q, k = args[0].clone(), args[1].clone()
    before = (q._version, k._version)
    (direct, handed), _ = _took(lambda: FREE_(q, k, *args[2:]))
    assert (direct, handed) == (1, 0)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert (q._version, k._version) == (before[0] + 1, before[1] + 1)


def test_table_free_entries_hand_the_rest_to_the_op():
    q, k, positions, inv, *rest = _free_case(dtype=torch.float32)
    q.requires_grad_(True)
    (direct, handed), (q_out, _) = _took(lambda: FREE(q, k, positions, inv, *rest))
    assert (direct, handed) == (0, 1) and q_out.grad_fn is not None
    with _DispatchLog() as log:
        (direct, handed), _ = _took(lambda: FREE(q.detach(), k, positions, inv, *rest))
    assert (direct, handed) == (0, 1) and FREE_OP in log.seen
    # Keywords, a bool amplitude, an int inverse: the op parses (or refuses) them.
    for call in (lambda: FREE(q.detach(), k, positions, inv, "half", (), -1, 1.25, (),
                              inverse=False),
                 lambda: FREE(q.detach(), k, positions, inv, "half", (), -1, True, (), False),
                 lambda: FREE(q.detach(), k, positions, inv, "half", (), -1, 1.25, (), 0)):
        d0, f0 = _counts()
        try:
            call()
        except Exception:
            pass
        assert _counts()[0] == d0 and _counts()[1] == f0 + 1
    # Bad input: the op's error, q and k untouched.
    q0, k0 = q.detach().clone(), k.clone()
    q1, k1 = q0.clone(), k0.clone()
    with pytest.raises(ValueError) as direct_error:
        FREE_(q1, k1, positions, inv[:-1], *rest)
    with pytest.raises(ValueError) as op_error:
        FREE_OP_(q0.clone(), k0.clone(), positions, inv[:-1], *rest)
    assert str(direct_error.value) == str(op_error.value)
    assert torch.equal(q1, q0) and torch.equal(k1, k0)


VLLM = ops._EAGER_ROTARY_EMBEDDING
VLLM_OP = torch.ops.rome.rotary_embedding.default


def _vllm_case(dtype=torch.bfloat16, neox=True, rotary_dim=64, qkv=None):
    """vLLM's arguments on row-strided q and k slices of a fused qkv buffer (`qkv`, or a new
    one)."""
    qkv = torch.randn(6, 3 * 4 * 64).to(dtype) if qkv is None else qkv
    query, key = qkv[:, :256], qkv[:, 256:384]
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.arange(64, dtype=torch.float64)[:, None] * inv
    cache = torch.cat([angle.cos(), angle.sin()], -1).float()
    positions = torch.tensor([0, 3, 63, 17, 5, 40])
    return [positions, query, key, 64, cache, neox, 0, False]


@pytest.mark.parametrize("form", ["neox", "gptj", "partial", "inverse", "query only", "fp32"])
def test_rotary_embedding_entry_matches_the_op(isa, form):
    qkv = torch.randn(6, 3 * 4 * 64).to(torch.float32 if form == "fp32" else torch.bfloat16)
    calls = []
    for buffer in (qkv.clone(), qkv.clone()):
        args = _vllm_case(neox=form != "gptj", rotary_dim=32 if form == "partial" else 64,
                          qkv=buffer)
        if form == "inverse":
            args[-1] = True
        if form == "query only":
            args[2] = None
        calls.append((buffer, args))
    (mine, mine_args), (theirs, theirs_args) = calls
    (direct, handed), result = _took(lambda: VLLM(*mine_args))
    assert (direct, handed) == (1, 0) and result is None
    VLLM_OP(*theirs_args)
    assert torch.equal(mine, theirs) and not torch.equal(mine, qkv)
    # The slices share the buffer's version counter: bumped once per slice, as the op does.
    assert mine._version == theirs._version == (1 if form == "query only" else 2)


def test_rotary_embedding_entry_hands_the_rest_to_the_op():
    positions, query, key, *rest = _vllm_case()
    with _DispatchLog() as log:
        (direct, handed), _ = _took(lambda: VLLM(positions, query, key, *rest))
    assert (direct, handed) == (0, 1) and VLLM_OP in log.seen
    # is_neox as an int, keywords: the op's parsing.
    d0, f0 = _counts()
    try:
        VLLM(positions, query, key, 64, rest[1], 1, 0, False)
    except Exception:
        pass
    VLLM(positions, query, key, 64, rest[1], True, rope_dim_offset=0, inverse=False)
    assert _counts() == (d0, f0 + 2)
    # A position past the cache: the op's IndexError, query and key untouched.
    q0, k0 = query.clone(), key.clone()
    bad = positions.clone()
    bad[2] = 64
    with pytest.raises(IndexError) as direct_error:
        VLLM(bad, query, key, *rest)
    with pytest.raises(IndexError) as op_error:
        VLLM_OP(bad, q0.clone(), k0.clone(), *rest)
    assert str(direct_error.value) == str(op_error.value)
    assert torch.equal(query, q0) and torch.equal(key, k0)
    # Through the public wrapper and the vLLM drop-in: the entry.
    import rome.vllm

    layer = rome.vllm.RotaryEmbedding(64, 64, 64, 10000.0, True, torch.float32)
    (direct, handed), _ = _took(lambda: layer(positions, query, key))
    assert (direct, handed) == (1, 0)


FUSED = ops._EAGER_FUSED_QK_NORM_ROPE
FUSED_OP = torch.ops.rome.fused_qk_norm_rope.default
WITH_CACHE = ops._EAGER_ROPE_WITH_CACHE
WITH_CACHE_OP = torch.ops.rome.rotary_embedding_with_cache.default


def _fused_case(dtype=torch.bfloat16, tokens=5):
    hq, hk, hv, d = 4, 2, 2, 64
    qkv = torch.randn(tokens, (hq + hk + hv) * d).to(dtype)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(32, dtype=torch.float64)[:, None] * inv
    cache = torch.cat([angle.cos(), angle.sin()], -1).float()
    weight_q = (1 + 0.1 * torch.randn(d)).to(dtype)
    weight_k = (1 + 0.1 * torch.randn(d)).to(dtype)
    positions = torch.randint(0, 32, (tokens,))
    return qkv, (hq, hk, hv, d), weight_q, weight_k, cache, positions


@pytest.mark.parametrize("gemma", [False, True])
def test_fused_entries_match_the_op(isa, gemma):
    qkv, (hq, hk, hv, d), wq, wk, cache, positions = _fused_case()
    mine, theirs = qkv.clone(), qkv.clone()
    args = (hq, hk, hv, d, 1e-6, wq, wk, cache, True, positions, gemma)
    (direct, handed), _ = _took(lambda: FUSED(mine, *args))
    assert (direct, handed) == (1, 0)
    FUSED_OP(theirs, *args)
    assert torch.equal(mine, theirs) and not torch.equal(mine, qkv) and mine._version == 1

    # RoPE + paged cache write, with and without QK-norm; slot -1: rotated, not stored.
    query, key, value = (t.contiguous() for t in qkv.split([hq * d, hk * d, hv * d], -1))
    slots = torch.tensor([3, -1, 0, 9, 4])
    results = []
    for entry in (WITH_CACHE, WITH_CACHE_OP):
        q, k = query.clone(), key.clone()
        kc, vc = torch.zeros(3, 4, hk, d).to(qkv.dtype), torch.zeros(3, 4, hv, d).to(qkv.dtype)
        weights = (wq, wk) if gemma else (None, None)
        (direct, handed), _ = _took(lambda: entry(positions, q, k, value, d, cache, True, kc, vc,
                                                  slots, *weights, 1e-6, gemma))
        results.append((q, k, kc, vc, direct))
    (q1, k1, kc1, vc1, direct), (q2, k2, kc2, vc2, _) = results
    assert direct == 1
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    assert [t._version for t in (q1, k1, kc1, vc1)] == [t._version for t in (q2, k2, kc2, vc2)]


def test_fused_entries_hand_the_rest_to_the_op_and_write_nothing_on_error():
    qkv, (hq, hk, hv, d), wq, wk, cache, positions = _fused_case()
    args = (hq, hk, hv, d, 1e-6, wq, wk, cache, True, positions, False)
    with _DispatchLog() as log:
        (direct, handed), _ = _took(lambda: FUSED(qkv.clone(), *args))
    assert (direct, handed) == (0, 1) and FUSED_OP in log.seen
    (direct, handed), _ = _took(lambda: FUSED(qkv.clone(), *args[:-1]))  # the default gemma_norm
    assert (direct, handed) == (0, 1)
    # A position past the cache: the op's error, qkv untouched.
    bad = positions.clone()
    bad[1] = 32
    mine, theirs = qkv.clone(), qkv.clone()
    with pytest.raises(IndexError) as direct_error:
        FUSED(mine, *args[:-2], bad, False)
    with pytest.raises(IndexError) as op_error:
        FUSED_OP(theirs, *args[:-2], bad, False)
    assert str(direct_error.value) == str(op_error.value) and torch.equal(mine, qkv)
    # A slot past the cache: nothing written anywhere.
    query, key, value = (t.contiguous() for t in qkv.split([hq * d, hk * d, hv * d], -1))
    q, k = query.clone(), key.clone()
    kc, vc = torch.zeros(3, 4, hk, d).to(qkv.dtype), torch.zeros(3, 4, hv, d).to(qkv.dtype)
    with pytest.raises(IndexError):
        WITH_CACHE(positions, q, k, value, d, cache, True, kc, vc, torch.tensor([0, 1, 2, 3, 12]),
                   None, None, 1e-6, False)
    assert torch.equal(q, query) and torch.equal(k, key)
    assert not kc.any() and not vc.any()
