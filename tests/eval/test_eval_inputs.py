"""Bad input to the evaluation tools is refused with a clear message instead
of silently measuring something else: TP=1 (no all-reduce, every variant
equals exact), reversed --exact-calls ranges (nothing forced to 16-bit),
and merging variant files from runs that differ."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from echo_vllm.eval import accuracy, depth, perplexity
from echo_vllm.eval.models import tp_size_arg


@pytest.mark.parametrize("text, value", [("0", 0), ("2", 2), ("3", 3), ("8", 8)])
def test_tp_size_accepts_the_default_and_real_sizes(text, value):
    assert tp_size_arg(text) == value


@pytest.mark.parametrize("text", ["1", "-2"])
def test_tp_size_below_two_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="at least 2"):
        tp_size_arg(text)


@pytest.mark.parametrize("tool", [accuracy, perplexity, depth])
def test_every_tool_refuses_tp_1(tool, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse stops before any model loads
        tool.main(["--tp", "1"])
    assert exit_info.value.code == 2 and "at least 2" in capsys.readouterr().err


def test_exact_calls_ranges():
    assert perplexity.parse_calls("1-4,9") == {1, 2, 3, 4, 9}
    assert perplexity.parse_calls("7") == {7}
    for bad in ("40-21", "a-3", "3-", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            perplexity.parse_calls(bad)


def _variant_file(out, name, **changes):
    meta = {"variant": name, "tasks_run": ["piqa"], "limit": 20, "model": "m", "backend": "hf",
            "world_size": 3, "real_tp": 1, "tasks": {}, "seconds": 1.0}
    meta.update(changes)
    args = SimpleNamespace(out=str(out), stem="acc")
    accuracy.variant_file(args, name).write_text(json.dumps(meta))
    return args


def test_merge_refuses_runs_that_measured_different_things(tmp_path):
    args = _variant_file(tmp_path, "exact")
    _variant_file(tmp_path, "default")
    accuracy.check_mergeable(accuracy.load_variants(args, None))  # same runs: fine
    _variant_file(tmp_path, "naive", limit=1000)
    with pytest.raises(SystemExit, match="'naive'.*limit: 1000 vs 20"):
        accuracy.check_mergeable(accuracy.load_variants(args, None))
    with pytest.raises(SystemExit, match="limit"):
        accuracy.main(["--merge", "--out", str(tmp_path), "--stem", "acc"])
