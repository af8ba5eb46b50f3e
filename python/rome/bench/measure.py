"""Timing (median of repeats after warm-up) and precision (against a float64 reference)."""

import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch

from .rows import Inputs, matrix64

def faster_of(candidates: Dict[str, Callable[[], object]]) -> Tuple[str, Dict[str, float]]:
    """The name of the faster callable after one warm-up and one timed call each, and every
    candidate's time (to pick the dtype a baseline runs in, e.g. torch's bf16 vs fp32 matmul)."""
    seconds = {}
    for name, fn in candidates.items():
        fn()
        t0 = time.perf_counter()
        fn()
        seconds[name] = time.perf_counter() - t0
    return min(seconds, key=seconds.get), seconds


def median_per_call_s(fn: Callable[[], object], samples: int, inner: int = 1) -> float:
    """Seconds per call: `inner` warm-up calls, then the median over `samples` runs of `inner`
    back-to-back calls each (inner > 1 for calls of microseconds)."""
    for _ in range(inner):
        fn()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def round_robin_samples(fns: Dict[str, Callable[[], object]], rounds: int, warmup: int,
                        inner: int = 1) -> Dict[str, List[float]]:
    """Seconds per call of each name in each of `rounds` rounds, every name sampled once per
    round (`inner` back-to-back calls a sample), after `warmup` calls of each: on a shared
    machine a burst of other work then hits every name, not one name's whole series."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[key].append((time.perf_counter() - t0) / inner)
    return samples


# Precision bound for the metric max(min(abs err, rel err)), per method: half an epsilon of the
# output dtype (the final rounding, unavoidable) plus 8 epsilons of the dtype the method computes
# in (bf16 math with bf16 tables rounds about 4 times per output). Epsilons: bf16 2^-7, fp16
# 2^-10, fp32 2^-23. A wrong rotation or table gives errors of order 1.
EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}
BOUND_ULPS = 8


def precision_bound(compute: torch.dtype, out: torch.dtype = torch.bfloat16) -> float:
    return 0.5 * EPS[out] + BOUND_ULPS * EPS[compute]


@dataclass
class Timing:
    median_s: float
    min_s: float
    repeats: int
    inner: int
    samples: List[float] = field(default_factory=list)


class Plan:
    """How one method is sampled: `inner` back-to-back calls per sample (enough to last
    `min_sample_s`: decode shapes), `samples_wanted` samples (`repeats`; at least 20 for such
    fast calls; fewer, but at least 3, when a cell would exceed `budget_s`)."""

    def __init__(self, fn, inner: int, samples_wanted: int):
        self.fn, self.inner, self.samples_wanted = fn, inner, samples_wanted
        self.samples: List[float] = []

    def due(self, round_index: int, rounds: int) -> bool:
        """Spreads samples_wanted samples evenly over `rounds` rounds."""
        n = self.samples_wanted
        return (round_index + 1) * n // rounds > round_index * n // rounds

    def sample(self):
        fn, inner = self.fn, self.inner
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        self.samples.append((time.perf_counter() - t0) / inner)

    def timing(self) -> "Timing":
        s = self.samples
        return Timing(statistics.median(s), min(s), len(s), self.inner, list(s))


def plan(fn: Callable[[], object], repeats: int, warmup: int, budget_s: float,
         min_sample_s: float = 1e-3) -> Tuple[Plan, object]:
    """Warms `fn` up and plans its samples. Returns (plan, an output of fn)."""
    out = None
    for _ in range(max(1, warmup)):
        out = fn()
    once = math.inf
    for _ in range(2):  # the faster of two calls: one descheduled call must not set the plan
        t0 = time.perf_counter()
        out = fn()
        once = min(once, time.perf_counter() - t0)
    inner = 1 if once >= min_sample_s else min(10000, math.ceil(min_sample_s / max(once, 1e-7)))
    n = repeats if inner == 1 else max(repeats, 20)
    if once * inner * n > budget_s:
        n = max(3, min(n, int(budget_s / max(once * inner, 1e-9))))
    return Plan(fn, inner, n), out


def time_call(fn: Callable[[], object], repeats: int, warmup: int, budget_s: float,
              min_sample_s: float = 1e-3) -> Tuple[Timing, object]:
    """Median seconds per call of one method on its own (see :func:`plan`)."""
    p, out = plan(fn, repeats, warmup, budget_s, min_sample_s)
    for _ in range(p.samples_wanted):
        p.sample()
    return p.timing(), out


# ------------------------------------------------------------------------------------------------
# Precision


@dataclass
class Precision:
    max_min_abs_rel: float  # the original work's metric: max over elements of min(abs, rel)
    max_abs: float
    max_rel: float


class Reference:
    """float64 reference of a row on a slice: head 0 of q (and of k), every position."""

    def __init__(self, inp: Inputs):
        row = inp.row
        self.row = row
        cos, sin = inp.lane_tables64()  # [S, 128]
        self.mat = matrix64(row)
        self.slices = [t[:, :1] for t in inp.operands()]
        self.refs = [x.double() * cos + (x.double() @ self.mat) * sin for x in self.slices]
        # The fp32 matrix reference rounded to bf16: the precision target for RoME.
        c32, s32 = cos.float(), sin.float()
        m32 = self.mat.float()
        self.fp32_ref = [(x.float() * c32 + (x.float() @ m32) * s32).to(torch.bfloat16) for x in self.slices]

    @property
    def description(self) -> str:
        return "head 0 of " + ("q and k" if len(self.slices) > 1 else "x") + f", all {self.row.seq} positions"

    def error(self, outputs) -> Precision:
        worst = Precision(0.0, 0.0, 0.0)
        for out, ref in zip(outputs, self.refs):
            got = out[:, :1].double()
            err = (got - ref).abs()
            rel = err / ref.abs()
            metric = torch.minimum(err, rel)  # rel is inf/nan where ref == 0
            metric = torch.where(ref == 0, err, metric)
            rel_finite = torch.where(ref == 0, torch.zeros_like(rel), rel)
            worst = Precision(
                max(worst.max_min_abs_rel, float(metric.max())),
                max(worst.max_abs, float(err.max())),
                max(worst.max_rel, float(rel_finite.max())),
            )
        return worst

    def fp32_reference_error(self) -> Precision:
        """Error of the fp32 matrix form rounded once to bf16 (already a head-0 slice)."""
        return self.error(self.fp32_ref)


def free_memory():
    gc.collect()
