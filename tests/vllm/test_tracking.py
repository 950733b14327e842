"""``vllm_glue.tracking``: call numbering per forward pass, and counters
under (simulated) CUDA-graph capture and replay; the metrics export's pace
(no vLLM import)."""

from types import SimpleNamespace

from echo_vllm.stats import CallRecord
from echo_vllm.vllm_glue import tracking
from echo_vllm.vllm_glue.tracking import (
    CALL_INDEX_KEY,
    ForwardTracker,
    StepStats,
    tag_forward,
)


def _run_calls(tracker, stats, kwargs, n, tokens=8):
    slots = []
    for _ in range(n):
        slot = tracker.next_call(kwargs, tokens)
        tracker.on_record(CallRecord("echo", "echo", wire_bytes=10, equiv_bytes=40))
        slots.append(slot)
    return slots


def test_indices_restart_per_forward_and_the_count_is_learned():
    stats = StepStats()
    tr = ForwardTracker(stats)
    first = _run_calls(tr, stats, {}, 5)
    assert [s.index for s in first] == [0, 1, 2, 3, 4]
    assert not any(s.last_call for s in first)  # not known yet
    assert first[0].first_of_forward and not first[1].first_of_forward
    second = _run_calls(tr, stats, {}, 5)
    assert [s.index for s in second] == [0, 1, 2, 3, 4]
    assert [s.last_call for s in second] == [False] * 4 + [True]
    assert stats.calls_per_forward == 5
    assert tr.next_call(None, 8).index is None  # no forward context


def test_side_calls_are_not_numbered_but_join_the_pass_and_its_plan(monkeypatch):
    """A side call (``residual=False``) takes no index: the residual calls
    around it are numbered 0, 1, 2 ... as if it were absent, the learned
    count is the residual calls', and its record still joins the pass's
    plan, so a replay counts it."""
    stats = StepStats()
    tr = ForwardTracker(stats)
    for _ in range(2):
        kw = {}
        slots = []
        for residual in (True, False, True, False, True):
            slots.append(tr.next_call(kw, 8, residual=residual))
            tr.on_record(CallRecord("echo" if residual else "exact", "echo" if residual else "not_residual_shape"))
        assert [s.index for s in slots] == [0, 1, 1, 2, 2]
    assert stats.calls_per_forward == 3 and stats.forwards_mismatched == 0
    assert [s.last_call for s in slots] == [False, False, False, False, True]
    side_only = {}  # a graph-mode pass whose only call seen is a side call: observed, not a replay
    tr.on_forward_start(side_only, num_tokens=8, cudagraph=True)
    tr.next_call(side_only, 8, residual=False)
    tr.settle()
    assert stats.forwards_replayed == 0 and stats.calls_per_forward == 3
    _capture(tr, stats, monkeypatch, tokens=4, n=1)
    monkeypatch.setattr(tracking, "capturing", lambda: True)
    kw = {}
    tr.next_call(kw, 4, residual=False)
    tr.on_record(CallRecord("exact", "not_residual_shape"))
    monkeypatch.setattr(tracking, "capturing", lambda: False)
    before = stats.calls[("exact", "not_residual_shape")]
    tr.on_graph_replay(4)
    assert stats.calls[("exact", "not_residual_shape")] == before + 1


def test_a_pass_with_another_count_is_counted_not_learned():
    stats = StepStats()
    tr = ForwardTracker(stats)
    _run_calls(tr, stats, {}, 5)
    _run_calls(tr, stats, {}, 3)  # e.g. a drafter model's pass
    _run_calls(tr, stats, {}, 5)
    assert stats.calls_per_forward == 5 and stats.forwards_mismatched == 1
    assert stats.forwards_observed == 2  # the third pass closes with the next one


def test_counters_include_graph_replays_and_exclude_capture(monkeypatch):
    """Eager pass (counted), captured pass (plan only), two replays (no
    Python ran: counted from the plan when the next pass starts)."""
    stats = StepStats()
    tr = ForwardTracker(stats)
    eager = {}
    tr.on_forward_start(eager, num_tokens=8, cudagraph=False)
    _run_calls(tr, stats, eager, 3)
    assert stats.calls[("echo", "echo")] == 3

    monkeypatch.setattr(tracking, "capturing", lambda: True)
    capture = {}
    tr.on_forward_start(capture, num_tokens=16, cudagraph=True)
    _run_calls(tr, stats, capture, 3, tokens=16)
    monkeypatch.setattr(tracking, "capturing", lambda: False)
    assert stats.calls[("echo", "echo")] == 3  # capture executes nothing

    for _ in range(2):  # replays of the 16-token graph: the hook never runs
        tr.on_forward_start({}, num_tokens=16, cudagraph=True)
    tr.on_forward_start({}, num_tokens=8, cudagraph=False)  # accounts the last replay
    assert stats.forwards_replayed == 2
    assert stats.calls[("echo", "echo")] == 3 + 2 * 3
    assert stats.wire_bytes == 10 * 9 and stats.equiv_16bit_bytes == 40 * 9
    snap = stats.snapshot()
    assert snap["forwards_replayed"] == 2 and snap["calls_per_forward"] == 3


