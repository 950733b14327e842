"""Stage 2, fused: dequantize the P received chunks, sum them in fp32 in rank
order, requantize, and add the requantization error into the feedback
buffer's own chunk -- one pass. Specification: ``quant.stage2_reference``.

The own chunk of local rank r is ``own_base + own_stride * r``: a real rank
(R = 1) owns chunk ``rank``; virtual ranks (R = P) own chunk r. Passing two
integers instead of a list keeps the launch free of per-call host data.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant import WireLayout
from . import contract
from .direct_launch import Launcher, LaunchPlan
from .bodies import stage2_tile
from .tile import store_chunk_groups


@triton.jit
def _stage2_kernel(
    recv_ptr, fb_ptr, out_ptr,
    recv_row_stride, fb_row_stride, out_row_stride, own_base, own_stride,
    chunk_numel, chunk_groups, chunk_bytes, payload_bytes,
    P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, INV_QMAX: tl.constexpr, ENCODER: tl.constexpr,
    HAS_FB: tl.constexpr,
):
    r = tl.program_id(1).to(tl.int64)
    lg = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    own = own_base + own_stride * r
    words, s_bits = stage2_tile(recv_ptr, r * recv_row_stride, chunk_bytes, payload_bytes, fb_ptr + r * fb_row_stride,
                                own * chunk_numel, lg, chunk_groups, P, G, INV_QMAX, ENCODER, HAS_FB, True)
    store_chunk_groups(out_ptr, r * out_row_stride, payload_bytes, lg, lg < chunk_groups, words, s_bits, G)


def own_chunk_progression(own_chunks: list[int], world_size: int) -> tuple[int, int]:
    """``own_chunks`` as ``(base, stride)``; they must be an arithmetic
    progression inside ``[0, world_size)`` (one real rank, or all virtual
    ranks in order)."""
    if not own_chunks:
        raise ValueError("own_chunks: empty")
    base = int(own_chunks[0])
    stride = int(own_chunks[1]) - base if len(own_chunks) > 1 else 0
    if any(int(c) != base + stride * k for k, c in enumerate(own_chunks)) or not all(
        0 <= int(c) < world_size for c in own_chunks
    ):
        raise ValueError(
            f"own_chunks={list(own_chunks)}: the kernel needs chunk indices base + stride * r "
            f"within [0, {world_size})"
        )
    return base, stride


#: :func:`own_chunk_progression`, cached: a call passes the same few lists.
_progression = functools.lru_cache(maxsize=256)(own_chunk_progression)

_LAUNCH = Launcher(_stage2_kernel, contract.LAUNCH_OPTIONS)


@functools.lru_cache(maxsize=contract.PLAN_CACHE_SIZE, typed=True)
def _plan(layout: WireLayout, rows: int, qmax: int, encoder: str, has_fb: bool) -> LaunchPlan:
    """``ints``: recv_row_stride, out_row_stride, then :func:`contract.chunk_ints`."""
    p = layout.world_size
    return LaunchPlan(
        launcher=_LAUNCH,
        grid=(contract.programs(layout), rows, 1),
        ints=(p * layout.chunk_bytes, layout.chunk_bytes, *contract.chunk_ints(layout)),
        constexprs=_LAUNCH.constexprs(
            P=p, G=layout.group_size, BG=contract.groups_per_program(layout), **contract.quantizer_constants(qmax, encoder),
            HAS_FB=has_fb,
        ),
        wire_shape=(rows, layout.chunk_bytes),
    )


def stage2(
    recv: torch.Tensor,
    feedback: torch.Tensor | None,
    own_chunks: list[int],
    layout: WireLayout,
    *,
    qmax: int,
    encoder: str = "absmax",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel version of ``quant.stage2_reference``: ``recv [R, P, chunk_bytes]``
    -> wire ``[R, chunk_bytes]``; adds the error into ``feedback``'s own chunk."""
    p = layout.world_size
    rows = recv.shape[0] if recv.dim() == 3 else -1
    contract.check_wire("recv", recv, (rows, p, layout.chunk_bytes))
    if len(own_chunks) != rows:
        raise ValueError(f"own_chunks: {len(own_chunks)} entries for {rows} local ranks")
    base, stride = _progression(tuple(own_chunks), p)
    if feedback is not None:
        contract.check_feedback(feedback, rows, layout)
    contract.check_device(recv, feedback, out)
    plan = _plan(layout, rows, qmax, encoder, feedback is not None)
    wire = contract.wire_or_new(out, plan.wire_shape, recv)
    fb = feedback if feedback is not None else recv
    recv_stride, out_stride, *chunk = plan.ints
    plan.launcher(plan.grid, (recv, fb, wire), (recv_stride, fb.stride(0), out_stride, base, stride, *chunk),
            plan.constexprs)
    return wire
