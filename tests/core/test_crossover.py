"""The crossover policy on recorded timings: a pure function, so every rank
that holds the same (slowest-rank) numbers picks the same thresholds."""

import pytest
import torch

from echo_vllm import EchoConfig, EchoConfigError
from echo_vllm.config import AUTO_BYTES, DEFAULT_MIN_BYTES
from echo_vllm.crossover import NEVER, Point, calibrate, decide, ladder

MiB = 1 << 20


def _points(speedups: dict[int, float]) -> list[Point]:
    return [Point(size, exact_s=1e-3 * s, echo_s=1e-3) for size, s in speedups.items()]


def test_echo_from_the_first_size_it_wins_at_for_good():
    c = decide(_points({MiB // 4: 0.3, MiB: 0.9, 4 * MiB: 1.3, 16 * MiB: 1.8, 64 * MiB: 2.1}))
    assert (c.min_bytes, c.max_bytes) == (4 * MiB, 0)
    assert "4 MiB" in c.reason and "2.10x" in c.reason


def test_a_win_below_a_loss_does_not_count():
    """Noise (or a latency quirk) at one small size: Echo starts above the last loss."""
    c = decide(_points({MiB // 4: 1.1, MiB: 0.95, 4 * MiB: 1.2, 16 * MiB: 1.5}))
    assert c.min_bytes == 4 * MiB


def test_a_tie_is_not_a_win():
    c = decide(_points({MiB: 1.01, 4 * MiB: 1.03}))
    assert c.min_bytes == 4 * MiB
    assert decide(_points({MiB: 1.01}), min_speedup=1.0).min_bytes == MiB


def test_never_when_echo_loses_at_the_largest_size():
    c = decide(_points({MiB: 2.0, 4 * MiB: 0.9}))
    assert c.min_bytes == NEVER and "not faster" in c.reason
    assert decide([]).min_bytes == NEVER


def test_order_of_points_does_not_matter():
    pts = _points({MiB: 0.5, 4 * MiB: 1.5, 16 * MiB: 2.0})
    assert decide(pts) == decide(list(reversed(pts)))


def test_ladder_is_whole_rows_up_to_the_largest_message():
    assert ladder(64 * MiB, 8192) == [64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    rows = ladder(1000 * 1152, 1152)  # rows of 576 bf16 values
    assert all(z % 1152 == 0 for z in rows) and rows[-1] == 1000 * 1152
    assert ladder(100, 1152) == [1152]  # never below one row


def test_calibrate_measures_both_and_takes_the_slowest_rank():
    calls = []
    seen = []

    def slowest(times):
        seen.append(list(times))
        return [t * 2 for t in times]  # another rank was twice as slow

    pts = calibrate(lambda x: calls.append(("exact", x.shape)), lambda x: calls.append(("echo", x.shape)),
                    [4096, 16384], cols=512, dtype=torch.bfloat16, device=torch.device("cpu"),
                    slowest=slowest, iters=3, warmup=1)
    assert [p.size_bytes for p in pts] == [4096, 16384]
    assert len(seen) == 1 and len(seen[0]) == 4  # one collective for every number
    assert [p.exact_s for p in pts] == [seen[0][0] * 2, seen[0][2] * 2]
    assert calls.count(("exact", (4, 512))) == 4 and calls.count(("echo", (16, 512))) == 4


def test_min_bytes_auto_is_the_default_and_parses():
    cfg = EchoConfig()
    assert cfg.min_bytes == AUTO_BYTES and cfg.min_bytes_auto
    assert cfg.effective_min_bytes == DEFAULT_MIN_BYTES  # until something is measured
    assert EchoConfig.from_mapping({"echo_min_bytes": "auto"}, prefix="echo_").min_bytes_auto
    assert EchoConfig.from_mapping({"echo_min_bytes": "1MiB"}, prefix="echo_").min_bytes == MiB
    with pytest.raises(EchoConfigError, match="'auto'"):
        EchoConfig(min_bytes=-2)
    with pytest.raises(EchoConfigError, match="max_bytes"):
        EchoConfig(max_bytes=1024)  # auto's 256 KiB floor is above it
