"""Timers that tell the truth about short GPU operations.

* CUDA events around each call, after warm-up; the median of the samples is
  reported (robust to the odd preempted iteration), the minimum is kept.
* Calls rotate through several input buffers so that a small message is not
  served from L2 every time (``rotation``).
* Below ~1 MiB a call costs less than its own launch overhead; there the
  calls are captured into a CUDA graph (``calls_per_graph`` calls each) and
  the graph is replayed, which measures the device time the way a CUDA-graph
  serving loop (vLLM's decode) sees it.
* On CPU (gloo) a host clock brackets each call between barriers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

#: Messages below this are timed by CUDA-graph replay.
GRAPH_BELOW_BYTES = 1 << 20


@dataclass
class Timing:
    """Seconds per call."""

    samples_s: list[float] = field(default_factory=list)
    probes: list[tuple[object, object]] = field(default_factory=list)
    """``(before, after)`` values of :func:`host_time`'s ``probe`` around each sample."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def max_s(self) -> float:
        return max(self.samples_s)

    def to_dict(self) -> dict:
        return {"median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s, "samples": len(self.samples_s)}


def rotation(nbytes: int, *, min_total_bytes: int = 256 << 20, max_buffers: int = 16) -> int:
    """How many input buffers to cycle through: enough that together they
    exceed the caches (H200 L2: 50 MB), at least 2, at most ``max_buffers``."""
    return max(2, min(max_buffers, -(-min_total_bytes // max(nbytes, 1))))


def cuda_time(run: Callable[[int], object], *, iters: int = 20, warmup: int = 5) -> Timing:
    """Median over ``iters`` eager calls ``run(i)``, each bracketed by events."""
    for i in range(warmup):
        run(i)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        start.record()
        run(warmup + i)
        end.record()
    torch.cuda.synchronize()
    return Timing([s.elapsed_time(e) * 1e-3 for s, e in events])


def cuda_mean_s(fn: Callable[[], object], *, reps: int = 30, warmup: int = 3) -> float:
    """Mean seconds per call of ``reps`` back-to-back launches of ``fn()``
    between two events (launches queue up: the device time of a stream of
    calls, as a kernel sees it inside a larger pass)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / reps


def cuda_graph_time(
    run: Callable[[int], object], *, iters: int = 20, warmup: int = 3, calls_per_graph: int = 10
) -> Timing:
    """Median over ``iters`` replays of a graph of ``calls_per_graph`` calls,
    divided by ``calls_per_graph``. ``run`` must be capturable (no host sync,
    no allocation that grows a caching pool mid-capture is fine)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: compile kernels, build NCCL comms
        for i in range(warmup):
            run(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            run(i)
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return Timing([s.elapsed_time(e) * 1e-3 / calls_per_graph for s, e in events])


def host_time(
    run: Callable[[int], object],
    *,
    iters: int = 5,
    warmup: int = 1,
    barrier: Callable[[], object] | None = None,
    probe: Callable[[], object] | None = None,
) -> Timing:
    """Median wall time of ``run(i)`` with a barrier before each call (so a
    rank that finished early does not count its wait as the next call).
    ``probe()`` is read after the opening barrier and after the closing one
    of each timed call, outside the clock (the link bench's interface
    counters); the pairs land in ``Timing.probes``."""
    return interleaved_host_time({"": run}, iters=iters, warmup=warmup, barrier=barrier, probe=probe)[""]


def interleaved_host_time(
    runs: dict[str, Callable[[int], object]],
    *,
    iters: int = 5,
    warmup: int = 1,
    barrier: Callable[[], object] | None = None,
    probe: Callable[[], object] | None = None,
) -> dict[str, Timing]:
    """:func:`host_time` of several contenders, their timed calls taken in
    turn (a, b, a, b, ...) after each one's warm-up: on a shared machine a
    load that comes and goes falls on all of them alike, not on whichever
    ran last."""
    for run in runs.values():
        for i in range(warmup):
            run(i)
    out = {name: Timing() for name in runs}
    for i in range(iters):
        for name, run in runs.items():
            if barrier is not None:
                barrier()
            before = probe() if probe is not None else None
            t0 = time.perf_counter()
            run(warmup + i)
            if barrier is not None:
                barrier()
            out[name].samples_s.append(time.perf_counter() - t0)
            if probe is not None:
                out[name].probes.append((before, probe()))
    return out
