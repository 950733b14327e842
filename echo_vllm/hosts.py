"""Which host each rank of a group is on, and the choice between flat and two-level Echo.

A group's ranks sit on H hosts. Inside a host the link is fast (NVLink,
shared memory); across hosts it is the network, 10x or more slower per
GPU. Flat Echo (one two-shot over all P ranks) sends each rank's 4-bit
chunks straight to every remote rank; two-level Echo (:mod:`echo_vllm.two_level`)
reduces inside the host first and sends only 2(H-1)/H x 4.5 bits per value
out of each host, whatever its number of GPUs.

* :class:`HostMap`: the host of each rank, numbered by first rank; each
  rank's *local index* (its place among its host's ranks, in rank order),
  the in-host groups and the cross-host groups (the ranks with the same
  local index, one per host, in host order).
* :func:`choose_topology`: flat or two-level (a pure function, with its
  reason, called once per group by ``backends.make_backend``).
* :func:`host_map_refusal`: a configured ``host_map`` that does not fit the
  group, as one line.
* :func:`transport_hosts`: ask the group (a collective, once per group):
  the ranks' host names over ``torch.distributed``; in-process virtual ranks
  share one host. The vLLM glue uses vLLM's own node test instead
  (``vllm_glue.communicator``).

Ranks of a host need not be contiguous (``0,1,0,1`` is two hosts of two):
the groups are defined by the map, not by rank ranges. What two-level does
need is that every cross-host group lists the hosts in the same order (host
h's k-th rank before host h+1's k-th rank for every k): its stage-2 sums
run in rank order, and the chunk a rank owns is its host's index. Every
contiguous or round-robin map has that; a map without it (``0,1,1,0``) runs
flat, with the reason.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from .config import TOPOLOGY_CHOICES, EchoConfigError


@dataclass(frozen=True)
class HostMap:
    """The host of each rank of a group (``host_of_rank[r]``, hosts numbered
    0, 1, ... by their first rank: :meth:`of` renumbers any labels)."""

    host_of_rank: tuple[int, ...]

    @classmethod
    def of(cls, labels: Sequence[object]) -> "HostMap":
        """The map of ranks whose hosts carry ``labels`` (any hashable values,
        one per rank in rank order; equal labels, same host)."""
        number: dict[object, int] = {}
        return cls(tuple(number.setdefault(label, len(number)) for label in labels))

    @property
    def world_size(self) -> int:
        return len(self.host_of_rank)

    @cached_property
    def in_host_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of each host, host by host, each in rank order."""
        groups: list[list[int]] = [[] for _ in range(max(self.host_of_rank, default=-1) + 1)]
        for rank, host in enumerate(self.host_of_rank):
            groups[host].append(rank)
        return tuple(tuple(g) for g in groups)

    @property
    def hosts(self) -> int:
        return len(self.in_host_groups)

    @cached_property
    def ranks_per_host(self) -> tuple[int, ...]:
        return tuple(len(g) for g in self.in_host_groups)

    def local_index(self, rank: int) -> int:
        """``rank``'s place among its host's ranks (rank order)."""
        return self.in_host_groups[self.host_of_rank[rank]].index(rank)

    @cached_property
    def cross_host_groups(self) -> tuple[tuple[int, ...], ...]:
        """For each local index k (hosts of equal size only): host 0's k-th
        rank, host 1's k-th rank, ... (host order)."""
        sizes = set(self.ranks_per_host)
        if len(sizes) != 1:
            raise ValueError(f"hosts of {sorted(sizes)} ranks: cross-host groups need hosts of equal size")
        return tuple(zip(*self.in_host_groups))

    def describe(self) -> str:
        """``2 hosts x 4 ranks`` or ``3 hosts (2, 2, 1 ranks)``."""
        sizes = self.ranks_per_host
        if len(set(sizes)) == 1:
            return f"{self.hosts} host{'s' if self.hosts > 1 else ''} x {sizes[0]} rank{'s' if sizes[0] > 1 else ''}"
        return f"{self.hosts} hosts ({', '.join(map(str, sizes))} ranks)"


#: ``choose_topology``'s answers.
FLAT, TWO_LEVEL = "flat", "two_level"


