"""Composed backends: stage functions around a transport's collectives.

The two-shot algorithm, for P ranks, rank r holding x_r and a carried error e_r:

1. stage 1 (every rank): u_r = rot(x_r) + e_r in fp32; q_r = Q(u_r);
   e_r <- u_r - D(q_r). Chunk j of q_r goes to rank j (all-to-all).
2. stage 2 (rank j): s_j = sum_r D(q_r[j]) in fp32, rank order;
   q2_j = Q(s_j); e_j[chunk j] += s_j - D(q2_j). All-gather q2.
3. output (every rank): y = rot^-1(D(q2)) -- the same bits on every rank.

Each value is quantized at most twice, whatever P. Runs over any
:class:`~echo_vllm.transport.Transport` (gloo, NCCL, vLLM's pynccl, virtual
ranks) with any :class:`~echo_vllm.backends.stages.StageOps`.
"""

from __future__ import annotations

import torch

from ..capture import capturing
from ..config import EchoConfig
from ..transport import Transport
from .base import EchoBackend
from .stages import StageOps


class ComposedBackend(EchoBackend):
    """Echo as stage 1 -> all-to-all -> stage 2 -> all-gather -> output."""

    def __init__(self, config: EchoConfig, transport: Transport, stages: StageOps):
        super().__init__(config, transport)
        if config.rounding == "stochastic" and not stages.stochastic:
            raise ValueError(f"rounding='stochastic' needs stages with noise input, not {stages.name!r}")
        self.stages = stages
        self.name = stages.name
        self._own_chunks = list(transport.local_ranks)
        self._generators: list[torch.Generator] | None = None

    def all_reduce(self, xs, layout, feedback, *, has_incoming, out=None):
        gathered = self._exchange(xs, layout, feedback, has_incoming)
        return self.stages.output(gathered, layout, xs.dtype, hadamard=self.config.hadamard, flips=self.flips,
                                  out=out)

    def _exchange(self, xs, layout, feedback, has_incoming):
        """Stage 1, the all-to-all, stage 2, the all-gather: the gathered chunks."""
        cfg, st = self.config, self.stages
        wire = st.stage1(xs, feedback, layout, qmax=cfg.qmax, hadamard=cfg.hadamard, has_incoming=has_incoming,
                         flips=self.flips, encoder=cfg.encoder, **self._noise(layout.padded_numel, xs.device))
        recv = self.transport.all_to_all(wire)
        q2 = st.stage2(recv, feedback, self._own_chunks, layout, qmax=cfg.qmax, encoder=cfg.encoder,
                       **self._noise(layout.chunk_numel, xs.device))
        return self.transport.all_gather(q2)

    def all_reduce_norm(self, xs, layout, feedback, norm, tiling, *, has_incoming):
        """The norm in the output stage (``StageOps.output_norm``) when ``tiling`` allows."""
        if tiling is None:
            return super().all_reduce_norm(xs, layout, feedback, norm, tiling, has_incoming=has_incoming)
        gathered = self._exchange(xs, layout, feedback, has_incoming)
        out, res = self.stages.output_norm(gathered, layout, xs.dtype, norm.weight, norm.eps,
                                           hadamard=self.config.hadamard, flips=self.flips,
                                           residual=norm.residual, out=norm.out,
                                           residual_out=norm.residual_out)
        shape = norm.residual.shape if norm.residual is not None else (layout.rows, layout.cols)
        return out.view(shape), res.view(shape) if res is not None else None

    def consume(self, xs, layout, feedback):
        return self.stages.consume(xs, feedback, layout, hadamard=self.config.hadamard, flips=self.flips)

    def _noise(self, numel: int, device: torch.device) -> dict:
        """The stage's ``noise`` keyword for stochastic rounding: uniform [0, 1)
        draws per local rank (seeded per rank from ``config.seed``); none when
        rounding to nearest (stages without noise take no such keyword)."""
        if self.config.rounding != "stochastic":
            return {}
        if capturing():
            # a replay would reuse the captured draw: the same "random" noise
            # every step, biased rounding instead of unbiased
            raise RuntimeError(
                "rounding='stochastic' cannot run inside a CUDA graph (replays would repeat one "
                "noise draw); run eager (vLLM: --enforce-eager) or use rounding='nearest'")
        if self._generators is None:
            self._generators = []
            for r in self.transport.local_ranks:
                g = torch.Generator(device=device)
                g.manual_seed(self.config.seed * 1_000_003 + r)
                self._generators.append(g)
        return {"noise": torch.stack([torch.rand(numel, generator=g, device=device) for g in self._generators])}


__all__ = ["ComposedBackend"]
