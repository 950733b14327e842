"""Call indices per forward pass, and counters that stay right under CUDA graphs.

Call index
    Echo's feedback chain runs along the all-reduces of one forward pass, so
    each call needs its position in that pass (:class:`~echo_vllm.numbering.CallCounter`).
    vLLM creates a fresh ``ForwardContext.additional_kwargs`` dict for every
    ``set_forward_context``: a new dict starts a new pass, and the count so
    far is kept in it, so the index restarts with every forward pass and,
    under CUDA graphs, is read only while a graph is captured -- the index
    baked into a graph is the one eager execution would use (vLLM's MoE
    layers use the same pattern).

Calls per forward
    ``exact_last_call`` needs to know which call is the last one. The first
    forward pass the hook sees end to end (vLLM's profiling run, a dummy
    batch) tells: the count is learned when the next forward pass starts.
    Until then no call is marked last. A later pass with another count (a
    drafter model, a partial pass) is counted as a mismatch and logged once;
    the learned value stays.

Counters under CUDA graphs
    A replayed graph runs no Python, so the hook cannot count its calls.
    Every forward pass the hook observes leaves a *plan* -- its calls'
    :class:`~echo_vllm.stats.CallRecord` s, which the tracker receives as the
    communicator's sink (:meth:`ForwardTracker.on_record`) -- keyed by its
    padded token count, the key vLLM's graphs
    are dispatched on. A plan recorded while capturing is the one its graph
    replays; a later eager pass of the same size does not replace it. Calls
    made *while capturing* go into plans only, not into the counters: they
    executed nothing. vLLM replays a graph in one of two ways:

    * inside a forward context: PIECEWISE graphs, and the V1 model runner's
      FULL graphs. The per-forward host hook (``on_forward_start``, wired to
      the platform's ``set_additional_forward_context``, which vLLM calls in
      every ``set_forward_context``) looks back at the previous pass: if it
      ran in a CUDA-graph mode and the hook saw none of its calls, it was a
      replay, and its plan is added to the counters. This lags by one
      forward pass; :meth:`ForwardTracker.settle` (the sessions' ``flush()``)
      closes the last pass.
    * without one: Model Runner V2 (0.26's default for dense models) replays
      FULL graphs -- every decode step -- with
      ``ModelCudaGraphManager.run_fullgraph``, which the hook wraps to call
      ``on_graph_replay``: counted at once.

    A replay whose size has no plan is counted in ``forwards_unplanned``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ..capture import capturing
from ..numbering import NO_PASS, CallCounter, CallSlot
from ..stats import CallRecord, EchoStats
from . import compat

logger = logging.getLogger("echo_vllm")

#: Keys Echo keeps in ``ForwardContext.additional_kwargs``.
CALL_INDEX_KEY = "echo_call_index"
"""Number of this group's all-reduces issued so far in the forward pass."""
TOKENS_KEY = "echo_num_tokens"
"""Padded token count vLLM gave ``set_forward_context`` (the graph key)."""
GRAPH_KEY = "echo_cudagraph"
"""The pass ran in a CUDA-graph mode (captured or replayed)."""

#: Seconds between two metric exports from the per-forward hook.
PUBLISH_INTERVAL_S = 1.0


