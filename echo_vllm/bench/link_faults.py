"""Faults on the link testbed: a link that drops, or a host that dies, mid-call.

Every rank runs Echo calls (or gloo's 16-bit all-reduce) back to back over
the shaped link; a second after the calls start (``after_s``) the last
host is struck:

* ``drop``: its link loses every packet both ways (tc's drop class on both
  ends): a silent partition, TCP retransmits into the void;
* ``down``: its end of the link is set down (the carrier goes);
* ``kill``: every process in its namespace (its ranks) gets SIGKILL.

What must follow: every surviving rank's call fails within gloo's timeout
(the process group's ``timeout``) with an error naming the call (which
Echo collective, which call) and, where gloo says it, the peer; no rank
returns an output from the broken call, and the calls before it agreed on
every rank. A link that comes back is not required to resume a call.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import EchoConfig
from ..transport import ProcessGroupTransport
from . import netns, report
from .link_calls import EchoCalls, SixteenBit, bench_config, digest, message

FAULTS = ("drop", "down", "kill")
#: Seconds to wait for the ranks to be ready to call (spawn, torch, numba).
READY_TIMEOUT_S = 300.0


class NamedTransport(ProcessGroupTransport):
    """A process-group transport that knows which of Echo's collectives is
    running, so that a failure can name it."""

    current = "no collective"

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        self.current = "stage-1 all-to-all"
        return super().all_to_all(send)

    def all_gather(self, chunks: torch.Tensor) -> torch.Tensor:
        self.current = "stage-2 all-gather"
        return super().all_gather(chunks)

    def exact_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.current = "16-bit all-reduce"
        return super().exact_all_reduce(x)


@dataclass(frozen=True)
class FaultPlan:
    """One fault case."""

    kind: str
    """``drop``, ``down`` or ``kill``."""
    host: int
    """The host struck."""
    algo: str
    """``flat`` (Echo) or ``16-bit``."""
    size_bytes: int
    hidden: int
    config: dict
    """EchoConfig fields."""
    ranks_per_host: int
    max_calls: int = 1000
    """Calls each rank makes at most (the fault must come first)."""


def fault_rank(rank: int, world: int, plan: FaultPlan, ready) -> dict:
    """Calls until one fails (``run_processes``' function): what failed,
    where, after how long; the digests of the calls that completed."""
    host = netns.host_map(world // plan.ranks_per_host, plan.ranks_per_host)[rank]
    x = message(rank, plan.size_bytes, plan.hidden, 0)
    transport = NamedTransport()
    calls = SixteenBit(x) if plan.algo == "16-bit" else EchoCalls(EchoConfig(**plan.config), x, transport)
    calls.first_calls()  # compiles, connects every pair
    dist.barrier()
    ready.set()
    done: list[str] = []
    for i in range(plan.max_calls):
        start = time.monotonic()
        try:
            y = calls(i)
        except Exception as e:  # gloo raises RuntimeError / DistBackendError; report whatever it is
            return {"rank": rank, "host": host, "failed_call": i,
                    "collective": transport.current if plan.algo != "16-bit" else "16-bit all-reduce",
                    "error": f"{type(e).__name__}: {' '.join(str(e).split())}", "after_s": time.monotonic() - start,
                    "at": time.time(), "completed": done}
        done.append(digest(y if y is not None else calls.work))
    return {"rank": rank, "host": host, "failed_call": None, "completed": done}


def strike(bed: netns.Testbed, kind: str, host: int) -> None:
    """Break ``host``'s link, or kill its ranks."""
    if kind == "drop":
        bed.cut(host)
    elif kind == "down":
        bed.set_link_up(host, False)
    else:
        bed.kill_host(host)


def run_fault(bed: netns.Testbed, plan: FaultPlan, *, timeout_s: float, after_s: float) -> dict:
    """Run ``plan`` on ``bed``: the ranks' reports (None for killed ranks)
    and when the fault struck (``time.time()``)."""
    from ..spawn import run_processes

    world = bed.hosts * plan.ranks_per_host
    hosts = netns.host_map(bed.hosts, plan.ranks_per_host)
    victims = frozenset(r for r in range(world) if hosts[r] == plan.host) if plan.kind == "kill" else frozenset()
    ready = mp.get_context("spawn").Event()
    struck: dict = {}

    def inject() -> None:
        if ready.wait(READY_TIMEOUT_S):
            time.sleep(after_s)
            struck["at"] = time.time()
            strike(bed, plan.kind, plan.host)

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    reports = run_processes(fault_rank, world, plan, ready, rank_setup=bed.placement(plan.ranks_per_host),
                            timeout_s=timeout_s, may_die=victims)
    injector.join()
    return {"struck_at": struck.get("at"), "reports": reports, "victims": sorted(victims)}


def fault_verdicts(result: dict, timeout_s: float, slack_s: float) -> list[str]:
    """What went wrong (empty: every surviving rank failed in time, naming
    the call, and the calls before the fault agreed on every rank)."""
    bad = []
    struck = result["struck_at"]
    if struck is None:
        return ["the fault never struck (the ranks were not ready)"]
    survivors = [r for r in result["reports"] if r is not None]
    for r in survivors:
        if r["failed_call"] is None:
            bad.append(f"rank {r['rank']}: all its calls completed (the fault did not reach it)")
        elif r["at"] - struck > timeout_s + slack_s:
            bad.append(f"rank {r['rank']}: failed {r['at'] - struck:.1f} s after the fault, "
                       f"beyond the timeout {timeout_s:g} s + {slack_s:g} s")
    completed = [r["completed"] for r in survivors]
    common = min((len(c) for c in completed), default=0)
    if any(c[:common] != completed[0][:common] for c in completed):
        bad.append("the calls completed before the fault differ between ranks")
    return bad


def format_fault(result: dict, plan: FaultPlan, timeout_s: float) -> str:
    lines = [f"fault {plan.kind} on host {plan.host} ({plan.algo}, {report.human_bytes(plan.size_bytes)}); "
             f"gloo timeout {timeout_s:g} s"]
    struck = result["struck_at"]
    for rank, r in enumerate(result["reports"]):
        if r is None:
            lines.append(f"  rank {rank}: killed")
        elif r["failed_call"] is None:
            lines.append(f"  rank {rank} (host {r['host']}): {len(r['completed'])} calls, no failure")
        else:
            peer = _peer(r["error"])
            lines.append(f"  rank {rank} (host {r['host']}): call {r['failed_call']} ({r['collective']}) failed "
                         f"{r['at'] - struck:.2f} s after the fault, {r['after_s']:.2f} s into the call"
                         f"{f', peer host {peer}' if peer is not None else ''}: {r['error'][:300]}")
    return "\n".join(lines)


def _peer(error: str) -> int | None:
    """The host of the peer gloo's error names (``[198.18.0.2]:port``), if any."""
    import re

    m = re.search(r"\[?(198\.18\.\d+\.\d+)\]?", error)
    return netns.host_of_address(m.group(1)) if m else None


def run_fault_command(args: argparse.Namespace) -> int:
    """``echo-vllm bench link --fault KIND``."""
    plan = FaultPlan(kind=args.fault, host=args.hosts - 1, algo="16-bit" if args.algos == ["16-bit"] else "flat",
                     size_bytes=max(args.sizes), hidden=args.hidden, config=bench_config(args.group_size).to_dict(),
                     ranks_per_host=args.ranks_per_host)
    with netns.Testbed(args.hosts, netns.LinkShape(args.rate[0], delay_s=args.delay, loss=args.loss)) as bed:
        print(f"testbed: {bed.describe()}")
        result = run_fault(bed, plan, timeout_s=args.timeout_s, after_s=args.fault_after_s)
    print(format_fault(result, plan, args.timeout_s))
    bad = fault_verdicts(result, args.timeout_s, slack_s=max(5.0, 0.5 * args.timeout_s))
    for line in bad:
        print(f"FAIL: {line}")
    if not bad:
        print("every surviving rank failed within the timeout, naming the call; no rank returned a broken call's output")
    return 1 if bad else 0


__all__ = ["FAULTS", "FaultPlan", "NamedTransport", "fault_rank", "fault_verdicts", "format_fault", "run_fault",
           "strike"]
