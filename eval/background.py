"""Background interconnect traffic at a set duty cycle (the congested condition).

Echo's largest reported gains (TTFT 1.44x) came with other jobs' traffic
sharing the links. This starts one process per GPU, joined in an NCCL group
over the same GPUs the server uses, that all-reduce a fixed message in a
loop: busy for ``duty * period_ms``, idle for the rest, until stopped.

On one GPU there is no interconnect to congest: the single process copies
the message device-to-device at the same duty cycle instead (memory
bandwidth contention only), and says so.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class TrafficSpec:
    duty: float = 0.5
    """Fraction of each period spent issuing collectives (0 < duty <= 1)."""
    period_ms: float = 100.0
    message_mib: int = 256
    """All-reduce size per call; large enough to be bandwidth-bound."""
    gpus: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not 0.0 < self.duty <= 1.0:
            raise ValueError(f"duty={self.duty}: must be in (0, 1]")
        if self.period_ms <= 0 or self.message_mib <= 0:
            raise ValueError("period_ms and message_mib must be positive")


def _loop(rank: int, spec: TrafficSpec, init_file: str, stop, ready) -> None:
    import torch
    import torch.distributed as dist

    world = len(spec.gpus)
    torch.cuda.set_device(spec.gpus[rank])
    numel = spec.message_mib * (1 << 20) // 2
    buf = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    other = torch.empty_like(buf)
    if world > 1:
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
        op = lambda: dist.all_reduce(buf)  # noqa: E731
    else:
        op = lambda: other.copy_(buf)  # noqa: E731
    op()
    torch.cuda.synchronize()
    ready.put(rank)
    busy_s = spec.duty * spec.period_ms / 1000
    idle_s = (1 - spec.duty) * spec.period_ms / 1000
    calls = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy_s:
            op()
            torch.cuda.synchronize()
            calls += 1
            if world > 1:
                buf.fill_(1.0)  # keep values finite
        if idle_s:
            time.sleep(idle_s)
    if world > 1:
        dist.destroy_process_group()


class BackgroundTraffic:
    """Context manager: traffic runs while the block runs."""

    def __init__(self, spec: TrafficSpec):
        self.spec = spec
        self.procs: list[mp.Process] = []

    def __enter__(self) -> "BackgroundTraffic":
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="echo-bg-")
        init_file = os.path.join(self._tmp.name, "store")
        self.stop, ready = ctx.Event(), ctx.Queue()
        world = len(self.spec.gpus)
        if world == 1:
            print("[echo-vllm] background traffic on ONE GPU: device-to-device copies at the duty cycle "
                  "(memory contention only; there is no interconnect to congest)", file=sys.stderr)
        for r in range(world):
            p = ctx.Process(target=_loop, args=(r, self.spec, init_file, self.stop, ready), daemon=True)
            p.start()
            self.procs.append(p)
        for _ in range(world):
            ready.get(timeout=300)
        print(f"[echo-vllm] background traffic: {world} GPU(s), {self.spec.message_mib} MiB all-reduces, "
              f"duty {self.spec.duty:.0%} of {self.spec.period_ms:g} ms", file=sys.stderr)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self._tmp.cleanup()
