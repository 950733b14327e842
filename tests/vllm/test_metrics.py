"""Echo's Prometheus metrics: valid exposition text, exact counter values,
idempotent publishing, and the multi-process path through vLLM's own /metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from echo_vllm.stats import CallRecord
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from echo_vllm.vllm_glue import metrics
from echo_vllm.vllm_glue.metrics import EchoMetrics, publish_config
from echo_vllm.server.probe import echo_samples, total
from echo_vllm.stats import EchoStats

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scrape(registry) -> dict[str, float]:
    """Exposition text -> samples, through prometheus_client's own parser."""
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # raises on invalid text
    assert families, text
    return echo_samples(text)


def make_stats(echo_calls: int, exact_calls: int, errors: list[float]) -> EchoStats:
    stats = EchoStats()
    for _ in range(echo_calls):
        stats.record(CallRecord("echo", "echo", wire_bytes=1152, equiv_bytes=4096))
    for _ in range(exact_calls):
        stats.record(CallRecord("exact", "below_min_bytes", nbytes=512))
    stats.record(CallRecord("exact", "exact_last_call", nbytes=2048))
    for e in errors:
        stats.add_error_sample(e)
    return stats


def test_counters_equal_the_snapshot_and_text_is_valid():
    registry = CollectorRegistry()
    m = EchoMetrics(registry)
    m.publish(make_stats(3, 2, [0.25, 0.5]).snapshot(), rank=1)
    s = scrape(registry)
    assert s['echo:allreduce_calls_total{path="echo",rank="1",reason="echo"}'] == 3
    assert s['echo:allreduce_calls_total{path="exact",rank="1",reason="below_min_bytes"}'] == 2
    assert s['echo:allreduce_calls_total{path="exact",rank="1",reason="exact_last_call"}'] == 1
    assert s['echo:wire_bytes_total{rank="1"}'] == 3 * 1152
    assert s['echo:equiv_16bit_bytes_total{rank="1"}'] == 3 * 4096
    assert s['echo:exact_bytes_total{rank="1"}'] == 2 * 512 + 2048
    assert s['echo:rel_error_samples_total{rank="1"}'] == 2
    assert s['echo:rel_error_sum_total{rank="1"}'] == 0.75  # exact in binary floating point
    assert s['echo:rel_error_mean{rank="1"}'] == 0.375


def test_publish_is_idempotent_incremental_and_survives_a_restart():
    registry = CollectorRegistry()
    m = EchoMetrics(registry)
    stats = make_stats(3, 0, [0.5])
    m.publish(stats.snapshot(), rank=0)
    m.publish(stats.snapshot(), rank=0)  # same totals: nothing moves
    first = scrape(registry)
    assert total(first, "echo:allreduce_calls_total", path="echo") == 3
    stats.record(CallRecord("echo", "echo", wire_bytes=1152, equiv_bytes=4096))
    stats.add_error_sample(0.25)
    m.publish(stats.snapshot(), rank=0)
    second = scrape(registry)
    assert total(second, "echo:allreduce_calls_total", path="echo") == 4
    assert second['echo:wire_bytes_total{rank="0"}'] == 4 * 1152
    assert second['echo:rel_error_samples_total{rank="0"}'] == 2
    assert second['echo:rel_error_sum_total{rank="0"}'] == 0.75
    # a new EchoStats (worker restarted its communicator) counts from zero again
    m.publish(make_stats(1, 0, [0.5]).snapshot(), rank=0)
    third = scrape(registry)
    assert total(third, "echo:allreduce_calls_total", path="echo") == 5
    assert third['echo:rel_error_samples_total{rank="0"}'] == 3
    assert third['echo:rel_error_sum_total{rank="0"}'] == 1.25
    assert third['echo:rel_error_mean{rank="0"}'] == 0.5
    # ranks are separate series
    m.publish(make_stats(2, 0, []).snapshot(), rank=3)
    fourth = scrape(registry)
    assert total(fourth, "echo:allreduce_calls_total", path="echo", rank="3") == 2
    assert total(fourth, "echo:allreduce_calls_total", path="echo") == 7


def test_error_sum_from_mean_when_the_snapshot_has_no_sum():
    registry = CollectorRegistry()
    m = EchoMetrics(registry)
    snap = make_stats(1, 0, [0.1, 0.2, 0.3]).snapshot()
    snap.pop("rel_err_sum", None)
    m.publish(snap, rank=0)
    s = scrape(registry)
    assert s['echo:rel_error_samples_total{rank="0"}'] == 3
    # mean * n rounds once more than the direct sum: within 2 ulp of 0.6
    assert s['echo:rel_error_sum_total{rank="0"}'] == pytest.approx(0.6, rel=4.5e-16)


