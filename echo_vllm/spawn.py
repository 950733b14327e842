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


def _worker(rank, world_size, init_file, backend, fn, args, results, timeout_s, env, rank_setup=None):
    os.environ.update(env)
    if rank_setup is not None:  # before any thread or socket: a network namespace binds only those made after
        rank_setup(rank, world_size)
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


#: How :func:`run_processes` starts processes: ``spawn``, a fresh interpreter
#: each; ``forkserver``, forked from multiprocessing's fork server, which
#: imports the modules given to ``set_forkserver_preload`` once (the tests
#: fork their vLLM ranks from one server that imported vLLM).
START_METHODS = ("spawn", "forkserver")
#: Most processes one run starts: each is a Python interpreter with torch
#: (hundreds of MB); far more than any tensor-parallel group.
MAX_PROCESSES = 256
#: Longest collective timeout: a day (a longer wait is a hang).
MAX_TIMEOUT_S = 24 * 3600


def check_run_arguments(fn: Any, world_size: Any, backend: Any, timeout_s: Any, start_method: Any = "spawn") -> None:
    """Raise ``ValueError`` naming the first argument :func:`run_processes`
    cannot run with."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_PROCESSES:
        raise ValueError(f"world_size={world_size!r}: must be an integer from 1 to {MAX_PROCESSES} "
                         "(each rank is a process with its own torch)")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: gloo or nccl")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s={timeout_s!r}: must be a number of seconds above 0, at most {MAX_TIMEOUT_S}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}: one of {', '.join(START_METHODS)}")
    if not callable(fn) or any(part in getattr(fn, "__qualname__", "") for part in ("<locals>", "<lambda>")):
        raise ValueError(f"fn={fn!r}: must be a module-level function (a spawned process imports it by name)")


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    start_method: str = "spawn",
    rank_setup: Callable[[int, int], None] | None = None,
    may_die: frozenset[int] = frozenset(),
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes
    (or forked from the fork server, ``start_method="forkserver"``); return
    the per-rank results (picklable) in rank order. ``fn`` must be a
    module-level function. Bad arguments raise ``ValueError`` here, before
    any process starts (a child could only report a pickling error).

    ``rank_setup(rank, world_size)``: a picklable callable each child runs
    first, before the process group (the link testbed puts each rank in
    its host's network namespace). ``may_die``: ranks a fault test kills on
    purpose; their death fails nothing and their result is None. However
    this call ends (an error, Ctrl-C, a signal handler's ``SystemExit``),
    no child outlives it."""
    check_run_arguments(fn, world_size, backend, timeout_s, start_method)
    if not set(may_die) <= set(range(world_size)):
        raise ValueError(f"may_die={sorted(may_die)}: ranks from 0 to {world_size - 1}")
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="echo-rdzv-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, backend, fn, args, results, timeout_s, env or {}, rank_setup),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        ended = False
        try:
            while len(out) + len(errors) < world_size:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    for r in may_die:
                        if procs[r].exitcode not in (None, 0):
                            out.setdefault(r, None)
                    dead = [p for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in may_die]
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
            ended = True
        finally:
            if errors or not ended:  # a failed rank, or this process interrupted: stop the rest now
                for p in procs:
                    p.kill()
            for p in procs:
                p.join(timeout=timeout_s)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
