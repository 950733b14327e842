"""The GPU-host probe against a stand-in OpenAI server (standard library).

The stand-in answers like vLLM does for the cases the probe sends; the point
is the probe's own logic (status handling, metric deltas, the summary's
verdicts), so the GPU run cannot fail on a client bug.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from echo_vllm.server import probe


class FakeVllm(BaseHTTPRequestHandler):
    calls = 0
    lenient = False  # True: accept malformed requests (a broken server)
    fused_norm = True  # False: every norm ran after the all-reduce (the pass off)
    lock = threading.Lock()

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status, body, ctype="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, "")
        if self.path == "/metrics":
            n = type(self).calls
            text = ("# HELP echo:allreduce_calls_total Echo all-reduce calls.\n"
                    "# TYPE echo:allreduce_calls_total counter\n"
                    f'echo:allreduce_calls_total{{path="echo",rank="0",reason="echo"}} {8 * n}\n'
                    f'echo:allreduce_calls_total{{path="exact",rank="0",reason="exact_last_call"}} {n}\n'
                    "# HELP echo:wire_bytes_total w\n# TYPE echo:wire_bytes_total counter\n"
                    f'echo:wire_bytes_total{{rank="0"}} {1152 * n}\n'
                    "# HELP echo:equiv_16bit_bytes_total e\n# TYPE echo:equiv_16bit_bytes_total counter\n"
                    f'echo:equiv_16bit_bytes_total{{rank="0"}} {4096 * n}\n'
                    "# HELP echo:norm_calls_total n\n# TYPE echo:norm_calls_total counter\n"
                    f'echo:norm_calls_total{{how="{"fused" if self.fused_norm else "exact path"}",rank="0"}} '
                    f'{6 * n}\n'
                    "# HELP echo:norm_fusion_sites s\n# TYPE echo:norm_fusion_sites gauge\n"
                    'echo:norm_fusion_sites{outcome="fused",rank="0"} 16.0\n'
                    "# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n"
                    'vllm:num_requests_running{model_name="tiny"} 0.0\n')
            return self._send(200, text, "text/plain; version=0.0.4")
        self._send(404, '{"error": "not found"}')

    def do_POST(self):
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            return self._send(200 if self.lenient else 400, '{"error": "bad json"}')
        if body.get("model") != "tiny" and not self.lenient:
            return self._send(404, '{"error": "The model does not exist."}')
        if body.get("max_tokens", 1) < 1 and not self.lenient:
            return self._send(400, '{"error": "max_tokens must be at least 1"}')
        with self.lock:
            type(self).calls += 1
        if self.path == "/v1/completions":
            return self._send(200, json.dumps({"choices": [{"text": " Paris"}]}))
        return self._send(200, json.dumps({"choices": [{"message": {"content": "hello"}}]}))


@pytest.fixture
def server():
    FakeVllm.calls, FakeVllm.lenient, FakeVllm.fused_norm = 0, False, True
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


BENCH = {"num_prompts": 64, "completed": 64, "failed": 0, "max_concurrency": 64, "output_throughput": 5000.0,
         "mean_ttft_ms": 20.0, "median_ttft_ms": 19.0, "p50_ttft_ms": 19.0, "p90_ttft_ms": 30.0, "p99_ttft_ms": 41.5,
         "mean_itl_ms": 5.0, "p50_itl_ms": 4.9, "p99_itl_ms": 9.0}


def test_probe_and_summary_pass_against_a_well_behaved_server(server, tmp_path):
    assert probe.wait_healthy(server, timeout_s=5) < 5
    result = probe.run_probe(server, "tiny", tmp_path)
    statuses = {c["check"]: c["status"] for c in result["checks"]}
    assert statuses == {"completions": 200, "chat": 200, "bad_json": 400, "unknown_model": 404,
                        "negative_max_tokens": 400, "serves_after_malformed": 200}
    assert all(c["ok"] for c in result["checks"])
    # 3 successful generations between the scrapes: 24 echo calls, 3 exact
    assert probe.total(result["echo_after_probe"], probe.CALLS, path="echo") == 24
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    ok, lines = probe.summarize(server, tmp_path, tmp_path / "bench.json")
    assert ok, lines
    text = "\n".join(lines)
    assert "64/64 completed, 0 failed" in text
    assert "TTFT ms mean=20.00 p50=19.00 p90=30.00 p99=41.50" in text
    assert "+27 all-reduce calls (+24 on the echo path)" in text
    assert "ratio 0.281" in text  # 1152 / 4096
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is True
    assert probe.main(["summary", "--base-url", server, "--out", str(tmp_path), "--bench",
                       str(tmp_path / "bench.json")]) == 0


def test_summary_fails_on_accepted_malformed_requests_and_load_errors(server, tmp_path):
    FakeVllm.lenient = True
    probe.run_probe(server, "tiny", tmp_path)
    (tmp_path / "bench.json").write_text(json.dumps(dict(BENCH, completed=60, failed=4)))
    ok, lines = probe.summarize(server, tmp_path, tmp_path / "bench.json")
    assert not ok
    failed = [l for l in lines if l.startswith("[FAIL]")]
    assert [l.split(":")[0] for l in failed] == ["[FAIL] bad_json", "[FAIL] unknown_model",
                                                 "[FAIL] negative_max_tokens", "[FAIL] load"]


def test_summary_fails_when_echo_counters_do_not_move(server, tmp_path):
    probe.run_probe(server, "tiny", tmp_path)
    data = json.loads((tmp_path / "probe.json").read_text())
    data["echo_before"] = probe.scrape(server, tmp_path, "again")  # nothing happens after this scrape
    (tmp_path / "probe.json").write_text(json.dumps(data))
    ok, lines = probe.summarize(server, tmp_path, None)
    assert not ok and any(l.startswith("[FAIL] echo metrics moved: +0") for l in lines)


def test_wait_gives_up(tmp_path):
    with pytest.raises(TimeoutError):
        probe.wait_healthy("http://127.0.0.1:9", timeout_s=0.2, poll_s=0.05)
    with pytest.raises(RuntimeError, match="exited"):
        probe.wait_healthy("http://127.0.0.1:9", timeout_s=5, pid=2**22 + 12345)


@pytest.mark.parametrize("timeout", ["nan", "inf", "-5", "0", "1e9"])
def test_wait_refuses_a_timeout_that_never_ends_or_never_waits(timeout, monkeypatch, capsys):
    """``wait --timeout nan`` never compared greater, so it waited forever."""
    monkeypatch.setattr(probe, "wait_healthy", lambda *a, **k: pytest.fail(f"waited with --timeout {timeout}"))
    with pytest.raises(SystemExit) as info:
        probe.main(["wait", "--base-url", "http://127.0.0.1:9", "--timeout", timeout])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert info.value.code == 2 and len(errors) == 1 and "Traceback" not in err
    assert f"argument --timeout: {timeout}: must be a finite number above 0 to 86400" in errors[0]


@pytest.mark.parametrize("argv,message", [
    (["wait", "--base-url", "garbage"], "argument --base-url: 'garbage': expected http://HOST[:PORT]"),
    (["wait", "--base-url", "http://u:s3cret@h:1"], "a user or password in the URL is not supported"),
    (["wait", "--pid", "0"], "argument --pid: 0: must be from 1 to 4194304 (a Linux pid)"),
    (["wait", "--pid", "99999999999999999999"], "argument --pid: 99999999999999999999: must be from 1"),
    (["probe", "--model", "m", "--out", "/etc/hostname"], "argument --out: /etc/hostname: exists and is not a folder"),
])
def test_bad_arguments_are_one_line_exit_2(argv, message, monkeypatch, capsys):
    """``garbage`` was urllib's ValueError, ``--pid 0`` (a process group,
    always alive) never failed early, a huge pid and an --out file were
    tracebacks; no error shows a password."""
    monkeypatch.setattr(probe, "wait_healthy", lambda *a, **k: pytest.fail("waited"))
    with pytest.raises(SystemExit) as info:
        probe.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and "Traceback" not in err and "s3cret" not in err


def test_wait_that_runs_out_is_one_line_exit_1(capsys):
    """The server's outcome, not a bug: it was a TimeoutError traceback."""
    assert probe.main(["wait", "--base-url", "http://127.0.0.1:9", "--timeout", "0.1"]) == 1
    err = capsys.readouterr().err
    assert err == "wait: /health did not answer 200 within 0.1 s\n"


