"""Numerical health of Echo's calls: non-finite values, counted on the device.

Why sampled and on the device: a check of every call's output would read
each message once more (about a third of an Echo call's own memory
traffic), and a host-side check needs a device sync per call. Under CUDA
graphs no host code runs per call at all. So a few fixed call positions of
every pass are checked (:func:`sampled`, from the call index alone: a
captured graph bakes in the same positions, and its replays count), and
the check is a handful of tiny device ops that add into a counter tensor
(:class:`HealthCounters`); the host reads that counter without a sync,
about once a second when metrics are published.

What one check looks at: the fp32 sum of the call's input (this rank's
partial, or the stacked partials of virtual ranks) and of its output. A sum
is NaN or infinite if and only if some value is (or the finite values
overflow fp32, which no sane activation does). Non-finite values that
enter the residual stream stay in it, and in the carried error, for the
rest of the pass: any later sample sees them. Read the two counts together:

* ``input``: the model handed Echo non-finite values (not Echo's doing; the
  exact path would return them too);
* ``output`` without ``input`` on every rank: Echo (or the link) produced
  them -- a bug to report; ``--tp-comm nccl`` is the workaround.
"""

from __future__ import annotations

import torch

from .capture import capturing

#: Counter slots.
INPUT, OUTPUT = 0, 1
WHERE = ("input", "output")


def sampled(call_index: int | None, every: int) -> bool:
    """Whether the call at ``call_index`` of its pass is checked: every
    ``every``-th call (indices ``every - 1``, ``2 * every - 1``, ...); none
    with ``every = 0`` or outside a pass."""
    return bool(every) and call_index is not None and call_index % every == every - 1


class HealthCounters:
    """Device-side counts of checked calls whose input / output held a
    non-finite value.

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
        self._last = (0, 0)

    def allocate(self) -> None:
        """Allocate the counter (idempotent; not under CUDA-graph capture).

        Always as normal tensors, also when called under
        ``torch.inference_mode()`` (vLLM allocates there): an inference
        tensor refuses the in-place ``zero_``/``copy_`` of :meth:`reset` and
        :meth:`read` outside inference mode, while a normal tensor takes
        in-place updates in both modes."""
        if self._counts is None:
            with torch.inference_mode(False):
                self._counts = torch.zeros(2, dtype=torch.int64, device=self.device)
                self._host = torch.zeros(2, dtype=torch.int64, pin_memory=self._cuda)

    def observe(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Count ``x`` (input) and ``y`` (output) if they hold NaN or Inf;
        False (nothing checked) while the counter is not allocated under
        capture."""
        if self._counts is None:
            if capturing():
                return False
            self.allocate()
        sums = torch.stack((x.sum(dtype=torch.float32), y.sum(dtype=torch.float32)))
        self._counts.add_(torch.isfinite(sums).logical_not())
        return True

    def read(self) -> tuple[int, int]:
        """``(inputs, outputs)`` non-finite so far (see the class docstring)."""
        if self._counts is None:
            return self._last
        if not self._cuda:
            inputs, outputs = self._counts.tolist()
            return int(inputs), int(outputs)
        if capturing():  # nothing may be queued on a capturing stream
            return self._last
        if self._copied is not None and self._copied.query():
            self._last = tuple(int(v) for v in self._host.tolist())
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
        self._last = (0, 0)


__all__ = ["HealthCounters", "INPUT", "OUTPUT", "WHERE", "sampled"]
