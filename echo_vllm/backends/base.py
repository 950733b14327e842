"""The backend interface: what runs one Echo all-reduce, end to end.

A backend turns this process's local inputs into the all-reduced output,
moving the bytes and running the stages; :class:`echo_vllm.communicator.EchoCommunicator`
keeps everything else (layouts, the ranks' shape agreement, the feedback
chain's rule). Two kinds exist: *composed* backends (stage functions around
a transport's all-to-all and all-gather, :mod:`.composed`) and *fused* ones
that replace transport and stages together (one kernel over peer-mapped
memory, :mod:`.fused`).

Contract of :meth:`EchoBackend.all_reduce`: the output bits are those of the
reference pipeline in :mod:`echo_vllm.quant` (stage 1 on every rank, the
chunks exchanged, stage 2 on each owner, stage 3 on the gathered chunks),
identical on every rank; the feedback buffer, when given, ends holding this
call's stage-1 error plus, on each rank's own chunk, its stage-2 error.
"""

from __future__ import annotations

import abc

import torch

from ..config import EchoConfig
from ..hosts import FLAT, HostMap
from ..rmsnorm import NormOperands
from ..rmsnorm_plan import NormTiling
from ..quant import WireLayout
from ..rotation import sign_flips
from ..transport import Transport


class EchoBackend(abc.ABC):
    """One way to run Echo over a group of ranks (see the module docstring)."""

    name: str = "?"
    topology: str = FLAT
    """``flat`` (one two-shot over the group) or ``two_level`` (:mod:`.two_level`)."""

    def __init__(self, config: EchoConfig, transport: Transport):
        self.config = config
        self.transport = transport
        self.world_size = transport.world_size
        self.local_ranks = transport.local_ranks
        self.hosts: HostMap | None = None
        """The host of each rank (``make_backend`` sets it; None: not asked)."""
        self.topology_reason = ""
        """Why ``topology`` (``hosts.choose_topology``'s reason; ``make_backend`` sets it)."""
        #: The rotation's sign flips (``rotation.sign_flips`` of the config's
        #: seed): a function of the config, so the same on every rank and call.
        self.flips = sign_flips(config.rotation_seed, config.group_size)

    @property
    def capturable(self) -> bool:
        """Whether a call can be recorded into a CUDA graph."""
        return self.transport.capturable

    @abc.abstractmethod
    def all_reduce(
        self,
        xs: torch.Tensor,
        layout: WireLayout,
        feedback: torch.Tensor | None,
        *,
        has_incoming: bool,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Echo of local inputs ``xs [R, numel]`` -> ``[numel]`` of ``xs.dtype``.
        ``feedback``: ``[R, >= feedback_numel(layout)]`` values or None (no
        feedback); its first ``feedback_numel(layout)`` values are added
        first if ``has_incoming``."""

    def all_reduce_norm(
        self,
        xs: torch.Tensor,
        layout: WireLayout,
        feedback: torch.Tensor | None,
        norm: NormOperands,
        tiling: NormTiling | None,
        *,
        has_incoming: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`all_reduce` followed by the residual add and RMSNorm of
        ``norm`` (``rmsnorm.NormOperands.apply``): ``(out, new residual)``,
        shaped as ``norm.residual`` (``[rows, cols]`` without one). With a
        ``tiling`` (``echo_vllm.rmsnorm_plan.norm_tiling``'s) a backend may do
        the norm in its output phase; the bits are the same either way.
        This default runs them one after the other."""
        y = self.all_reduce(xs, layout, feedback, has_incoming=has_incoming)
        return norm.apply(y.view(layout.rows, layout.cols))

    def compile(self, xs: torch.Tensor, layout: WireLayout, feedback: torch.Tensor | None, *,
                has_incoming: bool) -> None:
        """Compile what :meth:`all_reduce` of these operands would launch,
        launching nothing and leaving ``feedback`` as it is (no peer takes
        part: ranks may compile different messages' kernels ahead of their
        calls). This default has nothing to compile ahead."""

    @abc.abstractmethod
    def consume(self, xs: torch.Tensor, layout: WireLayout, feedback: torch.Tensor) -> torch.Tensor:
        """``xs + rot^-1(e)`` rounded to ``xs.dtype`` (``[R, numel]``): the input
        of an exact call that absorbs the carried error."""

    def feedback_numel(self, layout: WireLayout) -> int:
        """Values of the carried error one rank keeps for a message of
        ``layout``: the flat path's ``padded_numel`` (two-level: its shard's)."""
        return layout.padded_numel

    def fits(self, layout: WireLayout) -> bool:
        """Whether this backend's own kernels run a message of ``layout``
        (False: its fallback does, recorded under
        ``policy.Reason.EXCEEDS_FUSED_BUFFERS``)."""
        return True

    def exact_all_reduce(self, xs: torch.Tensor) -> torch.Tensor:
        """The 16-bit all-reduce of local inputs ``xs [R, ...]``."""
        return self.transport.exact_all_reduce(xs)

    def close(self) -> None:
        """Release what the backend holds (buffers, peer mappings)."""


__all__ = ["EchoBackend"]
