"""Shared fixtures of the Python suite.

Every test runs once per instruction set this build carries and this machine (and
ROME_MAX_ISA) allows, selected with rome.set_max_isa; the header lists the ISAs run and the ones
skipped with the reason. ROME_TEST_ISAS=scalar,avx512 narrows the list (e.g. for a quick run).
A test marked `one_isa` runs on the highest ISA only: opcheck checks the op's registration
(schema, fake/meta kernel, autograd, AOT dispatch), which no ISA changes, and every ISA's numbers
are checked by the reference tests; running it per ISA doubled the suite's time.

Under pytest-xdist (make test runs one worker per core) each worker runs torch on one thread:
two workers of two spinning OpenMP threads each on a 2-core machine made the heaviest tests
(tiny models, the benchmark's subprocess) 3-4x slower. Tests of threading set their own counts.
"""

import importlib
import os
import sys

import pytest
import torch

import rome

_ORDER = {name: i for i, name in enumerate(rome.ISAS)}


def _isas():
    ceiling = rome.set_max_isa("amx")  # the highest ISA allowed here
    info = rome.cpu_info()
    run, skipped = [], []
    for isa in rome.ISAS:
        if isa not in info["compiled_isas"]:
            skipped.append((isa, "not compiled into this build"))
        elif _ORDER[isa] > _ORDER[info["detected_isa"]]:
            skipped.append((isa, f"this CPU/OS does not support it (detected: {info['detected_isa']})"))
        elif _ORDER[isa] > _ORDER[ceiling]:
            skipped.append((isa, "lowered by ROME_MAX_ISA"))
        else:
            run.append(isa)
    wanted = os.environ.get("ROME_TEST_ISAS")
    if wanted:
        keep = [w.strip() for w in wanted.split(",") if w.strip()]
        skipped += [(isa, "not in ROME_TEST_ISAS") for isa in run if isa not in keep]
        run = [isa for isa in run if isa in keep]
    return run, skipped


ISAS_UNDER_TEST, ISAS_SKIPPED = _isas()


def _isa_lines():
    lines = [f"rome: ISAs under test: {', '.join(ISAS_UNDER_TEST) or 'none'}"]
    lines += [f"rome: skipping ISA {isa}: {why}" for isa, why in ISAS_SKIPPED]
    return lines


def pytest_report_header(config):
    return _isa_lines()


def pytest_terminal_summary(terminalreporter):
    """Again at the end: make test runs pytest -q, which hides the header."""
    for line in _isa_lines():
        terminalreporter.write_line(line)


def pytest_configure(config):
    config.addinivalue_line("markers", "one_isa: run on the highest ISA under test only")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_generate_tests(metafunc):
    if "isa" in metafunc.fixturenames:
        isas = ISAS_UNDER_TEST
        if metafunc.definition.get_closest_marker("one_isa") and isas:
            isas = isas[-1:]
        metafunc.parametrize("isa", isas, indirect=True, scope="function")


@pytest.fixture(autouse=True)
def isa(request):
    """The ISA of this test run (set for the test, restored afterwards)."""
    name = getattr(request, "param", None)
    if name is None:
        yield rome.active_isa()
        return
    active = rome.set_max_isa(name)
    assert active == name, f"asked for {name}, got {active}"
    try:
        yield name
    finally:
        rome.set_max_isa("amx")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ------------------------------------------------------------------------------------------------
# Reference math shared by the test files (imported as `from conftest import ...`).

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def lane_tables(cos, sin, rotary_dim, table_width="full", positions=None, column_axis=None):
    """Per-lane cos/sin of rotary_dim columns (direct: broadcastable shape; cache: gathered)."""
    def widen(t):
        if table_width == "halves":
            return torch.cat([t, t], dim=-1)
        if table_width == "pairs":
            return t.repeat_interleave(2, dim=-1)
        return t

    if positions is None:
        return widen(cos), widen(sin)
    positions = positions.long()
    if not column_axis:
        return widen(cos[positions]), widen(sin[positions])
    columns = cos.shape[-1]
    idx = torch.stack([positions[..., column_axis[c]] for c in range(columns)], dim=-1)
    col = torch.arange(columns)
    return widen(cos[idx, col]), widen(sin[idx, col])


def rotation_mats(rotation, rotary_dim, blocks=None, mat_a=None, mat_b=None):
    """(A, B) as float64 [rotary_dim, rotary_dim]."""
    if rotation == "dense":
        a = torch.eye(rotary_dim, dtype=torch.float64) if mat_a is None else mat_a.double()
        return a, mat_b.double()
    a, b = rome.matrices.rotation(rotation, rotary_dim, blocks=blocks, dtype=torch.float64)
    return a, b


def reference(q, cos, sin, positions=None, rotation="half", blocks=None, rotary_dim=-1,
              table_width="full", column_axis=None, mat_a=None, mat_b=None):
    """(y, scale) in float64: y = (x·A) ⊙ C + (x·B) ⊙ S on the first rotary_dim lanes; scale
    bounds the magnitude of the terms (for error bounds). Differentiable."""
    d = q.shape[-1]
    rd = d if rotary_dim == -1 else rotary_dim
    a, b = rotation_mats(rotation, rd, blocks, mat_a, mat_b)
    c, s = lane_tables(cos, sin, rd, table_width, positions, column_axis)
    x = q.double()
    xr, rest = x[..., :rd], x[..., rd:]
    c, s = c.double(), s.double()
    y = torch.cat([(xr @ a) * c + (xr @ b) * s, rest], dim=-1)
    scale = torch.cat([(xr.abs() @ a.abs()) * c.abs() + (xr.abs() @ b.abs()) * s.abs(), rest.abs()], dim=-1)
    return y, scale


def assert_rounded(out, ref, scale, ulps=1.0, dense_dim=0):
    """out (x's dtype) equals the float64 reference rounded once, within `ulps` units in the last
    place of out's dtype, plus the fp32 arithmetic error of the terms."""
    ref = ref.detach().to(torch.float64).expand(out.shape)
    scale = scale.detach().to(torch.float64).expand(out.shape)
    eps = torch.finfo(out.dtype).eps
    tiny = torch.finfo(out.dtype).tiny
    mag = ref.abs().clamp_min(tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag))) * eps
    fp32_error = (4 + dense_dim) * torch.finfo(torch.float32).eps * scale
    tol = ulps * ulp + fp32_error + tiny
    err = (out.double() - ref).abs()
    bad = err > tol
    assert not bad.any(), (
        f"{int(bad.sum())} of {out.numel()} elements off by more than {ulps} ulp: "
        f"max error {float(err.max()):.3g}, e.g. out {float(out.double()[bad][0])} "
        f"ref {float(ref[bad][0])}")


def on_meta(a):
    """A meta tensor with a's shape, strides, dtype and requires_grad; anything else as it is."""
    if not isinstance(a, torch.Tensor):
        return a
    m = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    return m.requires_grad_() if a.requires_grad else m


def need_module(module: str):
    """Imports `module` or skips the test with a printed reason."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a library failing to import here
        reason = f"{module} cannot be imported: {type(exc).__name__}: {exc}"
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
