"""The fused kernel's regression floor (echo_vllm.bench.floor)."""

import json
from pathlib import Path

from echo_vllm.bench import floor

DOC = "| P = 8, 64 MiB | 102.8 µs |\n<!-- accept-floor: fused emulated_per_rank P=8 64MiB 102.8 us -->\n"


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


def test_a_missing_measurement_or_floor_fails():
    assert floor.verdicts(_fused(None), floor.floors(DOC))[0][0] is False
    assert floor.verdicts(_fused(100.0), []) == [(False, "no accept-floor line in BENCHMARKS.md")]


def test_the_repository_records_the_fused_floor():
    doc = (Path(__file__).resolve().parents[2] / "BENCHMARKS.md").read_text()
    assert any(f.world_size == 8 and f.size_mib == 64 for f in floor.floors(doc))


def test_the_command_exits_with_the_verdict(tmp_path, capsys):
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text(DOC)
    fused = tmp_path / "fused.json"
    fused.write_text(json.dumps(_fused(99.0)))
    assert floor.main([str(fused), "--benchmarks", str(bench)]) == 0
    fused.write_text(json.dumps(_fused(130.0)))
    assert floor.main([str(fused), "--benchmarks", str(bench)]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert floor.main([str(tmp_path / "missing.json"), "--benchmarks", str(bench)]) == 2
