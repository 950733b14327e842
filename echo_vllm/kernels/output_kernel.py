"""Output: dequantize the all-gathered chunks, undo the rotation, cast.

Every rank runs this on the same gathered bytes, so every rank returns the
same bits. Specification: ``quant.output_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import WireLayout
from . import launch
from .tile import as_access, from_f32, group_mask, load_chunk_groups, unrotate, value_offsets


@triton.jit
def _output_kernel(
    gathered_ptr, out_ptr, numel,
    chunk_numel, chunk_groups, chunk_bytes, payload_bytes,
    G: tl.constexpr, BG: tl.constexpr, HADAMARD: tl.constexpr, SPREAD: tl.constexpr,
):
    j = tl.program_id(1).to(tl.int64)
    lg = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    gmask = lg < chunk_groups
    v = load_chunk_groups(gathered_ptr, j * chunk_bytes, payload_bytes, lg, gmask, BG, G, SPREAD)
    if HADAMARD:
        v = unrotate(v, BG, G, SPREAD)
    idx = value_offsets(j * chunk_numel, lg, G, SPREAD)
    tl.store(out_ptr + idx, as_access(from_f32(v, out_ptr.dtype.element_ty), BG, G, SPREAD),
             mask=group_mask(gmask, SPREAD) & (idx < numel))


def output(
    gathered: torch.Tensor,
    layout: WireLayout,
    out_dtype: torch.dtype,
    *,
    hadamard: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel version of ``quant.output_reference``: ``gathered [P, chunk_bytes]``
    -> ``[numel]`` of ``out_dtype``."""
    p = layout.world_size
    launch.check_wire("gathered", gathered, (p, layout.chunk_bytes))
    if out_dtype not in launch.INPUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not in {launch.INPUT_DTYPES}")
    if out is None:
        out = torch.empty(layout.numel, dtype=out_dtype, device=gathered.device)
    elif out.dtype != out_dtype or out.numel() != layout.numel or not out.is_contiguous():
        raise ValueError(
            f"out: expected {layout.numel} contiguous {out_dtype} values, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    launch.check_device(gathered, out)
    grid = (launch.programs(layout.chunk_groups), p)
    _output_kernel[grid](
        gathered, out, layout.numel,
        **launch.chunk_args(layout),
        G=layout.group_size, BG=launch.GROUPS_PER_PROGRAM, HADAMARD=bool(hadamard),
        SPREAD=launch.spread_groups(),
        **launch.LAUNCH_OPTIONS,
    )
    return out.view(layout.numel)
