"""The bytes one all-reduce call sends inside its host and across hosts.

One pure function per algorithm, from the message's layout and the host of
each rank (:class:`~echo_vllm.hosts.HostMap`), for one sending rank; a
host's bytes out are the sum over its ranks (:func:`per_host`). The
collectives are counted as NCCL and gloo run them: an all-to-all sends
each chunk straight to its rank; an all-gather (and the 16-bit ring's
reduce-scatter) is a ring in rank order, each rank sending P - 1 pieces to
the next rank, so a ring crosses the host boundary once per host when the
hosts' ranks are contiguous. N values per rank, w wire bytes per value
(0.5625 at g = 32), P = H G:

===============  ======================================  ===============================
algorithm        bytes sent inside a host                bytes sent out of a host      
===============  ======================================  ===============================
16-bit ring      (G - 1) 2 (P - 1) / P 2N                2 (P - 1) / P 2N
flat Echo        (G (G - 1) + (G - 1)(P - 1)) / P wN     (G (H - 1) / H + (P - 1) / P) wN
two-level Echo   2 (G - 1) N + (G - 1) wN                2 (H - 1) / H wN
===============  ======================================  ===============================

(hosts of G contiguous ranks; two-level's in-host term 2 (G - 1) N is its
16-bit reduce-scatter; :func:`echo_bytes` counts the layout's real
chunks, padding and scales included.) ``EchoCommunicator`` puts this rank's counts in every Echo
call's record (``CallRecord.in_host_bytes``, ``cross_host_bytes``), which
``/metrics`` exports as ``echo:level_bytes_total{level}``;
``echo-vllm bench allreduce`` prints the per-host table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .hosts import TWO_LEVEL, HostMap
from .quant import WireLayout
from .two_level import shard_layout


@dataclass(frozen=True)
class LevelBytes:
    """Bytes sent inside the sender's host and to other hosts."""

    in_host: int = 0
    cross_host: int = 0

    @property
    def total(self) -> int:
        return self.in_host + self.cross_host

    def __add__(self, other: "LevelBytes") -> "LevelBytes":
        return LevelBytes(self.in_host + other.in_host, self.cross_host + other.cross_host)


def _ring(hosts: HostMap, rank: int, nbytes: int) -> LevelBytes:
    """``nbytes`` that ``rank`` sends to the next rank of a ring in rank order."""
    p = hosts.world_size
    crosses = hosts.host_of_rank[(rank + 1) % p] != hosts.host_of_rank[rank]
    return LevelBytes(0, nbytes) if crosses else LevelBytes(nbytes, 0)


def echo_bytes(layout: WireLayout, hosts: HostMap, rank: int, topology: str, elem_bytes: int = 2) -> LevelBytes:
    """Bytes ``rank`` sends in one Echo call of the message of flat
    ``layout`` (``elem_bytes``: its input's bytes per value).

    Flat: the all-to-all's P - 1 chunks (those to ranks on other hosts
    cross), then the all-gather's ring, P - 1 chunks to the next rank.
    Two-level (``hosts``' hosts equal-sized): G - 1 of its 16-bit shards
    (the in-host reduce-scatter), the cross-host all-to-all's and ring
    all-gather's H - 1 chunks each, and G - 1 times its H gathered chunks
    (the in-host all-gather).
    """
    if topology == TWO_LEVEL:
        g_ranks, h_hosts = hosts.ranks_per_host[0], hosts.hosts
        sl = shard_layout(layout, h_hosts)
        in_host = (g_ranks - 1) * (sl.numel * elem_bytes + h_hosts * sl.chunk_bytes)
        return LevelBytes(in_host, 2 * (h_hosts - 1) * sl.chunk_bytes)
    p, chunk = layout.world_size, layout.chunk_bytes
    mine = hosts.host_of_rank[rank]
    remote = sum(h != mine for h in hosts.host_of_rank)
    return LevelBytes((p - 1 - remote) * chunk, remote * chunk) + _ring(hosts, rank, (p - 1) * chunk)


def ring_bytes(numel: int, hosts: HostMap, rank: int, elem_bytes: int = 2) -> LevelBytes:
    """Bytes ``rank`` sends in a 16-bit ring all-reduce of ``numel`` values
    (reduce-scatter + all-gather, ring in rank order: 2 (P - 1) pieces of
    numel / P values to the next rank; the bandwidth-optimal all-reduce
    ``WireLayout.ring_bytes_per_rank`` counts)."""
    p = hosts.world_size
    return _ring(hosts, rank, int(2 * (p - 1) * numel * elem_bytes / p))


def per_host(hosts: HostMap, of_rank: Callable[[int], LevelBytes]) -> list[LevelBytes]:
    """Each host's bytes out: the sum of ``of_rank(r)`` over its ranks."""
    out = [LevelBytes() for _ in range(hosts.hosts)]
    for rank, host in enumerate(hosts.host_of_rank):
        out[host] = out[host] + of_rank(rank)
    return out


__all__ = ["LevelBytes", "echo_bytes", "per_host", "ring_bytes"]
