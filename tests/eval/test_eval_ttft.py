"""TTFT harness pieces that run without a server or a GPU: the report that
merges per-mode runs, the one-GPU caveat, the background-traffic spec, the
GPU script's syntax and the accuracy table arithmetic."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from echo_vllm.eval import accuracy, ttft
from echo_vllm.eval.background import TrafficSpec


def _run(label, ttfts, gpus):
    return {"label": label, "model": "m", "gpus": gpus, "cells": [
        {"label": label, "input_len": L, "concurrency": 1, "mean_ttft_ms": t, "p50_ttft_ms": t,
         "p99_ttft_ms": t, "mean_itl_ms": 1.0, "p99_itl_ms": 2.0}
        for L, t in ttfts.items()]}


@pytest.mark.parametrize("gpus", [1, 4])
def test_report_merges_labels_and_states_the_one_gpu_caveat(tmp_path, gpus):
    (tmp_path / "ttft_exact.json").write_text(json.dumps(_run("exact", {512: 10.0, 4096: 80.0}, gpus)))
    (tmp_path / "ttft_echo.json").write_text(json.dumps(_run("echo", {512: 10.0, 4096: 64.0}, gpus)))
    res = ttft.report(str(tmp_path))
    speed = {(r["label"], r["input_len"]): r["ttft_speedup"] for r in res["rows"]}
    assert speed[("echo", 4096)] == pytest.approx(1.25) and speed[("exact", 4096)] is None
    md = (tmp_path / "ttft.md").read_text()
    assert ("NO communication savings" in md) == (gpus == 1)
    assert (tmp_path / "ttft.png").stat().st_size > 0


def test_traffic_spec_validates():
    TrafficSpec(0.5, 100, 64, (0, 1))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="duty"):
            TrafficSpec(bad)


def test_paired_delta_and_average():
    exact = [1, 0, 1, 1, 0, 0, 1, 0]
    echo = [1, 0, 0, 1, 0, 1, 1, 0]
    pr = accuracy.paired(exact, echo)
    assert pr["delta"] == 0.0 and pr["changed"] == 0.25 and pr["n"] == 8
    # stderr of the mean paired difference: d = (0,0,-1,0,0,1,0,0), var = 2/7
    assert pr["stderr"] == pytest.approx(100 * (2 / 7 / 8) ** 0.5)
    assert accuracy.mean_abs_dll([[-1.0, -2.0]], [[-1.5, -2.0]]) == pytest.approx(0.25)


def test_gpu_script_parses():
    script = Path(__file__).resolve().parents[2] / "eval" / "gpu_eval.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_launch_command_fills_mode_and_mode_args():
    template = "echo-vllm serve m --tp-comm echo --echo-emulate-tp 3 {mode_args} --served-model-name {mode}"
    mode_args = ttft.parse_mode_args(["exact=--echo-min-bytes 1152921504606846976", "echo="])
    assert mode_args == {"exact": "--echo-min-bytes 1152921504606846976", "echo": ""}
    assert ttft.launch_command(template, "exact", mode_args) == (
        "echo-vllm serve m --tp-comm echo --echo-emulate-tp 3 --echo-min-bytes 1152921504606846976 "
        "--served-model-name exact")
    # a label without --mode-args gets nothing in place of {mode_args}
    assert ttft.launch_command(template, "naive", mode_args).endswith("3  --served-model-name naive")
    with pytest.raises(ValueError, match="LABEL=ARGS"):
        ttft.parse_mode_args(["no-equals-sign"])


def test_report_rebuilds_cut_runs_from_vllm_bench_files(tmp_path):
    """A run stopped midway leaves no ttft_<label>.json, only vllm bench's
    raw files: the report still shows those cells (and prefers the merged
    file where both exist)."""
    (tmp_path / "ttft_exact.json").write_text(json.dumps(_run("exact", {512: 10.0}, 1)))
    for label, L, t in (("exact", 512, 999.0), ("exact", 4096, 80.0), ("echo", 512, 12.0), ("echo", 4096, 64.0)):
        raw = {"model_id": "m", "completed": 16, "mean_ttft_ms": t, "p50_ttft_ms": t, "p99_ttft_ms": t,
               "mean_itl_ms": 1.0, "p99_itl_ms": 2.0}
        (tmp_path / f"raw_{label}_in{L}_c1.json").write_text(json.dumps(raw))
    res = ttft.report(str(tmp_path))
    got = {(r["label"], r["input_len"]): (r["mean_ttft_ms"], r["ttft_speedup"]) for r in res["rows"]}
    assert got == {("exact", 512): (10.0, None), ("exact", 4096): (80.0, None),
                   ("echo", 512): (12.0, pytest.approx(10 / 12)), ("echo", 4096): (64.0, pytest.approx(1.25))}


def test_cell_seeds_differ_between_cells():
    seeds = {ttft.cell_seed(L, c) for L in (512, 1024, 2048, 4096, 8192) for c in (1, 8, 64)}
    assert len(seeds) == 15


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_fails_at_once_and_says_so():
    import time

    from echo_vllm.cli_args import UsageError

    url = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(UsageError, match=r"/health: connection refused: no server there \(start it, or give "
                                         r"--launch to start one\)"):
        ttft.wait_for_server(url, timeout_s=900)
    assert time.monotonic() - t0 < 30  # not the 900 s of polling


def test_waiting_for_a_launched_server_talks_and_ends(monkeypatch):
    """While our own server starts, a refused connection is expected: the
    wait goes on, says how long and what the last answer was, and ends at
    the timeout (or when the server process exits)."""
    from echo_vllm.cli_args import UsageError

    class Starting:
        returncode = None

        def poll(self):
            return self.returncode

    monkeypatch.setattr(ttft, "PROGRESS_EVERY_S", 0.0)
    lines = []
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(UsageError, match=r"not healthy after 0 s \(last answer: connection refused\)"):
        ttft.wait_for_server(url, timeout_s=0.3, proc=Starting(), log=lines.append)
    assert lines and lines[0].startswith(f"[ttft] waiting for {url}/health: ") and "connection refused" in lines[0]
    exited = Starting()
    exited.returncode = 3
    with pytest.raises(UsageError, match="the server \\(--launch\\) exited with 3"):
        ttft.wait_for_server(url, timeout_s=60, proc=exited)


def test_a_launched_server_command_is_printed_without_its_keys(tmp_path, refused):
    launch = "false serve m --api-key SECRETK1 --hf-token=SECRETK2 --tp-comm {mode}"  # exits at once
    error, printed = refused(["eval", "ttft", "--launch", launch, "--labels", "echo", "--out", str(tmp_path),
                              "--base-url", f"http://127.0.0.1:{_free_port()}"])
    assert "the server (--launch) exited with 1" in error
    assert "[ttft] starting: false serve m --api-key '***' '--hf-token=***' --tp-comm echo" in printed
    assert "SECRETK" not in printed


@pytest.mark.parametrize("launch, labels, message", [
    ("true serve --api-key SECRETK5 m", ["a", "b"], "has no {mode} or {mode_args}: every label would start the same"),
    ("no mode here", ["a"], "argument --launch: no: no such program"),
    ("no-such-program-x --api-key SECRETK3 {mode}", ["a"], "argument --launch: no-such-program-x: no such program"),
    ("VLLM_API_KEY=SECRETK4 serve {mode}", ["a"], "argument --launch: 'VLLM_API_KEY=***': no such program"),
])
def test_a_launch_that_cannot_start_a_server_per_label_is_refused_up_front(tmp_path, refused, launch, labels,
                                                                            message):
    error, printed = refused(["eval", "ttft", "--launch", launch, "--labels", *labels, "--out",
                              str(tmp_path / "out")])
    assert message in error and "SECRETK" not in printed
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, text, message", [
    ("ttft_x.json", "{", "ttft_x.json: not a readable JSON results file (Expecting property name"),
    ("ttft_x.json", "[]", "ttft_x.json: not a JSON object"),
    ("ttft_x.json", "{}", "ttft_x.json: no 'label', 'model', 'cells'"),
    ("ttft_x.json", '{"label": "x", "model": "m", "cells": [{}]}', "ttft_x.json: 'cells' is not a list of cells"),
    ("raw_x_in8_c1.json", "{", "raw_x_in8_c1.json: not a readable JSON results file"),
])
def test_report_refuses_files_it_did_not_write(tmp_path, refused, name, text, message):
    (tmp_path / name).write_text(text)
    error, _ = refused(["eval", "ttft", "--report", "--out", str(tmp_path)])
    assert f"{tmp_path / message}" in error


def test_report_refuses_a_fifo_without_reading_it(tmp_path, refused):
    import os

    os.mkfifo(tmp_path / "ttft_x.json")  # read, it would block until a writer came
    error, _ = refused(["eval", "ttft", "--report", "--out", str(tmp_path)])
    assert f"{tmp_path / 'ttft_x.json'}: not a regular file" in error


def test_the_command_recorded_in_the_report_shows_no_key(tmp_path, monkeypatch, capsys):
    """ttft.md / ttft.json record the command line: a key inside --launch's
    command line (one word to argparse) or an environment assignment there
    is shown as ***, like the printed ``[ttft] starting:`` line."""
    from echo_vllm import cli

    (tmp_path / "ttft_exact.json").write_text(json.dumps(_run("exact", {512: 10.0}, 1)))
    launch = "env HF_TOKEN=SECRETK7 true serve m --api-key SECRETK6 --tp-comm {mode}"
    argv = ["eval", "ttft", "--report", "--out", str(tmp_path), "--launch", launch]
    monkeypatch.setattr("sys.argv", ["echo-vllm", *argv])
    assert cli.main(argv) == 0
    capsys.readouterr()
    recorded = json.loads((tmp_path / "ttft.json").read_text())["environment"]["command"]
    assert "--api-key '***'" in recorded and "'HF_TOKEN=***'" in recorded and "--tp-comm '{mode}'" in recorded
    for name in ("ttft.json", "ttft.md"):
        assert "SECRETK" not in (tmp_path / name).read_text()


@pytest.mark.parametrize("url, message", [
    ("http://bob:SECRETK8@127.0.0.1:8000", "'http://bob:***@127.0.0.1:8000': a user or password in the URL is not"),
    ("ftp://bob:SECRETK8@h", "'ftp://bob:***@h': expected http://HOST[:PORT]"),
    ("http://bob:SECRETK8@h:99999", "'http://bob:***@h:99999': not a URL (Port out of range"),
])
def test_a_base_url_with_a_password_is_refused_without_showing_it(tmp_path, refused, url, message):
    error, printed = refused(["eval", "ttft", "--base-url", url, "--out", str(tmp_path / "out")])
    assert message in error and "SECRETK" not in printed
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--launch", "true {mode} {mode_args}", "--labels", "exact", "echo", "--mode-args", "ecoh=--api-key SECRETK9"],
     "--mode-args ecoh=...: 'ecoh' is none of the labels (exact, echo); did you mean 'echo'?"),
    (["--label", "echo", "--mode-args", "echo=--api-key SECRETK9"],
     "--mode-args echo=...: needs --launch (its text goes in place of {mode_args})"),
    (["--launch", "true {mode} {mode_args}", "--labels", "echo", "--mode-args", "echo=--x", "echo=--api-key SECRETK9"],
     "--mode-args: label 'echo' is given twice"),
])
def test_mode_args_that_no_server_would_get_are_refused(tmp_path, refused, argv, message):
    """A misspelt label's ARGS were dropped silently: its server started
    without them (and measured another configuration under its label)."""
    error, printed = refused(["eval", "ttft", *argv, "--out", str(tmp_path / "out"),
                              "--base-url", f"http://127.0.0.1:{_free_port()}"])
    assert message in error and "SECRETK" not in printed
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--input-lens", "512", "512"], "--input-lens 512 512: a value is given twice"),
    (["--concurrency", "1", "8", "1"], "--concurrency 1 8 1: a value is given twice"),
    (["--concurrency", "1", "8", "--num-prompts", "4"], "--num-prompts 4 is below --concurrency 8"),
])
def test_a_grid_that_would_not_measure_what_it_says_is_refused(tmp_path, refused, monkeypatch, argv, message):
    """A repeated size was measured twice, two table rows of one cell;
    ``--num-prompts 4`` with 8 clients was raised to 8 without a word."""
    monkeypatch.setattr(ttft, "run_label", lambda *a: pytest.fail("measured"))
    error, _ = refused(["eval", "ttft", *argv, "--out", str(tmp_path / "out")])
    assert message in error
    assert not (tmp_path / "out").exists()


def test_a_cell_whose_server_stops_answering_ends_at_its_timeout(tmp_path, monkeypatch):
    """vLLM's benchmark client waits hours on a server that passed /health
    and then stalls: the cell's process is ended at ``--cell-timeout``,
    naming the cell and the option. The stalled client is a process that
    sleeps, under the real ``subprocess.run`` timeout."""
    import sys
    import time

    from echo_vllm.cli_args import UsageError

    real_run = subprocess.run
    seen = {}

    def stalled(cmd, **kw):
        seen.update(kw)
        return real_run([sys.executable, "-c", "import time; time.sleep(120)"], **kw)

    monkeypatch.setattr(ttft.subprocess, "run", stalled)
    args = ttft.parser().parse_args(["--cell-timeout", "1.5", "--out", str(tmp_path)])
    args.label = "echo"
    t0 = time.monotonic()
    with pytest.raises(UsageError, match=r"vllm bench serve at 512 prompt tokens, 8 clients did not end within 2 s "
                                         r"\(--cell-timeout\): is http://127.0.0.1:8000 still answering\?"):
        ttft.bench_cell(args, "m", "m", 512, 8, tmp_path)
    assert seen["timeout"] == 1.5 and time.monotonic() - t0 < 60


@pytest.mark.parametrize("status,body,problem", [
    (404, b"", "HTTP 404"),
    (200, b"not json", "JSONDecodeError"),
    (200, b'{"data": []}', "no model listed"),
])
def test_a_server_without_a_model_list_is_named(status, body, problem):
    import http.server
    import threading

    from echo_vllm.cli_args import UsageError

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(UsageError, match=rf"^{url}/v1/models: {problem} \(give the served name with --model\)$"):
            ttft.served_model(url)
    finally:
        server.shutdown()
    with pytest.raises(UsageError, match=r"/v1/models: .*refused"):
        ttft.served_model(f"http://127.0.0.1:{_free_port()}")
