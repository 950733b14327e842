"""Call numbering: each all-reduce's place in its pass.

Echo's feedback chain runs along the all-reduces of one *pass* (a model's
forward pass, or one direction of a training step) that carry the residual
stream -- side calls (a norm's variance, another dtype) are not numbered
(:meth:`CallCounter.side`): call 0 starts clean,
each later call absorbs the error the one before it left, and the policy
keeps the first ``first_exact_calls`` and the last call of a pass
(``exact_last_call``) on the 16-bit path. So every caller needs, per call,
its index in the pass and whether it is the last one.

:class:`CallCounter` is that one counter. The vLLM glue's tracker
(:class:`echo_vllm.vllm_glue.tracking.ForwardTracker`), the one-device
emulation (:class:`echo_vllm.emulation.EmulatedTP`) and training's chains
(:class:`echo_vllm.training.collectives.ChainedAllReduce`) each hold one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallSlot:
    """One all-reduce's place in its pass."""

    index: int | None
    """0-based position; None outside any pass (no chain to carry error along)."""
    last_call: bool = False
    """The last call of the pass (known once the pass's call count is)."""
    first_of_forward: bool = False
    """The first call numbered since the pass started."""

    def __post_init__(self) -> None:
        # the policy compares the index and tests the flags: 3.5, -1 or "no" would pick a path silently
        i = self.index
        if i is not None and (not isinstance(i, int) or isinstance(i, bool) or i < 0):
            raise ValueError(f"CallSlot index={i!r:.60}: must be an integer from 0, or None outside any pass")
        for name in ("last_call", "first_of_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CallSlot {name}={getattr(self, name)!r:.60}: must be True or False")


#: The slot of a call made outside any pass.
NO_PASS = CallSlot(None)


class CallCounter:
    """Numbers the calls of each pass 0, 1, 2, ... and marks the last one.

    :meth:`start` begins a pass, :meth:`next` numbers its next call,
    :meth:`end` closes it (:meth:`start` closes the previous pass too).
    The calls per pass are declared (the constructor, or ``start(calls)``
    for one pass) or learned: the first pass that ends with calls in it
    sets :attr:`calls_per_pass` when none was declared. Until the count is
    known no call is marked last. Calls outside a pass get :data:`NO_PASS`
    and are not counted.
    """

    def __init__(self, calls_per_pass: int | None = None):
        self.calls_per_pass = calls_per_pass
        """Calls one pass makes: declared, or learned from the first pass."""
        self.count = 0
        """Calls numbered in the current (or last) pass so far."""
        self.active = False
        """A pass is open."""
        self._fresh = False

    def start(self, calls: int | None = None, *, at: int = 0) -> int | None:
        """Close the open pass (see :meth:`end`; its count is returned) and
        begin one whose first call gets index ``at`` (a pass resumed after
        another continues its numbering). ``calls``: this pass's call count
        when known in advance; None keeps the declared or learned one."""
        ended = self.end()
        if calls is not None:
            self.calls_per_pass = calls
        self.count = at
        self.active = True
        self._fresh = True
        return ended

    def next(self) -> CallSlot:
        """The slot of the next call (:data:`NO_PASS` outside a pass)."""
        if not self.active:
            return NO_PASS
        index = self.count
        self.count += 1
        first, self._fresh = self._fresh, False
        n = self.calls_per_pass
        return CallSlot(index, n is not None and index == n - 1, first)

    def side(self) -> CallSlot:
        """The slot of a side call (outside the numbered chain): the pass's
        current position, not counted, never last (:data:`NO_PASS` outside a
        pass). Its index only says that a pass is running."""
        if not self.active:
            return NO_PASS
        return CallSlot(self.count)

    def end(self) -> int | None:
        """Close the open pass and return its call count (None when no pass
        was open). The first pass with calls teaches :attr:`calls_per_pass`
        when none was declared."""
        if not self.active:
            return None
        self.active = False
        if self.calls_per_pass is None and self.count:
            self.calls_per_pass = self.count
        return self.count


__all__ = ["NO_PASS", "CallCounter", "CallSlot"]
