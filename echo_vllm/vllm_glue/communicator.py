"""TpEchoCommunicator: Echo for one vLLM tensor-parallel group, in vLLM's shape.

Shaped like vLLM's own device communicators (``CustomAllreduce``,
``QuickAllReduce``): built per group, ``disabled``, ``all_reduce(inp,
out=)``, ``close()``. The hook's patch of
``GroupCoordinator._all_reduce_out_place`` is a thin adapter around it, and
an upstream dispatcher could call it the same way.

It sees every all-reduce of the group: Echo's 4-bit path where the policy
says so, vLLM's own all-reduce otherwise -- after adding the chain's pending
error to the input (an exact call in the middle of a forward pass must
absorb it). Each call runs the glue's one per-call sequence
(:class:`~.calls.CallSequence`): numbered within its forward pass and
recorded by the session's tracker, which the communicator is given at
construction with everything else it needs (it knows nothing of sessions).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import crossover, envs
from ..backends import make_backend
from ..communicator import EchoCommunicator
from ..config import EchoConfig
from ..envs import EchoEnv
from ..feedback import FeedbackChain
from ..health import HealthCounters
from ..norm import NormOperands
from ..policy import ECHO_DTYPES
from ..quant import WireLayout
from ..transport import ProcessGroupTransport, Transport
from .calls import CallSequence
from .tracking import ForwardTracker

logger = logging.getLogger("echo_vllm")


class TpEchoCommunicator:
    """Echo for the TP group of ``coordinator`` (a vLLM ``GroupCoordinator``).

    ``tracker``: numbers the calls and receives their records (the session's).
    ``vllm_all_reduce``: the exact path, vLLM's own all-reduce of this group.
    ``hidden_size`` / ``max_num_tokens``: the model's width and largest batch
    (residual messages, the feedback buffer's and the fused backend's sizes).
    Collective: every rank of the group builds it at group creation (the
    backend may probe the group, :func:`echo_vllm.backends.make_backend`).
    """

    def __init__(self, coordinator: Any, config: EchoConfig, tracker: ForwardTracker,
                 vllm_all_reduce: Callable[[torch.Tensor], torch.Tensor], *, hidden_size: int | None = None,
                 max_num_tokens: int | None = None, env: EchoEnv | None = None):
        self.group_name = coordinator.unique_name
        self.world_size = int(coordinator.world_size)
        self.disabled = self.world_size < 2
        self.tracker = tracker
        self.hidden_size = hidden_size
        self.max_num_tokens = max_num_tokens
        self.transport = make_transport(coordinator)
        env = env if env is not None else envs.read()
        max_numel = None  # the largest message: rows of the model's width, padded to whole groups per rank
        if hidden_size and max_num_tokens and not self.disabled:
            max_numel = max_num_tokens * WireLayout(hidden_size, self.world_size, config.group_size).padded_cols
        self.backend, reason = make_backend(
            config, self.transport, device_type=getattr(coordinator.device, "type", "cpu"), env=env,
            peers=_peers(coordinator, self.transport), max_numel=max_numel)
        logger.info("echo: %s backend on %s (%s)", self.backend.name, self.group_name, reason)
        # sampled NaN/Inf checks count on the device (allocated with the feedback buffer)
        self.health = HealthCounters(coordinator.device) if config.health_every else None
        tracker.stats.health = self.health
        self.comm = EchoCommunicator(
            config, self.transport, device=coordinator.device, fixed_capacity=True, stats=tracker.stats,
            sink=tracker.on_record, backend=self.backend, env=env, health=self.health,
        )
        self.calls = CallSequence(self.comm, tracker, hidden_size=hidden_size, max_num_tokens=max_num_tokens,
                                  exact_fn=vllm_all_reduce)
        self._vllm_all_reduce = vllm_all_reduce
        tracker.stats.set_thresholds(self.comm.config.effective_min_bytes, self.comm.config.max_bytes)

    def calibrate(self, dtype: Any) -> crossover.Crossover | None:
        """Measure where Echo beats vLLM's all-reduce on this group and set
        the thresholds (``min_bytes="auto"`` only; every rank of the group
        must call it at the same point: it runs collectives). Messages are
        rows of the model's width in ``dtype``, up to its largest batch.
        None when nothing was measured (thresholds as configured)."""
        cfg = self.comm.config
        cols, max_tokens = self.hidden_size, self.max_num_tokens
        if self.disabled or not cfg.min_bytes_auto or cfg.batch_invariant or not cols or not max_tokens:
            return None
        dtype = dtype if dtype in ECHO_DTYPES else torch.bfloat16
        row_bytes = cols * torch.finfo(dtype).bits // 8
        echo = self.comm.echo
        device = self.comm.chain.device
        chain = FeedbackChain.of(cfg, 1, device)

        def run_echo(x: torch.Tensor) -> None:
            # the steady state of a forward pass: call 1 absorbs call 0's error
            chain.record(0, echo.chain_key(x.unsqueeze(0)), left_error=True)
            echo.all_reduce(x, chain, 1)

        points = crossover.calibrate(self._vllm_all_reduce, run_echo,
                                     crossover.ladder(max_tokens * row_bytes, row_bytes), cols=cols,
                                     dtype=dtype, device=device, slowest=self.transport.max_over_ranks)
        chain.release()
        result = crossover.decide(points)
        self.comm.set_thresholds(result.min_bytes, result.max_bytes)
        self.tracker.stats.set_thresholds(result.min_bytes, result.max_bytes)
        return result

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce ``inp`` over the group: Echo, or vLLM's all-reduce after
        absorbing the pending error. ``out``, if given, receives the result."""
        y = self.calls(inp).output
        if out is None:
            return y
        out.copy_(y)
        return out

    def all_reduce_norm(self, inp: torch.Tensor, norm: NormOperands) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`all_reduce` followed by the residual add and RMSNorm of
        ``norm`` (the compiled graph's fused op): ``(out, new residual)``."""
        out, res, _ = self.calls.norm(inp, norm)
        return out, res

    def close(self) -> None:
        self.comm.close()
        self.disabled = True


def make_transport(coordinator: Any) -> Transport:
    """vLLM's pynccl communicator on CUDA; the group's own process group
    (gloo on CPU) elsewhere."""
    device_comm = getattr(coordinator, "device_communicator", None)
    pynccl = getattr(device_comm, "pynccl_comm", None)
    if pynccl is not None and not getattr(pynccl, "disabled", True):
        from .pynccl_transport import PyncclTransport

        return PyncclTransport(pynccl, coordinator.cpu_group)
    return ProcessGroupTransport(coordinator.device_group)


def _peers(coordinator: Any, transport: Transport) -> Transport:
    """The group's ``torch.distributed`` transport: where the fused backend
    probes the GPUs and maps peer memory (NCCL on CUDA; pynccl cannot)."""
    return transport if isinstance(transport, ProcessGroupTransport) else ProcessGroupTransport(coordinator.device_group)


__all__ = ["TpEchoCommunicator", "make_transport"]
