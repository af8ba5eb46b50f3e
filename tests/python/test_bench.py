"""End to end: `python -m rome.bench --quick` runs, writes md/csv/json/png, and every method's
precision is within its dtype's bound (RoME's within the fp32 matrix reference rounded to bf16).

The benchmark runs once per session in a subprocess (its threads and allocator settings must not
leak into this process) on the highest ISA, so the checks are marked `one_isa`.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rome
from rome.bench import report, rows

ROWS = rows.ROW_KEYS


def _env():
    """This process's environment, with the directory `rome` was imported from first on the path
    (the subprocess must run the same package, installed or not)."""
    env = dict(os.environ)
    python_dir = str(Path(rome.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = python_dir + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = _env()
    proc = subprocess.run(
        [sys.executable, "-m", "rome.bench", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return out, proc


@pytest.mark.one_isa
def test_files_written(quick_run, isa):
    out, proc = quick_run
    for ext in ("md", "csv", "json", "png"):
        path = out / f"bench.{ext}"
        assert path.is_file() and path.stat().st_size > 0, f"missing {path}"
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "bench.png").stat().st_size > 20_000  # a real chart, not an empty canvas
    md = (out / "bench.md").read_text()
    assert "| row |" in md and "RoME" in md and "bench.png" in md
    with open(out / "bench.csv") as f:
        lines = list(csv.DictReader(f))
    assert {r["row"] for r in lines} == set(ROWS)
    assert {r["method"] for r in lines} >= {"small", "matrix", "rome", "floor"}
    layouts = json.loads((out / "layouts.json").read_text())["cells"]
    # Every default variant on every layout; table-free has no out= form (its column is empty).
    assert {(c["variant"], c["layout"]) for c in layouts} >= {
        ("table_free", "bnsd"), ("table_free", "bsnd"), ("table_free", "packed"),
        ("positions", "packed"), ("half", "bnsd")}
    for c in layouts:
        assert c["inplace"] > 0 and c["fresh"] > 0 and c["floor"] > 0, c
        assert (c["out"] is None) == (c["variant"] == "table_free"), c
    assert "| half 1D, table-free | packed |" in (out / "layouts.md").read_text()
    varlen = (out / "varlen_kv.md").read_text()
    assert "RoME varlen (cu_seqlens)" in varlen and "rerotate_ paged" in varlen
    fused = (out / "fused.md").read_text()
    assert "fused_qk_norm_rope" in fused and "rotary_embedding_with_cache" in fused
    decode = (out / "hf_decode.md").read_text()
    assert "rome.hf.apply_rotary_pos_emb" in decode and "deepseek_v3" in decode
    assert "not patched" not in decode and "Error" not in decode, decode
    dense = (out / "dense.md").read_text()
    assert "rope_matrix_ (in place)" in dense and "torch autograd" in dense
    cells = json.loads((out / "dense.json").read_text())["cells"]
    assert [c["threads"] for c in cells] == sorted({1, len(os.sched_getaffinity(0))})
    for c in cells:
        for key in ("bare_mm", "rope_matrix_", "one_matrix", "two_matrix", "rome_train", "torch_train"):
            assert c[key] > 0, (key, c)
    models = json.loads((out / "models.json").read_text())
    assert models["rows"] and all("error" not in r for r in models["rows"]), models["rows"]
    assert all(r["patched"] and r["rome_s"] > 0 and r["torch_s"] > 0 for r in models["rows"]), \
        models["rows"]
    # One-ulp RoPE differences grow to ~1% of a bf16 layer's output (AMX matmuls): RoME's output
    # must be no further from the fp32 model than torch's own bf16 output.
    assert all(r["max_rel_diff"] < 5e-2 for r in models["rows"]), models["rows"]
    assert all(r["rome_error_vs_fp32"] <= 2 * r["torch_error_vs_fp32"] + 1e-3
               for r in models["rows"]), models["rows"]
    assert models["decode"]["same_tokens"] and models["decode"]["rome_tok_s"] > 0
    assert "tokens/s" in (out / "models.md").read_text()
    assert (out / "models.csv").read_text().count("\n") >= 2  # a header and a row
    assert (out / "models.png").stat().st_size > 0


@pytest.mark.one_isa
def test_terminal_output(quick_run, isa):
    _, proc = quick_run
    assert "RoME benchmark" in proc.stdout
    assert "CPU:" in proc.stdout and "threads:" in proc.stdout and "torch" in proc.stdout
    assert "Targets" in proc.stdout and "Precision" in proc.stdout
    assert proc.stderr.count("[") >= len(ROWS)  # progress lines


@pytest.mark.one_isa
def test_every_cell_timed_or_explained(quick_run, isa):
    out, _ = quick_run
    results = json.loads((out / "bench.json").read_text())
    assert [r["row"] for r in results["rows"]] == ROWS
    assert results["machine"]["isa"] == rome.active_isa() or results["machine"]["isa"] in rome.ISAS
    for r in results["rows"]:
        for key in report.TIME_COLUMNS:
            entry = r["methods"].get(key)
            assert entry is not None, (r["row"], key)
            assert entry.get("na") or entry.get("median_s", 0) > 0, (r["row"], key, entry)
        # These always run (a dense matrix has no small-ops form).
        always = ("matrix", "rome", "rome_inplace", "floor") + (() if r["matrix"] == "orthogonal" else ("small",))
        for key in always:
            assert r["methods"][key].get("median_s", 0) > 0, (r["row"], key, r["methods"][key])


@pytest.mark.one_isa
def test_matrix_path_rows(quick_run, isa):
    """Dense rows and the forced row run RoME's matrix path, report its GFLOP/s and appear in the
    Matrix path table; the permutation rows run the permute path."""
    out, proc = quick_run
    results = json.loads((out / "bench.json").read_text())
    matrix_rows = [r for r in results["rows"] if r["matrix"] != "rotate"]
    assert {r["row"] for r in matrix_rows} == {"dense_1d", "dense_3d", "dense_llm", "forced_half_1d"}
    for r in results["rows"]:
        cpp = r["methods"]["rome_cpp"]
        if "na" in cpp:
            continue
        assert cpp["path"] == ("permute" if r["matrix"] == "rotate" else "dense"), (r["row"], cpp)
    for r in results["rows"]:
        bare = r["methods"]["bare_mm"]
        if r["matrix"] == "rotate":
            assert "na" in bare, (r["row"], bare)
        else:  # PyTorch's best bare x @ M, and RoME's ratio to it
            assert bare["median_s"] > 0 and "error" not in bare, (r["row"], bare)
            assert r["derived"]["rome_inplace_to_bare_mm"] > 0, (r["row"], r["derived"])
    for r in matrix_rows:
        d = r["derived"]
        assert r["matrix_flops"] > 0 and d["rome_gflops"] > 0, (r["row"], d)
        assert r["title"] in proc.stdout
    assert "Matrix path" in proc.stdout and "## Matrix path" in (out / "bench.md").read_text()
    assert "inpl/bare mm" in proc.stdout


@pytest.mark.one_isa
def test_precision_within_bounds(quick_run, isa):
    out, _ = quick_run
    results = json.loads((out / "bench.json").read_text())
    for r in results["rows"]:
        for key, entry in r["methods"].items():
            err = entry.get("error")
            if err is None:
                continue
            assert err["max_min_abs_rel"] <= entry["error_bound"], (r["row"], key, err, entry["error_bound"])
        d = r["derived"]
        assert d["precision_ok"], (r["row"], d["rome_error"], d["fp32_reference_error"])
        # The fp32 reference rounded to bf16 is itself within half a bf16 epsilon.
        assert r["fp32_reference_error"]["max_min_abs_rel"] <= 2.0 ** -8 * 1.0001


@pytest.mark.one_isa
def test_unknown_row_rejected(tmp_path, isa):
    proc = subprocess.run([sys.executable, "-m", "rome.bench", "--rows", "nope", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and "unknown rows" in proc.stderr


@pytest.mark.one_isa
def test_streaming_memmove_threshold(monkeypatch, isa):
    """The floor's memmove: re-run under 3/4 of the sysfs L3 only where glibc's threshold is higher,
    keeping the caller's other tunables; never twice."""
    from rome.bench import glibc_streaming as g

    monkeypatch.setattr(g, "sysfs_l3_bytes", lambda: 32 << 20)
    monkeypatch.setattr(g, "current_threshold", lambda: 192 << 20)
    assert g.wanted_threshold() == 24 << 20
    monkeypatch.setattr(g, "current_threshold", lambda: 16 << 20)
    assert g.wanted_threshold() is None
    monkeypatch.setattr(g, "current_threshold", lambda: None)
    assert g.wanted_threshold() is None

    calls = []
    monkeypatch.setattr(g.os, "execve", lambda exe, argv, env: calls.append((argv, env)))
    monkeypatch.setattr(g, "current_threshold", lambda: 192 << 20)
    monkeypatch.delenv("ROME_BENCH_GLIBC_TUNED", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.arena_max=2:{g.TUNABLE}=0x1")
    g.reexec_with_streaming_memmove()
    (argv, env), = calls
    assert argv[1:3] == ["-m", "rome.bench"]
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{g.TUNABLE}={24 << 20:#x}"
    assert env["ROME_BENCH_GLIBC_TUNED"] == str(24 << 20)
    monkeypatch.setenv("ROME_BENCH_GLIBC_TUNED", str(24 << 20))
    g.reexec_with_streaming_memmove()
    assert len(calls) == 1
    assert "24 MiB" in g.describe()


@pytest.mark.one_isa
def test_bench_memmove_streams(quick_run, isa):
    """The quick run recorded memmove's threshold; where glibc's was above 3/4 of the L3 it ran
    lowered."""
    out, _ = quick_run
    machine = json.loads((out / "bench.json").read_text())["machine"]
    from rome.bench import glibc_streaming as g

    assert "glibc memmove streams above" in machine["memmove"] or "unknown" in machine["memmove"]
    if g.sysfs_l3_bytes() and g.current_threshold() and g.sysfs_l3_bytes() * 3 // 4 < g.current_threshold():
        assert "3/4 of the sysfs L3" in machine["memmove"]
