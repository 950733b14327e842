"""Whole rows per program: the tile plan of the output phase with the residual add and RMSNorm.

The norm needs a row's mean square before it can write any value of the
row, so a program holds whole rows: ``rows`` rows (virtual rows past the
message too, in the fused kernel's phases 1-2: the chunk's padding groups)
of every chunk, a rank's ``row_groups`` groups of each padded to a power of
two (``padded_row_groups``; the padding lanes are masked). A program holds
its rows' values in fp32 registers until the variance is known: at most
:data:`VALUES_PER_THREAD` a thread. :func:`norm_tiling` decides, with its
reason, from the layout alone (so a token's path never depends on its
batch); a row it refuses takes Echo's output, then the norm on its own.
"""

from __future__ import annotations

from typing import NamedTuple

from .norm import MAX_COLS
from .quant import WireLayout

#: Values of a row the fused norm takes (Qwen3-8B 4096, larger models 5120 and 8192, up to 16384).
MAX_NORM_COLS = 16384
assert MAX_NORM_COLS <= MAX_COLS, "the kernels' integer sum of squares must hold the widest row"
#: Values one warp covers in the lane layout (32 lanes of 8): the smallest tile of a chunk.
WARP_VALUES = 256
#: Most warps per program.
MAX_WARPS = 16
#: Values of its rows (every chunk) a thread holds in fp32 registers.
VALUES_PER_THREAD = 64
#: Most warps of the fused kernel's norm programs resident per SM.
NORM_WARPS_PER_SM = 16
#: Registers a thread of the fused norm kernel is given besides the row
#: values it holds (one each): compiled for sm_90, phase 3 of 8192 x 4096
#: needs ~98 at P = 2 (16 values) and spills at 128 with P = 8 (64 values).
BASE_REGISTERS = 96
#: Registers per SM (Hopper).
SM_REGISTERS = 65536


class NormTiling(NamedTuple):
    """``rows`` whole rows per tile, ``padded_row_groups`` groups of each per
    chunk, ``num_warps`` warps per program, ``values_per_thread`` row
    values a thread holds (every chunk)."""

    rows: int
    padded_row_groups: int
    num_warps: int
    values_per_thread: int = VALUES_PER_THREAD

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
        :data:`NORM_WARPS_PER_SM` warps allow, each thread with
        :data:`BASE_REGISTERS` plus one register per value it holds."""
        regs = SM_REGISTERS // (self.num_warps * 32 * (BASE_REGISTERS + self.values_per_thread))
        return max(1, min(NORM_WARPS_PER_SM // self.num_warps, regs))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def norm_tiling(layout: WireLayout) -> tuple[NormTiling | None, str]:
    """``(tiling, reason)`` for the output phase with the norm over
    ``layout``'s rows; ``(None, why not)`` when a row cannot be whole in one
    program (the caller takes the unfused path and counts the reason)."""
    if layout.cols > MAX_NORM_COLS:
        return None, f"rows of {layout.cols} values (the fused norm holds rows of up to {MAX_NORM_COLS})"
    rgp = _next_power_of_2(layout.row_groups)
    chunk_row = rgp * layout.group_size
    rows = max(1, WARP_VALUES // chunk_row)
    warps = min(MAX_WARPS, rows * chunk_row // WARP_VALUES)
    per_thread = layout.world_size * rows * chunk_row // (32 * warps)
    if per_thread > VALUES_PER_THREAD:
        return None, (f"rows of {layout.cols} values over {layout.world_size} ranks need {per_thread} values a "
                      f"thread (at most {VALUES_PER_THREAD})")
    return NormTiling(rows, rgp, warps, per_thread), (f"{rows} row(s) of {layout.world_size} x {rgp} groups per program, "
                                          f"{warps} warp(s)")


__all__ = ["BASE_REGISTERS", "MAX_NORM_COLS", "MAX_WARPS", "NORM_WARPS_PER_SM", "NormTiling", "VALUES_PER_THREAD", "WARP_VALUES",
           "norm_tiling"]
