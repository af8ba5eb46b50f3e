"""torch.compile(fullgraph=True) of modules calling each operator: no graph break, the operator
stays one node of the graph (not decomposed), and results (and gradients) equal eager mode."""

import pytest
import torch
from torch import nn

import rome

B, N, S, D = 2, 4, 6, 32


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graph_targets(fn, *args):
    """Names of the call_function targets Dynamo captures for fn (fullgraph)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return targets


def assert_in_graph(op, fn, *args):
    """fn compiles to one graph (fullgraph) in which `op` is a node of its own."""
    targets = graph_targets(fn, *args)
    assert op in targets or op + ".default" in targets, f"{op} not in the graph: {targets}"


def tables(shape=(S, D), dtype=torch.float32):
    angle = torch.rand(shape) * 6
    return angle.cos().to(dtype), angle.sin().to(dtype)


class Rope(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, cos, sin, positions=None):
        qo, ko = rome.rope(q, k, cos, sin, positions=positions, **self.kw)
        return qo * 2, ko


class RopeMatrix(nn.Module):
    def forward(self, x, mat, sin, cos):
        return rome.rope_matrix(x, mat, sin, cos) + 1


class RopeInplace(nn.Module):
    def forward(self, q, k, cos, sin):
        rome.rope_(q, k, cos, sin, rotation="interleave")
        return q.sum(), k


class RopeMatrixInplace(nn.Module):
    def forward(self, x, mat, sin, cos):
        y = rome.rope_matrix_(x, mat, sin, cos)
        return y * 1


class VllmAttentionPrologue(nn.Module):
    """Slices a fused qkv projection and rotates q and k in place (vLLM)."""

    def forward(self, positions, qkv, cache):
        q, k, v = qkv.split([4 * D, 2 * D, 2 * D], dim=-1)
        rome.rotary_embedding(positions, q, k, D, cache, True)
        return q, k, v


class ExecuTorchRope(nn.Module):
    def forward(self, x, freqs):
        return rome.apply_rotary_emb_interleaved(x, freqs)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("variant", ("half", "blocks", "positions", "dense", "dynamic"))
def test_compile_rope(variant, dtype):
    kw = {"blocks": dict(blocks=[8, 16, 8]), "dense": dict(rotation="dense", mat_b=torch.randn(D, D))}.get(variant, {})
    module = Rope(**kw)
    q, k = torch.randn(B, N, S, D).to(dtype), torch.randn(B, 1, S, D).to(dtype)
    if variant == "positions":
        cos, sin = tables((50, D))
        args = (q, k, cos, sin, torch.randint(0, 50, (B, 1, S)))
    else:
        args = (q, k, *tables())
    assert_in_graph("rome.rope", module, *args)
    compiled = torch.compile(module, fullgraph=True, dynamic=variant == "dynamic")
    for got, want in zip(compiled(*args), module(*args)):
        assert torch.equal(got, want)
    if variant == "dynamic":  # another sequence length, same compiled graph
        q2, k2 = torch.randn(B, N, S + 3, D).to(dtype), torch.randn(B, 1, S + 3, D).to(dtype)
        args2 = (q2, k2, *tables((S + 3, D)))
        for got, want in zip(compiled(*args2), module(*args2)):
            assert torch.equal(got, want)


def test_compile_rope_training():
    module = Rope(rotation="interleave")
    q = torch.randn(B, N, S, D, requires_grad=True)
    k = torch.randn(B, 1, S, D, requires_grad=True)
    cos, sin = (t.requires_grad_() for t in tables())
    compiled = torch.compile(module, fullgraph=True)
    grads = []
    for fn in (compiled, module):
        qo, ko = fn(q, k, cos, sin)
        grads.append(torch.autograd.grad((qo.square().sum() + ko.sum()), [q, k, cos, sin]))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_compile_rope_matrix(dtype):
    module = RopeMatrix()
    x = torch.randn(B, N, S, D).to(dtype)
    mat = rome.matrices.block_diag([8, 16, 8])
    cos, sin = tables((1, 1, S, D), dtype)
    assert_in_graph("rome.rope_matrix", module, x, mat, sin, cos)
    compiled = torch.compile(module, fullgraph=True)
    assert torch.equal(compiled(x, mat, sin, cos), module(x, mat, sin, cos))


def test_compile_rope_matrix_training():
    module = RopeMatrix()
    x = torch.randn(B, N, S, D, requires_grad=True)
    mat = (torch.randn(D, D) / 6).requires_grad_()
    cos, sin = (t.requires_grad_() for t in tables((B, 1, S, D)))
    compiled = torch.compile(module, fullgraph=True)
    grads = []
    for fn in (compiled, module):
        y = fn(x, mat, sin, cos)
        grads.append(torch.autograd.grad(y.square().sum(), [x, mat, sin, cos]))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_compile_rope_inplace():
    module = RopeInplace()
    q, k = torch.randn(B, N, S, D), torch.randn(B, 2, S, D)
    cos, sin = tables()
    assert_in_graph("rome.rope_", module, q.clone(), k.clone(), cos, sin)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    got = torch.compile(module, fullgraph=True)(q1, k1, cos, sin)
    want = module(q2, k2, cos, sin)
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(got[1], want[1])
    assert not torch.equal(q1, q)


def test_compile_rope_matrix_inplace():
    module = RopeMatrixInplace()
    x = torch.randn(B, N, S, D)
    mat = rome.matrices.half(D)
    cos, sin = tables()
    assert_in_graph("rome.rope_matrix_", module, x.clone(), mat, sin, cos)
    x1, x2 = x.clone(), x.clone()
    got = torch.compile(module, fullgraph=True)(x1, mat, sin, cos)
    want = module(x2, mat, sin, cos)
    assert torch.equal(got, want) and torch.equal(x1, x2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_compile_rotary_embedding(dtype):
    module = VllmAttentionPrologue()
    positions = torch.randint(0, 64, (9,))
    qkv = torch.randn(9, 8 * D).to(dtype)
    cache = rome.tables.cos_sin_cache(64, D)
    assert_in_graph("rome.rotary_embedding", module, positions, qkv.clone(), cache)
    qkv1, qkv2 = qkv.clone(), qkv.clone()
    got = torch.compile(module, fullgraph=True)(positions, qkv1, cache)
    want = module(positions, qkv2, cache)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(qkv1, qkv2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_compile_apply_rotary_emb_interleaved(dtype):
    module = ExecuTorchRope()
    x = torch.randn(2, S, D).to(dtype)
    freqs = torch.randn(1, S, D // 2, 2)
    assert_in_graph("rome.apply_rotary_emb_interleaved", module, x, freqs)
    assert torch.equal(torch.compile(module, fullgraph=True)(x, freqs), module(x, freqs))


def test_compile_rotary_embedding_module():
    module = rome.RotaryEmbedding(D, axes_dims=[8, 12, 12], max_positions=16)
    q, k = torch.randn(1, N, 24, D, dtype=torch.bfloat16), torch.randn(1, 2, 24, D, dtype=torch.bfloat16)
    compiled = torch.compile(module, fullgraph=True)
    for got, want in zip(compiled(q, k, grid=(2, 3, 4)), module(q, k, grid=(2, 3, 4))):
        assert torch.equal(got, want)


@pytest.mark.parametrize("op", ["rope", "rope_", "rotary_embedding"])
def test_compile_refuses_bad_shapes_while_tracing(op):
    """The Meta kernels check with the CPU kernels' code: a table of the wrong width fails while
    tracing with the CPU kernel's message (naming the op's argument), before anything runs."""
    q = torch.randn(B, N, S, D)
    before = q.clone()
    if op == "rotary_embedding":
        query = q.reshape(B * S, N * D)
        cache = torch.randn(16, D + 2)  # rotary_dim D + 2 > head_size D

        def fn(query):
            rome.ops.rotary_embedding(torch.arange(B * S), query, None, D, cache, True)
            return query * 2

        args, name = (query,), "cos_sin_cache"
    else:
        cos, sin = torch.randn(S, D - 2), torch.randn(S, D - 2)

        def fn(q):
            if op == "rope":
                return rome.ops.rope(q, None, cos, sin)[0] * 2
            rome.ops.rope_(q, None, cos, sin)
            return q * 2

        args, name = (q,), "cos"
    graphs = []  # a graph reaches the backend only if tracing succeeded

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with pytest.raises(Exception) as info:
        torch.compile(fn, fullgraph=True, backend=backend)(*args)
    assert f"rome: {name}: expected" in str(info.value)
    assert not graphs, "the error came from running the graph, not from tracing it"
    assert torch.equal(q, before)


class TableFree(nn.Module):
    def __init__(self, inv_freq):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, q, k, positions):
        qo, ko = rome.ops.rope_from_positions(q, k, positions, self.inv_freq, amplitude=1.5)
        return qo - 1, ko


class TableFreeInplace(TableFree):
    def forward(self, q, k, positions):
        rome.ops.rope_from_positions_(q, k, positions, self.inv_freq, rotation="interleave")
        return q.sum()


def test_compile_table_free_dynamic_and_in_place():
    """Table-free RoPE under inductor (fullgraph): one node of the graph; with dynamic shapes
    another sequence length reuses the graph; in place writes the caller's q and k."""
    inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    module = TableFree(inv)
    q, k = torch.randn(B, N, S, D).bfloat16(), torch.randn(B, 2, S, D).bfloat16()
    positions = torch.arange(S) * 99991
    assert_in_graph("rome.rope_from_positions", module, q, k, positions)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for s in (S, S + 5):
        q, k = torch.randn(B, N, s, D).bfloat16(), torch.randn(B, 2, s, D).bfloat16()
        positions = torch.arange(s) * 99991
        for got, want in zip(compiled(q, k, positions), module(q, k, positions)):
            assert torch.equal(got, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    inplace = TableFreeInplace(inv)
    assert_in_graph("rome.rope_from_positions_", inplace, q.clone(), k.clone(), positions)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    got = torch.compile(inplace, fullgraph=True)(q1, k1, positions)
    want = inplace(q2, k2, positions)
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(got, want)
    assert not torch.equal(q1, q)
