"""The fused kernel's regression floor (echo_vllm.bench.floor)."""

import json
import os
import threading
from pathlib import Path

import pytest

from echo_vllm.bench import floor

FLOOR = {"key": "emulated_per_rank", "world_size": 8, "size_mib": 64, "recorded_us": 102.8}
DOC = {"floors": [FLOOR]}
SCALED = {"floors": [{**FLOOR, "copy_gbps": 4000, "device": "a GPU"}]}


def _write(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def _fused(us: float | None) -> dict:
    times = {} if us is None else {"emulated_per_rank": us}
    return {"cases": [{"world_size": 8, "size_bytes": 64 << 20, "times_us": times},
                      {"world_size": 2, "size_bytes": 64 << 20, "times_us": {"emulated_per_rank": 1.0}}]}


def test_within_ten_percent_passes_and_beyond_fails():
    recorded = floor.floors(DOC)
    assert recorded == [floor.Floor("emulated_per_rank", 8, 64, 102.8)]
    assert [ok for ok, _ in floor.verdicts(_fused(113.0), recorded)] == [True]  # 102.8 * 1.1 = 113.08
    ok, reason = floor.verdicts(_fused(113.2), recorded)[0]
    assert not ok and "SLOWER" in reason and "113.2" in reason


def test_a_floor_with_its_copy_bandwidth_scales_to_the_run_s_bandwidth():
    """Memory-bound: half the copy bandwidth allows twice the time, on any GPU."""
    recorded = floor.floors(SCALED)  # keys beyond the case's (the device) are the reader's
    assert recorded == [floor.Floor("emulated_per_rank", 8, 64, 102.8, 4000.0)]
    slow_gpu = {**_fused(226.0), "copy_gbps": 2000.0, "device": "NVIDIA H100 80GB HBM3"}  # 205.6 * 1.1 = 226.16
    ok, reason = floor.verdicts(slow_gpu, recorded)[0]
    assert ok and "4000 / 2000 GB/s on NVIDIA H100 80GB HBM3" in reason and "226.2" in reason
    assert not floor.verdicts({**slow_gpu, "cases": _fused(226.3)["cases"]}, recorded)[0][0]
    assert floor.verdicts({**_fused(113.0), "copy_gbps": 4000.0}, recorded)[0][0]  # the same bandwidth: unscaled
    assert not floor.verdicts({**_fused(113.2), "copy_gbps": 4000.0}, recorded)[0][0]


def test_a_scaled_floor_without_the_run_s_bandwidth_is_unreadable_input(tmp_path, capsys):
    bench = _write(tmp_path / "floor.json", SCALED)
    fused = _write(tmp_path / "fused.json", _fused(99.0))  # no copy_gbps: the floor cannot be placed
    assert floor.main([str(fused), "--floor", str(bench)]) == 2
    assert "copy_gbps" in capsys.readouterr().err


def test_a_missing_measurement_or_floor_fails():
    assert floor.verdicts(_fused(None), floor.floors(DOC))[0][0] is False
    assert floor.verdicts(_fused(100.0), []) == [(False, "no floor recorded")]


def test_the_shipped_floor_judges_a_run_by_default(tmp_path):
    """The package's fused_floor.json is what the acceptance reads: a
    P = 8, 64 MiB case with the copy bandwidth beside it, 5% above it passes
    and 15% above it fails."""
    shipped = floor.floors(json.loads(floor.DEFAULT_FLOOR.read_text()))
    case = next(f for f in shipped if f.world_size == 8 and f.size_mib == 64)
    assert case.copy_gbps
    fused = tmp_path / "fused.json"
    for factor, code in ((1.05, 0), (1.15, 1)):
        _write(fused, {**_fused(case.recorded_us * factor), "copy_gbps": case.copy_gbps})
        assert floor.main([str(fused)]) == code


def test_the_command_exits_with_the_verdict(tmp_path, capsys):
    bench = _write(tmp_path / "floor.json", DOC)
    fused = _write(tmp_path / "fused.json", _fused(99.0))
    assert floor.main([str(fused), "--floor", str(bench)]) == 0
    _write(fused, _fused(130.0))
    assert floor.main([str(fused), "--floor", str(bench)]) == 1
    assert "FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        floor.main([str(tmp_path / "missing.json"), "--floor", str(bench)])
    assert info.value.code == 2


@pytest.mark.parametrize("doc", ["{not json", {"floor": []}, {"floors": [{"key": "emulated_per_rank"}]},
                                 {"floors": [{**FLOOR, "world_size": "eight"}]}, [1]])
def test_a_malformed_floor_file_is_one_line_exit_2(tmp_path, capsys, doc):
    bench = tmp_path / "floor.json"
    bench.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    fused = _write(tmp_path / "fused.json", _fused(99.0))
    assert floor.main([str(fused), "--floor", str(bench)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"floor: {bench}: not a floor file" in err


def _unblock(fifo: Path) -> None:
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader: nothing blocked
        pass


@pytest.mark.parametrize("make", ["fifo", "list", "no_size"])
def test_an_input_that_is_not_a_fused_json_is_one_line_exit_2(tmp_path, capsys, monkeypatch, make):
    """A FIFO (``<(...)``) blocked the read forever (``/dev/zero`` filled the
    memory); JSON of another shape ended in a traceback."""
    monkeypatch.chdir(tmp_path)
    bench, fused = _write(Path("floor.json"), DOC), Path("fused.json")
    if make == "fifo":
        os.mkfifo(fused)
        threading.Timer(5, _unblock, [fused]).start()  # a reader blocked in open() gets EOF: the test ends
    else:
        fused.write_text(json.dumps([1] if make == "list" else {"cases": [{"world_size": 8}]}))
    try:
        code = floor.main([str(fused), "--floor", str(bench)])
    except SystemExit as e:  # argparse's refusal
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "fused.json" in err and "Traceback" not in err
