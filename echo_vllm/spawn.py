"""Run a function on P local processes joined in a gloo (or NCCL) group.

Used by the demo, the gloo benchmark and the distributed tests: rendezvous is
a ``file://`` store in a fresh temporary directory (no fixed ports, so
parallel runs never collide), results come back through a queue, and a
child that dies or raises fails the whole run with its traceback instead of
leaving the others hanging.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: A collective that waits longer than this is a bug (a rank that skipped a
#: call), not a slow machine: fail instead of hanging CI.
DEFAULT_TIMEOUT_S = 300


def _worker(rank, world_size, init_file, backend, fn, args, results, timeout_s, env):
    os.environ.update(env)
    # P processes share the machine's cores: more threads than cores per
    # process makes every collective wait on descheduled spinners.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # tensors travel as bytes: a queue would pass them by shared-memory
        # handle, which dies with the child process
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report everything, including assertion errors
        results.put((rank, "error", traceback.format_exc()))


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes;
    return the per-rank results (picklable) in rank order. ``fn`` must be a
    module-level function."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="echo-rdzv-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, backend, fn, args, results, timeout_s, env or {}),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            while len(out) + len(errors) < world_size:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead and not errors:
                        errors.append(
                            "process(es) died: "
                            + ", ".join(f"pid {p.pid} exit {p.exitcode}" for p in dead)
                        )
                    if errors:
                        break
                    continue
                if status == "ok":
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    break
        finally:
            if errors:
                for p in procs:
                    p.kill()
            for p in procs:
                p.join(timeout=timeout_s)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
