"""EchoCommunicator: which path each call takes, running it, one record per call.

This is the dispatcher everything user-facing goes through (the vLLM glue,
the demo, the benchmarks, training): ``should_echo`` asks the policy
(:func:`echo_vllm.policy.decide`), ``all_reduce`` runs the chosen path
(:class:`~echo_vllm.allreduce.EchoAllReduce`, or the exact path that absorbs
the chain's pending error) and hands one :class:`~echo_vllm.stats.CallRecord`
to its sink.
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
from .policy import CallInfo, Decision, Path, Reason, decide
from .stats import CallRecord, CallSink, EchoStats
from .transport import Transport


class EchoCommunicator:
    """Echo for one stream of calls (a model's forward pass, or one direction
    of a training step) over one transport.

    ``capacity_numel``: feedback values per rank to allocate now. With
    ``fixed_capacity`` (default: when a capacity is given) the buffer never
    grows: a message that does not fit takes the exact path, counted (vLLM
    sizes it once, before CUDA-graph capture, with :meth:`reserve`).
    ``sink``: where each call's record goes (default ``stats.record``).
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
    ):
        self.config = config
        self.transport = transport
        self.echo = EchoAllReduce(config, transport, backend=backend, env=env)
        self.chain = FeedbackChain.of(config, len(transport.local_ranks), device, capacity_numel)
        self.stats = stats if stats is not None else EchoStats()
        self.sink: CallSink = sink if sink is not None else self.stats.record
        self.fixed_capacity = capacity_numel > 0 if fixed_capacity is None else fixed_capacity

    @property
    def disabled(self) -> bool:
        """Nothing to reduce with Echo (vLLM's communicator convention)."""
        return self.transport.world_size < 2

    def set_thresholds(self, min_bytes: int, max_bytes: int) -> None:
        """Replace the size thresholds (a measured crossover, ``echo_vllm.crossover``)."""
        self.config = self.config.replace(min_bytes=min_bytes, max_bytes=max_bytes)

    def reserve(self, rows: int, cols: int) -> None:
        """Size the feedback buffer for messages of up to ``rows`` rows of ``cols``."""
        if self.config.feedback:
            self.chain.reserve(self.echo.layout(rows * cols, cols).padded_numel)

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
            lay = self.echo.message_layout(tuple(y.shape))
            self.sink(CallRecord("echo", decision.reason.value, wire_bytes=lay.wire_bytes_per_rank,
                                 equiv_bytes=lay.ring_bytes_per_rank(y.element_size())))
            return y
        return self.exact(x, call_index, reason=decision.reason, exact_fn=exact_fn)

    def exact(
        self,
        x: torch.Tensor,
        call_index: int | None,
        *,
        reason: Reason | str,
        exact_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """16-bit path that consumes the chain's pending error, recorded under ``reason``."""
        per_rank = x[0] if self.transport.is_virtual else x
        self.sink(CallRecord("exact", getattr(reason, "value", reason),
                             nbytes=per_rank.numel() * per_rank.element_size()))
        return self.echo.exact_all_reduce(x, self.chain, call_index, exact_fn)

    def close(self) -> None:
        """Release the backend's resources and the feedback buffer."""
        self.echo.close()
        self.chain.release()