def test_glue_step_stats_extras():
    """Keys the vLLM glue adds (StepStats): forwards by kind, calls per
    forward, residual-stream error. A plain dict stands in for StepStats so
    this test does not depend on the glue's module."""
    registry = CollectorRegistry()
    m = EchoMetrics(registry)
    snap = dict(make_stats(2, 0, []).snapshot(), forwards_observed=3, forwards_replayed=10, forwards_mismatched=0,
                calls_per_forward=9, residual_err_end_mean=0.125, residual_err_max_mean=0.5, residual_samples=3)
    m.publish(snap, rank=0)
    m.publish(dict(snap, forwards_replayed=12, residual_samples=4, residual_err_end_mean=0.25), rank=0)
    s = scrape(registry)
    assert s['echo:forwards_total{kind="observed",rank="0"}'] == 3
    assert s['echo:forwards_total{kind="replayed",rank="0"}'] == 12
    assert 'echo:forwards_total{kind="mismatched",rank="0"}' not in s  # never incremented
    assert s['echo:calls_per_forward{rank="0"}'] == 9
    assert s['echo:residual_error_samples_total{rank="0"}'] == 4
    assert s['echo:residual_rel_error{rank="0",stat="end_mean"}'] == 0.25
    assert s['echo:residual_rel_error{rank="0",stat="max_mean"}'] == 0.5


def test_health_counters_reach_metrics_with_their_labels():
    """The chain's outcome and the non-finite checks: carried, dropped by
    reason, checked, non-finite by where, the model's bypasses."""
    registry = CollectorRegistry()
    m = EchoMetrics(registry)
    stats = EchoStats()
    for rec in (CallRecord("echo", "echo", carried=True, checked=True), CallRecord("echo", "echo", dropped="index_gap"),
                CallRecord("exact", "below_min_bytes", dropped="shape_changed")):
        stats.record(rec)
    snap = dict(stats.snapshot(), nonfinite={"input": 0, "output": 2}, saturated=1,
                bypasses=["flashinfer_allreduce_rmsnorm"])
    m.publish(snap, rank=1)
    m.publish(dict(snap, feedback_dropped={"index_gap": 3, "shape_changed": 1}, saturated=4), rank=1)
    s = scrape(registry)
    assert s['echo:feedback_carried_total{rank="1"}'] == 1
    assert s['echo:feedback_dropped_total{rank="1",reason="index_gap"}'] == 3
    assert s['echo:feedback_dropped_total{rank="1",reason="shape_changed"}'] == 1
    assert s['echo:health_checked_total{rank="1"}'] == 1
    assert s['echo:nonfinite_total{rank="1",where="output"}'] == 2
    assert 'echo:nonfinite_total{rank="1",where="input"}' not in s  # never incremented
    assert s['echo:saturated_total{rank="1"}'] == 4  # its own event, brought up to the last total
    assert s['echo:model_bypass{path="flashinfer_allreduce_rmsnorm",rank="1"}'] == 1


def test_config_info():
    registry = CollectorRegistry()
    publish_config({"tp_comm": "echo", "group_size": 32, "feedback": "true"}, registry=registry)
    s = scrape(registry)
    assert s['echo:config_info{feedback="true",group_size="32",tp_comm="echo"}'] == 1


def test_module_publish_never_raises(monkeypatch, caplog):
    registry = CollectorRegistry()
    monkeypatch.setattr(metrics, "_default", EchoMetrics(registry))
    monkeypatch.setattr(metrics, "_warned", set())
    metrics.publish({"calls": {"echo/echo": "many"}}, rank=0)
    metrics.publish({"calls": {"echo/echo": "many"}, "x": 1}, rank=0)
    assert sum("publishing metrics failed (ValueError" in r.getMessage() for r in caplog.records) == 1
    metrics.publish(make_stats(2, 0, []).snapshot(), rank=0)
    assert total(scrape(registry), "echo:allreduce_calls_total") == 3


# -- several processes, one /metrics: vLLM's route in multiprocess mode ----------

WORKER = textwrap.dedent("""
    import sys
    from echo_vllm.vllm_glue import metrics
    from echo_vllm.stats import CallRecord, EchoStats
    rank, n = int(sys.argv[1]), int(sys.argv[2])
    stats = EchoStats()
    for _ in range(n):
        stats.record(CallRecord("echo", "echo", wire_bytes=100, equiv_bytes=400))
    stats.record(CallRecord("exact", "exact_last_call", nbytes=64))
    stats.add_error_sample(0.5)
    metrics.publish(stats.snapshot(), rank)
    stats.record(CallRecord("echo", "echo", wire_bytes=100, equiv_bytes=400))
    metrics.publish(stats.snapshot(), rank)
    metrics.publish(stats.snapshot(), rank)
""")

API_SERVER = textwrap.dedent("""
    import json
    from echo_vllm.vllm_glue import metrics
    metrics.publish_config({"tp_comm": "echo", "emulate_tp": "4"})
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router
    app = FastAPI()
    attach_router(app)
    response = TestClient(app).get("/metrics")
    print(json.dumps({"status": response.status_code, "text": response.text}))
""")


