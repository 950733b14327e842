"""What ``echo-vllm serve`` prints and prepares before vLLM starts: secrets
masked in the printed command line, a user's Prometheus multiprocess
directory cleared of an earlier run. vLLM itself is replaced (no import)."""

from __future__ import annotations

import os

import pytest

from echo_vllm.server import cli, vllm_serve
from echo_vllm.server.cli import MASK, clear_multiprocess_dir, masked_argv
from echo_vllm.vllm_glue import metrics

MASKED = [
    (["m", "--api-key", "s3cret", "--port", "8000"], ["m", "--api-key", MASK, "--port", "8000"]),
    (["m", "--api-key=s3cret"], ["m", f"--api-key={MASK}"]),
    (["m", "--api_key", "a", "b", "-tp", "2"], ["m", "--api_key", MASK, MASK, "-tp", "2"]),  # nargs="+"
    (["m", "--api-k=a", "--api-key", "--dashed--"], ["m", f"--api-k={MASK}", "--api-key", MASK]),
    (["m", "--hf-token", "hf_x", "--hf-token", "--seed", "1"], ["m", "--hf-token", MASK, "--hf-token", "--seed", "1"]),
    # not secrets: other options sharing the first word, and anything after "--"
    (["m", "--api-server-count", "2", "--hf-overrides", "{}", "--", "--api-key", "x"],
     ["m", "--api-server-count", "2", "--hf-overrides", "{}", "--", "--api-key", "x"]),
]


@pytest.mark.parametrize("argv,expected", MASKED)
def test_masked_argv(argv, expected):
    assert masked_argv(argv) == expected


@pytest.fixture
def served(monkeypatch, tmp_path):
    """Run ``cli.main``; vLLM's serve replaced by a recorder of what it saw.
    The multiprocess directory is ``tmp_path`` (restored afterwards, like
    the client's value class, which prepare_multiprocess_dir switches)."""
    from prometheus_client import values

    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    monkeypatch.setenv(metrics.MULTIPROC_ENV, str(tmp_path))
    seen = []

    def fake_serve(vllm_argv, settings, on_parsed=None):
        path = os.environ.get(metrics.MULTIPROC_ENV)
        seen.append({"argv": vllm_argv, "files": sorted(os.listdir(path)) if path else None})
        return 0

    monkeypatch.setattr(vllm_serve, "serve", fake_serve)
    return seen


@pytest.mark.parametrize("key_tokens", [["--api-key", "s3cret"], ["--api-key=s3cret"]])
def test_the_printed_command_line_masks_the_api_key(served, capsys, key_tokens):
    for extra in ([], ["--tp-comm", "echo", "--echo-emulate-tp", "2"]):
        assert cli.main(["m", *key_tokens, "--port", "8000", *extra]) == 0
        err = capsys.readouterr().err
        assert "running: vllm serve m " in err and "s3cret" not in err
        assert f"--api-key {MASK} " in err or f"--api-key={MASK} " in err
    assert all("s3cret" in " ".join(s["argv"]) for s in served)  # vLLM itself still gets the key


def test_a_user_multiprocess_dir_is_cleared_at_start(served, capsys, tmp_path):
    for name in ("counter_123.db", "gauge_all_123.db", "histogram_456.db", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub.db").mkdir()
    assert cli.main(["m", "--tp-comm", "echo", "--echo-emulate-tp", "2"]) == 0
    assert served[-1]["files"] == ["notes.txt", "sub.db"]  # only the value files went, before vLLM started
    err = capsys.readouterr().err
    assert f"removed 3 metric file(s) (*.db) of an earlier run from {tmp_path}" in err
    # nothing stale, nothing said
    assert cli.main(["m", "--tp-comm", "echo", "--echo-emulate-tp", "2"]) == 0
    assert "removed" not in capsys.readouterr().err


def test_stock_vllm_leaves_the_directory_alone(served, tmp_path):
    """--tp-comm nccl is vLLM as is: its multiprocess rules are vLLM's."""
    (tmp_path / "counter_1.db").write_text("x")
    assert cli.main(["m"]) == 0
    assert served[-1]["files"] == ["counter_1.db"]


def test_clear_multiprocess_dir_without_a_directory():
    assert clear_multiprocess_dir(None) == [] and clear_multiprocess_dir("/nonexistent/echo-vllm") == []