@dataclass
class StepStats(EchoStats):
    """:class:`EchoStats` plus what the vLLM glue knows about forward passes."""

    forwards_observed: int = 0
    """Forward passes whose all-reduces ran Python (eager, compiled, capture)."""
    forwards_replayed: int = 0
    """Forward passes replayed from a CUDA graph, counted from their plan."""
    forwards_unplanned: int = 0
    """Replayed passes of a size no plan was recorded for: their calls are
    missing from the counters (logged once)."""
    forwards_mismatched: int = 0
    """Observed passes whose call count differed from the learned one."""
    calls_per_forward: int | None = None
    """Residual-stream all-reduces per forward pass (side calls not
    counted), learned from the first full pass."""
    residual_err_end_sum: float = 0.0
    """Sum over measured passes of |sum_t (y_t - S_t)| / |sum_t S_t| at the
    end of the pass (emulation's ``tp_comm_emulate_measure``)."""
    residual_err_max_sum: float = 0.0
    """Same, taking the largest value over the pass's calls."""
    residual_samples: int = 0
    min_bytes: int | None = None
    """The size threshold in force (measured at start with ``min_bytes="auto"``)."""
    max_bytes: int | None = None
    bypasses: tuple[str, ...] = ()
    """The model's fused all-reduce paths that go around Echo's hook
    (``bypass.Bypass.path``; logged at start)."""
    topology: tuple[str, str] | None = None
    """The TP group's topology and why (``hosts.choose_topology``; logged
    at start), or None before the group's communicator is built."""
    norm_sites: Counter = field(default_factory=Counter)
    """Echo's all-reduces in the compiled graphs by what the norm fusion
    pass did with them (``"fused"`` or why not; ``norm_fusion``), summed
    over the graphs compiled (a cached compilation runs no pass)."""

    def add_norm_sites(self, outcomes: Counter) -> None:
        with self._lock:
            self.norm_sites.update(outcomes)

    def set_thresholds(self, min_bytes: int, max_bytes: int) -> None:
        with self._lock:
            self.min_bytes, self.max_bytes = int(min_bytes), int(max_bytes)

    def replay(self, plan: list[CallRecord]) -> None:
        """Count one replayed forward pass from its captured plan."""
        for rec in plan:
            self.record(rec)
        with self._lock:
            self.forwards_replayed += 1

    def add_residual_sample(self, end: float, worst: float) -> None:
        with self._lock:
            self.residual_err_end_sum += end
            self.residual_err_max_sum += worst
            self.residual_samples += 1

    def snapshot(self) -> dict:
        snap = super().snapshot()
        n = self.residual_samples
        with self._lock:
            snap.update(
                forwards_observed=self.forwards_observed,
                forwards_replayed=self.forwards_replayed,
                forwards_unplanned=self.forwards_unplanned,
                forwards_mismatched=self.forwards_mismatched,
                calls_per_forward=self.calls_per_forward,
                residual_err_end_mean=self.residual_err_end_sum / n if n else None,
                residual_err_max_mean=self.residual_err_max_sum / n if n else None,
                residual_samples=n,
                min_bytes=self.min_bytes,
                max_bytes=self.max_bytes,
                bypasses=list(self.bypasses),
                topology=list(self.topology) if self.topology is not None else None,
                norm_sites=dict(sorted(self.norm_sites.items())),
            )
        return snap