def test_replay_of_an_unknown_size_is_counted_as_unplanned():
    stats = StepStats()
    tr = ForwardTracker(stats)
    tr.on_forward_start({}, num_tokens=32, cudagraph=True)
    tr.on_forward_start({}, num_tokens=32, cudagraph=True)
    tr.on_graph_replay(16)  # settles the second pass first
    assert stats.forwards_replayed == 0 and not stats.calls
    assert stats.forwards_unplanned == 3 and stats.snapshot()["forwards_unplanned"] == 3


def _capture(tr, stats, monkeypatch, tokens, n=3, path=("echo", "echo")):
    """A pass captured into a graph of ``tokens`` (inside a NONE-mode
    context, as Model Runner V2 captures FULL graphs)."""
    monkeypatch.setattr(tracking, "capturing", lambda: True)
    kw = {}
    tr.on_forward_start(kw, num_tokens=tokens, cudagraph=False)
    for _ in range(n):
        tr.next_call(kw, tokens)
        tr.on_record(CallRecord(*path, nbytes=tokens, wire_bytes=10, equiv_bytes=40))
    monkeypatch.setattr(tracking, "capturing", lambda: False)


def test_full_graph_replays_without_a_context_count_at_once(monkeypatch):
    """Model Runner V2 replays FULL graphs with no forward context: the hook
    around run_fullgraph counts each, and first settles the pass before."""
    stats = StepStats()
    tr = ForwardTracker(stats)
    _capture(tr, stats, monkeypatch, tokens=4)
    eager = {}
    tr.on_forward_start(eager, num_tokens=8, cudagraph=False)  # prefill, observed
    _run_calls(tr, stats, eager, 3)
    for _ in range(5):
        tr.on_graph_replay(4)
    assert stats.forwards_replayed == 5 and stats.forwards_observed == 2  # capture + prefill
    assert stats.calls[("echo", "echo")] == 3 + 5 * 3


def test_settle_closes_the_last_pass_but_not_a_running_one(monkeypatch):
    stats = StepStats()
    tr = ForwardTracker(stats)
    _capture(tr, stats, monkeypatch, tokens=4)
    replay = {}
    tr.on_forward_start(replay, num_tokens=4, cudagraph=True)  # a PIECEWISE replay
    tr.settle(running=replay)  # still running: left open
    assert stats.forwards_replayed == 0
    tr.settle()
    assert stats.forwards_replayed == 1 and stats.calls[("echo", "echo")] == 3
    tr.settle()  # idempotent
    assert stats.forwards_replayed == 1
    eager = {}
    tr.on_forward_start(eager, num_tokens=8, cudagraph=False)
    _run_calls(tr, stats, eager, 2)
    tr.settle(running=eager)
    assert stats.forwards_observed == 1  # the capture; the eager pass is still open
    tr.settle()
    assert stats.forwards_observed == 2 and stats.forwards_mismatched == 1


def test_the_captured_plan_is_what_replays_count(monkeypatch):
    """An eager pass of a captured size (a fallback batch) must not replace
    the plan the graph was captured with: the graph replays the capture's
    decisions (here gloo cannot be captured: exact)."""
    stats = StepStats()
    tr = ForwardTracker(stats)
    _capture(tr, stats, monkeypatch, tokens=4, path=("exact", "capture_unsupported"))
    eager = {}
    tr.on_forward_start(eager, num_tokens=4, cudagraph=False)
    _run_calls(tr, stats, eager, 3, tokens=4)
    tr.on_graph_replay(4)
    assert stats.calls == {("echo", "echo"): 3, ("exact", "capture_unsupported"): 3}
    assert stats.exact_bytes == 3 * 4


def test_metrics_publish_at_most_once_a_second():
    seen = []
    tr = ForwardTracker(StepStats(), rank=3, publish=lambda snap, rank: seen.append(rank))
    assert tr.maybe_publish(now=100.0)
    assert not tr.maybe_publish(now=100.5)
    assert tr.maybe_publish(now=101.0)
    assert seen == [3, 3]


def test_a_failing_metrics_export_is_disabled_not_raised():
    def boom(snap, rank):
        raise RuntimeError("no prometheus")

    tr = ForwardTracker(StepStats(), publish=boom)
    assert tr.maybe_publish(now=10.0)
    assert not tr.maybe_publish(now=20.0)


def test_tag_forward_reads_vllms_keyword_arguments():
    desc = SimpleNamespace(num_tokens=16)
    assert tag_forward({"num_tokens": 13, "batch_descriptor": desc, "cudagraph_runtime_mode": 1}) == (16, True)
    assert tag_forward({"num_tokens": 13, "batch_descriptor": None, "cudagraph_runtime_mode": 0}) == (13, False)
    assert tag_forward({}) == (None, False)


def test_call_index_lives_in_the_forward_kwargs():
    stats = StepStats()
    tr = ForwardTracker(stats)
    kw = {}
    tr.next_call(kw, 4)
    tr.next_call(kw, 4)
    assert kw[CALL_INDEX_KEY] == 2
