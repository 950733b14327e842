"""``echo_vllm.stats``: the counters built from call records, their
snapshot, and the log-once rule for fallbacks (every exact-path call is
counted under its reason; the first of each reason is logged)."""

from echo_vllm.health import WHERE
from echo_vllm.stats import CallRecord, EchoStats


def _records():
    return [
        CallRecord("echo", "echo", wire_bytes=10, in_host_bytes=4, cross_host_bytes=6, equiv_bytes=40, carried=True,
                   checked=True),
        CallRecord("echo", "echo", wire_bytes=12, in_host_bytes=12, equiv_bytes=44, norm="fused"),
        CallRecord("exact", "below_min_bytes", nbytes=256, dropped="shape_changed"),
        CallRecord("exact", "below_min_bytes", nbytes=128, norm="no weight"),
        CallRecord("exact", "unsupported_dtype", nbytes=64, checked=True, dropped="shape_changed"),
    ]


def test_records_add_up_by_path_reason_and_what_the_chain_did():
    stats = EchoStats()
    for rec in _records():
        stats.record(rec)
    stats.add_error_sample(0.25)
    stats.add_error_sample(0.5)
    assert stats.snapshot() == {
        "calls": {"echo/echo": 2, "exact/below_min_bytes": 2, "exact/unsupported_dtype": 1},
        "wire_bytes": 22,
        "level_bytes": {"cross_host": 6, "in_host": 16},
        "equiv_16bit_bytes": 84,
        "exact_bytes": 448,  # the bytes of the exact calls only
        "rel_err_mean": 0.375,
        "rel_err_sum": 0.75,
        "rel_err_samples": 2,
        "feedback_carried": 1,
        "feedback_dropped": {"shape_changed": 2},
        "health_checked": 2,
        "norm_calls": {"fused": 1, "no weight": 1},
        "nonfinite": None,  # no health counters
    }
    assert EchoStats().snapshot()["rel_err_mean"] is None  # no samples: no mean


def test_each_fallback_reason_drop_and_unfused_norm_is_logged_once(caplog):
    stats = EchoStats()
    with caplog.at_level("INFO", logger="echo_vllm"):
        for rec in _records() + _records():
            stats.record(rec)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("falls back to the exact path (reason=below_min_bytes)" in m for m in lines) == 1
    assert sum("falls back to the exact path (reason=unsupported_dtype)" in m for m in lines) == 1
    assert sum("(reason=shape_changed)" in m and "dropped" in m for m in lines) == 1
    assert sum("not fused into it (reason=no weight)" in m for m in lines) == 1
    assert len(lines) == 4  # Echo calls and fused norms say nothing
    assert [r.levelname for r in caplog.records if "dropped" in r.getMessage()] == ["WARNING"]
    assert stats.calls[("exact", "below_min_bytes")] == 4  # every call counted, logged or not


def test_the_snapshot_reads_the_health_counters_where_there_are_some():
    class Health:
        def read(self):
            return [3, 1]

    stats = EchoStats(health=Health())
    assert stats.snapshot()["nonfinite"] == dict(zip(WHERE, [3, 1])) == {"input": 3, "output": 1}