def choose_topology(host_of_rank: Sequence[int], requested: str, *, stochastic: bool = False) -> tuple[str, str]:
    """``(topology, reason)`` for a group whose rank r is on host
    ``host_of_rank[r]`` (any labels), ``requested`` one of
    ``EchoConfig.topology``'s values.

    ``flat`` is taken as asked. Two-level needs 2 or more hosts, the same
    number of ranks on each, 2 or more of them, cross-host groups in one
    host order (module docstring) and rounding to nearest (``stochastic``:
    its noise is drawn per rank of the flat path); ``auto`` takes it where
    all hold and flat otherwise, with the first that fails as the reason;
    an explicit ``two_level`` that fails one raises :class:`EchoConfigError`
    naming it.
    """
    if requested not in TOPOLOGY_CHOICES:
        raise EchoConfigError(f"topology={requested!r}: choose one of {', '.join(TOPOLOGY_CHOICES)}")
    hosts = HostMap.of(host_of_rank)
    if requested == FLAT:
        return FLAT, f"configured ({hosts.describe()})"
    why_not = _two_level_refusal(hosts, stochastic)
    if not why_not:
        return TWO_LEVEL, f"{hosts.describe()}" + (" (configured)" if requested == TWO_LEVEL else "")
    if requested == TWO_LEVEL:
        raise EchoConfigError(f"topology='two_level' cannot run on this group: {why_not}")
    return FLAT, why_not


def _two_level_refusal(hosts: HostMap, stochastic: bool) -> str:
    """Why two-level cannot run on ``hosts`` ("" if it can)."""
    sizes = hosts.ranks_per_host
    if hosts.hosts < 2:
        return f"{hosts.describe()}: one host, nothing crosses the network"
    if len(set(sizes)) > 1:
        return f"{hosts.describe()}: hosts of unequal size (two-level needs the same number of ranks on each)"
    if sizes[0] < 2:
        return f"{hosts.describe()}: one rank per host, two-level would be flat"
    for k, group in enumerate(hosts.cross_host_groups):
        if list(group) != sorted(group):
            return (f"{hosts.describe()}: local rank {k} of each host comes in another host order "
                    f"(ranks {list(group)}); number the ranks host by host or round-robin")
    if stochastic:
        return f"{hosts.describe()}: stochastic rounding runs flat"
    return ""


def host_map_refusal(host_map: Sequence[int] | None, world_size: int) -> str:
    """Why a configured ``host_map`` cannot describe a group of
    ``world_size`` ranks ("" if it can, or if none is configured)."""
    if host_map is None or len(host_map) == world_size:
        return ""
    return (f"host_map={','.join(map(str, host_map))} names {len(host_map)} rank{'s' if len(host_map) != 1 else ''} "
            f"but the group has {world_size}: give the host of every rank, in group-rank order")


def check_host_map(host_map: Sequence[int] | None, world_size: int) -> None:
    """Raise :class:`EchoConfigError` with :func:`host_map_refusal`'s line."""
    refusal = host_map_refusal(host_map, world_size)
    if refusal:
        raise EchoConfigError(refusal)


def host_key() -> int:
    """This machine's key: 63 bits of a hash of its host name (equal names,
    one host: set ``host_map`` where hosts share a name)."""
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def transport_hosts(transport: object) -> HostMap:
    """The hosts of ``transport``'s ranks: one all-gather of :func:`host_key`
    over a ``torch.distributed`` group (a collective: every rank calls it at
    the same point); one host for in-process virtual ranks and for any
    other transport (whose bytes this process cannot place)."""
    from .transport import ProcessGroupTransport

    if isinstance(transport, ProcessGroupTransport):
        device = "cuda" if transport.backend == "nccl" else "cpu"
        mine = torch.tensor([host_key()], dtype=torch.int64, device=device)
        every = torch.empty(transport.world_size, dtype=torch.int64, device=device)
        torch.distributed.all_gather_into_tensor(every, mine, group=transport.group)
        return HostMap.of(every.tolist())
    return HostMap((0,) * transport.world_size)  # type: ignore[attr-defined]


__all__ = ["FLAT", "TWO_LEVEL", "HostMap", "check_host_map", "choose_topology", "host_key", "host_map_refusal",
           "transport_hosts"]
