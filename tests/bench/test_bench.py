"""The benchmark plumbing on CPU: the projection model, the table, and a
smoke run of both CLI commands (no timing is asserted)."""

from __future__ import annotations

import json
import math
import os

import pytest

from echo_vllm.bench import cli, projection, report
from echo_vllm.quant import WireLayout


def test_nccl_time_inverts_busbw():
    # nccl-tests: busbw = (S / t) * 2 (P-1) / P
    for p in (2, 4, 8):
        t = projection.nccl_time_s(1 << 30, p, 200.0)
        assert math.isclose((1 << 30) / t * 2 * (p - 1) / p, 200e9, rel_tol=1e-12)


def test_echo_projection_adds_kernels_and_wire_time():
    lay = WireLayout((1 << 30) // 2, 8, 32)
    link = projection.Link("test", 100.0, 8, mem_scale=2.0)
    pr = projection.project(link, 1 << 30, lay.wire_bytes_per_rank, echo_kernels_s=1e-3, naive_kernels_s=5e-4)
    comm = lay.wire_bytes_per_rank / 100e9
    assert math.isclose(pr.echo_s, 2e-3 + comm)
    assert math.isclose(pr.echo_overlapped_s, max(2e-3, comm))
    assert math.isclose(pr.naive_s, 1e-3 + comm)
    assert pr.speedup_overlapped >= pr.speedup
    # 4.5 bits per value on the wire (g=32): the link-only bound is 16/4.5
    assert pr.nccl_s / comm == pytest.approx(16 / 4.5, rel=1e-3)


def test_table_reports_speedup_over_baseline():
    rows = [report.Row(1 << 20, "16-bit", 4, 2e-3), report.Row(1 << 20, "echo", 4, 1e-3)]
    table = report.format_table(rows, "16-bit", ("16-bit", "echo"))
    assert "1 MiB" in table and "2.00x" in table
    assert rows[1].busbw_gbps == pytest.approx((1 << 20) / 1e-3 / 1e9 * 1.5)


def test_sizes_parse_and_range():
    assert report.parse_size("8K") == 8192 and report.parse_size("64MiB") == 64 << 20
    assert report.parse_size("1G") == 1 << 30 and report.parse_size("1000") == 1000
    assert report.size_range(8192, 65536) == [8192, 16384, 32768, 65536]


def test_gloo_allreduce_cli_smoke(tmp_path, capsys):
    rc = cli.main(["allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "64K",
                   "--iters", "2", "--cpu-kernels", "reference", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "allreduce_gloo_p2.json").read_text())
    algos = {r["algo"] for r in data["rows"]}
    assert algos == {"exact", "naive", "echo", "wire-only"}
    assert all(r["time_s"] > 0 and r["size_bytes"] == 65536 for r in data["rows"])
    assert "speedup" in capsys.readouterr().out


def test_the_bytes_table_gives_each_level_per_host():
    from echo_vllm.bench.allreduce_bench import format_level_bytes, level_bytes
    from echo_vllm.hosts import HostMap

    two = HostMap((0, 0, 1, 1))
    rows = level_bytes([1 << 20], two, 32)
    assert [r["algo"] for r in rows] == ["16-bit ring", "flat Echo", "two-level Echo"]
    by = {r["algo"]: r for r in rows}
    assert by["two-level Echo"]["cross_host_bytes"] < by["flat Echo"]["cross_host_bytes"] < \
        by["16-bit ring"]["cross_host_bytes"]
    assert "3.00 N" in format_level_bytes(rows, two)  # the ring's 2 (P-1)/P x 2 bytes a value leave a host
    one = level_bytes([1 << 20], HostMap((0, 0, 0, 0)), 32)  # one host: no two-level row, nothing crosses
    assert [r["algo"] for r in one] == ["16-bit ring", "flat Echo"] and all(r["cross_host_bytes"] == 0 for r in one)


def test_a_host_map_that_does_not_fit_the_world_is_refused_before_processes_start():
    from echo_vllm.cli_args import UsageError

    with pytest.raises(UsageError, match="--host-map: host_map=0,1 names 2 ranks but the group has 4"):
        cli.main(["allreduce", "--backend", "gloo", "--world-size", "4", "--sizes", "64K", "--host-map", "0,1"])


def test_kernels_cli_smoke_on_cpu(tmp_path, capsys):
    rc = cli.main(["kernels", "--device", "cpu", "--world-sizes", "2", "--sizes", "64K",
                   "--iters", "1", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "kernels.json").read_text())
    (res,) = data["results"]
    assert set(res["kernels"]) >= {"stage1", "stage2", "output", "consume", "naive_stage1"}
    out = capsys.readouterr().out
    assert "verified" in out and "PROJECTION (not a measurement)" in out


def test_kernels_times_stages_1_and_2_with_each_encoder_in_one_run(tmp_path, capsys):
    """``--encoders absmax,signed_mse``: stages 1 and 2 verified and timed
    with both, the second as "<kernel> signed_mse" beside the first."""
    rc = cli.main(["kernels", "--device", "cpu", "--world-sizes", "2", "--sizes", "16K", "--iters", "1",
                   "--encoders", "absmax,signed_mse", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["encoders"] == ["absmax", "signed_mse"] and data["config"]["encoder"] == "absmax"
    (res,) = data["results"]
    assert {"stage1", "stage2", "stage1 signed_mse", "stage2 signed_mse"} <= set(res["kernels"])
    assert res["kernels"]["stage1 signed_mse"]["bytes"] == res["kernels"]["stage1"]["bytes"]
    assert "Stages 1 and 2 by encoder" in capsys.readouterr().out


def test_encoder_table_puts_each_encoder_beside_the_first():
    from echo_vllm.bench import report

    encoders = ("absmax", "signed_mse")
    assert report.encoder_key("stage1", "absmax", encoders) == "stage1"
    assert report.encoder_key("stage1", "signed_mse", encoders) == "stage1 signed_mse"
    table = report.encoder_table([("P=8 1 GiB", {"stage1": 100.0, "stage1 signed_mse": 125.0})], ("stage1",),
                                 encoders)
    assert table.splitlines()[-1].endswith("100.0 us |            125.0 us  1.250 |")


def test_kernels_model_only_needs_no_device(capsys):
    rc = cli.main(["kernels", "--model-only", "--sizes", "64M,1G", "--world-sizes", "8"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "MODEL ONLY" in out and "PROJECTION (not a measurement)" in out and "1 GiB" in out


def test_eager_table_puts_call_time_beside_device_time():
    from echo_vllm.bench import kernels_bench as kb

    r = kb.SizeResult(8, 1 << 20, 0)
    for i, name in enumerate(kb.ECHO_KERNELS + ("consume",) + kb.NAIVE_KERNELS):
        r.kernels[name] = kb.KernelResult(name, time_s=(i + 1) * 1e-6, bytes_moved=1, eager_s=(i + 41) * 1e-6)
    table = kb.eager_table([r])
    assert "41.0 /      1.0" in table and "44.0 /      4.0" in table  # stage1, consume
    assert table.splitlines()[-1].endswith(f"{41 + 42 + 43:9.1f} /    6.0")  # the call: sums of both
    r.kernels["stage2"].eager_s = None
    assert kb.eager_table([r]) == ""  # nothing to show unless every kernel has both


def test_reference_bandwidths_have_their_read_write_mixes():
    import torch

    from echo_vllm.bench import kernels_bench as kb

    refs = kb.measure_reference_gbps(torch.device("cpu"), 1 << 16, iters=2)
    assert set(refs) == {"write", "add"} and all(v > 0 for v in refs.values())


def test_one_gpu_fallback_passes_every_kernels_bench_option():
    """``bench allreduce`` on one GPU hands over to ``bench kernels``: the
    arguments must be complete (a hand-built Namespace once lacked --timing)
    and carry this command's values."""
    import argparse

    from echo_vllm.bench import allreduce_bench, kernels_bench
    from echo_vllm.config import EchoConfig

    ap = argparse.ArgumentParser()
    allreduce_bench.add_arguments(ap)
    args = ap.parse_args(["--sizes", "1M,4M", "--group-size", "64"])
    kargs = allreduce_bench.one_gpu_kernel_args(args)
    kp = argparse.ArgumentParser()
    kernels_bench.add_arguments(kp)
    assert set(vars(kp.parse_args([]))) <= set(vars(kargs))
    assert (kargs.sizes, kargs.group_size, kargs.no_layout_compare) == ([1 << 20, 4 << 20], 64, True)
    assert kargs.feedback_dtype == args.feedback_dtype == EchoConfig.feedback_dtype


def test_the_route_measure_times_echo_calls(capsys):
    """``host_overhead --route`` times calls that take Echo's path (its
    no-op backend runs), not an early exact return."""
    from echo_vllm.bench import host_overhead

    assert host_overhead.main(["--route", "--calls", "20"]) == 0
    assert "no-op backend" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["", "x", "2.0"])
def test_allreduce_names_a_world_size_variable_that_is_no_integer(value, refused, monkeypatch):
    """A leftover ``WORLD_SIZE=`` (torchrun's) was a ValueError traceback."""
    monkeypatch.setenv("WORLD_SIZE", value)
    error, _ = refused(["bench", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "1k"])
    assert f"WORLD_SIZE={value!r}: not an integer (torchrun sets it: unset it outside torchrun)" in error


@pytest.mark.parametrize("option,values,message", [
    ("--feedback-dtype", "bfloat16,bfloat16", "a value is given twice"),
    ("--feedback-dtype", "bfloat16,int7", "'int7': choose from float32,bfloat16,int8"),
    ("--encoders", "absmax,absmax", "a value is given twice"),
    ("--encoders", "absmax,signed", "'signed': choose from absmax,signed_mse")])
def test_sass_report_refuses_a_repeated_or_unknown_feedback_dtype_or_encoder(option, values, message, monkeypatch,
                                                                              capsys):
    """A repeated format compiled and printed its table twice."""
    from echo_vllm.bench import sass_report

    monkeypatch.setattr(sass_report, "report", lambda *a: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as info:
        sass_report.main([option, values])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("calls", ["0", "-5"])
def test_host_overhead_refuses_a_call_count_below_one(calls, capsys):
    """``--calls 0`` was a ZeroDivisionError traceback, ``--calls -5``
    printed negative times per call."""
    from echo_vllm.bench import host_overhead

    with pytest.raises(SystemExit) as info:
        host_overhead.main(["--route", f"--calls={calls}"])
    assert info.value.code == 2 and f"argument --calls: {calls}: must be from 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag,message", [
    ("--warmup", "argument --warmup: 0: must be from 1 to 1048576 (the first call compiles kernels"),
    ("--iters", "argument --iters: 0: must be from 1 to 1048576"),
])
def test_allreduce_refuses_zero_calls_instead_of_its_default(flag, message, refused):
    error, _ = refused(["bench", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "1k", flag, "0"])
    assert message in error


def test_kernels_model_only_writes_what_it_modelled(tmp_path, capsys):
    mine = tmp_path.parent / f"{tmp_path.name}-mine.json"
    mine.write_text("the user's file")
    (tmp_path / "kernels.json").symlink_to(mine)  # replaced by the result, never written through
    assert cli.main(["kernels", "--model-only", "--sizes", "64M", "--world-sizes", "8", "--out", str(tmp_path)]) == 0
    assert mine.read_text() == "the user's file" and not (tmp_path / "kernels.json").is_symlink()
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["model_only"] is True and data["results"][0]["size_bytes"] == 64 << 20
    assert data["projections"] and os.listdir(tmp_path) == ["kernels.json"]
    assert f"wrote {tmp_path}/kernels.json (modelled, nothing measured" in capsys.readouterr().out


def test_kernels_refuses_a_size_the_device_cannot_hold_before_work(monkeypatch, refused):
    from echo_vllm.bench import kernels_bench

    def tripwire(*args, **kwargs):
        raise AssertionError("reached the work")

    monkeypatch.setattr(kernels_bench, "verify", tripwire)
    monkeypatch.setattr(kernels_bench, "measure_copy_gbps", tripwire)
    monkeypatch.setattr(kernels_bench, "device_memory_bytes", lambda device: 1 << 30)
    error, _ = refused(["bench", "kernels", "--device", "cpu", "--sizes", "8K,64M", "--world-sizes", "2"])
    assert "size 64 MiB at P=2: needs about 1.7 GiB, more than the 1.0 GiB of cpu memory" in error


@pytest.mark.parametrize("backends,device,message", [
    ("triton", "cpu", "--echo-backends triton with tensors on cpu: backend 'triton' (configured) takes CPU "
                      "tensors only in Triton's interpreter"),
    ("reference,fused", "cpu", "--echo-backends fused with tensors on cpu: backend='fused' does not run on cpu"),
    ("numba", "cuda", "--echo-backends numba with tensors on cuda: backend='numba' does not run on cuda"),
])
def test_allreduce_refuses_an_echo_backend_the_device_cannot_run_before_any_rank_starts(
        backends, device, message, monkeypatch, refused):
    """The ranks timed every other column first, then died in a traceback."""
    from echo_vllm.bench import allreduce_bench

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(allreduce_bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(allreduce_bench, "_launch", lambda *a, **k: pytest.fail("a rank started"))
    error, _ = refused(["bench", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "1k",
                        "--device", device, "--echo-backends", backends])
    assert message in error


def test_allreduce_takes_triton_on_cpu_tensors_in_the_interpreter(monkeypatch):
    from echo_vllm.bench import allreduce_bench
    from echo_vllm.envs import EchoEnv

    allreduce_bench.check_echo_backends(["triton", "reference", "numba"], "cpu", EchoEnv(triton_interpret=True))
    allreduce_bench.check_echo_backends(["triton", "fused", "reference"], "cuda", EchoEnv())


@pytest.mark.parametrize("argv,message", [
    (["kernels", "--model-only", "--sizes", "8K,8K"], "argument --sizes: '8K,8K': 8K is given twice"),
    (["kernels", "--model-only", "--world-sizes", "4,4"], "argument --world-sizes: '4,4': 4 is given twice"),
    (["allreduce", "--backend", "gloo", "--sizes", "1M,1048576"], "1048576 is given twice (1M is the same: 1048576)"),
    (["norm", "--tokens", "1024,1024"], "argument --tokens: '1024,1024': 1024 is given twice"),
    (["fused", "--world-sizes", "2,8,2"], "argument --world-sizes: '2,8,2': 2 is given twice"),
])
def test_a_size_or_world_size_given_twice_is_refused(argv, message, refused):
    """``--sizes 8K,8K`` measured (or modelled) every row twice, and the
    all-reduce table merged the repeats into one row."""
    error, _ = refused(["bench", *argv])
    assert message in error


@pytest.mark.parametrize("argv,message", [
    (["kernels", "--model-only", "--sizes", "8K,3"], "argument --sizes: '8K,3': 3 bytes is not a whole number of "
                                                     "bf16 values (2 bytes each)"),
    (["kernels", "--model-only", "--min-size", "1025"], "argument --min-size: '1025': 1025 bytes"),
    (["allreduce", "--backend", "gloo", "--sizes", "3"], "argument --sizes: '3': 3 bytes is not a whole number"),
    (["allreduce", "--backend", "gloo", "--max-size", "0x41"], "argument --max-size: '0x41': 65 bytes"),
    (["fused", "--sizes", "64M,1k,7"], "argument --sizes: '64M,1k,7': 7 bytes"),
])
def test_an_odd_message_size_is_refused(argv, message, refused):
    """A bf16 message of 3 bytes is 1 value: it was timed as 2 bytes and
    reported (bandwidth included) as 3."""
    error, _ = refused(["bench", *argv])
    assert message in error
