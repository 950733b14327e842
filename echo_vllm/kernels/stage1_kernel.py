"""Stage 1, fused: u = rot(x) + e; quantize u; e <- u - dequant; write the wire.

One pass over memory: reads x (and the carried error when there is one),
writes the packed chunks laid out for the all-to-all (chunk j contiguous)
and the new error, in place. Specification: ``quant.stage1_reference``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant import WireLayout
from . import contract
from .direct_launch import Launcher, LaunchPlan
from .bodies import stage1_finish, stage1_load
from .tile import group_rows


@triton.jit
def _stage1_kernel(
    x_ptr, fb_ptr, wire_ptr,
    x_row_stride, fb_row_stride, wire_row_stride, row_groups, cols, msg_groups,
    chunk_numel, chunk_groups, chunk_bytes, payload_bytes,
    G: tl.constexpr, BG: tl.constexpr, INV_QMAX: tl.constexpr, ENCODER: tl.constexpr,
    HADAMARD: tl.constexpr, HAS_FB: tl.constexpr, HAS_INCOMING: tl.constexpr, LANES: tl.constexpr,
    FLIPS: tl.constexpr,
):
    # program (block of groups, destination chunk j, local rank r)
    j = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2).to(tl.int64)
    lg = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    fb_row = fb_ptr + r * fb_row_stride
    x, e = stage1_load(x_ptr + r * x_row_stride, fb_row, j, lg, group_rows(lg, row_groups), row_groups, cols,
                       msg_groups, chunk_numel, chunk_groups, G, HAS_FB, HAS_INCOMING)
    stage1_finish(x, e, fb_row, wire_ptr, r * wire_row_stride + j * chunk_bytes, payload_bytes, j, lg, chunk_numel,
                  chunk_groups, G, INV_QMAX, ENCODER, HADAMARD, HAS_FB, HAS_INCOMING, LANES, FLIPS)


_LAUNCH = Launcher(_stage1_kernel, contract.LAUNCH_OPTIONS)


@functools.lru_cache(maxsize=contract.PLAN_CACHE_SIZE, typed=True)
def _plan(layout: WireLayout, rows: int, qmax: int, encoder: str, hadamard: bool, has_fb: bool, has_incoming: bool,
          lanes: bool, flips: int) -> LaunchPlan:
    """``ints``: wire_row_stride, :func:`contract.message_ints`, :func:`contract.chunk_ints`."""
    p = layout.world_size
    return LaunchPlan(
        launcher=_LAUNCH,
        grid=(contract.programs(layout), p, rows),
        ints=(p * layout.chunk_bytes, *contract.message_ints(layout), *contract.chunk_ints(layout)),
        constexprs=_LAUNCH.constexprs(
            G=layout.group_size, BG=contract.groups_per_program(layout), **contract.quantizer_constants(qmax, encoder),
            HADAMARD=hadamard, HAS_FB=has_fb, HAS_INCOMING=has_incoming, LANES=lanes, FLIPS=flips,
        ),
        wire_shape=(rows, p, layout.chunk_bytes),
    )


def stage1(
    x: torch.Tensor,
    feedback: torch.Tensor | None,
    layout: WireLayout,
    *,
    qmax: int,
    hadamard: bool,
    has_incoming: bool,
    flips: int = 0,
    encoder: str = "absmax",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel version of ``quant.stage1_reference``: ``x [R, numel]`` ->
    wire ``[R, P, chunk_bytes]``; rewrites ``feedback[:, :padded_numel]``."""
    rows = x.shape[0] if x.dim() == 2 else -1
    contract.check_rows("x", x, rows, layout.numel, contract.INPUT_DTYPES)
    if x.shape[1] != layout.numel:
        raise ValueError(f"x: {x.shape[1]} values per row, layout says {layout.numel}")
    if feedback is not None:
        contract.check_feedback(feedback, rows, layout)
    contract.check_device(x, feedback, out)
    plan = _plan(layout, rows, qmax, encoder, bool(hadamard), feedback is not None, bool(has_incoming),
                 contract.lane_layout(layout.cols, contract.TILE_VALUES, contract.NUM_WARPS, x),
                 contract.check_flips(flips, layout))
    wire = contract.wire_or_new(out, plan.wire_shape, x)
    fb = feedback if feedback is not None else x
    plan.launcher(plan.grid, (x, fb, wire), (x.stride(0), fb.stride(0), *plan.ints), plan.constexprs)
    return wire
