"""One record per all-reduce call, the counters built from them, and the
log-once rule for fallbacks.

:class:`~echo_vllm.communicator.EchoCommunicator` hands one
:class:`CallRecord` per call to one sink (a callable); :class:`EchoStats`
is the usual sink (``EchoStats.record``). The vLLM glue puts its own sink
in between, which also keeps the records of a forward pass as the plan a
CUDA-graph replay repeats. The serving layer exports the counters to
Prometheus (``echo_vllm.vllm_glue.metrics``); tests and benchmarks read
them directly. A fallback is never silent: every exact-path call is counted
under its reason, and the first occurrence of each reason is logged.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from .health import WHERE

logger = logging.getLogger("echo_vllm")


@dataclass(frozen=True)
class CallRecord:
    """What one all-reduce call did."""

    path: str
    """``"echo"`` or ``"exact"``."""
    reason: str
    """Why it took that path (a ``policy.Reason`` value, or the caller's own)."""
    nbytes: int = 0
    """Input bytes of this rank's message (exact calls)."""
    wire_bytes: int = 0
    """Bytes this rank sent on the wire (Echo calls): ``in_host_bytes + cross_host_bytes``."""
    in_host_bytes: int = 0
    """Of those, bytes sent to ranks on this rank's host (``echo_vllm.wire_bytes``)."""
    cross_host_bytes: int = 0
    """Of those, bytes sent to ranks on other hosts: what crosses the network."""
    equiv_bytes: int = 0
    """Bytes a bandwidth-optimal 16-bit all-reduce would have sent (Echo calls)."""
    carried: bool = False
    """The call absorbed the error the chain's previous call left."""
    dropped: str = ""
    """A pending error the call could not continue, and why
    (``feedback.Drop`` value; empty: none)."""
    checked: bool = False
    """The call's input and output were checked for non-finite values
    (:mod:`echo_vllm.health`)."""
    norm: str = ""
    """A call followed by the residual add and RMSNorm
    (``EchoCommunicator.all_reduce_norm``): ``"fused"``, or why the norm ran
    after the all-reduce instead; empty for a plain all-reduce."""


#: Where a communicator hands its records.
CallSink = Callable[[CallRecord], None]


@dataclass
class EchoStats:
    calls: Counter = field(default_factory=Counter)
    """Calls by (path, reason)."""
    wire_bytes: int = 0
    """Bytes this rank sent on the wire in Echo calls."""
    level_bytes: Counter = field(default_factory=Counter)
    """Those bytes by where they went: ``in_host``, ``cross_host``."""
    equiv_16bit_bytes: int = 0
    """Bytes a bandwidth-optimal 16-bit all-reduce of the same Echo calls would
    have sent from this rank."""
    exact_bytes: int = 0
    """Input bytes of calls that took the exact path."""
    rel_err_sum: float = 0.0
    """Sum of sampled relative errors |y - exact| / |exact| (see metrics)."""
    rel_err_samples: int = 0
    feedback_carried: int = 0
    """Calls that absorbed the error the previous call of their chain left."""
    feedback_dropped: Counter = field(default_factory=Counter)
    """Pending errors no call absorbed, by reason (``feedback.Drop`` values)."""
    health_checked: int = 0
    """Calls checked for non-finite values (:mod:`echo_vllm.health`)."""
    norm_calls: Counter = field(default_factory=Counter)
    """Calls followed by the residual add and RMSNorm, by how the norm ran
    (``"fused"`` or the reason it was not)."""
    health: Any = field(default=None, repr=False)
    """The :class:`~echo_vllm.health.HealthCounters` those checks add into
    (device-side; read by :meth:`snapshot`), or None."""
    _logged: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, rec: CallRecord) -> None:
        """Count one call (the communicators' default sink)."""
        with self._lock:
            self.calls[(rec.path, rec.reason)] += 1
            if rec.path == "echo":
                self.wire_bytes += rec.wire_bytes
                self.level_bytes["in_host"] += rec.in_host_bytes
                self.level_bytes["cross_host"] += rec.cross_host_bytes
                self.equiv_16bit_bytes += rec.equiv_bytes
            else:
                self.exact_bytes += rec.nbytes
            self.feedback_carried += rec.carried
            self.health_checked += rec.checked
            if rec.dropped:
                self.feedback_dropped[rec.dropped] += 1
            if rec.norm:
                self.norm_calls[rec.norm] += 1
            first_norm = rec.norm not in ("", "fused") and ("norm", rec.norm) not in self._logged
            if first_norm:
                self._logged.add(("norm", rec.norm))
            first = rec.path != "echo" and rec.reason not in self._logged
            if first:
                self._logged.add(rec.reason)
            first_drop = bool(rec.dropped) and ("dropped", rec.dropped) not in self._logged
            if first_drop:
                self._logged.add(("dropped", rec.dropped))
        if first:
            logger.info("echo: all-reduce falls back to the exact path (reason=%s); "
                        "counted in echo stats, logged once per reason", rec.reason)
        if first_norm:
            logger.info("echo: the residual add and RMSNorm run after the all-reduce, not fused into it "
                        "(reason=%s); counted in norm_calls, logged once per reason", rec.norm)
        if first_drop:
            logger.warning("echo: a carried error was dropped (reason=%s): a chain broke, one call's 4-bit error "
                           "stays in the residual stream; counted in feedback_dropped, logged once per reason",
                           rec.dropped)

    def add_error_sample(self, rel_err: float) -> None:
        with self._lock:
            self.rel_err_sum += rel_err
            self.rel_err_samples += 1

    def snapshot(self) -> dict:
        """Every counter as plain values; ``nonfinite`` is
        ``{"input": n, "output": n}`` read from :attr:`health` (lagging by
        one read on CUDA), or None without it."""
        nonfinite = None
        if self.health is not None:
            nonfinite = dict(zip(WHERE, self.health.read()))
        with self._lock:
            return {
                "calls": {f"{p}/{r}": n for (p, r), n in sorted(self.calls.items())},
                "wire_bytes": self.wire_bytes,
                "level_bytes": dict(sorted(self.level_bytes.items())),
                "equiv_16bit_bytes": self.equiv_16bit_bytes,
                "exact_bytes": self.exact_bytes,
                "rel_err_mean": self.rel_err_sum / self.rel_err_samples if self.rel_err_samples else None,
                "rel_err_sum": self.rel_err_sum,
                "rel_err_samples": self.rel_err_samples,
                "feedback_carried": self.feedback_carried,
                "feedback_dropped": dict(sorted(self.feedback_dropped.items())),
                "health_checked": self.health_checked,
                "norm_calls": dict(sorted(self.norm_calls.items())),
                "nonfinite": nonfinite,
            }