class ForwardTracker:
    """Numbers the calls of each forward pass and accounts graph replays.

    One per Echo session (process). ``next_call`` and ``on_record`` are
    called for every all-reduce Echo sees (:class:`~echo_vllm.communicator.EchoCommunicator`'s ``numbering``);
    ``on_forward_start`` by the per-forward host hook; ``on_graph_replay``
    where vLLM replays a FULL graph outside any forward context; ``settle``
    by whoever reads the counters.
    """

    def __init__(self, stats: StepStats, *, rank: int = 0, publish: Callable | None = None):
        self.stats = stats
        self.rank = rank
        self._publish = publish
        self._last_publish = 0.0
        self.counter = CallCounter(stats.calls_per_forward)
        """Numbers the calls of the pass being observed."""
        self._observing: dict | None = None
        self._in_forward = False
        self._plan: list[CallRecord] = []
        self._plan_tokens: int | None = None
        self._plan_captured = False
        self._plans: dict[int | None, list[CallRecord]] = {}
        self._captured: set[int | None] = set()
        self._started: dict | None = None

    # -- the hook's side --------------------------------------------------------

    def number(self, rows: int, residual: bool) -> CallSlot:
        """The communicators' ``numbering``: :meth:`next_call` in the current
        forward context (vLLM's)."""
        return self.next_call(compat.forward_kwargs(), rows, residual=residual)

    def next_call(self, kwargs: dict | None, num_tokens: int, *, residual: bool = True) -> CallSlot:
        """The slot of the next all-reduce of the pass whose context holds
        ``kwargs`` (None: no forward context). ``residual=False``: a side
        call, which the pass's numbering skips (``CallCounter.side``); it
        still belongs to the pass (and its plan)."""
        if kwargs is None:
            self._in_forward = False
            return NO_PASS
        self._in_forward = True
        if kwargs is not self._observing:
            self._finish_observed()
            self._observing = kwargs
            self._plan = []
            self._plan_tokens = kwargs.get(TOKENS_KEY, num_tokens)
            self._plan_captured = False
            self.counter.start(at=kwargs.get(CALL_INDEX_KEY, 0))
        if not self._plan_captured and capturing():
            self._plan_captured = True
        slot = self.counter.next() if residual else self.counter.side()
        # set by side calls too: a pass with any call seen is not a replay
        kwargs[CALL_INDEX_KEY] = self.counter.count
        return slot

    def _finish_observed(self) -> None:
        """Close the pass observed so far: learn its call count, keep its plan."""
        if self._observing is None:
            return
        self._observing = None
        known = self.counter.calls_per_pass
        calls = self.counter.end()
        key = self._plan_tokens
        if self._plan_captured:  # what the graph of this size will replay
            self._plans[key] = self._plan
            self._captured.add(key)
        elif key not in self._captured:
            self._plans[key] = self._plan
        stats = self.stats
        with stats._lock:
            stats.forwards_observed += 1
            learned = known is None and bool(calls)  # a pass of side calls only teaches nothing
            mismatch = known is not None and calls != known
            if learned:
                stats.calls_per_forward = calls
            elif mismatch:
                stats.forwards_mismatched += 1
        if learned:
            logger.info("echo: learned %d all-reduces per forward pass", calls)
        elif mismatch and stats.forwards_mismatched == 1:
            logger.warning(
                "echo: a forward pass made %d all-reduces, expected %d (drafter model or "
                "partial pass?); exact_last_call marks call %d; counted in forwards_mismatched",
                calls, known, known - 1,
            )

    def on_record(self, rec: CallRecord) -> None:
        """The communicators' sink: a call of the observed pass joins its
        plan; it is counted unless a graph is being captured (a capture
        executes nothing; its replays are counted from the plan)."""
        if self._in_forward and self._observing is not None:
            self._plan.append(rec)
        if not capturing():
            self.stats.record(rec)

    # -- replays -------------------------------------------------------------------

    def settle(self, running: dict | None = None) -> None:
        """Account every pass that has ended: close the observed one (call
        count, plan) and count the last started one if it was a replay.
        ``running``: the ``additional_kwargs`` of a forward pass still in
        progress (``compat.forward_kwargs()``), left open."""
        if self._observing is not None and self._observing is not running:
            self._finish_observed()
        prev = self._started
        if prev is None or prev is running:
            return
        self._started = None
        if prev.get(GRAPH_KEY) and CALL_INDEX_KEY not in prev:
            self._count_replay(prev.get(TOKENS_KEY))

    def on_graph_replay(self, num_tokens: int | None) -> None:
        """vLLM replayed the FULL graph of ``num_tokens`` without a forward
        context (Model Runner V2): settle what came before, count it now."""
        self.settle()
        self._count_replay(num_tokens)
        self.maybe_publish()

    def _count_replay(self, num_tokens: int | None) -> None:
        plan = self._plans.get(num_tokens)
        if plan is not None:
            self.stats.replay(plan)
            return
        stats = self.stats
        with stats._lock:
            stats.forwards_unplanned += 1
            first = stats.forwards_unplanned == 1
        if first:
            logger.warning(
                "echo: a CUDA graph of %s tokens was replayed but no pass of that size was seen "
                "at capture; its all-reduces are missing from the counters (forwards_unplanned)",
                num_tokens,
            )

    # -- the per-forward host hook ---------------------------------------------

    def on_forward_start(self, kwargs: dict, *, num_tokens: int | None, cudagraph: bool) -> None:
        """Called as every forward context is created, before the model runs.
        Accounts the previous pass if it was a graph replay, then tags this
        one; exports metrics at most every PUBLISH_INTERVAL_S."""
        self.settle()
        kwargs[TOKENS_KEY] = num_tokens
        kwargs[GRAPH_KEY] = bool(cudagraph)
        self._started = kwargs
        self.maybe_publish()

    def maybe_publish(self, now: float | None = None) -> bool:
        if self._publish is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_publish < PUBLISH_INTERVAL_S:
            return False
        self._last_publish = now
        try:
            self._publish(self.stats.snapshot(), self.rank)
        except Exception:  # metrics must never take the engine down
            logger.exception("echo: metrics export failed; disabling it for this process")
            self._publish = None
        return True


def metrics_publisher() -> Callable[[dict, int], Any] | None:
    """``echo_vllm.vllm_glue.metrics.publish`` if that module is importable."""
    try:
        from . import metrics
    except Exception:
        return None
    return getattr(metrics, "publish", None)


def tag_forward(call_kwargs: dict) -> tuple[int | None, bool]:
    """(padded token count, CUDA-graph mode) from the arguments vLLM passes
    ``set_additional_forward_context`` (all by keyword in 0.26)."""
    desc = call_kwargs.get("batch_descriptor")
    tokens = getattr(desc, "num_tokens", None)
    if tokens is None:
        tokens = call_kwargs.get("num_tokens")
    mode = call_kwargs.get("cudagraph_runtime_mode")
    # CUDAGraphMode.NONE is falsy (CUDAGraphMode.__bool__), PIECEWISE / FULL truthy
    return tokens, bool(mode) if mode is not None else False
