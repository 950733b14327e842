"""Whole rows per program: the tile plan of the output phase with the residual add and RMSNorm.

The norm needs a row's mean square before it can write any value of the
row, so a program holds whole rows: ``rows`` rows (virtual rows past the
message too, in the fused kernel's phases 1-2: the chunk's padding groups)
of every chunk, a rank's ``row_groups`` groups of each padded to a power of
two (``padded_row_groups``; the padding lanes are masked): a tile covers
:data:`FUSED_TILE_VALUES` values of each chunk where rows allow, the fused
kernel's own tile for large messages (its phases 1 and 2 run Echo's tile,
with as many programs per SM as the output phase's registers allow:
:meth:`NormTiling.per_sm`). The output phase (``kernels.rmsnorm_tile``) reads
a tile's rows in one pass, a step of ``one_pass_rows`` rows of every chunk
at a time, where a step is at most :data:`ONE_PASS_MAX_VALUES` values a
thread (Qwen3-8B's rows at P = 2, 4 and 8); wider rows in two passes, so
that a thread holds one chunk's values at a time (the second time Echo's
output itself, stored by the first, when the tile is small:
``decode_once``).
:func:`norm_tiling` decides, with its reason, from the layout alone (so a
token's path never depends on its batch); a row it refuses takes Echo's
output, then the norm on its own.
"""

from __future__ import annotations

from typing import NamedTuple

from .rmsnorm import MAX_COLS
from .quant import WireLayout

#: Values of a row the fused norm takes (Qwen3-8B 4096, larger models 5120 and 8192, up to 16384).
MAX_NORM_COLS = 16384
assert MAX_NORM_COLS <= MAX_COLS, "the kernels' integer sum of squares must hold the widest row"
#: Most ranks the fused norm takes: a thread keeps its lane's sum of squares of every chunk.
MAX_NORM_RANKS = 8
#: Chunks whose loads the output phase's first pass issues at once (fewer when there are fewer).
CHUNKS_PER_STEP = 4
#: Most values of a tile (its rows, every chunk) whose Echo output the first
#: pass stores for the second to read back instead of decoding again: larger
#: tiles, read back from L2 by every resident program, ran slower than a
#: second decode (BENCHMARKS.md, "Dropped ideas worth knowing").
DECODE_ONCE_MAX_VALUES = 8192
#: Most values a thread holds when the output phase reads a step's rows of
#: every chunk at once (one pass: ``NormTiling.one_pass_rows``); wider rows
#: take two passes, a chunk at a time. At 8 warps, 16 is one row of 4096
#: (Qwen3-8B at any P): faster than two passes (BENCHMARKS.md, "Dropped ideas worth knowing").
ONE_PASS_MAX_VALUES = 16
#: Values one warp covers in the lane layout (32 lanes of 8): the smallest tile of a chunk.
WARP_VALUES = 256
#: Values of each chunk a tile covers when its rows are shorter: the fused
#: kernel's tile for large chunks (``fused_kernel.TILE_TABLE``).
FUSED_TILE_VALUES = 2048
#: Most warps per program.
MAX_WARPS = 16
#: Fewest warps a program has (a tile is at least :data:`FUSED_TILE_VALUES` values of each chunk).
MIN_WARPS = FUSED_TILE_VALUES // WARP_VALUES
#: Most warps of the fused kernel's norm programs resident per SM (as its own large tiles: 3 programs of 8).
NORM_WARPS_PER_SM = 24
#: Most programs of the fused norm kernel resident per SM (sizes the barrier flags).
MAX_PROGRAMS_PER_SM = NORM_WARPS_PER_SM // MIN_WARPS
#: Registers a thread of the fused norm kernel needs: ``BASE_REGISTERS``
#: plus ``REGISTERS_PER_VALUE`` for each value of the chunks whose loads the
#: output phase's first pass issues at once, or holds in one pass (a lower
#: bound: compiled for sm_90, hidden 4096, the fused kernel's phase 3 takes
#: 68, 72 and 72 registers at P = 2, 4 and 8 in one pass, 63, 80 and 69 in
#: two, within the 80 of 3 programs per SM;
#: ``tests/kernels/test_norm_layouts.py`` checks that the plans compile
#: without spills under the cap these give).
BASE_REGISTERS = 32
REGISTERS_PER_VALUE = 1
#: Registers per SM (Hopper).
SM_REGISTERS = 65536