def _run(code, *args, env):
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.vllm
def test_worker_counters_reach_vllms_metrics_route(tmp_path):
    pytest.importorskip("vllm")
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), PYTHONPATH=REPO)
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(n)], env=env, cwd=REPO,
                                stderr=subprocess.PIPE, text=True) for rank, n in ((0, 3), (1, 5))]
    for w in workers:
        assert w.wait(timeout=180) == 0, w.stderr.read()[-3000:]
    result = json.loads(_run(API_SERVER, env=env).strip().splitlines()[-1])
    assert result["status"] == 200
    s = echo_samples(result["text"])  # parsed with prometheus_client's parser
    assert s['echo:allreduce_calls_total{path="echo",rank="0",reason="echo"}'] == 4
    assert s['echo:allreduce_calls_total{path="echo",rank="1",reason="echo"}'] == 6
    assert total(s, "echo:allreduce_calls_total", reason="exact_last_call") == 2
    assert s['echo:wire_bytes_total{rank="1"}'] == 600
    assert s['echo:equiv_16bit_bytes_total{rank="0"}'] == 1600
    assert total(s, "echo:rel_error_samples_total") == 2
    assert s['echo:rel_error_mean{rank="0"}'] == 0.5
    assert s['echo:config_info{emulate_tp="4",tp_comm="echo"}'] == 1


def test_prepare_multiprocess_dir(monkeypatch):
    monkeypatch.delenv(metrics.MULTIPROC_ENV, raising=False)
    monkeypatch.setattr(metrics, "_tmpdir", None)
    from prometheus_client import values

    monkeypatch.setattr(values, "ValueClass", values.ValueClass)  # restored after the test
    path, removed = metrics.prepare_multiprocess_dir()
    assert os.path.isdir(path) and os.environ[metrics.MULTIPROC_ENV] == path and removed == []
    assert values.ValueClass is not values.MutexValue  # new metrics write to the shared files
    open(os.path.join(path, f"counter_{os.getpid()}.db"), "w").close()  # this process's own
    assert metrics.prepare_multiprocess_dir() == (path, [])  # our own folder is kept as it is
    assert os.listdir(path) == [f"counter_{os.getpid()}.db"]


def test_judge_multiprocess_dir():
    def live(pid):
        return pid == 7

    assert metrics.judge_multiprocess_dir("d", [], live) == (None, [])
    assert metrics.judge_multiprocess_dir("d", [("counter_1.db", True), ("gauge_all_2.db", True)], live) == (
        None, ["counter_1.db", "gauge_all_2.db"])
    for entries in ([("customers.db", True)], [("counter_1.db", False)], [("counter_x.db", True)],
                    [("counter_1.db.bak", True)], [("gauge_sometimes_1.db", True)]):
        problem, stale = metrics.judge_multiprocess_dir("d", entries, live)
        assert problem and "nothing of yours is removed" in problem and stale == []
    problem, stale = metrics.judge_multiprocess_dir("d", [("counter_1.db", True), ("summary_7.db", True)], live)
    assert "running process(es) [7]" in problem and stale == []


def test_norm_calls_and_sites():
    """How each call's norm ran (a counter, replays included through the
    records) and what the compilation pass did with the sites (a gauge)."""
    registry = CollectorRegistry()
    m = EchoMetrics(registry)
    stats = make_stats(0, 0, [])
    for how in ("fused", "fused", "exact path"):
        stats.record(CallRecord("echo" if how == "fused" else "exact", "echo", norm=how))
    snap = dict(stats.snapshot(), norm_sites={"fused": 16, "the reduced output is used beyond the norm": 1})
    m.publish(snap, rank=0)
    m.publish(snap, rank=0)  # same totals: nothing moves
    s = scrape(registry)
    assert s['echo:norm_calls_total{how="fused",rank="0"}'] == 2
    assert s['echo:norm_calls_total{how="exact path",rank="0"}'] == 1
    assert s['echo:norm_fusion_sites{outcome="fused",rank="0"}'] == 16
    assert s['echo:norm_fusion_sites{outcome="the reduced output is used beyond the norm",rank="0"}'] == 1


LATE_WORKER = textwrap.dedent("""
    import os, sys
    import prometheus_client  # noqa: F401  (vLLM imports it before Ray's executor sets the folder)
    from echo_vllm.vllm_glue import metrics
    from echo_vllm.stats import CallRecord, EchoStats
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
    stats = EchoStats()
    stats.record(CallRecord("echo", "echo", wire_bytes=100, equiv_bytes=400))
    metrics.publish(stats.snapshot(), 2)
""")


@pytest.mark.vllm
def test_a_worker_given_the_folder_after_importing_the_client_still_exports(tmp_path):
    """A Ray worker imports vLLM (and prometheus_client) before vLLM's Ray
    executor copies the engine's variables to it: its counters reach
    /metrics all the same."""
    pytest.importorskip("vllm")
    late = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    _run(LATE_WORKER, tmp_path, env=dict(late, PYTHONPATH=REPO))
    result = json.loads(_run(API_SERVER, env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
                                                  PYTHONPATH=REPO)).strip().splitlines()[-1])
    assert echo_samples(result["text"])['echo:allreduce_calls_total{path="echo",rank="2",reason="echo"}'] == 1
