"""EchoCommunicator: policy + Echo + feedback chain + counters, one object.

This is the dispatcher everything user-facing goes through (the vLLM hook,
the demo, the benchmarks): ``should_echo`` asks the policy, ``all_reduce``
runs the chosen path, keeps the chain rule and counts the call.
"""

from __future__ import annotations

from typing import Callable

import torch

from .capture import capturing
from .collective import EchoAllReduce
from .config import EchoConfig
from .feedback import FeedbackChain
from .policy import CallInfo, Decision, Path, decide
from .stats import EchoStats
from .transport import Transport


class EchoCommunicator:
    def __init__(
        self,
        config: EchoConfig,
        transport: Transport,
        *,
        device: torch.device | str = "cpu",
        capacity_numel: int = 0,
        stats: EchoStats | None = None,
    ):
        self.config = config
        self.transport = transport
        self.echo = EchoAllReduce(config, transport)
        self.chain = FeedbackChain(
            len(transport.local_ranks), device, config.feedback_dtype, capacity_numel
        )
        self.stats = stats if stats is not None else EchoStats()
        self.fixed_capacity = capacity_numel > 0
        """With a pre-sized buffer (vLLM), larger messages fall back instead
        of growing it."""

    def reserve(self, numel: int) -> None:
        """Size the feedback buffer for messages of up to ``numel`` values."""
        if self.config.feedback:
            self.chain.reserve(self.echo.layout(numel).padded_numel)
            self.fixed_capacity = True

    def should_echo(
        self,
        x: torch.Tensor,
        call_index: int | None,
        *,
        last_call: bool = False,
        residual: bool = True,
    ) -> Decision:
        per_rank = x[0] if self.transport.is_virtual else x
        numel = per_rank.numel()
        fits = True
        if self.fixed_capacity and self.config.feedback and numel:
            fits = self.chain.fits(self.echo.layout(numel).padded_numel)
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
            lay = self.echo.layout(y.numel())
            self.stats.count(
                "echo",
                decision.reason.value,
                wire=lay.wire_bytes_per_rank,
                equiv=lay.ring_bytes_per_rank(y.element_size()),
            )
            return y
        self.stats.count("exact", decision.reason.value, nbytes=x.numel() * x.element_size())
        return self.exact(x, call_index, exact_fn=exact_fn)

    def exact(
        self,
        x: torch.Tensor,
        call_index: int | None,
        *,
        exact_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """16-bit path that consumes the chain's pending error."""
        return self.echo.exact_all_reduce(x, self.chain, call_index, exact_fn)