class NormTiling(NamedTuple):
    """``rows`` whole rows per tile, ``padded_row_groups`` groups of each per
    chunk, ``num_warps`` warps per program, ``values_per_thread`` values of
    one chunk a thread holds, ``chunks_per_step`` chunks whose loads the
    output phase's first pass issues at once, ``decode_once``: whether its
    second pass reads Echo's output back from the output buffer (else it
    decodes the chunks again), ``aligned``: a row is exactly
    ``padded_row_groups`` groups of each chunk (a power of two), so a tile's
    rows are consecutive groups and the kernels index them as such,
    ``one_pass_rows``: when above 0, the output phase reads, sums and stores
    that many rows of every chunk at a time in one pass (a thread then holds
    ``values_per_thread`` values of every chunk, ``chunks_per_step`` is 1 and
    ``decode_once`` does not apply); 0: two passes, a chunk at a time.
    The one-pass loop is not software-pipelined: 2 and 3 stages were slower
    (BENCHMARKS.md, "Dropped ideas worth knowing")."""

    rows: int
    padded_row_groups: int
    num_warps: int
    values_per_thread: int = FUSED_TILE_VALUES // (32 * MIN_WARPS)
    chunks_per_step: int = CHUNKS_PER_STEP
    decode_once: bool = True
    aligned: bool = False
    one_pass_rows: int = 0

    @property
    def groups_per_tile(self) -> int:
        """Groups of one chunk in a tile."""
        return self.rows * self.padded_row_groups

    def tiles(self, layout: WireLayout) -> int:
        """Tiles covering every group of a chunk (padding groups as virtual rows)."""
        virtual_rows = -(-layout.chunk_groups // layout.row_groups)
        return -(-virtual_rows // self.rows)

    def row_tiles(self, layout: WireLayout) -> int:
        """Tiles covering the message's rows."""
        return -(-layout.rows // self.rows)

    def per_sm(self) -> int:
        """Programs of the fused kernel resident per SM: as many as
        :data:`NORM_WARPS_PER_SM` warps allow, each thread with the registers
        it needs (:func:`registers`)."""
        need = registers(self.chunks_per_step, self.values_per_thread)
        regs = SM_REGISTERS // (self.num_warps * 32 * need)
        return max(1, min(NORM_WARPS_PER_SM // self.num_warps, regs))


def registers(chunks_per_step: int, values_per_thread: int) -> int:
    """Registers a thread of the fused norm kernel needs (:data:`BASE_REGISTERS`)."""
    return BASE_REGISTERS + REGISTERS_PER_VALUE * chunks_per_step * values_per_thread


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def one_pass_rows(world_size: int, chunk_row: int, rows: int, num_warps: int) -> int:
    """Rows of every chunk (``chunk_row`` values of each, the chunks padded
    to a power of two) that one step of the one-pass output phase holds
    within :data:`ONE_PASS_MAX_VALUES` a thread, at most ``rows``; 0 when
    one row is already more."""
    return min(rows, ONE_PASS_MAX_VALUES * 32 * num_warps // (_next_power_of_2(world_size) * chunk_row))


def norm_tiling(layout: WireLayout, *, one_pass: bool = True) -> tuple[NormTiling | None, str]:
    """``(tiling, reason)`` for the output phase with the norm over
    ``layout``'s rows; ``(None, why not)`` when a row cannot be whole in one
    program (the caller takes the unfused path and counts the reason).
    ``one_pass=False``: two passes even where one would do (to compare them)."""
    if layout.cols > MAX_NORM_COLS:
        return None, f"rows of {layout.cols} values (the fused norm holds rows of up to {MAX_NORM_COLS})"
    if layout.world_size > MAX_NORM_RANKS:
        return None, f"{layout.world_size} ranks (the fused norm takes at most {MAX_NORM_RANKS})"
    rgp = _next_power_of_2(layout.row_groups)
    chunk_row = rgp * layout.group_size
    rows = max(1, FUSED_TILE_VALUES // chunk_row)
    warps = min(MAX_WARPS, rows * chunk_row // WARP_VALUES)
    per_thread = rows * chunk_row // (32 * warps)
    aligned = layout.row_groups == rgp
    head = f"{rows} row(s) of {layout.world_size} x {rgp} groups per program, {warps} warps, "
    one = one_pass_rows(layout.world_size, chunk_row, rows, warps)
    if one_pass and one >= 1:
        held = one * _next_power_of_2(layout.world_size) * chunk_row // (32 * warps)
        return NormTiling(rows, rgp, warps, held, 1, False, aligned, one), (
            head + f"one pass, {one} row(s) of every chunk at a time ({held} values a thread)")
    step = min(layout.world_size, CHUNKS_PER_STEP)
    once = rows * chunk_row * layout.world_size <= DECODE_ONCE_MAX_VALUES
    return NormTiling(rows, rgp, warps, per_thread, step, once, aligned), (
        head + ("two passes, decoded once" if once else f"two passes, decoded twice (tiles over "
                                                         f"{DECODE_ONCE_MAX_VALUES} values)"))


__all__ = ["BASE_REGISTERS", "CHUNKS_PER_STEP", "DECODE_ONCE_MAX_VALUES", "MAX_NORM_COLS", "MAX_NORM_RANKS", "MAX_PROGRAMS_PER_SM", "MAX_WARPS", "MIN_WARPS", "NORM_WARPS_PER_SM",
           "NormTiling", "ONE_PASS_MAX_VALUES", "REGISTERS_PER_VALUE", "FUSED_TILE_VALUES", "WARP_VALUES", "norm_tiling", "one_pass_rows", "registers"]