def test_summary_names_a_missing_probe_and_a_bench_file_it_cannot_read(server, tmp_path, capsys):
    """No probe.json was a traceback; a FIFO as --bench blocked forever."""
    assert probe.main(["summary", "--base-url", server, "--out", str(tmp_path)]) == 2
    assert f"probe summary: error: {tmp_path}/probe.json: not what `probe --out {tmp_path}` writes" in \
        capsys.readouterr().err
    probe.run_probe(server, "tiny", tmp_path)
    os.mkfifo(tmp_path / "bench.json")
    ok, lines = probe.summarize(server, tmp_path, tmp_path / "bench.json")
    assert not ok and f"[FAIL] load: {tmp_path}/bench.json is not a regular file" in lines


def test_summary_checks_the_fused_norm_when_the_pass_is_on(server, tmp_path):
    probe.run_probe(server, "tiny", tmp_path)
    ok, lines = probe.summarize(server, tmp_path, None, expect_fused_norm=True)
    assert ok, lines
    assert any(l.startswith("[PASS] fused into Echo (norm after the all-reduce: calls by how it ran {'fused': ")
               and "compiled sites {'fused': 16.0}" in l for l in lines), lines
    FakeVllm.fused_norm = False
    ok, lines = probe.summarize(server, tmp_path, None, expect_fused_norm=True)
    assert not ok and any(l.startswith("[FAIL] fused into Echo") for l in lines)
    ok, lines = probe.summarize(server, tmp_path, None)  # the pass off: reported, not required
    assert ok and any("norm after the all-reduce: calls by how it ran {'exact path'" in l for l in lines)
