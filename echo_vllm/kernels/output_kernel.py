"""Output: dequantize the all-gathered chunks, undo the rotation, cast.

Every rank runs this on the same gathered bytes, so every rank returns the
same bits. Specification: ``quant.output_reference``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant import WireLayout
from . import contract
from .direct_launch import Launcher, LaunchPlan
from .bodies import output_finish, output_load
from .tile import block_offsets, group_rows


@triton.jit
def _output_kernel(
    gathered_ptr, out_ptr, row_groups, cols, msg_groups,
    chunk_numel, chunk_groups, chunk_bytes, payload_bytes,
    G: tl.constexpr, BG: tl.constexpr, HADAMARD: tl.constexpr, LANES: tl.constexpr, FLIPS: tl.constexpr,
):
    j = tl.program_id(1)
    lg = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    words, s = output_load(gathered_ptr, j.to(tl.int64) * chunk_bytes, payload_bytes, lg, chunk_groups, G)
    output_finish(words, s, out_ptr, block_offsets(lg, group_rows(lg, row_groups), cols, msg_groups, G), j,
                  row_groups, cols, G, HADAMARD, LANES, FLIPS)


_LAUNCH = Launcher(_output_kernel, contract.LAUNCH_OPTIONS)


@functools.lru_cache(maxsize=contract.PLAN_CACHE_SIZE, typed=True)
def _plan(layout: WireLayout, hadamard: bool, lanes: bool, flips: int) -> LaunchPlan:
    """``ints``: :func:`contract.message_ints`, then :func:`contract.chunk_ints`."""
    return LaunchPlan(
        launcher=_LAUNCH,
        grid=(contract.programs(layout), layout.world_size, 1),
        ints=(*contract.message_ints(layout), *contract.chunk_ints(layout)),
        constexprs=_LAUNCH.constexprs(G=layout.group_size, BG=contract.groups_per_program(layout), HADAMARD=hadamard,
                                      LANES=lanes, FLIPS=flips),
        wire_shape=(layout.world_size, layout.chunk_bytes),
    )


def output(
    gathered: torch.Tensor,
    layout: WireLayout,
    out_dtype: torch.dtype,
    *,
    hadamard: bool,
    flips: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel version of ``quant.output_reference``: ``gathered [P, chunk_bytes]``
    -> ``[numel]`` of ``out_dtype``."""
    if out_dtype not in contract.INPUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not in {contract.INPUT_DTYPES}")
    if out is None:
        out = torch.empty(layout.numel, dtype=out_dtype, device=gathered.device)
    elif out.dtype != out_dtype or out.numel() != layout.numel or not out.is_contiguous():
        raise ValueError(
            f"out: expected {layout.numel} contiguous {out_dtype} values, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    lanes = contract.lane_layout(layout.cols, contract.TILE_VALUES, contract.NUM_WARPS, out)
    plan = _plan(layout, bool(hadamard), lanes, contract.check_flips(flips, layout))
    contract.check_wire("gathered", gathered, plan.wire_shape)
    contract.check_device(gathered, out)
    plan.launcher(plan.grid, (gathered, out), plan.ints, plan.constexprs)
    return out if out.dim() == 1 else out.view(layout.numel)
