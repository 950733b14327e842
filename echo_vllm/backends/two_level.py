"""Two-level Echo across hosts as one backend: stage functions around two sub-transports.

:class:`TwoLevelBackend` runs :mod:`echo_vllm.two_level`'s algorithm with
any :class:`~echo_vllm.backends.stages.StageOps` (references, numba loops,
Triton kernels) over two splits of the group's transport
(``Transport.split``): the *in-host* groups (a host's ranks) carry the
16-bit reduce-scatter and the all-gather of the 4-bit chunks; the
*cross-host* groups (the ranks with the same local index, one per host)
carry the flat two-shot's all-to-all and all-gather with P = H. The output
stage is the flat layout's, so its bits (and ``output_norm``'s) are those
of :func:`echo_vllm.two_level.two_level_reference` on every rank.

Built by :func:`echo_vllm.backends.make_backend` when the topology is
two-level (:func:`echo_vllm.hosts.choose_topology`); building it is a
collective where the ranks are processes (``torch.distributed.new_group``
per sub-group, members only). On CUDA the stages are Triton's: the fused
symmetric-memory kernel runs inside one host only.
"""

from __future__ import annotations

import torch

from .. import two_level
from ..config import EchoConfig
from ..hosts import TWO_LEVEL, HostMap
from ..quant import WireLayout
from ..transport import Transport
from .composed import ComposedBackend
from .stages import StageOps

#: A sub-transport and the positions of its ranks among the parent's local ranks.
Part = tuple[Transport, tuple[int, ...]]


class TwoLevelBackend(ComposedBackend):
    """Echo over ``hosts``' hosts: in-host reduce-scatter, cross-host Echo on
    each rank's shard, in-host all-gather of the 4-bit chunks (see the
    module docstring). ``in_host`` / ``cross_host``: the parts of
    ``transport.split`` over ``hosts.in_host_groups`` / ``cross_host_groups``
    (:meth:`over` makes them)."""

    topology = TWO_LEVEL

    def __init__(self, config: EchoConfig, transport: Transport, stages: StageOps, hosts: HostMap,
                 in_host: list[Part], cross_host: list[Part]):
        if config.rounding == "stochastic":
            raise ValueError("two-level Echo rounds to nearest: rounding='stochastic' runs flat")
        super().__init__(config, transport, stages)
        self.hosts = hosts
        self.in_host = in_host
        self.cross_host = cross_host
        self._host = [hosts.host_of_rank[r] for r in transport.local_ranks]
        self._local = [hosts.local_index(r) for r in transport.local_ranks]

    @classmethod
    def over(cls, config: EchoConfig, transport: Transport, stages: StageOps, hosts: HostMap, *,
             split: Transport | None = None) -> "TwoLevelBackend":
        """The backend with its sub-transports split from ``split`` (default
        ``transport``; the vLLM glue splits the group's torch.distributed
        group where ``transport`` is pynccl): a collective, in-host groups
        first, then cross-host ones, on every rank."""
        split = transport if split is None else split
        return cls(config, transport, stages, hosts, split.split(hosts.in_host_groups),
                   split.split(hosts.cross_host_groups))

    @property
    def capturable(self) -> bool:
        return all(t.capturable for t, _ in self.in_host + self.cross_host)

    def feedback_numel(self, layout: WireLayout) -> int:
        return two_level.shard_layout(layout, self.hosts.hosts).padded_numel

    def _exchange(self, xs, layout, feedback, has_incoming):
        """The flat layout's gathered chunks ``[P, chunk_bytes]``: the three
        steps of the module docstring, each local rank on its own shard."""
        cfg, st = self.config, self.stages
        g_ranks, h_hosts = self.hosts.ranks_per_host[0], self.hosts.hosts
        sl = two_level.shard_layout(layout, h_hosts)
        shards = two_level.to_shards(xs, layout, g_ranks)
        # positions by basic indexing only: a list index is a host-to-device copy, which graph capture refuses
        sums: list[torch.Tensor | None] = [None] * xs.shape[0]
        for tr, pos in self.in_host:  # 1. the 16-bit shards as bytes (gloo has no bf16 all-to-all)
            recv = tr.all_to_all(torch.stack([shards[p] for p in pos]).view(torch.uint8))
            host_sums = two_level.host_sum_reference(recv.view(xs.dtype))
            for i, p in enumerate(pos):
                sums[p] = host_sums[i : i + 1]

        def rows(t: torch.Tensor | None, p: int) -> torch.Tensor | None:
            return None if t is None else t[p : p + 1]

        chunks: list[torch.Tensor | None] = [None] * xs.shape[0]
        for tr, pos in self.cross_host:  # 2. Echo over the hosts, each local rank on its shard
            wire = torch.cat([st.stage1(sums[p], rows(feedback, p), sl, qmax=cfg.qmax, hadamard=cfg.hadamard,
                                        has_incoming=has_incoming, flips=self.flips, encoder=cfg.encoder) for p in pos])
            recv = tr.all_to_all(wire)
            q2 = torch.cat([st.stage2(recv[i : i + 1], rows(feedback, p), [self._host[p]], sl, qmax=cfg.qmax,
                                      encoder=cfg.encoder)
                            for i, p in enumerate(pos)])
            gathered = tr.all_gather(q2)
            for p in pos:
                chunks[p] = gathered
        # 3. every host gathers the same chunks: the first part's ranks stand for all
        tr, pos = self.in_host[0]
        mine = torch.stack([chunks[p].reshape(-1) for p in pos])
        return tr.all_gather(mine).view(layout.world_size, layout.chunk_bytes)

    def consume(self, xs, layout, feedback):
        """Each local rank's input with its carried error added on its shard's columns."""
        g_ranks = self.hosts.ranks_per_host[0]
        sl = two_level.shard_layout(layout, self.hosts.hosts)
        shards = two_level.to_shards(xs, layout, g_ranks)
        out = xs.clone()
        for p, l in enumerate(self._local):
            absorbed = self.stages.consume(shards[p : p + 1, l], feedback[p : p + 1], sl, hadamard=self.config.hadamard,
                                           flips=self.flips)
            two_level.put_shard(out[p : p + 1], absorbed, layout, l, g_ranks)
        return out


__all__ = ["TwoLevelBackend"]
