"""``echo-vllm bench fused``: the byte counts its roofline divides by, and its plans (pure, no GPU)."""

from __future__ import annotations

import pytest
import torch

from echo_vllm.bench import fused_bench
from echo_vllm.quant import WireLayout


def test_phase_bytes_count_each_input_once_and_each_output_once():
    # P = 8, 64 MiB of bf16 in rows of 8192: 4096 rows, chunks of 512 groups of 32 per row
    lay = WireLayout(4096 * 8192, 8, 32, 8192)
    chunk = lay.chunk_numel // 2 + 2 * lay.chunk_groups  # 4-bit codes + a bf16 scale per group
    assert lay.chunk_bytes == chunk == (1 << 22) * 9 // 16
    b = fused_bench.phase_bytes(lay, torch.bfloat16)
    n = lay.numel
    assert b["phase1"] == (2 * n + 2 * n, 2 * n + 8 * chunk)  # x, fb -> fb, a chunk to every peer
    assert b["phase2"] == (8 * chunk + 2 * n // 8, 2 * n // 8 + 8 * chunk)  # P chunks, own fb -> own fb, P copies
    assert b["phase3"] == (8 * chunk, 2 * n)
    assert b["stage2"] == (8 * chunk + 2 * n // 8, 2 * n // 8 + chunk)  # the all-gather copies the chunk, not stage 2
    assert fused_bench.phase_bytes(lay, torch.float32)["phase1"] == (2 * n + 4 * n, 4 * n + 8 * chunk)
    # int8: a code per value and a bf16 scale per group of 32, 1.0625 bytes per value
    i8 = fused_bench.phase_bytes(lay, torch.int8)
    assert i8["phase1"] == (2 * n + n * 17 // 16, n * 17 // 16 + 8 * chunk)
    assert i8["stage2"] == (8 * chunk + n * 17 // 128, n * 17 // 128 + chunk)


def test_plans_name_tile_warps_and_programs_per_sm():
    from echo_vllm.kernels import fused_kernel as fk

    lay = WireLayout(4096 * 8192, 8, 32, 8192)
    plan = fused_bench.parse_plan("1024:4:6", lay, 132)
    assert plan.groups_per_tile == 32 and plan.num_warps == 4 and plan.programs == 132 * 6
    assert fk.resident_programs(plan.registers, 0, 4) >= 6
    with pytest.raises(ValueError):
        fused_bench.parse_plan("1024:4", lay, 132)


def test_cli_help():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "echo_vllm.cli", "bench", "fused", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--plans" in out.stdout and "roofline" in out.stdout and "int8" in out.stdout
