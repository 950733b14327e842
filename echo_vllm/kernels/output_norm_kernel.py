"""Output with the residual add and RMSNorm: Echo's output phase that also
does vLLM's ``fused_add_rms_norm`` (or ``rms_norm``) on the rows it decodes.

Every rank runs this on the same gathered bytes, so every rank returns the
same bits. Specification: ``quant.output_reference`` followed by
``rmsnorm.add_rms_norm(..., variance="kernel")`` (``rmsnorm.rms_norm`` without a
residual); the device code is :func:`.rmsnorm_tile.output_norm_tile`, shared
with the fused kernel's phase 3. Rows must be whole in one program: the
tile plan is :func:`echo_vllm.rmsnorm_plan.norm_tiling` (a layout it refuses
raises here; callers ask it first and take the unfused path).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant import WireLayout
from . import contract
from .direct_launch import Launcher, LaunchPlan
from ..rmsnorm_plan import NormTiling, norm_tiling
from .rmsnorm_tile import ADD_RESIDUAL, KEEP_OUTPUT, NO_RESIDUAL, output_norm_tile


@triton.jit
def _output_norm_kernel(
    gathered_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    row_groups, cols, msg_groups, chunk_groups, chunk_bytes, payload_bytes, eps,
    P: tl.constexpr, G: tl.constexpr, K: tl.constexpr, RGP: tl.constexpr, HADAMARD: tl.constexpr,
    RESIDUAL: tl.constexpr, LANES: tl.constexpr, STEP: tl.constexpr, DECODE_ONCE: tl.constexpr,
    ALIGNED: tl.constexpr, ONE_PASS_ROWS: tl.constexpr, FLIPS: tl.constexpr,
):
    output_norm_tile(gathered_ptr, 0, chunk_bytes.to(tl.int64), payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     tl.program_id(0), row_groups, cols, msg_groups, chunk_groups, eps, P, G, K, RGP, HADAMARD,
                     RESIDUAL, LANES, STEP, DECODE_ONCE, ALIGNED, ONE_PASS_ROWS, FLIPS)


@functools.lru_cache(maxsize=None)
def _launcher(num_warps: int) -> Launcher:
    return Launcher(_output_norm_kernel, {**contract.LAUNCH_OPTIONS, "num_warps": num_warps})



@functools.lru_cache(maxsize=contract.PLAN_CACHE_SIZE, typed=True)
def _plan(layout: WireLayout, tiling: NormTiling, hadamard: bool, residual: int,
          lanes: bool, flips: int = 0) -> LaunchPlan:
    """``ints``: :func:`contract.message_ints`' ``row_groups, cols, msg_groups``,
    then ``chunk_groups, chunk_bytes, payload_bytes``."""
    la = _launcher(tiling.num_warps)
    if tiling.one_pass_rows:  # a program per one-pass step: its kernel has no loop
        tiling = tiling._replace(rows=tiling.one_pass_rows)
    return LaunchPlan(
        launcher=la,
        grid=(tiling.row_tiles(layout), 1, 1),
        ints=(*contract.message_ints(layout), layout.chunk_groups, layout.chunk_bytes, layout.payload_bytes),
        constexprs=la.constexprs(P=layout.world_size, G=layout.group_size, K=tiling.rows,
                                 RGP=tiling.padded_row_groups, HADAMARD=hadamard, RESIDUAL=residual,
                                 LANES=lanes, STEP=tiling.chunks_per_step,
                                 DECODE_ONCE=tiling.decode_once, ALIGNED=tiling.aligned,
                                 ONE_PASS_ROWS=tiling.one_pass_rows, FLIPS=flips),
        wire_shape=(layout.world_size, layout.chunk_bytes),
    )


def check_norm_operands(layout: WireLayout, out_dtype: torch.dtype, weight: torch.Tensor,
                        residual: torch.Tensor | None, out: torch.Tensor | None,
                        residual_out: torch.Tensor | None, *, ranks: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check the norm's tensors against ``layout`` (``ranks`` > 0: ``[ranks,
    numel]``-shaped per-rank copies, else ``numel`` values) and return
    ``(out, residual_out)``, ``out`` allocated when not given (the new
    residual goes into ``residual`` itself when ``residual_out`` is None;
    ``residual_out`` without ``residual`` gets Echo's output,
    :func:`residual_mode`)."""
    if out_dtype not in contract.INPUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not in {contract.INPUT_DTYPES}")
    if weight.dim() != 1 or weight.numel() != layout.cols or not weight.is_contiguous():
        raise ValueError(f"weight: expected {layout.cols} contiguous values, got {tuple(weight.shape)}")
    if weight.dtype not in contract.INPUT_DTYPES:
        raise TypeError(f"weight: dtype {weight.dtype} not in {contract.INPUT_DTYPES}")
    numel = layout.numel * max(ranks, 1)
    shape = (ranks, layout.numel) if ranks else (layout.numel,)

    def message(name, t, dtypes):
        if t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"{name}: expected {numel} contiguous values, got {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: dtype {t.dtype} not in {dtypes}")

    if residual is not None:
        message("residual", residual, contract.INPUT_DTYPES)
        if residual_out is None:
            residual_out = residual
    if residual_out is not None:
        message("residual_out", residual_out, (out_dtype,))
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=weight.device)
    message("out", out, (out_dtype,))
    for name, t in (("residual", residual), ("residual_out", residual_out)):
        if t is not None and _overlap(out, t):  # the kernels keep Echo's output in ``out`` between two reads of it
            raise ValueError(f"out overlaps {name}: the norm needs separate buffers")
    return out, residual_out


