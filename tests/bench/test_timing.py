"""The host-clock timers' order of calls (not their speed)."""

from __future__ import annotations

from echo_vllm.bench import timing


def test_contenders_are_timed_in_turn_after_their_warm_ups():
    calls: list[tuple[str, int]] = []
    events: list[str] = []
    runs = {name: (lambda i, name=name: calls.append((name, i))) for name in ("a", "b")}
    out = timing.interleaved_host_time(runs, iters=2, warmup=1, barrier=lambda: events.append("barrier"),
                                       probe=lambda: len(calls))
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert [len(t.samples_s) for t in out.values()] == [2, 2]
    # the probe is read around each timed call alone: one call between its readings
    assert [after - before for t in out.values() for before, after in t.probes] == [1, 1, 1, 1]
    assert events.count("barrier") == 2 * 4


def test_host_time_is_one_contender():
    seen: list[int] = []
    t = timing.host_time(seen.append, iters=3, warmup=2)
    assert seen == [0, 1, 2, 3, 4] and len(t.samples_s) == 3 and t.probes == []
