"""Concurrency from Python: the operators called from many Python threads at once (the GIL is
released inside torch.ops calls), from torch's own thread pools (TorchScript's inter-op pool via
torch.jit.fork, torch.compile'd code whose kernels run in the intra-op pool, a large torch op
running at the same time under torch.set_num_threads(2)), and while rome.set_num_threads is
changed from another thread.

Every result must be bit-identical to a serial run in the main thread: RoME splits work
statically and each output element is computed by one thread, and the table/matrix gradients are
reduced in an order that does not depend on the thread count, so neither the number of threads
RoME uses nor a busy pool (a concurrent caller runs its work on its own thread) may change a bit.
The shared read-only tables must not change either.

Runs once per ISA (conftest parametrization).
"""

import concurrent.futures as cf
import threading
import time
from typing import List

import pytest
import torch

import rome

THREADS = 8

# torch.jit.script (the inter-op pool test) and torch's own modules warn that TorchScript is
# deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")


# ------------------------------------------------------------------------------------------------
# Workloads: shared read-only tables, per-instance inputs, one call each. Sizes are chosen so
# that some calls go through RoME's pool (over 256 KiB moved) and some stay on the caller
# (decode), with and without k, in and out of place, forward and backward.


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def make_shared():
    g = _gen(1234)
    shared = dict(
        cos=_randn(g, 256, 128), sin=_randn(g, 256, 128),  # direct [S, D] fp32
        cos16=_randn(g, 1, 1, 256, 128, dtype=torch.bfloat16),
        sin16=_randn(g, 1, 1, 256, 128, dtype=torch.bfloat16),
        cache_cos=_randn(g, 300, 64), cache_sin=_randn(g, 300, 64),  # NeoX half-width cache
        positions=torch.randint(0, 300, (1, 1, 256), generator=g),
        vllm_cache=_randn(g, 512, 64, dtype=torch.bfloat16),  # [P, rotary_dim 64], head 128
        mat=_randn(g, 64, 64) / 8,
        freqs=_randn(g, 1, 24, 64, 2),
    )
    shared["leaf_cos"] = shared["cos"].clone().requires_grad_()
    shared["leaf_sin"] = shared["sin"].clone().requires_grad_()
    shared["leaf_mat"] = shared["mat"].clone().requires_grad_()
    return shared


def make_inputs(name, i):
    g = _gen(100 * i + WORKLOADS.index(name))
    if name == "rope_direct_qk":
        return dict(q=_randn(g, 1, 8, 256, 128, dtype=torch.bfloat16),
                    k=_randn(g, 1, 2, 256, 128, dtype=torch.bfloat16))
    if name == "rope_cache_halves":
        return dict(q=_randn(g, 1, 4, 256, 128, dtype=torch.float16))
    if name == "rope_inplace_blocks":
        return dict(q=_randn(g, 1, 256, 8, 128).transpose(1, 2))  # BSND memory
    if name == "rope_decode":
        return dict(q=_randn(g, 1, 32, 1, 128, dtype=torch.bfloat16),
                    k=_randn(g, 1, 8, 1, 128, dtype=torch.bfloat16), pos=40 + i)
    if name == "rotary_embedding":
        return dict(qkv=_randn(g, 96, (16 + 2 * 4) * 128, dtype=torch.bfloat16),
                    positions=torch.randint(0, 512, (96,), generator=g))
    if name == "rope_matrix_dense":
        return dict(x=_randn(g, 1, 8, 256, 64))
    if name == "interleaved":
        return dict(x=_randn(g, 4, 24, 128, dtype=torch.bfloat16))
    if name == "backward":
        return dict(q=_randn(g, 1, 4, 256, 128), gy=_randn(g, 1, 4, 256, 128))
    if name == "backward_dense":
        return dict(x=_randn(g, 1, 4, 256, 64), gy=_randn(g, 1, 4, 256, 64))
    raise ValueError(name)


