"""The fused norm's tile plan: whole rows per program, a step's rows of
every chunk (one pass) or a chunk's values (two passes) a thread within the
register budget, the unfused path for rows it cannot take, with the reason."""

import pytest

from echo_vllm.rmsnorm_plan import (CHUNKS_PER_STEP, DECODE_ONCE_MAX_VALUES, MAX_NORM_COLS, MAX_PROGRAMS_PER_SM, MAX_WARPS,
                                 NORM_WARPS_PER_SM, ONE_PASS_MAX_VALUES, SM_REGISTERS, FUSED_TILE_VALUES, norm_tiling,
                                 registers)
from echo_vllm.quant import WireLayout


@pytest.mark.parametrize("cols", [4096, 5120, 8192, 16384, 2880, 1, 100])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [16, 32, 128])
def test_tiling_keeps_rows_whole_within_the_register_budget(cols, world, group):
    lay = WireLayout(cols * 3, world, group, cols)
    t, reason = norm_tiling(lay)
    assert t is not None, reason
    assert t.padded_row_groups >= lay.row_groups and t.padded_row_groups & (t.padded_row_groups - 1) == 0
    assert t.rows * t.padded_row_groups * group >= 256 * t.num_warps  # a warp's lanes hold whole groups
    # as large as the fused kernel's own tile, larger only for a whole row, then with more warps
    assert t.groups_per_tile * group == max(FUSED_TILE_VALUES, t.padded_row_groups * group)
    assert t.num_warps <= MAX_WARPS
    chunks = 1 << (world - 1).bit_length()  # one pass: the chunks padded to a power of two
    if t.one_pass_rows:
        # a step's rows of every chunk, as many as keep a thread within its values, dividing the tile
        step = t.one_pass_rows * chunks * t.padded_row_groups * group
        assert step == t.values_per_thread * 32 * t.num_warps and t.values_per_thread <= ONE_PASS_MAX_VALUES
        assert t.rows % t.one_pass_rows == 0 and step >= 256 * t.num_warps  # the step's lanes hold whole groups
        assert t.one_pass_rows == t.rows or 2 * step > ONE_PASS_MAX_VALUES * 32 * t.num_warps
        assert t.chunks_per_step == 1 and not t.decode_once and "one pass" in reason
    else:
        # a row of every chunk is too many values for one pass: one chunk's values at a time
        assert chunks * t.padded_row_groups * group > ONE_PASS_MAX_VALUES * 32 * t.num_warps
        assert t.groups_per_tile * group == t.values_per_thread * 32 * t.num_warps
        assert t.values_per_thread <= 2 * FUSED_TILE_VALUES // (32 * 8)
        assert t.chunks_per_step == min(world, CHUNKS_PER_STEP)
        assert t.decode_once == (t.groups_per_tile * group * world <= DECODE_ONCE_MAX_VALUES)
        assert ("decoded once" if t.decode_once else "decoded twice") in reason
    # the fused kernel's programs per SM: within the warp limit, each thread its registers
    per_sm = t.per_sm()
    assert per_sm <= MAX_PROGRAMS_PER_SM and per_sm * t.num_warps <= max(NORM_WARPS_PER_SM, t.num_warps)
    need = t.num_warps * 32 * registers(t.chunks_per_step, t.values_per_thread)
    assert per_sm == 1 or per_sm * need <= SM_REGISTERS
    assert t.tiles(lay) * t.rows * lay.row_groups >= lay.chunk_groups  # every group of a chunk in some tile
    assert t.row_tiles(lay) * t.rows >= lay.rows
    # rows of exactly a power of two of groups per chunk are consecutive groups: the kernels index them so
    assert t.aligned == (lay.row_groups == t.padded_row_groups)
    if t.aligned:
        tile = [(r * lay.row_groups + b) for r in range(t.rows) for b in range(t.padded_row_groups)]
        assert tile == list(range(t.groups_per_tile))


def test_tiling_refuses_wide_rows_with_a_reason():
    t, reason = norm_tiling(WireLayout(MAX_NORM_COLS + 1, 2, 32))
    assert t is None and f"rows of {MAX_NORM_COLS + 1} values" in reason
    t, reason = norm_tiling(WireLayout(4096, 16, 32))
    assert t is None and "16 ranks" in reason


@pytest.mark.parametrize("world", [2, 4, 8])
def test_qwen3_8b_rows_take_one_pass_a_row_at_a_time(world):
    t, _ = norm_tiling(WireLayout(8192 * 4096, world, 32, 4096))
    assert (t.one_pass_rows, t.num_warps, t.values_per_thread) == (1, 8, 16)


@pytest.mark.parametrize("cols,world", [(4096, 3), (8192, 8), (16384, 2)])
def test_rows_of_more_values_take_two_passes(cols, world):
    t, reason = norm_tiling(WireLayout(8 * cols, world, 32, cols))
    assert t.one_pass_rows == 0 and "two passes" in reason
