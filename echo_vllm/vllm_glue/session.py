"""The Echo session of one process: the one object the vLLM glue reaches.

When vLLM creates the tensor-parallel group of an engine that asks for Echo,
:mod:`.startup` builds a session and makes it this process's *current*
session (one registry: :func:`current`, :func:`activate`, :func:`deactivate`).
A session owns the engine's Echo settings, the counters, the call numbering
of forward passes (:class:`~.tracking.ForwardTracker`), and the sink every
communicator hands its call records to. Two kinds:

* :class:`TpSession` -- real tensor parallelism: the TP group's
  :class:`~.communicator.TpEchoCommunicator`;
* :class:`~.emulation.EmulationSession` -- TP=P emulated on one device.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..capture import capturing
from ..communicator import EchoCommunicator
from ..policy import ECHO_DTYPES
from ..stats import CallRecord
from . import compat
from .communicator import TpEchoCommunicator
from .settings import TpCommSettings
from .tracking import CallSlot, ForwardTracker, StepStats, metrics_publisher

logger = logging.getLogger("echo_vllm")


class EchoSession:
    """Echo in this process for one engine: settings, counters, call numbering."""

    model_note: str | None = None
    """Why the engine's Echo settings were adjusted for this model (e.g.
    16-bit kept on a post-norm model), or None; also logged at start."""

    def __init__(self, settings: TpCommSettings, vllm_config: Any, rank: int):
        self.settings = settings
        self.stats = StepStats()
        self.tracker = ForwardTracker(self.stats, rank=rank, publish=metrics_publisher())
        self.hidden_size = compat.hidden_size(vllm_config)
        """Model hidden size: residual-stream messages are [tokens, hidden]."""
        self.max_num_tokens = compat.max_num_batched_tokens(vllm_config)
        """Largest batch a forward pass carries: sizes the feedback buffer."""
        self._reserved = False

    # -- calls ---------------------------------------------------------------------

    def next_call(self, per_rank: torch.Tensor) -> CallSlot:
        """The place of the next all-reduce in its forward pass."""
        return self.tracker.next_call(compat.forward_kwargs(), per_rank.shape[0] if per_rank.dim() else 0)

    def record(self, rec: CallRecord) -> None:
        """The sink of this session's communicators."""
        self.tracker.on_record(rec)

    def is_residual(self, per_rank: torch.Tensor) -> bool:
        return per_rank.dim() == 2 and (
            self.hidden_size is None or per_rank.shape[-1] == self.hidden_size
        )

    def reserve_once(self, comm: EchoCommunicator, per_rank: torch.Tensor) -> None:
        """Allocate the feedback buffer at its largest size -- the largest
        batch times the hidden size -- on the first residual call outside
        graph capture (vLLM's profiling run, so its memory profiler sees the
        buffer). Until then Echo falls back (counted): the communicator never
        grows the buffer on demand."""
        if self._reserved or per_rank.dtype not in ECHO_DTYPES or capturing():
            return
        tokens = max(self.max_num_tokens or 0, per_rank.shape[0])
        comm.reserve(tokens, per_rank.shape[-1])
        self._reserved = True

    # -- counters ------------------------------------------------------------------

    def flush(self) -> None:
        """Account the passes that have ended (the one-pass lag of replay
        counting): call before reading the counters."""
        self.tracker.settle(running=compat.forward_kwargs())

    def reset_stats(self) -> StepStats:
        """Start fresh counters (keeping the learned call count and the
        captured plans); returns the old ones, settled."""
        self.flush()
        old = self.stats
        self.stats = self.tracker.stats = StepStats(calls_per_forward=old.calls_per_forward,
                                                    min_bytes=old.min_bytes, max_bytes=old.max_bytes)
        return old

    def close(self) -> None:
        """Release what the session holds (buffers, backends)."""


class TpSession(EchoSession):
    """Echo for one process's tensor-parallel group."""

    def __init__(self, coordinator: Any, settings: TpCommSettings, vllm_config: Any):
        super().__init__(settings, vllm_config, rank=int(getattr(coordinator, "rank_in_group", 0)))
        self.dtype = compat.model_dtype(vllm_config)
        self.communicator = TpEchoCommunicator(coordinator, self)

    def close(self) -> None:
        self.communicator.close()


_CURRENT: EchoSession | None = None


def current() -> EchoSession | None:
    """This process's session (None when Echo is not active here)."""
    return _CURRENT


def activate(session: EchoSession) -> EchoSession:
    """Make ``session`` current, closing the one it replaces."""
    global _CURRENT
    deactivate()
    _CURRENT = session
    return session


def deactivate() -> None:
    """No current session (a new engine that does not use Echo)."""
    global _CURRENT
    old, _CURRENT = _CURRENT, None
    if old is not None:
        old.close()


def current_stats() -> StepStats | None:
    """This process's Echo counters (None when Echo is not active here)."""
    return _CURRENT.stats if _CURRENT is not None else None


__all__ = ["EchoSession", "TpSession", "activate", "current", "current_stats", "deactivate"]
