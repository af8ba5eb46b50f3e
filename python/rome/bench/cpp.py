"""The "RoME (C++)" column: runs the rome_timer program (bench/timer/rome_timer.cpp), which calls
the C++ library without PyTorch and also times a copy of the same bytes in its own process."""

import json
import os
import subprocess
from pathlib import Path
from typing import Optional

from .rows import Row


def find_timer(explicit: Optional[str] = None) -> Optional[Path]:
    """--timer, then $ROME_TIMER, then build/rome_timer in the source tree or the working
    directory."""
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    if os.environ.get("ROME_TIMER"):
        candidates.append(Path(os.environ["ROME_TIMER"]))
    here = Path(__file__).resolve()
    for parent in list(here.parents)[:4]:
        candidates.append(parent / "build" / "rome_timer")
    candidates.append(Path.cwd() / "build" / "rome_timer")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def command(timer: Path, row: Row, threads: int, repeats: int) -> list:
    rotation = "dense" if row.dense else row.mode
    cmd = [str(timer), "--rotation", rotation, "--q", ",".join(map(str, row.q_shape)),
           "--dtype", "bf16", "--table-dtype", "f32", "--threads", str(threads),
           "--repeats", str(repeats), "--warmup", "2"]
    if row.multi_axis:
        cmd += ["--blocks", ",".join(map(str, row.dims))]
    if row.k_shape is not None:
        cmd += ["--k", ",".join(map(str, row.k_shape))]
    if row.cache:
        cmd += ["--cache", str(row.cache)]
    if row.matrix == "forced":
        cmd += ["--force-dense"]
    return cmd


def run(timer: Path, row: Row, threads: int, repeats: int, timeout: float = 300.0) -> dict:
    """The timer's JSON (times in seconds) plus the command line."""
    cmd = command(timer, row, threads, repeats)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["command"] = " ".join(cmd)
    return out
