"""The RMSNorm after the all-reduce: vLLM's numerics, and the variance Echo's kernels compute.

Every tensor-parallel all-reduce of a pre-norm transformer is followed by
vLLM's ``fused_add_rms_norm`` (the embedding's by ``rms_norm``). Echo's
output phase can do that work on the row it already holds in registers
(``echo_vllm.kernels.output_norm_kernel``, the fused kernel's phase 3); this
module is the specification it matches.

What vLLM 0.26 computes
-----------------------
``vllm/ir/ops/layernorm.py``, functions ``fused_add_rms_norm`` and
``rms_norm`` (the IR ops' ``native`` implementation, which is what vLLM runs
on CUDA whenever it compiles with Inductor: ``CudaPlatform.get_default_ir_op_priority``
in ``vllm/platforms/cuda.py`` gives ``["native"]`` then, ``["vllm_c",
"native"]`` only without Inductor; ``RMSNorm.forward_cuda`` in
``vllm/model_executor/layers/layernorm.py`` calls ``forward_native``, which
calls the IR op). For ``x`` of the model dtype:

1. ``s = fp32(x) + fp32(residual)``: the sum in fp32;
2. the new residual is ``s`` rounded to ``x.dtype``;
3. ``variance = mean(s ** 2)`` over the last dimension, in fp32, on the
   *unrounded* ``s``;
4. ``n = s * rsqrt(variance + eps)`` in fp32 (``eps`` rounded to fp32);
5. ``(dtype_w(n) * weight)`` in the weight's dtype (the cast to the weight
   dtype before the multiply), then rounded to ``x.dtype``.

vLLM's C++ kernel (``vllm_c``, eager mode only) rounds the sum to the model
dtype before the variance; Echo fuses only under compilation, where
``native`` runs.

The one step no two implementations round alike is the sum inside the
mean: torch's CPU kernel, its CUDA kernel and every Triton kernel Inductor
generates add the squares in different orders (Inductor's order also
depends on the launch configuration its autotuner picks), and CUDA's eager
mean multiplies by ``fp32(1 / H)`` where the CPU and Inductor divide by
``H``. :func:`add_rms_norm` with ``variance="torch"`` is vLLM's op to the
bit on the device it runs on; with ``variance="kernel"`` (what Echo's
kernels compute) the mean square is :func:`kernel_mean_square`, whose sum
does not depend on any order: it is within 3/4 of an fp32 unit in the
last place of the exact sum of its 8-value block sums (9/16 for rows of
up to 16384; rows whose largest block sum is below ``2**-60`` are
truncated to multiples of ``2**-MAX_SHIFT``, far below any ``eps``). Everything else is
shared, so the two differ only where the variances' last bits differ.

The kernels' mean square
------------------------
For each row (columns past the row are 0):

* ``b_i``: the sum of the squares ``fp32(s * s)`` of each block of 8
  columns starting at a multiple of 8, as a pairwise tree
  ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))`` (a kernel lane's 8
  values, summed in registers);
* ``M = max_i b_i``; for ``M`` NaN or infinite the sum is ``M``; otherwise,
  with ``e`` such that ``M < 2**e`` (``e = max(exponent field, 1) - 126``)
  and ``k = min(FIXED_BITS - e, MAX_SHIFT)``, the sum is
  ``fp32(sum_i trunc(b_i * 2**k)) * 2**-k`` -- an integer sum, the same in
  any order. Each term is below ``2**FIXED_BITS``, so rows of up to
  ``2**(53 - FIXED_BITS)`` blocks sum below ``2**53``: exact in int64 and
  in float64, so the one rounding to fp32 is the same on every path;
* the mean square is that sum divided by ``H`` (IEEE division).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Values per block of the kernels' sum of squares (a lane's values).
BLOCK_VALUES = 8
#: Each block sum becomes an integer below ``2**FIXED_BITS`` (see the module docstring).
FIXED_BITS = 40
#: The largest power of two block sums are scaled by (fp32's range: 2**100 and 2**-100 are normal).
MAX_SHIFT = 100
#: Widest row the integer sum holds exactly: ``2**(53 - FIXED_BITS)`` blocks.
MAX_COLS = BLOCK_VALUES << (53 - FIXED_BITS)

VARIANCES = ("torch", "kernel")


def block_sums(sq: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` fp32 -> ``[..., ceil(H / 8)]``: each block of 8 summed as
    the kernels' pairwise tree (zeros past ``H``)."""
    pad = (-sq.shape[-1]) % BLOCK_VALUES
    v = torch.nn.functional.pad(sq, (0, pad)).reshape(*sq.shape[:-1], -1, BLOCK_VALUES)
    v = v[..., 0::2] + v[..., 1::2]  # (0, 1) (2, 3) (4, 5) (6, 7)
    v = v[..., 0::2] + v[..., 1::2]  # (01, 23) (45, 67)
    return v[..., 0] + v[..., 1]


