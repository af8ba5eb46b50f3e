"""The executor seen from torch: out-of-place into preallocated outputs (rope_out), and RoME
following torch's thread setting (torch.set_num_threads) unless rome.set_num_threads overrides.

Thread counts are checked with rome.last_call_threads(), which counts the distinct threads that
ran the calling thread's last forward call: no timing is involved.
"""

import os

import pytest
import torch
from torch.library import opcheck

import rome

D = 128


def _tables(s, d=D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, d, generator=g).to(dtype), torch.randn(s, d, generator=g).to(dtype)


def _x(*shape, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ------------------------------------------------------------------------------------------------
# rope_out


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("layout", ("bnsd", "bsnd", "packed"))
def test_rope_out_equals_rope(isa, dtype, layout):
    if layout == "bnsd":
        q, k = _x(2, 8, 33, D, dtype=dtype), _x(2, 2, 33, D, dtype=dtype, seed=2)
        cos, sin = _tables(33)
        kw = {}
    elif layout == "bsnd":
        q, k = _x(2, 33, 8, D, dtype=dtype), _x(2, 33, 2, D, dtype=dtype, seed=2)
        cos, sin = _tables(33)
        cos, sin = cos[None, :, None], sin[None, :, None]
        kw = {}
    else:  # q/k slices of a fused qkv buffer, positions into a half-width cache
        qkv = _x(29, (8 + 2 + 2) * D, dtype=dtype)
        q, k = qkv[:, : 8 * D].view(29, 8, D), qkv[:, 8 * D : 10 * D].view(29, 2, D)
        cos, sin = _tables(64, D // 2)
        kw = dict(positions=torch.randint(0, 64, (29, 1)), table_width="halves")
    want_q, want_k = rome.ops.rope(q, k, cos, sin, **kw)
    q_out = torch.full_like(q, float("nan"))
    k_out = torch.full_like(k, float("nan"))
    got = rome.ops.rope(q, k, cos, sin, out=(q_out, k_out), **kw)
    assert got[0] is q_out and got[1] is k_out
    assert torch.equal(q_out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want_q.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert torch.equal(k_out, want_k)
    # Without k.
    q_out2 = torch.full_like(q, float("nan"))
    rome.ops.rope(q, None, cos, sin, out=(q_out2, None), **kw)
    assert torch.equal(q_out2, want_q)


def test_rope_out_strided_output_and_untouched_padding(isa):
    q = _x(1, 4, 17, D)
    cos, sin = _tables(17)
    buf = torch.full((1, 17, 6, D), float("nan"), dtype=torch.bfloat16)
    q_out = buf[:, :, 1:5].transpose(1, 2)  # a strided view: heads 1..4 of a BSND buffer
    rome.ops.rope(q, None, cos, sin, out=(q_out, None))
    assert torch.equal(q_out, rome.ops.rope(q, None, cos, sin)[0])
    assert torch.isnan(buf[:, :, 0]).all() and torch.isnan(buf[:, :, 5]).all()


@pytest.mark.parametrize(
    "case, match",
    [
        ("k_out_missing", r"rome: k_out: expected a tensor \(k is given\), got None"),
        ("k_out_extra", r"rome: k_out: expected None \(k is None\)"),
        ("dtype", r"rome: q_out: expected dtype BFloat16 \(the input's\), got Float"),
        ("shape", r"rome: q_out: "),
        ("overlap", r"rome: q_out: "),
    ],
)
def test_rope_out_errors_leave_outputs_untouched(isa, case, match):
    buf = _x(2 * 4 * 9 * D)
    q, k = buf[: 4 * 9 * D].view(1, 4, 9, D), _x(1, 2, 9, D, seed=2)
    cos, sin = _tables(9)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    args = dict(q=q, k=k, out=(q_out, k_out))
    if case == "k_out_missing":
        args["out"] = (q_out, None)
    elif case == "k_out_extra":
        args["k"] = None
    elif case == "dtype":
        q_out = torch.full(q.shape, float("nan"))
        args["out"] = (q_out, k_out)
    elif case == "shape":
        q_out = torch.full((1, 4, 8, D), float("nan"), dtype=q.dtype)
        args["out"] = (q_out, k_out)
    elif case == "overlap":
        q_out = buf[D : D + 4 * 9 * D].view(1, 4, 9, D)  # q shifted by one row
        args["out"] = (q_out, k_out)
    before = [t.clone() for t in (q, k, q_out, k_out)]
    with pytest.raises(ValueError, match=match):
        rome.ops.rope(args["q"], args["k"], cos, sin, out=args["out"])
    for t, b in zip((q, k, q_out, k_out), before):
        assert torch.equal(t, b) or (torch.isnan(t).all() and torch.isnan(b).all())


def test_rope_out_is_inference_only(isa):
    q = _x(1, 2, 5, D).requires_grad_()
    cos, sin = _tables(5)
    with pytest.raises(NotImplementedError, match=r"^rome: q: expected a tensor that does not require grad"):
        rome.ops.rope(q, None, cos, sin, out=(torch.empty_like(q), None))
    with torch.no_grad():
        out = torch.empty_like(q)
        rome.ops.rope(q, None, cos, sin, out=(out, None))


def test_opcheck_rope_out(isa):
    q, k = _x(1, 4, 9, D), _x(1, 2, 9, D, seed=2)
    cos, sin = _tables(9)
    opcheck(torch.ops.rome.rope_out.default, (q, k, cos, sin, torch.empty_like(q), torch.empty_like(k)))
    opcheck(torch.ops.rome.rope_out.default, (q, None, cos, sin, torch.empty_like(q), None))


def test_rope_out_compiles_fullgraph(isa):
    q = _x(1, 4, 9, D)
    cos, sin = _tables(9)

    def f(q, cos, sin, out):
        torch.ops.rome.rope_out(q, None, cos, sin, out, None)
        return out * 2

    want = f(q, cos, sin, torch.empty_like(q))
    got = torch.compile(f, fullgraph=True, backend="eager")(q, cos, sin, torch.empty_like(q))
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------
# Threads


@pytest.fixture
def torch_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)
    rome.set_num_threads(0)


def _big():
    q = _x(1, 8, 1024, D)  # 2 MiB: large enough to be split
    cos, sin = _tables(1024)
    return q, cos, sin


def test_follows_torch_set_num_threads(isa, torch_threads):
    q, cos, sin = _big()
    torch.set_num_threads(1)
    rome.ops.rope_(q, None, cos, sin)
    assert rome.last_call_threads() == 1
    rome.ops.rope(q, None, cos, sin)
    assert rome.last_call_threads() == 1
    if os.cpu_count() >= 2:
        torch.set_num_threads(2)
        rome.ops.rope_(q, None, cos, sin)
        assert rome.last_call_threads() == 2


def test_rome_set_num_threads_overrides_torch(isa, torch_threads):
    q, cos, sin = _big()
    torch.set_num_threads(1)
    rome.set_num_threads(2)
    rome.ops.rope_(q, None, cos, sin)
    assert rome.last_call_threads() == 2
    torch.set_num_threads(2)
    rome.set_num_threads(1)
    rome.ops.rope_(q, None, cos, sin)
    assert rome.last_call_threads() == 1
    rome.set_num_threads(0)  # back to torch's setting
    rome.ops.rope_(q, None, cos, sin)
    assert rome.last_call_threads() == 2


def test_decode_stays_on_the_calling_thread(isa, torch_threads):
    torch.set_num_threads(2)
    q, k = _x(1, 32, 1, D), _x(1, 8, 1, D, seed=2)
    cos, sin = _tables(1)
    rome.ops.rope_(q, k, cos, sin)
    assert rome.last_call_threads() == 1
