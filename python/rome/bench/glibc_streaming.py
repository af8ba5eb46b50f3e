"""glibc's memmove as a streaming copy floor.

glibc's memmove switches to non-temporal stores only above ``x86_non_temporal_threshold``, 3/4 of
the shared cache size it reads from CPUID. A VM may report its host's whole L3 there: the Zen 3
VM of BENCHMARKS.md reports 256 MB against the 32 MB L3 the kernel lists in sysfs, so memmove of
anything under 192 MB read every destination line before writing it (8 GB/s against 12-14 for a
streaming copy of the same 177 MB on one thread) and a floor built on it flattered RoME.
``python -m rome.bench`` therefore re-runs itself with the threshold at 3/4 of the sysfs L3 (glibc's
own rule, on the cache the kernel reports) when that is lower than glibc's.
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
_LOADER = Path("/lib64/ld-linux-x86-64.so.2")


def current_threshold() -> Optional[int]:
    """The threshold glibc uses in a process started with this environment (None: unknown)."""
    if not _LOADER.exists():
        return None
    try:
        out = subprocess.run([str(_LOADER), "--list-tunables"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(re.escape(TUNABLE) + r": (0x[0-9a-f]+)", out)
    return int(m.group(1), 16) if m else None


def sysfs_l3_bytes() -> Optional[int]:
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            m = re.fullmatch(r"(\d+)([KMG]?)", (index / "size").read_text().strip())
        except OSError:
            return None
        if m:
            return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
    return None


def wanted_threshold() -> Optional[int]:
    """The lower threshold to run with, or None where glibc's is already at most the rule's."""
    l3, current = sysfs_l3_bytes(), current_threshold()
    if l3 is None or current is None:
        return None
    wanted = l3 * 3 // 4
    return wanted if wanted < current else None


def reexec_with_streaming_memmove() -> None:
    """Replace this process with itself under the lower threshold (once; no-op where not needed)."""
    if os.environ.get("ROME_BENCH_GLIBC_TUNED") is not None:
        return
    wanted = wanted_threshold()
    if wanted is None:
        os.environ.update(ROME_BENCH_GLIBC_TUNED="0")
        return
    env = dict(os.environ, ROME_BENCH_GLIBC_TUNED=str(wanted))
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith(TUNABLE + "=")]
    env["GLIBC_TUNABLES"] = ":".join(tunables + [f"{TUNABLE}={wanted:#x}"])
    os.execve(sys.executable, [sys.executable, "-m", "rome.bench", *sys.argv[1:]], env)


def describe() -> str:
    """For the report: what memmove's threshold was in this process."""
    tuned = os.environ.get("ROME_BENCH_GLIBC_TUNED")
    if tuned and tuned != "0":
        return (f"glibc memmove streams above {int(tuned) >> 20} MiB (3/4 of the sysfs L3; "
                f"glibc's CPUID-based threshold was higher)")
    current = current_threshold()
    return f"glibc memmove streams above {current >> 20} MiB" if current else "glibc threshold unknown"
