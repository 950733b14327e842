"""The per-call sequence: one all-reduce of a forward pass, start to end.

Real tensor parallelism (:class:`~.communicator.TpEchoCommunicator`) and
the one-device emulation (:class:`~.emulation.EmulationSession`) run every
all-reduce through :class:`CallSequence`, in this order:

1. whether it is a residual-stream message (``[tokens, hidden]`` in
   bf16/fp16); anything else is a *side call* (MiniMax-M2's fp32 q/k norm
   variance, a Mamba2 mixer's ``[T, 1]`` sum of squares, integers), which
   takes the exact path and leaves the feedback chain alone;
2. its slot: the call's index among the pass's residual calls (side calls
   are not numbered) and whether it is the last (the session's
   :class:`~.tracking.ForwardTracker`);
3. the feedback buffer, reserved once at its largest size on the first
   residual call outside graph capture (vLLM's profiling run, so vLLM's
   memory profiler sees it); until then Echo falls back (counted): the
   communicator never grows it on demand;
4. Echo or the exact path (:class:`~echo_vllm.communicator.EchoCommunicator`,
   whose policy decides; integer messages go to the exact all-reduce
   directly: the exact path adds float errors);
5. its record, handed to the tracker (the communicator's sink).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..capture import capturing
from ..communicator import EXACT_PATH_NORM, EchoCommunicator
from ..norm import NormOperands
from ..numbering import CallSlot
from ..policy import ECHO_DTYPES, Reason
from ..stats import CallRecord
from . import compat
from .tracking import ForwardTracker


class Reduced(NamedTuple):
    """What one call of the sequence gave."""

    output: torch.Tensor
    slot: CallSlot
    residual: bool
    """The message was a residual-stream one (``[tokens, hidden]``)."""


class CallSequence:
    """Every all-reduce of one model, each through the same sequence (see
    the module docstring).

    ``comm``: Echo over the group, its sink ``tracker.on_record``.
    ``hidden_size``: the model's (residual messages are ``[tokens,
    hidden]``; None accepts any width). ``max_num_tokens``: the largest
    batch of a forward pass (sizes the feedback buffer). ``echo``: False
    takes the exact path on every call (the emulation's 16-bit baseline).
    ``exact_fn``: the 16-bit all-reduce of a message as given (vLLM's own
    for a TP group); default the transport's.
    """

    def __init__(self, comm: EchoCommunicator, tracker: ForwardTracker, *, hidden_size: int | None,
                 max_num_tokens: int | None, echo: bool = True,
                 exact_fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.comm = comm
        self.tracker = tracker
        self.hidden_size = hidden_size
        self.max_num_tokens = max_num_tokens
        self.echo = echo
        self.exact_fn = exact_fn
        self._reserved = False

    def __call__(self, x: torch.Tensor) -> Reduced:
        """Reduce ``x`` (this rank's message; stacked ``[P, ...]`` partials
        over virtual ranks)."""
        per_rank, residual = self._message(x)
        slot = self._slot(per_rank, residual)
        if not x.is_floating_point():
            self.tracker.on_record(CallRecord("exact", Reason.DTYPE.value,
                                              nbytes=per_rank.numel() * per_rank.element_size()))
            exact = self.exact_fn or self.comm.transport.all_reduce_exact
            return Reduced(exact(x), slot, False)
        if residual:
            self._reserve_once(per_rank)
        if self.echo:
            # the policy gives side calls their reason (unsupported_dtype, not_residual_shape)
            y = self.comm.all_reduce(x, slot.index, last_call=slot.last_call, residual=residual,
                                     exact_fn=self.exact_fn)
        else:
            y = self.comm.exact(x, slot.index, reason=Reason.DISABLED, exact_fn=self.exact_fn)
        return Reduced(y, slot, residual)

    def norm(self, x: torch.Tensor, norm: NormOperands) -> tuple[torch.Tensor, torch.Tensor | None, CallSlot]:
        """Reduce ``x`` and apply the residual add and RMSNorm of ``norm``
        (the compiled graph's fused op, :mod:`.norm_fusion`): ``(out, new
        residual, slot)``. Steps 1-5 as for any call; on Echo's path the norm
        runs in its output phase where the row fits
        (``EchoCommunicator.all_reduce_norm``), else after the reduce. A
        message that is not a residual-stream one reduces as usual, then
        the norm runs."""
        per_rank, residual = self._message(x)
        if not residual:
            reduced = self(x)
            return (*norm.apply(reduced.output), reduced.slot)
        slot = self._slot(per_rank, residual)
        self._reserve_once(per_rank)
        if self.echo:
            out, res = self.comm.all_reduce_norm(x, norm, slot.index, last_call=slot.last_call,
                                                 exact_fn=self.exact_fn)
        else:
            out, res = norm.apply(self.comm.exact(x, slot.index, reason=Reason.DISABLED, exact_fn=self.exact_fn,
                                                  norm=EXACT_PATH_NORM))
        return out, res, slot

    def _message(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """This rank's message and whether it is a residual-stream one (step 1)."""
        per_rank = x[0] if self.comm.transport.is_virtual else x
        return per_rank, self.is_residual(per_rank)

    def _slot(self, per_rank: torch.Tensor, residual: bool) -> CallSlot:
        """The call's slot in its forward pass (step 2)."""
        return self.tracker.next_call(compat.forward_kwargs(), per_rank.shape[0] if per_rank.dim() else 0,
                                      residual=residual)

    def is_residual(self, per_rank: torch.Tensor) -> bool:
        """A residual-stream message: ``[tokens, hidden]``, not empty, in a
        dtype Echo reduces (an fp32 message is a norm's statistic, not the
        stream)."""
        return (per_rank.dtype in ECHO_DTYPES and per_rank.dim() == 2 and per_rank.numel() > 0
                and (self.hidden_size is None or per_rank.shape[-1] == self.hidden_size))

    def _reserve_once(self, per_rank: torch.Tensor) -> None:
        if self._reserved or per_rank.dtype not in ECHO_DTYPES or capturing():
            return
        tokens = max(self.max_num_tokens or 0, per_rank.shape[0])
        self.comm.reserve(tokens, per_rank.shape[-1])
        self._reserved = True


__all__ = ["CallSequence", "Reduced"]
