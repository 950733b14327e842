"""EchoCommunicator: which path each call takes, running it, one record per call.

This is the dispatcher everything user-facing goes through (the vLLM glue,
the demo, the benchmarks, training): ``should_echo`` asks the policy
(:func:`echo_vllm.policy.decide`), ``all_reduce`` runs the chosen path
(:class:`~echo_vllm.allreduce.EchoAllReduce`, or the exact path that absorbs
the chain's pending error; a side call's exact path leaves the chain alone)
and hands one :class:`~echo_vllm.stats.CallRecord` to its sink, saying what
the chain did (carried, dropped) and whether the call's health was checked
(:mod:`echo_vllm.health`), so that a CUDA-graph replay of the records
counts the same.
"""

from __future__ import annotations

from typing import Callable

import torch

from .allreduce import EchoAllReduce
from .backends import EchoBackend
from .capture import capturing
from .config import EchoConfig
from .envs import EchoEnv
from .feedback import FeedbackChain
from .health import HealthCounters, sampled
from .norm import NormOperands
from .policy import CallInfo, Decision, Path, Reason, decide
from .stats import CallRecord, CallSink, EchoStats
from .transport import Transport


#: ``CallRecord.norm`` of a call on the exact path: the norm runs after vLLM's 16-bit all-reduce.
EXACT_PATH_NORM = "exact path"


