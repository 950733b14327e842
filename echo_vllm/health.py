"""Numerical health of Echo's calls: non-finite values and saturated sums,
counted on the device.

Why sampled and on the device: a check of every call's output would read
each message once more (about a third of an Echo call's own memory
traffic), and a host-side check needs a device sync per call. Under CUDA
graphs no host code runs per call at all. So a few fixed call positions of
every pass are checked (:func:`sampled`, from the call index alone: a
captured graph bakes in the same positions, and its replays count), and
the check is a handful of tiny device ops that add into a counter tensor
(:class:`HealthCounters`); the host reads that counter without a sync,
about once a second when metrics are published.

What one check looks at: the smallest and largest value of the call's
input (this rank's partial, or the stacked partials of virtual ranks) and
of its output (``torch.aminmax``: one read, exact, NaN propagates). A value
is NaN or infinite if and only if one of those is. Non-finite values that
enter the residual stream stay in it, and in the carried error, for the
rest of the pass: any later sample sees them. Read the counts together:

* ``input``: the model handed Echo non-finite values (not Echo's doing; the
  exact path would return them too). In Echo's output each one turns its
  whole group (``group_size`` values, one scale) to NaN, where the exact
  path keeps it to its own position;
* ``output`` without ``input`` on every rank: Echo (or the link) produced
  them -- a bug to report; ``--tp-comm nccl`` is the workaround;
* ``saturated``: the output holds the largest finite value of its dtype
  (bf16: about 3.39e38). Echo decodes a sum beyond the dtype's range to
  that value, where NCCL's 16-bit sum and the exact path give infinity: a
  sum that overflows stays finite, so it is counted here, as its own event
  (an exact sum equal to the largest value is counted too; no real
  activation is).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .capture import capturing

#: Counter slots: non-finite input, non-finite output, saturated output.
INPUT, OUTPUT, SATURATED = 0, 1, 2
WHERE = ("input", "output")
"""Where a non-finite value was seen (the labels of ``echo:nonfinite_total``)."""


class HealthCounts(NamedTuple):
    """Checked calls whose input / output held NaN or Inf, and whose output
    saturated (held the dtype's largest finite magnitude)."""

    input: int = 0
    output: int = 0
    saturated: int = 0


def sampled(call_index: int | None, every: int) -> bool:
    """Whether the call at ``call_index`` of its pass is checked: every
    ``every``-th call (indices ``every - 1``, ``2 * every - 1``, ...); none
    with ``every = 0`` or outside a pass."""
    return bool(every) and call_index is not None and call_index % every == every - 1


class HealthCounters:
    """Device-side counts of checked calls whose input / output held a
    non-finite value, and whose output saturated (:class:`HealthCounts`).

    :meth:`observe` queues the check on the current stream (no sync,
    capturable); :meth:`read` returns host totals. On CUDA the read is
    asynchronous: it starts a copy into pinned memory and returns what the
    previous completed copy saw, so the totals lag by one read (about one
    metrics interval). The counter is allocated by :meth:`allocate` (the
    vLLM glue calls it with the feedback buffer's, on the profiling run) or
    by the first check outside CUDA-graph capture -- never under capture,
    where a replay would zero it again.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._counts: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._last = HealthCounts()

    def allocate(self) -> None:
        """Allocate the counter (idempotent; not under CUDA-graph capture).

        Always as normal tensors, also when called under
        ``torch.inference_mode()`` (vLLM allocates there): an inference
        tensor refuses the in-place ``zero_``/``copy_`` of :meth:`reset` and
        :meth:`read` outside inference mode, while a normal tensor takes
        in-place updates in both modes."""
        if self._counts is None:
            with torch.inference_mode(False):
                self._counts = torch.zeros(len(HealthCounts._fields), dtype=torch.int64, device=self.device)
                self._host = torch.zeros(len(HealthCounts._fields), dtype=torch.int64, pin_memory=self._cuda)

    def observe(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Count ``x`` (input) and ``y`` (output) if they hold NaN or Inf,
        and ``y`` if it holds its dtype's largest finite magnitude; False
        (nothing checked) for an empty message, and while the counter is not
        allocated under capture."""
        if not x.numel() or not y.numel():
            return False
        if self._counts is None:
            if capturing():
                return False
            self.allocate()
        # the extremes in fp32, which holds every 16-bit value exactly (the dtype's max included)
        ends = torch.stack((*torch.aminmax(x), *torch.aminmax(y))).float()
        bad = torch.isfinite(ends).logical_not()
        top = ends[2:].abs() == torch.finfo(y.dtype).max
        self._counts.add_(torch.stack((bad[:2].any(), bad[2:].any(), top.any())))
        return True

    def read(self) -> HealthCounts:
        """The counts so far (see the class docstring)."""
        if self._counts is None:
            return self._last
        if not self._cuda:
            return HealthCounts(*map(int, self._counts.tolist()))
        if capturing():  # nothing may be queued on a capturing stream
            return self._last
        if self._copied is not None and self._copied.query():
            self._last = HealthCounts(*map(int, self._host.tolist()))
            self._copied = None
        if self._copied is None:
            self._host.copy_(self._counts, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._last

    def reset(self) -> None:
        """Start again from zero (queued on the current stream)."""
        if self._counts is not None:
            self._counts.zero_()
        self._copied = None
        self._last = HealthCounts()


__all__ = ["HealthCounters", "HealthCounts", "INPUT", "OUTPUT", "SATURATED", "WHERE", "sampled"]
