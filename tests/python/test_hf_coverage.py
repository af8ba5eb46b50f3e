"""rome.hf serves every RoPE function transformers' modeling modules define.

For each modeling module of the installed transformers that defines ``apply_rotary_pos_emb`` or
another function rome.hf patches (MLA's ``apply_rotary_pos_emb_interleave``, Llama-4's and
DeepSeek-V2's complex ``apply_rotary_emb``, ``apply_rotary_pos_emb_vision``): patch_module must
serve it (or the module must be listed in rome.hf.NOT_SERVED with its reason), and on inputs
drawn for its form the replacement must

- run RoME's op (a profiler check),
- give the original's output shapes and dtypes,
- be correctly rounded against the original function evaluated in float64 on the same inputs
  (RoME computes in fp32 and rounds once: within one ulp of the output dtype plus fp32 noise of
  the terms, |x| · (|cos| + |sin|) <= 2 · max|x|),

in fp32 and bf16, with tables in the input's dtype and in fp32.
"""

import importlib
import pkgutil
import sys
import warnings

import pytest
import torch

import rome.hf

U32 = 2.0 ** -24


def _defines_rope(module) -> bool:
    return any(name in module.__dict__ for name in rome.hf._PATCHED_NAMES)


def _modules_with_rope():
    try:
        import transformers.models as models
    except Exception as exc:
        pytest.skip(f"transformers cannot be imported: {exc}")
    found, failed = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in pkgutil.iter_modules(models.__path__):
            package = f"transformers.models.{family.name}"
            try:
                pkg = importlib.import_module(package)
            except Exception:
                failed.append(package)
                continue
            for sub in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
                if not sub.name.startswith("modeling_"):
                    continue
                try:
                    module = importlib.import_module(f"{package}.{sub.name}")
                except Exception:
                    failed.append(f"{package}.{sub.name}")
                    continue
                if _defines_rope(module):
                    found.append(module)
    if failed:
        print(f"not importable here ({len(failed)}): {failed}", file=sys.stderr)
    return found


@pytest.fixture(scope="module")
def rope_modules():
    return _modules_with_rope()


def _tables(shape, generator):
    angle = torch.rand(shape, generator=generator, dtype=torch.float64) * 20 - 10
    return angle.cos().float(), angle.sin().float()