def residual_mode(residual: torch.Tensor | None, residual_out: torch.Tensor | None) -> int:
    """The kernels' ``RESIDUAL``: a residual is added and the sum stored
    (``ADD_RESIDUAL``); without one, ``residual_out`` given, Echo's output is
    stored there as well (``KEEP_OUTPUT``: a decoder's first norm, whose
    input is also the next residual), else only the norm (``NO_RESIDUAL``)."""
    if residual is not None:
        return ADD_RESIDUAL.value
    return KEEP_OUTPUT.value if residual_out is not None else NO_RESIDUAL.value


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of two contiguous tensors overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def output_norm(
    gathered: torch.Tensor,
    layout: WireLayout,
    out_dtype: torch.dtype,
    weight: torch.Tensor,
    eps: float,
    *,
    hadamard: bool,
    flips: int = 0,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    tiling: NormTiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kernel version of ``quant.output_reference`` then
    ``rmsnorm.add_rms_norm(y, residual, weight, eps, variance="kernel")``:
    ``gathered [P, chunk_bytes]`` -> ``(out [numel], new residual [numel])``
    of ``out_dtype`` (without ``residual``: ``rmsnorm.rms_norm``, and
    ``residual_out`` holding Echo's output, or None when not given).
    The new residual goes into ``residual_out``, by default ``residual``
    itself (in place, as vLLM's op). ``tiling``: the tile plan, by default
    ``norm_tiling(layout)``'s (tests and experiments give others)."""
    if tiling is None:
        tiling, reason = norm_tiling(layout)
        if tiling is None:
            raise ValueError(f"output_norm: {reason}")
    out, residual_out = check_norm_operands(layout, out_dtype, weight, residual, out, residual_out)
    res = residual if residual is not None else out  # unused pointers without a residual
    rows = (out, weight, res, residual_out if residual_out is not None else out)
    lanes = contract.lane_layout(layout.cols, tiling.groups_per_tile * layout.group_size, tiling.num_warps, *rows)
    plan = _plan(layout, tiling, bool(hadamard), residual_mode(residual, residual_out), lanes,
                 contract.check_flips(flips, layout))
    contract.check_wire("gathered", gathered, plan.wire_shape)
    contract.check_device(gathered, weight, residual, out, residual_out)
    plan.launcher(plan.grid, (gathered, res, weight, out, residual_out if residual_out is not None else out),
       (*plan.ints, float(eps)), plan.constexprs)
    return out.view(layout.numel), residual_out.view(layout.numel) if residual_out is not None else None
