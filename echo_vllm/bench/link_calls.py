"""What every rank runs on the link testbed: the algorithms, the messages,
the calls and the check of their bits.

Shared by ``bench link`` (:mod:`.link_bench`) and its fault cases
(:mod:`.link_faults`). Each rank's message is drawn from a seed, so the
reference (:func:`reference_digests`, the plain-torch specification on P
virtual ranks) can be computed without the ranks, before they start, and
every rank compares its output's digest with it and with every other rank's
(:func:`check_bits`) before anything is timed.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..communicator import EchoCommunicator, chain_key, message_layout
from ..config import EchoConfig
from ..emulation import StackedCommunicator
from ..feedback import FeedbackChain
from ..hosts import TWO_LEVEL, choose_topology
from ..numbering import CallSlot
from ..policy import Path
from ..transport import ProcessGroupTransport, Transport, VirtualTransport
from . import report
from .allreduce_bench import STEADY

ALGOS = ("16-bit", "flat", "two-level")
"""``16-bit``: gloo's bf16 all-reduce; ``flat``: Echo over all P ranks;
``two-level``: Echo reduced inside each host first, then across hosts
(``EchoConfig(topology="two_level", host_map=...)``)."""
BASELINE = "16-bit"



def algo_refusal(algo: str, host_map: tuple[int, ...]) -> str:
    """Why ``algo`` cannot run on the testbed's placement ``host_map`` ("" if
    it can): two-level Echo needs two or more hosts of two or more ranks
    (``hosts.choose_topology``'s reason)."""
    if algo != "two-level":
        return ""
    topology, reason = choose_topology(host_map, "auto")
    return "" if topology == TWO_LEVEL else f"two-level Echo cannot run on {reason}"


def echo_config(algo: str, base: EchoConfig, host_map: tuple[int, ...]) -> EchoConfig | None:
    """The EchoConfig of ``algo`` (None for the 16-bit all-reduce): ``base``
    with its topology; the host map is the testbed's, given explicitly."""
    if algo == BASELINE:
        return None
    if algo == "flat":
        return base.replace(topology="flat")
    return base.replace(topology="two_level", host_map=host_map)


def bench_config(group_size: int) -> EchoConfig:
    """Echo as the bench runs it: every size quantized, the fastest CPU
    kernels installed (numba's loops: the reference's bits)."""
    from ..backends import fastest_cpu_backend

    return EchoConfig(group_size=group_size, min_bytes=0, backend=fastest_cpu_backend())


# -- messages and the reference ----------------------------------------------------------


def message(rank: int, size_bytes: int, hidden: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s bf16 message ``[size / (2 hidden), hidden]``: the same
    on every run, in the ranks and in :func:`reference_digests`."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + size_bytes)
    return torch.randn(size_bytes // (2 * hidden), hidden, generator=gen).to(torch.bfloat16)


def digest(t: torch.Tensor) -> str:
    """The output's bits, hashed (every rank's and the reference's compare equal or not)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


#: Calls each contender's bits are checked on: a fresh chain's first (no
#: incoming error) and second (the first's error carried in).
VERIFIED_CALLS = 2


def reference_digests(cfg: EchoConfig, size_bytes: int, world: int, hidden: int, seed: int) -> list[str]:
    """The digests of the reference's (plain torch, the specification) first
    :data:`VERIFIED_CALLS` outputs of one chain, on ``world`` virtual ranks
    holding the ranks' messages."""
    xs = torch.stack([message(r, size_bytes, hidden, seed) for r in range(world)])
    ref_cfg = cfg.replace(backend="reference")
    echo = StackedCommunicator(ref_cfg, VirtualTransport(world))
    chain = FeedbackChain.of(ref_cfg, world)
    try:
        return [digest(echo.all_reduce(xs, slot=CallSlot(call), path=Path.ECHO, chain=chain))
                for call in range(VERIFIED_CALLS)]
    finally:
        echo.close()
        chain.release()


# -- the contenders on one rank -------------------------------------------------------------


class FreeTransport(Transport):
    """Collectives that cost a copy: this rank receives what it sent (the
    all-to-all) and its own chunk from everyone (the all-gather). Echo over
    it runs its stages on one rank's real data: the kernels' share of a
    call, with nothing on the link."""

    def __init__(self, world_size: int, rank: int):
        self.world_size, self.local_ranks = world_size, (rank,)

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return send.clone()

    def all_gather(self, chunks: torch.Tensor) -> torch.Tensor:
        return chunks.expand((self.world_size,) + tuple(chunks.shape[1:])).contiguous()

    def exact_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x[0] * self.world_size


class SixteenBit:
    """gloo's bf16 all-reduce, in place on its own copy of the message."""

    def __init__(self, x: torch.Tensor):
        self.x, self.work = x, x.clone()

    def first_calls(self) -> list[torch.Tensor]:
        y = self.x.clone()
        dist.all_reduce(y)
        return [y]

    def __call__(self, i: int) -> None:
        dist.all_reduce(self.work)

    def close(self) -> None:
        pass


class EchoCalls:
    """Echo on one rank, in a forward pass's steady state: each timed call
    absorbs the error the previous one left (as ``bench allreduce``)."""

    def __init__(self, cfg: EchoConfig, x: torch.Tensor, transport: Transport):
        self.x = x
        self.echo = EchoCommunicator(cfg, transport, device=x.device)
        self.chain = FeedbackChain.of(cfg, 1, x.device)
        self.key = chain_key(x, message_layout(tuple(x.shape), transport.world_size, cfg.group_size))

    def first_calls(self) -> list[torch.Tensor]:
        return [self.echo.all_reduce(self.x, slot=CallSlot(call), path=Path.ECHO, chain=self.chain)
                for call in range(VERIFIED_CALLS)]

    def __call__(self, i: int) -> torch.Tensor:
        # the steady state of a forward pass: call 1 absorbs call 0's error
        self.chain.record(0, self.key, left_error=True)
        return self.echo.all_reduce(self.x, slot=STEADY, path=Path.ECHO, chain=self.chain)

    def close(self) -> None:
        self.echo.close()
        self.chain.release()


def contender(algo: str, cfg: EchoConfig, x: torch.Tensor, host_map: tuple[int, ...]):
    algo_cfg = echo_config(algo, cfg, host_map)
    return SixteenBit(x) if algo_cfg is None else EchoCalls(algo_cfg, x, ProcessGroupTransport())


def check_bits(algo: str, size_bytes: int, mine: list[str], expected: list[str] | None) -> None:
    """Raise (every rank) unless every rank's digests equal rank 0's and, where
    given, the reference's: a wrong answer is never timed."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    where = f"{algo} at {report.human_bytes(size_bytes)}"
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            raise RuntimeError(f"{where}: rank {r}'s output differs from rank 0's (calls {theirs} vs {every[0]})")
    if expected is not None and every[0] != expected:
        raise RuntimeError(f"{where}: the output differs from the reference's (digests {every[0]} vs {expected})")



__all__ = ["ALGOS", "BASELINE", "EchoCalls", "FreeTransport", "SixteenBit", "VERIFIED_CALLS", "algo_refusal",
           "bench_config", "check_bits", "contender", "digest", "echo_config", "message", "reference_digests"]