def _draw(form: str, generator):
    """Arguments (fp32) for a function of `form`: B 2, q heads 3, k heads 2 (GQA), S 5, D 16."""
    b, s, d = 2, 5, 16

    def x(heads, tokens=s, dim=d):
        return torch.randn(b, heads, tokens, dim, generator=generator)

    q, k = x(3), x(2)
    if form in ("llama", "llama_each_own_dtype", "half_fp32_as_q", "pairs_fp32_as_q",
                "pairs_full", "half_negated", "pairs_from_half_table",
                "pairs_from_half_table_fp32_as_q", "pairs_from_stacked_freqs"):
        return (q, k, *_tables((b, s, d), generator))
    if form in ("partial", "pairs_from_half_table_partial", "pairs_full_partial",
                "half_partial_k_optional"):
        return (q, k, *_tables((b, s, d // 2), generator))
    if form in ("half_halves_table", "pairs_pairs_table"):
        return (q, k, *_tables((b, s, d // 2), generator))
    if form == "half_single":
        return (q, *_tables((b, s, d), generator))
    if form == "pairs_trailing":
        return (q, *_tables((b, s, 4), generator))  # rope on the last 8 of 16 lanes
    if form == "half_after_prefix_tokens":
        cos, sin = _tables((s, d), generator)
        return (x(3, s + 2), x(2, s + 2), cos, sin)  # a cls and a register token first
    if form == "pairs_gptj":
        sin_cos = _tables((b, s, d // 2), generator)
        return (torch.randn(b, s, 3, d, generator=generator), sin_cos[1], sin_cos[0])
    if form == "half_qkv_gathered":
        cos, sin = _tables((11, d), generator)
        positions = torch.randint(0, 11, (b, s), generator=generator)
        return (q, k, x(2), cos, sin, positions)
    if form == "half_q_last_positions":
        return (x(3, 2), k, *_tables((b, s, d), generator))
    raise AssertionError(f"no inputs drawn for form {form}")


def _form_of(replacement) -> str:
    name = getattr(replacement, "rome_form", None)
    if name is not None:
        return name
    if replacement in (rome.hf._apply_rotary_pos_emb_v5, rome.hf.apply_rotary_pos_emb):
        return "llama"
    if replacement in (rome.hf._apply_partial_rotary_pos_emb,
                       rome.hf._apply_partial_rotary_pos_emb_v4):
        return "partial"
    raise AssertionError(f"unknown replacement {replacement}")


def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    mag = values.abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _is_table(form, index, value):
    """Whether argument `index` of `form` is a cos/sin table (cast with the tables' dtype)."""
    if not torch.is_tensor(value) or not value.is_floating_point():
        return False
    first_table = {"half_single": 1, "pairs_trailing": 1, "pairs_gptj": 1,
                   "half_qkv_gathered": 3}.get(form, 2)
    return first_table <= index < first_table + 2


@pytest.mark.one_isa
def test_every_module_is_served(rope_modules):
    served = []
    for module in rope_modules:
        handle = rome.hf.patch_module(module)
        try:
            partly = [k for k in handle.skipped if k.startswith(module.__name__ + ".")]
            if module.__name__ in handle.patched and not partly:
                served.append(module.__name__)
            else:
                assert module.__name__.rsplit(".", 1)[-1] in rome.hf.NOT_SERVED, \
                    f"{module.__name__} not served ({handle.skipped}) " \
                    "and not listed in rome.hf.NOT_SERVED"
        finally:
            handle.undo()
    print(f"served {len(served)} of {len(rope_modules)} modules", file=sys.stderr)
    assert len(rope_modules) >= 150, "transformers' modeling modules were not found"
    assert len(served) >= 0.95 * len(rope_modules)


def _check_against_float64(name, form, original, replacement, args32, dtype, table_dtype):
    """Failures of `replacement` (RoME's) against `original` on `args32` cast to `dtype`."""
    args = tuple(
        a.to(table_dtype) if _is_table(form, i, a)
        else a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a
        for i, a in enumerate(args32))
    wide = tuple(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    expected = _as_tuple(original(*args))
    exact = _as_tuple(original(*wide))
    with torch.profiler.profile() as prof:
        got = _as_tuple(replacement(*args))
    if not any(e.name == "rome::rope" for e in prof.events()):
        return [f"{name}: rome::rope did not run"]
    failures = []
    scale = max(a.abs().max().item() for a in args if torch.is_tensor(a) and a.is_floating_point())
    for g, e, x in zip(got, expected, exact):
        if g.shape != e.shape or g.dtype != e.dtype:
            failures.append(f"{name}: {tuple(g.shape)} {g.dtype} vs the original's "
                            f"{tuple(e.shape)} {e.dtype}")
            continue
        bound = _ulp(x, g.dtype) + 8 * U32 * 2 * scale
        err = (g.double() - x).abs()
        if not bool((err <= bound).all()):
            failures.append(f"{name}: max error {err.max().item():.3g} over the bound")
    # Inputs RoME does not take (float64) run the module's own function.
    for g, x in zip(_as_tuple(replacement(*wide)), exact):
        if not torch.equal(g, x):
            failures.append(f"{name}: float64 inputs did not run the original")
    return failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tables", ["same", "fp32"])
def test_every_served_module_matches_float64(rope_modules, dtype, tables):
    generator = torch.Generator().manual_seed(7)
    table_dtype = dtype if tables == "same" else torch.float32
    checked, mla_checked, failures = 0, 0, []
    for module in rope_modules:
        original = module.__dict__.get("apply_rotary_pos_emb")
        mla_original = module.__dict__.get("apply_rotary_pos_emb_interleave")
        handle = rome.hf.patch_module(module)
        try:
            if module.__name__ not in handle.patched:
                continue
            # (A module patched for another function only: test_every_module_is_served says so.)
            if original is not None and module.apply_rotary_pos_emb is not original:
                replacement = module.apply_rotary_pos_emb
                form = _form_of(replacement)
                failures += _check_against_float64(f"{module.__name__} ({form})", form,
                                                   original, replacement,
                                                   _draw(form, generator), dtype, table_dtype)
                checked += 1
            if mla_original is not None:
                # DeepSeek-V3's MLA path; the tables' second half is never read.
                mla = module.apply_rotary_pos_emb_interleave
                if mla is mla_original:
                    failures.append(f"{module.__name__}: apply_rotary_pos_emb_interleave not "
                                    f"patched ({handle.skipped})")
                    continue
                q, k, cos, sin = _draw("llama", generator)
                failures += _check_against_float64(
                    f"{module.__name__} ({mla.rome_form})", "llama", mla_original, mla,
                    (q, k[:, :1], cos, sin), dtype, table_dtype)
                mla_checked += 1
        finally:
            handle.undo()
        assert module.__dict__.get("apply_rotary_pos_emb") is original
        assert module.__dict__.get("apply_rotary_pos_emb_interleave") is mla_original
    assert not failures, "\n".join(failures)
    with_function = [m for m in rope_modules if "apply_rotary_pos_emb" in m.__dict__]
    assert checked >= 0.95 * len(with_function), checked
    assert mla_checked >= 12, mla_checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama4", "deepseek_v2"])
def test_complex_frequency_forms(family, dtype):
    """Llama-4's and DeepSeek-V2's ``apply_rotary_emb``: q and k [B, S, H, D] as (real, imag)
    pairs times complex64 freqs_cis ([B, S, D/2] and [S, D/2]). RoME runs (profiler), with the
    original's shapes and dtypes, correctly rounded against float64 complex math; complex128
    frequencies run the original; undo restores it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except Exception as exc:
        pytest.skip(f"transformers has no {family} here: {exc}")
    original = module.__dict__.get("apply_rotary_emb")
    if original is None:
        pytest.skip(f"{family} defines no apply_rotary_emb in this transformers")
    g = torch.Generator().manual_seed(3)
    b, s, d = 2, 5, 16
    xq = torch.randn(b, s, 3, d, generator=g).to(dtype)
    xk = torch.randn(b, s, 2, d, generator=g).to(dtype)
    shape = (b, s, d // 2) if family == "llama4" else (s, d // 2)
    angle = torch.rand(shape, generator=g, dtype=torch.float64) * 200 - 100
    freqs = torch.polar(torch.ones_like(angle), angle)
    f_b = freqs[:, :, None, :] if family == "llama4" else freqs.unsqueeze(1)
    with rome.hf.patch_module(module) as handle:
        assert module.__name__ in handle.patched, handle.skipped
        replacement = module.apply_rotary_emb
        assert replacement is not original and replacement.__name__ == "apply_rotary_emb"
        with torch.profiler.profile() as prof:
            got = replacement(xq, xk, freqs.to(torch.complex64))
        assert any(e.name == "rome::rope" for e in prof.events())
        for out, x in zip(got, (xq, xk)):
            assert out.shape == x.shape and out.dtype == x.dtype
            pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
            exact = torch.view_as_real(pairs * f_b.to(torch.complex64).to(torch.complex128))
            exact = exact.flatten(3)
            bound = _ulp(exact, dtype) + 8 * U32 * 2 * x.abs().max().item()
            assert bool(((out.double() - exact).abs() <= bound).all())
        want = original(xq, xk, freqs)  # complex128: the original's math
        for out, w in zip(replacement(xq, xk, freqs), want):
            assert torch.equal(out, w)
        # Rank 3 (flatten(3) changes the shape there) and empty x: the original's result or error.
        f64 = freqs.to(torch.complex64)
        if family == "deepseek_v2":
            x3 = torch.randn(s, 3, d, generator=g).to(dtype)
            for out, w in zip(replacement(x3, x3, f64), original(x3, x3, f64)):
                assert out.shape == w.shape and torch.equal(out, w)
        empty = xq[:, :0]
        with pytest.raises(RuntimeError) as theirs:
            original(empty, empty, f64[:, :0] if family == "llama4" else f64[:0])
        with pytest.raises(RuntimeError) as ours:
            replacement(empty, empty, f64[:, :0] if family == "llama4" else f64[:0])
        assert str(ours.value) == str(theirs.value)
    assert module.apply_rotary_emb is original


def _vision_exact(form, x, cos, sin):
    """A vision tower's rotation of x [S, H, D] by tables [S, W] in float64."""
    x, cos, sin = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    rot = cos.shape[-1]
    xr = x[..., :rot]
    if form == "pairs_vision":
        partner = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
    else:
        partner = torch.cat((-xr[..., rot // 2:], xr[..., : rot // 2]), -1)
    return torch.cat((xr * cos + partner * sin, x[..., rot:]), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_vision_function_matches_float64(rope_modules, dtype):
    """``apply_rotary_pos_emb_vision`` (Qwen2-VL's vision tower and its kin: q and k [S, H, D],
    tables [S, D], or [S, D/2] for MiniMax-M3-VL's partial form): RoME runs (profiler), with the
    original's shapes and dtypes, correctly rounded against float64; float64 inputs run the
    original."""
    g = torch.Generator().manual_seed(5)
    checked, failures = 0, []
    for module in rope_modules:
        original = module.__dict__.get("apply_rotary_pos_emb_vision")
        if original is None:
            continue
        with rome.hf.patch_module(module) as handle:
            replacement = module.apply_rotary_pos_emb_vision
            if replacement is original:
                failures.append(f"{module.__name__}: not patched ({handle.skipped})")
                continue
            form = replacement.rome_form
            width = 8 if form == "half_vision_partial" else 16
            q = torch.randn(7, 3, 16, generator=g).to(dtype)
            k = torch.randn(7, 3, 16, generator=g).to(dtype)
            angle = torch.rand(7, width // 2, generator=g, dtype=torch.float64) * 20 - 10
            if form == "pairs_vision":
                angle = angle.repeat_interleave(2, -1)
            else:
                angle = torch.cat([angle, angle], -1)
            cos, sin = angle.cos().float(), angle.sin().float()
            want = original(q, k, cos, sin)
            with torch.profiler.profile() as prof:
                got = replacement(q, k, cos, sin)
            if not any(e.name == "rome::rope" for e in prof.events()):
                failures.append(f"{module.__name__}: rome::rope did not run")
                continue
            for out, ref, x in zip(got, want, (q, k)):
                exact = _vision_exact(form, x, cos, sin)
                bound = _ulp(exact, out.dtype) + 8 * U32 * 2 * x.abs().max().item()
                if out.shape != ref.shape or out.dtype != ref.dtype:
                    failures.append(f"{module.__name__}: {out.dtype} {tuple(out.shape)} vs "
                                    f"{ref.dtype} {tuple(ref.shape)}")
                elif not bool(((out.double() - exact).abs() <= bound).all()):
                    failures.append(f"{module.__name__} ({form}): over the bound")
            wide = (q.double(), k.double(), cos.double(), sin.double())
            for out, ref in zip(replacement(*wide), original(*wide)):
                if not torch.equal(out, ref):
                    failures.append(f"{module.__name__}: float64 inputs did not run the original")
            checked += 1
        assert module.apply_rotary_pos_emb_vision is original
    assert not failures, "\n".join(failures)
    assert checked >= 20, checked


_SWAPPED_HELPER = """
import torch

def _apply_rotary_emb(x, sin, cos):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = _apply_rotary_emb(q, cos, sin)
    k_embed = _apply_rotary_emb(k, cos, sin)
    return q_embed, k_embed
"""


def test_inputs_a_form_does_not_compute_run_the_original(tmp_path, monkeypatch):
    """Tables of a higher rank than q (transformers broadcasts to the tables' rank), Perception
    Encoder's rank-4 tables (its template sums another axis then) and a helper whose arguments
    are reordered (another function under the same body) must not run RoME's math."""
    def same_as_original(module_name, args):
        module = importlib.import_module(module_name)
        original = module.apply_rotary_pos_emb
        with rome.hf.patch_module(module) as handle:
            assert module_name in handle.patched, handle
            got = module.apply_rotary_pos_emb(*args)
        want = original(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w), (module_name, g.shape, w.shape)

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 8, generator=g)
    cos, sin = _tables((1, 1, 4, 8), g)
    same_as_original("transformers.models.olmo.modeling_olmo", (q, k, cos, sin))
    same_as_original("transformers.models.pe_audio.modeling_pe_audio",
                     (q[:1, :2, :3], k[:1, :2, :3], cos[..., :3, :], sin[..., :3, :]))
    (tmp_path / "rome_swapped_helper.py").write_text(_SWAPPED_HELPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("rome_swapped_helper")
    with rome.hf.patch_module(module) as handle:
        assert handle.patched == [], handle


def test_repatch_after_a_manual_restore():
    """A handle whose patch was undone by hand does not undo a later patch."""
    module = importlib.import_module("transformers.models.olmo.modeling_olmo")
    original = module.apply_rotary_pos_emb
    first = rome.hf.patch_module(module)
    module.apply_rotary_pos_emb = original
    second = rome.hf.patch_module(module)
    replacement = module.apply_rotary_pos_emb
    first.undo()
    assert module.apply_rotary_pos_emb is replacement and second.active
    second.undo()
    assert module.apply_rotary_pos_emb is original
