"""TpEchoCommunicator: Echo for one vLLM tensor-parallel group, in vLLM's shape.

Shaped like vLLM's own device communicators (``CustomAllreduce``,
``QuickAllReduce``): built per group, ``disabled``, ``should_echo(inp)``,
``all_reduce(inp, out=)``, ``close()``. The hook's patch of
``GroupCoordinator._all_reduce_out_place`` is a thin adapter around it, and an
upstream dispatcher could call it the same way.

It sees every all-reduce of the group: Echo's 4-bit path where the policy
says so, vLLM's own all-reduce otherwise -- after adding the chain's pending
error to the input (an exact call in the middle of a forward pass must
absorb it). Each call is numbered within its forward pass by the session
and recorded in the session's sink.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import crossover
from ..backends import ComposedBackend, EchoBackend, TritonStages
from ..backends.fused import FusedSymmMemBackend, fused_support
from ..communicator import EchoCommunicator
from ..config import EchoConfig, EchoConfigError
from ..feedback import FeedbackChain
from ..policy import ECHO_DTYPES, Reason
from ..quant import WireLayout
from ..stats import CallRecord
from ..transport import ProcessGroupTransport, Transport

if TYPE_CHECKING:
    from .session import EchoSession

logger = logging.getLogger("echo_vllm")


class TpEchoCommunicator:
    """Echo for the TP group of ``coordinator`` (a vLLM ``GroupCoordinator``)."""

    def __init__(self, coordinator: Any, session: "EchoSession",
                 vllm_all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.session = session
        self.group_name = coordinator.unique_name
        self.world_size = int(coordinator.world_size)
        self.disabled = self.world_size < 2
        self.transport = make_transport(coordinator)
        cfg = session.settings.echo
        max_numel = None  # the largest message: rows of the model's width, padded to whole groups per rank
        if session.hidden_size and session.max_num_tokens and not self.disabled:
            row = WireLayout(session.hidden_size, self.world_size, cfg.group_size)
            max_numel = session.max_num_tokens * row.padded_cols
        self.backend = fused_backend(cfg, coordinator, self.transport, max_numel)
        self.comm = EchoCommunicator(
            cfg, self.transport, device=coordinator.device,
            fixed_capacity=True, stats=session.stats, sink=session.record, backend=self.backend,
        )
        self._vllm_all_reduce = vllm_all_reduce
        session.stats.set_thresholds(self.comm.config.effective_min_bytes, self.comm.config.max_bytes)

    def bind(self, vllm_all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The exact path: vLLM's own all-reduce of this group."""
        self._vllm_all_reduce = vllm_all_reduce

    def calibrate(self, cols: int | None, max_tokens: int | None, dtype: Any) -> crossover.Crossover | None:
        """Measure where Echo beats vLLM's all-reduce on this group and set
        the thresholds (``min_bytes="auto"`` only; every rank of the group
        must call it at the same point: it runs collectives). Messages are
        rows of ``cols`` values of ``dtype``, up to ``max_tokens`` rows.
        None when nothing was measured (thresholds as configured)."""
        cfg = self.comm.config
        if self.disabled or not cfg.min_bytes_auto or cfg.batch_invariant or not cols or not max_tokens:
            return None
        dtype = dtype if dtype in ECHO_DTYPES else torch.bfloat16
        row_bytes = cols * torch.finfo(dtype).bits // 8
        echo = self.comm.echo
        device = self.comm.chain.device
        chain = FeedbackChain(1, device, cfg.feedback_dtype)

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
        self.session.stats.set_thresholds(result.min_bytes, result.max_bytes)
        return result

    def should_echo(self, inp: torch.Tensor) -> bool:
        """Whether the next call, with ``inp``, takes Echo's 4-bit path."""
        if self.disabled or not inp.is_floating_point():
            return False
        slot = self.session.tracker.peek(self._kwargs())
        residual = self.session.is_residual(inp)
        return self.comm.should_echo(inp, slot.index, last_call=slot.last_call, residual=residual).echo

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce ``inp`` over the group: Echo, or vLLM's all-reduce after
        absorbing the pending error. ``out``, if given, receives the result."""
        slot = self.session.next_call(inp)
        if not inp.is_floating_point():  # Echo's exact path adds float errors: not for ints
            self.session.record(CallRecord("exact", Reason.DTYPE.value, nbytes=inp.numel() * inp.element_size()))
            y = self._vllm_all_reduce(inp)
        else:
            residual = self.session.is_residual(inp)
            if residual:
                self.session.reserve_once(self.comm, inp)
            y = self.comm.all_reduce(inp, slot.index, last_call=slot.last_call, residual=residual,
                                     exact_fn=self._vllm_all_reduce)
        if out is None:
            return y
        out.copy_(y)
        return out

    def close(self) -> None:
        self.comm.close()
        self.disabled = True

    @staticmethod
    def _kwargs() -> dict | None:
        from . import compat

        return compat.forward_kwargs()


def fused_backend(config: EchoConfig, coordinator: Any, transport: Transport,
                  max_numel: int | None) -> EchoBackend | None:
    """The fused backend for this TP group when it can run (CUDA, one host,
    P2P GPUs: decided from facts gathered over the group's NCCL group, the
    same on every rank) and the configuration allows it (``backend`` auto
    or fused); messages larger than its buffers take the composed Triton
    path over ``transport``. None: the composed path (``backend="fused"``
    that cannot run is an error naming why). Collective: every rank calls
    it at group creation."""
    if config.backend not in ("auto", "fused") or getattr(coordinator.device, "type", "cpu") != "cuda":
        return None
    if config.rounding == "stochastic":
        return None
    group_transport = ProcessGroupTransport(coordinator.device_group)
    ok, reason = fused_support(group_transport)
    if not ok:
        if config.backend == "fused":
            raise EchoConfigError(f"echo_backend=fused cannot run on group {coordinator.unique_name}: {reason}")
        logger.info("echo: composed backend on %s (fused unavailable: %s)", coordinator.unique_name, reason)
        return None
    fallback = ComposedBackend(config, transport, TritonStages())
    backend = FusedSymmMemBackend(config, group_transport, max_numel=max_numel, fallback=fallback)
    logger.info("echo: fused backend on %s (%s; buffers for %s values per rank)", coordinator.unique_name, reason,
                max_numel)
    return backend


def make_transport(coordinator: Any) -> Transport:
    """vLLM's pynccl communicator on CUDA; the group's own process group
    (gloo on CPU) elsewhere."""
    device_comm = getattr(coordinator, "device_communicator", None)
    pynccl = getattr(device_comm, "pynccl_comm", None)
    if pynccl is not None and not getattr(pynccl, "disabled", True):
        from .pynccl_transport import PyncclTransport

        return PyncclTransport(pynccl, coordinator.cpu_group)
    return ProcessGroupTransport(coordinator.device_group)


__all__ = ["TpEchoCommunicator", "fused_backend", "make_transport"]