def run(name, shared, inp) -> List[torch.Tensor]:
    s = shared
    if name == "rope_direct_qk":
        return list(torch.ops.rome.rope(inp["q"], inp["k"], s["cos16"], s["sin16"]))
    if name == "rope_cache_halves":
        qo, _ = torch.ops.rome.rope(inp["q"], None, s["cache_cos"], s["cache_sin"], s["positions"],
                                    table_width="halves")
        return [qo]
    if name == "rope_inplace_blocks":
        q = inp["q"].clone()
        torch.ops.rome.rope_(q, None, s["cos"], s["sin"], None, "half", [44, 44, 40])
        return [q]
    if name == "rope_decode":
        p = inp["pos"]
        return list(torch.ops.rome.rope(inp["q"], inp["k"], s["cos"][p:p + 1], s["sin"][p:p + 1]))
    if name == "rotary_embedding":
        qkv = inp["qkv"].clone()
        torch.ops.rome.rotary_embedding(inp["positions"], qkv[:, :16 * 128],
                                        qkv[:, 16 * 128:20 * 128], 128, s["vllm_cache"], True)
        return [qkv]
    if name == "rope_matrix_dense":
        return [torch.ops.rome.rope_matrix(inp["x"], s["mat"], s["sin"][:, :64], s["cos"][:, :64])]
    if name == "interleaved":
        return [torch.ops.rome.apply_rotary_emb_interleaved(inp["x"], s["freqs"])]
    if name == "backward":
        q = inp["q"].clone().requires_grad_()
        qo, _ = torch.ops.rome.rope(q, None, s["leaf_cos"], s["leaf_sin"], None, "interleave")
        # autograd.grad (not .backward): no accumulation into the shared leaves' .grad.
        return list(torch.autograd.grad(qo, [q, s["leaf_cos"], s["leaf_sin"]], inp["gy"]))
    if name == "backward_dense":
        x = inp["x"].clone().requires_grad_()
        y = torch.ops.rome.rope_matrix(x, s["leaf_mat"], s["sin"][:, :64], s["cos"][:, :64])
        return list(torch.autograd.grad(y, [x, s["leaf_mat"]], inp["gy"]))
    raise ValueError(name)


WORKLOADS = ("rope_direct_qk", "rope_cache_halves", "rope_inplace_blocks", "rope_decode",
             "rotary_embedding", "rope_matrix_dense", "interleaved", "backward", "backward_dense")


@pytest.fixture(scope="module")
def tensors():
    """Shared tables and per-instance inputs (read only, built once)."""
    shared = make_shared()
    inputs = {(w, i): make_inputs(w, i) for w in WORKLOADS for i in range(THREADS)}
    originals = {key: {n: t.clone() for n, t in inp.items() if isinstance(t, torch.Tensor)}
                 for key, inp in inputs.items()}
    yield shared, inputs, {}
    for key, inp in originals.items():
        for n, t in inp.items():
            assert torch.equal(inputs[key][n], t), f"input {key} {n} changed"


@pytest.fixture
def setup(tensors, isa):
    """(shared tables, inputs, serial results under this test's ISA (computed once per ISA)),
    with thread settings restored and the shared tables checked afterwards."""
    shared, inputs, serial_by_isa = tensors
    torch_threads = torch.get_num_threads()
    before = {k: v.detach().clone() for k, v in shared.items()}
    if isa not in serial_by_isa:
        serial_by_isa[isa] = {key: run(key[0], shared, inp) for key, inp in inputs.items()}
    serial = serial_by_isa[isa]
    try:
        yield shared, inputs, serial
    finally:
        rome.set_num_threads(0)
        torch.set_num_threads(torch_threads)
    for k, v in shared.items():
        assert torch.equal(v.detach(), before[k]), f"shared table {k} changed"
        assert v.grad is None


def assert_identical(key, got, want):
    assert len(got) == len(want), key
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), f"{key}: differs from the serial run (max diff {float((a.double() - b.double()).abs().max())})"


def run_concurrently(shared, inputs, serial, rounds, workers=THREADS, keys=None):
    """Every (workload, instance) `rounds` times over `workers` Python threads, started together."""
    keys = list(keys or inputs)
    jobs = [key for _ in range(rounds) for key in keys]
    # Interleave workloads so different ops overlap (deterministic order).
    jobs = jobs[::2] + jobs[1::2]
    start = threading.Barrier(workers)

    def worker(index):
        start.wait()
        done = 0
        for key in jobs[index::workers]:
            assert_identical(key, run(key[0], shared, inputs[key]), serial[key])
            done += 1
        return done

    with cf.ThreadPoolExecutor(workers) as pool:
        total = sum(f.result() for f in [pool.submit(worker, w) for w in range(workers)])
    assert total == len(jobs)


# ------------------------------------------------------------------------------------------------


def test_python_threads_bit_identical(isa, setup):
    shared, inputs, serial = setup
    run_concurrently(shared, inputs, serial, rounds=3)


def test_python_threads_single_rome_thread_each(isa, setup):
    """Each call on its caller only (set_num_threads(1)): 8 callers really run side by side."""
    shared, inputs, serial = setup
    rome.set_num_threads(1)
    run_concurrently(shared, inputs, serial, rounds=2)


