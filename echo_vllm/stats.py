"""Counters of what Echo did, and the log-once rule for fallbacks.

Each process keeps one :class:`EchoStats` per communicator. The serving layer
exports them to Prometheus (``echo_vllm.metrics``); tests and benchmarks read
them directly. A fallback is never silent: every exact-path call is counted
under its reason, and the first occurrence of each reason is logged.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger("echo_vllm")


@dataclass
class EchoStats:
    calls: Counter = field(default_factory=Counter)
    """Calls by (path, reason)."""
    wire_bytes: int = 0
    """Bytes this rank sent on the wire in Echo calls."""
    equiv_16bit_bytes: int = 0
    """Bytes a bandwidth-optimal 16-bit all-reduce of the same Echo calls would
    have sent from this rank."""
    exact_bytes: int = 0
    """Input bytes of calls that took the exact path."""
    rel_err_sum: float = 0.0
    """Sum of sampled relative errors |y - exact| / |exact| (see metrics)."""
    rel_err_samples: int = 0
    _logged: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, path: str, reason: str, *, nbytes: int = 0, wire: int = 0, equiv: int = 0) -> None:
        with self._lock:
            self.calls[(path, reason)] += 1
            if path == "echo":
                self.wire_bytes += wire
                self.equiv_16bit_bytes += equiv
            else:
                self.exact_bytes += nbytes
            first = path != "echo" and reason not in self._logged
            if first:
                self._logged.add(reason)
        if first:
            logger.info("echo: all-reduce falls back to the exact path (reason=%s); "
                        "counted in echo stats, logged once per reason", reason)

    def add_error_sample(self, rel_err: float) -> None:
        with self._lock:
            self.rel_err_sum += rel_err
            self.rel_err_samples += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "calls": {f"{p}/{r}": n for (p, r), n in sorted(self.calls.items())},
                "wire_bytes": self.wire_bytes,
                "equiv_16bit_bytes": self.equiv_16bit_bytes,
                "exact_bytes": self.exact_bytes,
                "rel_err_mean": self.rel_err_sum / self.rel_err_samples if self.rel_err_samples else None,
                "rel_err_sum": self.rel_err_sum,
                "rel_err_samples": self.rel_err_samples,
            }