def _power_of_two(k: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**k`` for int32 ``k`` in [-126, 127], from its bits."""
    return ((k + 127) << 23).view(torch.float32)


def fixed_shift(m: torch.Tensor) -> torch.Tensor:
    """int32 ``k``: block sums of a row whose largest is ``m`` (>= 0, finite)
    scale by ``2**k`` to integers below ``2**FIXED_BITS``."""
    field = (m.view(torch.int32) >> 23) & 0xFF
    e = torch.clamp(field, min=1) - 126
    return torch.clamp(FIXED_BITS - e, max=MAX_SHIFT)


def kernel_sum_squares(x: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` fp32 -> ``[..., 1]``: the kernels' sum of ``x * x`` over
    the last dimension (module docstring; order-free)."""
    if x.shape[-1] > MAX_COLS:
        raise ValueError(f"rows of {x.shape[-1]} values: the exact integer sum holds at most {MAX_COLS}")
    b = block_sums(x * x)
    m = b.amax(dim=-1, keepdim=True)  # NaN if any block is
    finite = m < float("inf")
    k = fixed_shift(torch.where(finite, m, 0.0))
    terms = (torch.where(finite, b, 0.0) * _power_of_two(k)).to(torch.int64)  # truncates toward 0
    total = terms.sum(dim=-1, keepdim=True).to(torch.float32) * _power_of_two(-k)
    return torch.where(finite, total, m)


def kernel_mean_square(x: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` fp32 -> ``[..., 1]``: :func:`kernel_sum_squares` / H,
    an IEEE division on every device (as the kernels' ``div_rn``)."""
    total = kernel_sum_squares(x)
    # a tensor divisor: CUDA divides by a Python number as a multiply by
    # fp32(1 / H), which is another rounding where H is not a power of two
    return total / torch.full_like(total, x.shape[-1])


def _normalize(s: torch.Tensor, weight: torch.Tensor | None, eps: float, dtype: torch.dtype,
               variance: str) -> torch.Tensor:
    """Steps 3-5 of the module docstring on fp32 ``s``."""
    if variance == "torch":
        var = s.pow(2).mean(dim=-1, keepdim=True)
    elif variance == "kernel":
        var = kernel_mean_square(s)
    else:
        raise ValueError(f"variance={variance!r}: one of {VARIANCES}")
    n = s * torch.rsqrt(var + eps)
    if weight is not None:
        n = n.to(weight.dtype) * weight
    return n.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                 variance: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_add_rms_norm(x, residual, weight, eps)``: ``(out, new
    residual)``, both of ``x.dtype`` (module docstring, steps 1-5; with
    ``variance="kernel"`` the mean square of Echo's kernels)."""
    s = x.to(torch.float32) + residual.to(torch.float32)
    return _normalize(s, weight, eps, x.dtype, variance), s.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, variance: str = "torch") -> torch.Tensor:
    """vLLM's ``rms_norm(x, weight, eps)`` (steps 3-5 on ``fp32(x)``)."""
    return _normalize(x.to(torch.float32), weight, eps, x.dtype, variance)


@dataclass(frozen=True)
class NormOperands:
    """What the norm after an all-reduce takes besides Echo's output: the
    weight and eps of vLLM's op, the residual (None: ``rms_norm``), and
    where the results go (None: a new tensor for the output; the residual
    itself, in place, for the new residual). ``residual_out`` without a
    residual gets Echo's output itself: the next residual of a decoder's
    first norm, which vLLM takes from the norm's input."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    out: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    def apply(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`norm_into` of ``y`` with these operands."""
        return norm_into(y, self.weight, self.eps, residual=self.residual, out=self.out,
                         residual_out=self.residual_out)


def norm_into(y: torch.Tensor, weight: torch.Tensor | None, eps: float, *, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None,
              residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Echo's output ``y`` then the norm of its kernels (``variance="kernel"``),
    written like the kernels' outputs: ``(out, new residual)``, into ``out``
    and ``residual_out`` when given, the new residual into ``residual``
    itself otherwise; shapes as ``residual``'s (``y``'s without one). Without
    ``residual`` the new residual is ``y`` itself, copied into
    ``residual_out`` (None when not given). The unfused path, the same bits
    as the fused one."""
    shape = residual.shape if residual is not None else y.shape
    y = y.reshape(shape)
    if residual is None:
        o, r = rms_norm(y, weight, eps, variance="kernel"), None
        if residual_out is not None:
            residual_out.view(shape).copy_(y)
            r = residual_out
    else:
        o, r = add_rms_norm(y, residual, weight, eps, variance="kernel")
        residual_out = residual if residual_out is None else residual_out
        residual_out.view(shape).copy_(r)
        r = residual_out
    if out is None:
        return o, r
    out.view(shape).copy_(o)
    return out, r


__all__ = [
    "BLOCK_VALUES", "FIXED_BITS", "MAX_COLS", "MAX_SHIFT", "NormOperands", "VARIANCES", "add_rms_norm", "block_sums",
    "fixed_shift", "kernel_mean_square", "kernel_sum_squares", "norm_into", "rms_norm",
]
