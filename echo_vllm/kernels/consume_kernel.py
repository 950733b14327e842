"""Consume: the input of an exact (16-bit) call absorbs the carried error,
x + rot^-1(e), rounded to x's dtype. Specification: ``quant.consume_reference``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant import WireLayout
from . import contract
from .direct_launch import Launcher, LaunchPlan
from .bodies import consume_tile


@triton.jit
def _consume_kernel(
    x_ptr, fb_ptr, out_ptr,
    x_row_stride, fb_row_stride, out_row_stride, row_groups, cols, msg_groups, chunk_numel,
    G: tl.constexpr, BG: tl.constexpr, HADAMARD: tl.constexpr, LANES: tl.constexpr, FLIPS: tl.constexpr,
):
    # program (block of groups, chunk j, local rank r): the error is in wire order
    j = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2).to(tl.int64)
    lg = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    consume_tile(x_ptr + r * x_row_stride, fb_ptr + r * fb_row_stride, out_ptr + r * out_row_stride, j, lg,
                 row_groups, cols, msg_groups, chunk_numel, G, HADAMARD, LANES, FLIPS)


_LAUNCH = Launcher(_consume_kernel, contract.LAUNCH_OPTIONS)


@functools.lru_cache(maxsize=contract.PLAN_CACHE_SIZE, typed=True)
def _plan(layout: WireLayout, rows: int, hadamard: bool, lanes: bool, flips: int) -> LaunchPlan:
    """``ints``: :func:`contract.message_ints`, chunk_numel (the rows' strides are per call)."""
    return LaunchPlan(
        launcher=_LAUNCH,
        grid=(contract.programs(layout), layout.world_size, rows),
        ints=(*contract.message_ints(layout), layout.chunk_numel),
        constexprs=_LAUNCH.constexprs(G=layout.group_size, BG=contract.groups_per_program(layout), HADAMARD=hadamard,
                                      LANES=lanes, FLIPS=flips),
        wire_shape=(),
    )


def consume(
    x: torch.Tensor,
    feedback: torch.Tensor,
    layout: WireLayout,
    *,
    hadamard: bool,
    flips: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel version of ``quant.consume_reference``: ``x [R, numel]`` -> ``[R, numel]``."""
    rows = x.shape[0] if x.dim() == 2 else -1
    contract.check_rows("x", x, rows, layout.numel, contract.INPUT_DTYPES)
    if x.shape[1] != layout.numel:
        raise ValueError(f"x: {x.shape[1]} values per row, layout says {layout.numel}")
    contract.check_feedback(feedback, rows, layout)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        contract.check_rows("out", out, rows, layout.numel, (x.dtype,))
    contract.check_device(x, feedback, out)
    lanes = contract.lane_layout(layout.cols, contract.TILE_VALUES, contract.NUM_WARPS, x, out)
    plan = _plan(layout, rows, bool(hadamard), lanes, contract.check_flips(flips, layout))
    plan.launcher(plan.grid, (x, feedback, out), (x.stride(0), feedback.stride(0), out.stride(0), *plan.ints),
            plan.constexprs)
    return out
