"""Where Echo is faster than the 16-bit all-reduce, measured on this machine.

Quantized all-reduces have a latency floor above a 16-bit all-reduce's at
small messages and win only where bandwidth dominates; where that crossover
lies depends on the GPU, the link and P. So ``min_bytes="auto"`` (the
default) is decided at engine start from a short measurement on the real
group (:func:`calibrate`): both all-reduces on a ladder of message sizes,
the slowest rank's time for each (every rank then holds the same numbers),
and one pure function (:func:`decide`) turns them into thresholds. Every
rank computes the same thresholds from the same numbers: ranks that
disagreed on the path of a call would hang.

Echo's side of the measurement runs through the group's own backend, so
it measures the topology in use: across hosts, two-level Echo sends
2(H-1)/H x 4.5 bits per value over the network where the 16-bit
all-reduce sends ~2 x 16, and its crossover comes at smaller messages
than inside one host, where the link is fast and the kernels' floors
decide. Nothing here assumes where it lies.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

#: ``min_bytes`` that no message reaches: Echo never runs.
NEVER = 1 << 62

#: Echo must beat the 16-bit all-reduce by this factor at a size to take it
#: (measurement noise must not send a size to a slower path).
MIN_SPEEDUP = 1.02

#: Sizes measured: powers of 4 from here to the largest message the engine sends.
SMALLEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class Point:
    """One message size, both all-reduces (seconds, slowest rank)."""

    size_bytes: int
    exact_s: float
    echo_s: float

    @property
    def speedup(self) -> float:
        return self.exact_s / self.echo_s if self.echo_s > 0 else 0.0


@dataclass(frozen=True)
class Crossover:
    """Thresholds for ``EchoConfig`` and why."""

    min_bytes: int
    max_bytes: int
    """0: no upper limit (Echo kept winning up to the largest size measured)."""
    reason: str


def decide(points: Sequence[Point], *, min_speedup: float = MIN_SPEEDUP) -> Crossover:
    """Echo from the smallest measured size from which it wins at every larger
    measured size (speed-up >= ``min_speedup``) on; 16-bit below it. A size
    between a losing and a winning measurement stays 16-bit (the winning one
    is the threshold). Never Echo when it does not win at the largest size."""
    pts = sorted(points, key=lambda p: p.size_bytes)
    if not pts:
        return Crossover(NEVER, 0, "nothing measured")
    start = len(pts)
    while start > 0 and pts[start - 1].speedup >= min_speedup:
        start -= 1
    table = ", ".join(f"{_human(p.size_bytes)} {p.speedup:.2f}x" for p in pts)
    if start == len(pts):
        return Crossover(NEVER, 0, f"Echo is not faster at any measured size ({table})")
    return Crossover(pts[start].size_bytes, 0,
                     f"Echo from {_human(pts[start].size_bytes)} (speed-up over 16-bit: {table})")


def ladder(max_bytes: int, row_bytes: int) -> list[int]:
    """Sizes to measure: powers of 4 from :data:`SMALLEST_BYTES` up to
    ``max_bytes`` (and ``max_bytes`` itself), whole rows of ``row_bytes``."""
    sizes, s = [], SMALLEST_BYTES
    while s < max_bytes:
        sizes.append(s)
        s *= 4
    sizes.append(max_bytes)
    rounded = {max(row_bytes, (z // row_bytes) * row_bytes) for z in sizes}
    return sorted(rounded)


def calibrate(
    run_exact: Callable[[torch.Tensor], object],
    run_echo: Callable[[torch.Tensor], object],
    sizes: Sequence[int],
    *,
    cols: int,
    dtype: torch.dtype,
    device: torch.device,
    slowest: Callable[[list[float]], list[float]],
    iters: int = 5,
    warmup: int = 2,
) -> list[Point]:
    """Median time of ``run_exact(x)`` and ``run_echo(x)`` for messages of
    each size (rows of ``cols`` values), then ``slowest`` (the maximum over
    ranks, one small collective) so every rank holds the same numbers."""
    times: list[float] = []
    for size in sizes:
        rows = max(1, size // (cols * torch.finfo(dtype).bits // 8))
        g = torch.Generator(device=device).manual_seed(size)
        x = torch.randn(rows, cols, generator=g, device=device).to(dtype)
        for fn in (run_exact, run_echo):
            times.append(_median_s(fn, x, iters, warmup))
    times = slowest(times)
    return [Point(size, times[2 * i], times[2 * i + 1]) for i, size in enumerate(sizes)]


def _median_s(fn: Callable[[torch.Tensor], object], x: torch.Tensor, iters: int, warmup: int) -> float:
    # every call gets a fresh copy: the exact path may reduce in place
    for _ in range(warmup):
        fn(x.clone())
    samples = []
    for _ in range(iters):
        y = x.clone()
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(y)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn(y)
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _human(n: int) -> str:
    if n >= NEVER:
        return "never"
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.4g} {unit}"
    return f"{n} B"


__all__ = ["Crossover", "NEVER", "Point", "calibrate", "decide", "ladder"]
