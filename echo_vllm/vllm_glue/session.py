"""The Echo session of one process: the one object the vLLM glue reaches.

When vLLM creates the tensor-parallel group of an engine that asks for Echo,
:mod:`.startup` builds a session and makes it this process's *current*
session (one registry: :func:`current`, :func:`activate`, :func:`deactivate`).
A session owns the engine's Echo settings, the counters and the call
numbering of forward passes (:class:`~.tracking.ForwardTracker`, the sink
of every call record), and the model facts the communicator needs (its
width and largest batch). Two kinds:

* :class:`TpSession` -- real tensor parallelism: the TP group's
  :class:`~echo_vllm.communicator.EchoCommunicator`
  (:func:`~.communicator.tp_communicator`), built with what it needs
  (the session itself is not handed down);
* :class:`~.emulation.EmulationSession` -- TP=P emulated on one device.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from . import compat
from .communicator import tp_communicator
from .settings import TpCommSettings
from .tracking import ForwardTracker, StepStats, metrics_publisher

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

    # -- counters ------------------------------------------------------------------

    def flush(self) -> None:
        """Account the passes that have ended (the one-pass lag of replay
        counting): call before reading the counters."""
        self.tracker.settle(running=compat.forward_kwargs())

    def reset_stats(self) -> StepStats:
        """Start fresh counters (keeping the learned call count and the
        captured plans); returns the old ones, settled (their ``nonfinite``
        reads None: the device-side health counter now counts for the new
        ones, from zero)."""
        self.flush()
        old = self.stats
        self.stats = self.tracker.stats = StepStats(calls_per_forward=old.calls_per_forward,
                                                    min_bytes=old.min_bytes, max_bytes=old.max_bytes,
                                                    bypasses=old.bypasses, topology=old.topology,
                                                    health=old.health)
        if old.health is not None:
            # the device-side counter starts from zero too; the old counters no longer read it
            old.health.reset()
            old.health = None
        return old

    def close(self) -> None:
        """Release what the session holds (buffers, backends)."""


class TpSession(EchoSession):
    """Echo for one process's tensor-parallel group. ``vllm_all_reduce``:
    vLLM's own all-reduce of that group (the exact path)."""

    def __init__(self, coordinator: Any, settings: TpCommSettings, vllm_config: Any,
                 vllm_all_reduce: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__(settings, vllm_config, rank=int(getattr(coordinator, "rank_in_group", 0)))
        self.dtype = compat.model_dtype(vllm_config)
        self.communicator = tp_communicator(coordinator, settings.echo, self.tracker, vllm_all_reduce,
                                            hidden_size=self.hidden_size, max_num_tokens=self.max_num_tokens)

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