def test_same_output_shape_many_threads_one_op(isa, setup):
    """One op, many callers, tables shared: the pool handoff (busy pool -> caller runs alone)."""
    shared, inputs, serial = setup
    keys = [("rope_direct_qk", i) for i in range(THREADS)] + [("backward", i) for i in range(THREADS)]
    run_concurrently(shared, inputs, serial, rounds=4, keys=keys)


def test_with_torch_intra_op_work_running(isa, setup):
    """torch.set_num_threads(2) and large torch ops (at::parallel_for over the intra-op pool)
    running in another thread while the RoME ops run in 4 Python threads."""
    shared, inputs, serial = setup
    torch.set_num_threads(2)
    stop = threading.Event()
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    big = torch.randn(1 << 21)
    expected = a @ b
    busy_rounds = [0]

    def torch_work():
        while not stop.is_set():
            assert torch.equal(a @ b, expected)
            torch.sigmoid(big).sum()
            busy_rounds[0] += 1

    t = threading.Thread(target=torch_work)
    t.start()
    try:
        run_concurrently(shared, inputs, serial, rounds=2, workers=4)
    finally:
        stop.set()
        t.join()
    assert busy_rounds[0] > 0


def test_from_torchscript_inter_op_pool(isa, setup):
    """torch.jit.fork runs the calls on torch's inter-op thread pool (at::launch), all at once."""
    shared, inputs, serial = setup

    @torch.jit.script
    def rope_one(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> List[torch.Tensor]:
        qo, ko = torch.ops.rome.rope(q, k, cos, sin)
        return [qo, ko]

    @torch.jit.script
    def fan_out(qs: List[torch.Tensor], ks: List[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor) -> List[List[torch.Tensor]]:
        futures = [torch.jit.fork(rope_one, q, k, cos, sin) for q, k in zip(qs, ks)]
        return [torch.jit.wait(f) for f in futures]

    keys = [("rope_direct_qk", i) for i in range(THREADS)]
    for _ in range(2):
        outs = fan_out([inputs[k]["q"] for k in keys], [inputs[k]["k"] for k in keys],
                       shared["cos16"], shared["sin16"])
        for key, got in zip(keys, outs):
            assert_identical(key, got, serial[key])


def test_torch_compiled_function_from_threads(isa, setup):
    """A torch.compile'd function (inductor: its own kernels run over the intra-op pool) that
    calls the ops between torch ops, compiled once, then called from 4 Python threads at once."""
    shared, inputs, serial = setup
    torch.set_num_threads(2)

    def prologue(qkv, positions, cache, x, freqs):
        qkv = qkv * 1  # a torch kernel before the op
        q, k = qkv[:, :16 * 128], qkv[:, 16 * 128:20 * 128]
        torch.ops.rome.rotary_embedding(positions, q, k, 128, cache, True)
        y = torch.ops.rome.apply_rotary_emb_interleaved(x, freqs)
        return qkv, (y.float() + 1).to(y.dtype)

    compiled = torch.compile(prologue, fullgraph=True)
    keys = [(("rotary_embedding", i), ("interleaved", i)) for i in range(4)]

    def expected(i):
        qkv, = serial[("rotary_embedding", i)]
        y, = serial[("interleaved", i)]
        return qkv, (y.float() + 1).to(y.dtype)

    def call(i):
        return compiled(inputs[("rotary_embedding", i)]["qkv"], inputs[("rotary_embedding", i)]["positions"],
                        shared["vllm_cache"], inputs[("interleaved", i)]["x"], shared["freqs"])

    for i in range(4):  # compile (first call) and check in the main thread
        assert_identical(keys[i], list(call(i)), list(expected(i)))
    with cf.ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            results = list(pool.map(call, range(4)))
            for i, got in enumerate(results):
                assert_identical(keys[i], list(got), list(expected(i)))


def test_set_num_threads_changed_while_running(isa, setup):
    """rome.set_num_threads switched over and over from another thread during the calls."""
    shared, inputs, serial = setup
    stop = threading.Event()
    switches = [0]
    errors = []

    def switcher():
        values = (1, 2, 3, 0, 8, 1, 4, 2, 16)
        while not stop.is_set():
            rome.set_num_threads(values[switches[0] % len(values)])
            switches[0] += 1
            try:
                rome.set_num_threads(-1)
            except ValueError as e:  # still checked, still the documented error, from a thread
                if not str(e).startswith("rome: threads: expected"):
                    errors.append(str(e))
            else:
                errors.append("set_num_threads(-1) accepted")
            time.sleep(0.0005)

    t = threading.Thread(target=switcher)
    t.start()
    try:
        run_concurrently(shared, inputs, serial, rounds=2, workers=4)
    finally:
        stop.set()
        t.join()
    assert switches[0] > 1
    assert not errors, errors
