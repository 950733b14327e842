"""``echo-vllm bench norm``: the bytes its roofline divides by, the TTFT
projection's arithmetic, its arguments (pure, no GPU)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from echo_vllm.bench import norm_bench
from echo_vllm.bench.projection import nccl_time_s
from echo_vllm.quant import WireLayout


def test_norm_phase_bytes():
    """Phase 3 with the norm reads the gathered chunks, the residual and the
    weight, writes the new residual and the output; the unfused norm reads
    y and the residual and writes both: fusing saves one write and one read of y."""
    lay = WireLayout(8192 * 4096, 8, 32, 4096)
    b = norm_bench.norm_phase_bytes(lay)
    n, chunk = 2 * lay.numel, lay.chunk_bytes
    assert b["phase3"] == (8 * chunk, n)
    assert b["phase3_norm"] == (8 * chunk + n + 2 * 4096, 2 * n)
    assert b["norm"] == (2 * n + 2 * 4096, 2 * n)
    unfused = sum(b["phase3"]) + sum(b["norm"])
    assert unfused - sum(b["phase3_norm"]) == 2 * n  # y written once and read once less: ~134 MB here
    assert 2 * n == 134217728


def test_ttft_projection_is_the_stated_sum():
    """36 layers x (compute + 2 x (all-reduce + norm)), labelled a projection."""
    p = norm_bench.ttft_projection(8, 8192, 725.0, echo_us=102.0, echo_norm_us=110.0, norm_us=75.0, busbw_gbps=480.0)
    assert p["projection"] is True
    nccl_us = nccl_time_s(8192 * 4096 * 2, 8, 480.0) * 1e6
    assert p["ttft_us"]["nccl"] == pytest.approx(36 * (725 + 2 * (nccl_us + 75)))
    wire_us = WireLayout(8192 * 4096, 8, 32, 4096).wire_bytes_per_rank / 480e9 * 1e6
    assert p["ttft_us"]["echo"] == pytest.approx(36 * (725 + 2 * (102 + wire_us + 75)))
    assert p["ttft_us"]["echo_norm"] == pytest.approx(36 * (725 + 2 * (110 + wire_us)))
    assert p["speedup_echo_norm"] > p["speedup_echo"] > 1
    over = norm_bench.ttft_projection(8, 8192, 725.0, echo_us=102.0, echo_norm_us=110.0, norm_us=75.0,
                                      busbw_gbps=480.0, overlapped=True)
    assert over["ttft_us"]["echo_norm"] == pytest.approx(36 * (725 + 2 * max(110, wire_us)))


def test_layer_times_parse_and_refuse_by_name():
    assert norm_bench.parse_layer_us("8:8192:725, 2:1024:90.5") == {(8, 8192): 725.0, (2, 1024): 90.5}
    assert norm_bench.parse_layer_us("") == {}
    with pytest.raises(ValueError, match="'8:8192'"):
        norm_bench.parse_layer_us("8:8192")
    with pytest.raises(ValueError, match="'1:8192:5'"):
        norm_bench.parse_layer_us("1:8192:5")


@pytest.mark.parametrize("spec,message", [
    ("8:8192:nan", "'8:8192:nan': TP from 2 to 64, TOKENS >= 1 and a positive, finite time"),
    ("8:8192:inf", "'8:8192:inf'"),
    ("8:8192:1e400", "'8:8192:1e400'"),
    ("65:8192:5", "'65:8192:5'"),
    ("8:8192:725,8:8192:900", "'8:8192:900': TP=8 T=8192 is given twice"),
])
def test_layer_times_that_would_make_the_projection_nan_or_ambiguous_are_refused(spec, message):
    """NaN passed ``us <= 0``: the TTFT projection printed nan; a repeated
    (TP, T) silently kept the last time."""
    with pytest.raises(ValueError) as info:
        norm_bench.parse_layer_us(spec)
    assert str(info.value).startswith(f"--layer-us {message}")


def test_cli_help_and_bad_layer_times():
    out = subprocess.run([sys.executable, "-m", "echo_vllm.cli", "bench", "norm", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--layer-us" in out.stdout and "roofline" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "echo_vllm.cli", "bench", "norm", "--layer-us", "8:x:1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "bench norm: --layer-us '8:x:1'" in bad.stderr and "Traceback" not in bad.stderr


def test_projection_png_is_titled_a_projection(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    rows = [norm_bench.ttft_projection(tp, 1024, 100.0, echo_us=20.0, echo_norm_us=18.0, norm_us=9.0, busbw_gbps=bw)
            for tp in (2, 8) for bw in norm_bench.NCCL_BUSBW_GBPS]
    titles = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, label, *a, **k: (titles.append(label), original(self, label, *a, **k))[1])
    assert norm_bench.plot_projection(rows, tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"
    assert len(titles) == 2 and all(t.startswith("PROJECTION") for t in titles)
    assert not norm_bench.plot_projection([], tmp_path / "none.png")


def test_measure_layer_refuses_another_width(capsys):
    ap = argparse.ArgumentParser()
    norm_bench.add_arguments(ap)
    assert norm_bench.run(ap.parse_args(["--measure-layer", "--hidden", "5120"])) == 2
    assert "--measure-layer times Qwen3-8B's layer (hidden 4096), not --hidden 5120" in capsys.readouterr().err


def test_a_saved_run_reports_again_with_the_given_layer_times(tmp_path, capsys):
    """``--from-json``: the tables of a saved run and its projection with
    the layer times given (they replace the file's own), no GPU."""
    case = norm_bench.NormCase(8, 8192, 4096, plan={}, bytes=norm_bench.norm_phase_bytes(
        WireLayout(8192 * 4096, 8, 32, 4096)), times_us={
        "echo": 102.0, "echo_norm": 110.0, "phase1": 64.0, "phase2": 20.0, "phase3_norm": 30.0, "norm": 65.0,
        "echo_then_norm": 167.0}, norm_impls={"inductor": 65.0})
    saved = tmp_path / "norm.json"
    saved.write_text(json.dumps({"device": "H200", "copy_gbps": 4264.0, "cases": [
        dataclasses.asdict(case)], "layer_compute_us": {"8:8192": 1.0}}))
    ap = argparse.ArgumentParser()
    norm_bench.add_arguments(ap)
    assert norm_bench.run(ap.parse_args(["--from-json", str(saved), "--layer-us", "8:8192:725",
                                         "--out", str(tmp_path / "again")])) == 0
    out = capsys.readouterr().out
    want = norm_bench.ttft_projection(8, 8192, 725.0, echo_us=102.0, echo_norm_us=110.0, norm_us=65.0,
                                      busbw_gbps=480.0)
    assert "PROJECTION (not measured)" in out and f"{want['speedup_echo']:5.2f}" in out
    again = json.loads((tmp_path / "again" / "norm.json").read_text())
    assert again["layer_compute_us"] == {"8:8192": 725.0} and again["projection"][1]["ttft_us"] == want["ttft_us"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert norm_bench.run(ap.parse_args(["--from-json", str(bad)])) == 2
    assert "not a norm.json of this bench" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--world-sizes", "1"], "argument --world-sizes: 1: must be from 2 to 64"),
    (["--tokens", "-5"], "argument --tokens: -5: must be at least 1"),
    (["--hidden", "-1"], "argument --hidden: -1: must be from 1 to 1048576"),
    (["--buffer-sets", "0"], "argument --buffer-sets: 0: must be from 1 to 64"),
    (["--from-json", "/nonexistent/norm.json"], "argument --from-json: /nonexistent/norm.json: no such file"),
    (["--out", "/etc/hostname"], "argument --out: /etc/hostname: exists and is not a folder"),
    (["--out", "/proc/echo-vllm-x"], "/proc, where it would be made, is not writable"),
])
def test_options_are_typed_as_bench_fused(argv, message, capsys):
    from echo_vllm import cli

    assert cli.main(["bench", "norm", *argv]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_a_message_above_the_bench_limit_is_refused(capsys):
    ap = argparse.ArgumentParser()
    norm_bench.add_arguments(ap)
    assert norm_bench.run(ap.parse_args(["--tokens", "8,99999999", "--hidden", "1048576"])) == 2
    assert "--tokens 99999999 x --hidden 1048576 is 199999998 MiB of bf16: at most 64 GiB" in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    ({"cases": []}, "(KeyError: 'copy_gbps')"),
    ({"cases": [], "copy_gbps": "x"}, "(ValueError: "),
    ({"cases": [], "copy_gbps": 1.0, "layer_compute_us": []}, "(AttributeError: "),
    ({"cases": [{"world_size": 2}], "copy_gbps": 1.0}, "(TypeError: "),
])
def test_a_malformed_saved_run_is_one_line_and_writes_nothing(content, message, tmp_path, capsys):
    saved = tmp_path / "norm.json"
    saved.write_text(json.dumps(content))
    ap = argparse.ArgumentParser()
    norm_bench.add_arguments(ap)
    assert norm_bench.run(ap.parse_args(["--from-json", str(saved), "--out", str(tmp_path / "again")])) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"--from-json {saved}: not a norm.json of this bench {message}" in captured.err
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("world,hidden,two_pass", [(8, 4096, True), (2, 4096, True), (8, 16384, False)])
def test_one_pass_plans_are_timed_and_verified_beside_two_passes(world, hidden, two_pass, monkeypatch):
    """Where the plan reads its rows in one pass, the bench also verifies
    and times the same layout in two passes (what one pass buys, measured
    in the same run); a plan in two passes is timed once."""
    lay = WireLayout(37 * hidden, world, 32, hidden)
    plans = norm_bench._plans(lay)
    assert (plans["plan"].one_pass_rows > 0) == two_pass and ("two_pass" in plans) == two_pass
    if two_pass:
        assert plans["two_pass"].one_pass_rows == 0 and plans["two_pass"].rows == plans["plan"].rows
    seen = []
    monkeypatch.setattr(norm_bench, "_verify_plan", lambda w, lay, plan: seen.append(plan) or [f"{plan.one_pass_rows}"])
    assert norm_bench.verify_norm(world, hidden) == [f"{p.one_pass_rows}" for p in plans.values()]
    assert seen == list(plans.values())


def test_the_table_shows_two_passes_where_measured():
    times = {"echo": 102.0, "echo_norm": 110.0, "phase1": 64.0, "phase2": 20.0, "phase3_norm": 30.0, "norm": 65.0,
             "echo_then_norm": 167.0}
    lay = WireLayout(8192 * 4096, 8, 32, 4096)
    one = norm_bench.NormCase(8, 8192, 4096, plan={}, bytes=norm_bench.norm_phase_bytes(lay),
                              times_us={**times, "echo_norm_two_pass": 123.4})
    old = norm_bench.NormCase(8, 1024, 4096, plan={}, bytes=norm_bench.norm_phase_bytes(lay), times_us=times)
    rows = norm_bench.table([one, old], 4264.0).splitlines()
    assert "2 passes" in rows[0]
    assert rows[2].split("|")[3].strip() == "123.4" and rows[3].split("|")[3].strip() == "-"