class EchoCommunicator:
    """Echo for one stream of calls (a model's forward pass, or one direction
    of a training step) over one transport.

    ``capacity_numel``: feedback values per rank to allocate now. With
    ``fixed_capacity`` (default: when a capacity is given) the buffer never
    grows: a message that does not fit takes the exact path, counted (vLLM
    sizes it once, before CUDA-graph capture, with :meth:`reserve`).
    ``sink``: where each call's record goes (default ``stats.record``).
    ``health``: where the sampled checks of Echo calls
    (``config.health_every``) count non-finite values (default: none
    checked).
    """

    def __init__(
        self,
        config: EchoConfig,
        transport: Transport,
        *,
        device: torch.device | str = "cpu",
        capacity_numel: int = 0,
        fixed_capacity: bool | None = None,
        stats: EchoStats | None = None,
        sink: CallSink | None = None,
        backend: EchoBackend | None = None,
        env: EchoEnv | None = None,
        health: HealthCounters | None = None,
    ):
        self.config = config
        self.transport = transport
        self.echo = EchoAllReduce(config, transport, backend=backend, env=env)
        self.chain = FeedbackChain.of(config, len(transport.local_ranks), device, capacity_numel)
        self.stats = stats if stats is not None else EchoStats()
        self.sink: CallSink = sink if sink is not None else self.stats.record
        self.fixed_capacity = capacity_numel > 0 if fixed_capacity is None else fixed_capacity
        self.health = health

    @property
    def disabled(self) -> bool:
        """Nothing to reduce with Echo (vLLM's communicator convention)."""
        return self.transport.world_size < 2

    def set_thresholds(self, min_bytes: int, max_bytes: int) -> None:
        """Replace the size thresholds (a measured crossover, ``echo_vllm.crossover``)."""
        self.config = self.config.replace(min_bytes=min_bytes, max_bytes=max_bytes)

    def reserve(self, rows: int, cols: int) -> None:
        """Size the feedback buffer for messages of up to ``rows`` rows of
        ``cols`` (and allocate the health counter: both before any capture)."""
        if self.config.feedback:
            self.chain.reserve(self.echo.layout(rows * cols, cols).padded_numel)
        if self.health is not None:
            self.health.allocate()

    def should_echo(
        self,
        x: torch.Tensor,
        call_index: int | None,
        *,
        last_call: bool = False,
        residual: bool = True,
    ) -> Decision:
        """The policy's path for ``x`` (no side effects)."""
        per_rank = x[0] if self.transport.is_virtual else x
        numel = per_rank.numel()
        fits = True
        if self.fixed_capacity and self.config.feedback and numel:
            fits = self.chain.fits(self.echo.message_layout(tuple(per_rank.shape)).padded_numel)
        return decide(
            CallInfo(
                nbytes=numel * per_rank.element_size(),
                dtype=per_rank.dtype,
                world_size=self.transport.world_size,
                capturing=capturing(),
                call_index=call_index,
                last_call=last_call,
                residual=residual and numel > 0,
                fits_buffer=fits,
                transport_capturable=self.transport.capturable,
            ),
            self.config,
        )

    def all_reduce(
        self,
        x: torch.Tensor,
        call_index: int | None,
        *,
        last_call: bool = False,
        residual: bool = True,
        exact_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Reduce ``x`` on the path the policy picks. ``exact_fn`` replaces the
        transport's 16-bit all-reduce (the vLLM hook passes vLLM's own)."""
        decision = self.should_echo(x, call_index, last_call=last_call, residual=residual)
        if decision.path is Path.ECHO:
            y = self.echo.all_reduce(x, self.chain, call_index)
            checked = (self.health is not None and sampled(call_index, self.config.health_every)
                       and self.health.observe(x, y))
            lay = self.echo.message_layout(tuple(y.shape))
            self.sink(CallRecord("echo", self._echo_reason(decision, lay, y), wire_bytes=lay.wire_bytes_per_rank,
                                 equiv_bytes=lay.ring_bytes_per_rank(y.element_size()), checked=checked,
                                 **self._chain_outcome()))
            return y
        return self.exact(x, call_index, reason=decision.reason, exact_fn=exact_fn, side=decision.side)

    def all_reduce_norm(
        self,
        x: torch.Tensor,
        norm: NormOperands,
        call_index: int | None,
        *,
        last_call: bool = False,
        exact_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`all_reduce` of a residual-stream call followed by the
        residual add and RMSNorm of ``norm`` (vLLM's ``fused_add_rms_norm``,
        ``rms_norm`` without a residual): ``(out, new residual)``. On Echo's
        path the norm runs in its output phase where the row fits
        (``norm_plan.norm_tiling``), else after it; on the exact path after
        it; the record says which (``CallRecord.norm``)."""
        decision = self.should_echo(x, call_index, last_call=last_call, residual=True)
        if decision.path is Path.ECHO:
            out, res, how = self.echo.all_reduce_norm(x, norm, self.chain, call_index)
            checked = (self.health is not None and sampled(call_index, self.config.health_every)
                       and self.health.observe(x, out))
            lay = self.echo.message_layout(tuple(out.shape))
            self.sink(CallRecord("echo", self._echo_reason(decision, lay, out), wire_bytes=lay.wire_bytes_per_rank,
                                 equiv_bytes=lay.ring_bytes_per_rank(out.element_size()), checked=checked, norm=how,
                                 **self._chain_outcome()))
            return out, res
        y = self.exact(x, call_index, reason=decision.reason, exact_fn=exact_fn, side=decision.side,
                       norm=EXACT_PATH_NORM)
        return norm.apply(y)

    def exact(
        self,
        x: torch.Tensor,
        call_index: int | None,
        *,
        reason: Reason | str,
        exact_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        side: bool = False,
        norm: str = "",
    ) -> torch.Tensor:
        """16-bit path, recorded under ``reason``: it consumes the chain's
        pending error, or, for a ``side`` call (outside the residual
        stream, :data:`~echo_vllm.policy.SIDE_REASONS`), leaves the chain as
        it is for the stream's next call. ``norm``: the record's
        ``CallRecord.norm``."""
        per_rank = x[0] if self.transport.is_virtual else x
        y = self.echo.exact_all_reduce(x, None if side else self.chain, call_index, exact_fn)
        self.sink(CallRecord("exact", getattr(reason, "value", reason),
                             nbytes=per_rank.numel() * per_rank.element_size(), norm=norm, **self._chain_outcome()))
        return y

    def _echo_reason(self, decision: Decision, layout, y: torch.Tensor) -> str:
        """The record's reason of a call Echo ran: the decision's, unless the
        backend's own kernels could not take the message (its fallback ran it)."""
        if self.echo.backend(y.device).fits(layout):
            return decision.reason.value
        return Reason.EXCEEDS_FUSED_BUFFERS.value

    def _chain_outcome(self) -> dict:
        """The record fields of what the chain did in the call just run."""
        take = self.chain.pop_take()
        if take is None:
            return {}
        return {"carried": take.incoming, "dropped": take.dropped.value if take.dropped else ""}

    def close(self) -> None:
        """Release the backend's resources and the feedback buffer."""
        self.echo.close()
        self.chain.release()
