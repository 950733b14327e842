"""The error Echo carries from one all-reduce to the next of a forward pass.

Why a chain: in a pre-norm transformer every all-reduce output is added to the
residual stream. If call t returns ``S_t + E_{t-1} - E_t`` (exact sum plus the
error carried in, minus the error carried out), the residual after T calls
holds ``sum S_t + E_0 - E_T``: the errors telescope and the residual carries
one call's error at any depth. That needs

* the carried error to enter the *next* call of the *same* stream (same
  forward pass, same shape), and nothing else;
* call 0 of every forward pass to start clean (``E_0 = 0``): a token's error
  never crosses into another step;
* an exact (16-bit) call in the middle to *consume* the carried error (add it
  to its input) and leave none;
* a call outside the stream (a *side call*: another shape or dtype, a norm's
  variance, a gate) to leave the chain alone: it is never numbered in the
  chain and never takes or records, so the pending error waits for the next
  call of the stream. Its exact output is added to nothing the chain tracks,
  and the telescoping holds across it.

One buffer per local rank is enough storage: each error is consumed by the
very next call, and the stage kernels read and rewrite it in place, in the
format ``EchoConfig.feedback_dtype`` names (float32, bfloat16, or int8 codes
with a bf16 scale per group: ``echo_vllm.quant``'s docstring). The
buffer is allocated once (outside CUDA-graph capture) at its largest size
and reused at every size; which part of it is valid is Python state decided
only by call index and shape, so a captured graph bakes in the same decision
that eager execution makes.

A chain is an explicit object (no module-level state) so that independent
streams -- two models, a forward and a backward chain in training -- each
own one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .capture import capturing
from .config import SUPPORTED_GROUP_SIZES, EchoConfig
from .quant import FEEDBACK_STORAGE, feedback_row_len


class Drop(str, enum.Enum):
    """Why a pending error was not taken by the call after it, in the
    middle of a pass (the label of the metric ``echo:feedback_dropped_total``).
    Both are properties of the pass's own calls, so a CUDA graph captured
    from a pass repeats them; an error left at the end of a pass is not a
    drop (:attr:`ChainStats.unflushed`: it depends on the pass before, which
    a replayed graph does not know)."""

    INDEX_GAP = "index_gap"
    """The previous call of the chain was not ``call_index - 1``: a call
    numbered in the chain that did not take (a caller's numbering error)."""
    KEY_CHANGED = "shape_changed"
    """The call has another shape, dtype or layout than the one that left it."""


@dataclass(frozen=True)
class Take:
    """What :meth:`FeedbackChain.take` decided for one call."""

    incoming: bool
    """The call absorbs the pending error."""
    dropped: Drop | None = None
    """A pending error the call could not continue, and why (None: none)."""


@dataclass
class ChainStats:
    """What the chain did, for metrics and tests."""

    carried: int = 0
    """Calls that consumed an incoming error."""
    started_clean: int = 0
    """Calls that began with no incoming error (call 0, after an exact call)."""
    dropped: int = 0
    """Pending errors thrown away in the middle of a pass because the next
    call did not continue the chain (index gap or different shape): a
    bounded one-call error left in the residual, counted so it is never
    silent."""
    unflushed: int = 0
    """Passes that ended with an error pending (seen by the next pass's call
    0): ``exact_last_call`` off, or the pass's call count not known yet or
    different from the learned one."""


@dataclass
class FeedbackChain:
    """Carried quantization error of ``local_ranks`` ranks for one stream.

    ``capacity_numel`` (values per rank) may be given up front -- the vLLM
    plugin sizes it for ``max_num_batched_tokens * hidden`` and allocates it
    before any graph capture; otherwise the buffer grows on demand (eager use).
    ``dtype`` defaults to float32 (the error carried exactly, what the chain's
    unit tests check); :class:`~echo_vllm.communicator.EchoCommunicator`, the
    plugin and the benchmarks build theirs with :meth:`of`, which takes
    ``EchoConfig.feedback_dtype`` (bfloat16 by default) and ``group_size`` --
    do the same when building a chain by hand. ``group_size`` sizes an int8
    buffer (``1 + 2/g`` bytes per value); the default, the smallest
    supported group, gives the most bytes per value, so such a buffer holds
    the same number of values at every larger group size.
    """

    local_ranks: int
    device: torch.device | str = "cpu"
    dtype: str = "float32"
    capacity_numel: int = 0
    group_size: int = min(SUPPORTED_GROUP_SIZES)
    stats: ChainStats = field(default_factory=ChainStats)

    @classmethod
    def of(cls, config: EchoConfig, local_ranks: int, device: torch.device | str = "cpu",
           capacity_numel: int = 0) -> "FeedbackChain":
        """The chain a call under ``config`` needs: its feedback dtype and group size."""
        return cls(local_ranks, device, config.feedback_dtype, capacity_numel, config.group_size)

    def __post_init__(self) -> None:
        if self.dtype not in FEEDBACK_STORAGE:
            raise ValueError(f"feedback dtype {self.dtype!r}: choose one of {tuple(FEEDBACK_STORAGE)}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size!r}: not in {SUPPORTED_GROUP_SIZES}")
        self.device = torch.device(self.device)
        self._buffer: torch.Tensor | None = None
        self._pending_key: tuple | None = None
        self._last_index: int | None = None
        self._take: Take | None = None
        if self.capacity_numel:
            self.reserve(self.capacity_numel)

    # -- storage ---------------------------------------------------------------

    def _row_len(self, numel: int) -> int:
        """Buffer elements per rank that hold ``numel`` values (int8: bytes)."""
        return feedback_row_len(numel, FEEDBACK_STORAGE[self.dtype], self.group_size)

    def reserve(self, numel: int) -> None:
        """Make the buffer hold at least ``numel`` values per rank. Allocates
        (zeroed: every format decodes zeros as 0); never call it under
        CUDA-graph capture with a larger size than reserved before."""
        if self.fits(numel):
            return
        if capturing():
            raise RuntimeError(
                f"feedback buffer must grow to {numel} values during CUDA-graph capture; "
                "reserve it before capture (EchoCommunicator sizes it on the profiling run)"
            )
        self._buffer = torch.zeros(
            self.local_ranks, self._row_len(numel), dtype=FEEDBACK_STORAGE[self.dtype], device=self.device
        )
        self.capacity_numel = numel
        self._pending_key = None

    def fits(self, numel: int) -> bool:
        return self._buffer is not None and self._buffer.shape[1] >= self._row_len(numel)

    def buffer(self, numel: int) -> torch.Tensor:
        """The [local_ranks, row length] buffer (row length: elements of its
        dtype, :func:`~echo_vllm.quant.feedback_row_len`), grown to hold
        ``numel`` values if needed."""
        self.reserve(numel)
        assert self._buffer is not None
        return self._buffer

    # -- the chain rule --------------------------------------------------------

    def incoming(self, call_index: int | None, key: tuple) -> bool:
        """Whether the buffer holds an error a call ``call_index`` with ``key``
        (shape, dtype, layout) must absorb: only if the previous call of this
        chain was ``call_index - 1``, had the same key and left an error.
        Call 0 (a new forward pass) and calls outside a forward pass never
        carry. A question only; :meth:`take` is the call's own step."""
        return (
            self._pending_key is not None
            and call_index is not None
            and call_index > 0
            and self._last_index == call_index - 1
            and self._pending_key == key
        )

    def take(self, call_index: int | None, key: tuple) -> bool:
        """Start call ``call_index``: :meth:`incoming`, counted in ``stats``
        (a pending error the call cannot continue is counted as dropped, or
        as unflushed at call 0); :meth:`pop_take` tells the caller what."""
        ok = self.incoming(call_index, key)
        drop = None
        if self._pending_key is not None and not ok and call_index is not None:
            if call_index == 0:
                self.stats.unflushed += 1
            else:
                drop = Drop.INDEX_GAP if self._last_index != call_index - 1 else Drop.KEY_CHANGED
                self.stats.dropped += 1
        if ok:
            self.stats.carried += 1
        else:
            self.stats.started_clean += 1
        self._take = Take(ok, drop)
        return ok

    def pop_take(self) -> Take | None:
        """What the last :meth:`take` since the previous ``pop_take``
        decided, or None when no call took since (a side call, feedback
        off): the call's record says it."""
        take, self._take = self._take, None
        return take

    def record(self, call_index: int | None, key: tuple, left_error: bool) -> None:
        """After a call: remember whether it left an error for the next one."""
        self._last_index = call_index
        self._pending_key = key if (left_error and call_index is not None) else None

    def release(self) -> None:
        """Free the buffer (a later call allocates it again)."""
        self._buffer = None
        self.capacity_numel = 0
        self._pending_key = None

    def reset(self) -> None:
        """Forget any pending error (the buffer contents become irrelevant)."""
        self._pending_key = None
        self._last_index = None

    @property
    def pending(self) -> bool:
        return self._pending_key is not None
