"""Inputs at the edges of each dtype's range, and the error bound of one Echo call.

:func:`extreme_inputs` builds finite per-rank messages whose exact sum is
within the dtype's range, in three patterns: a magnitude sweep (one rank's
rows at 2**e for e from the dtype's smallest subnormal up to its largest
finite value, the dtype's max itself included; the other ranks smaller and
of the opposite sign, so the sum never leaves the range), cancelling pairs
(rank i and rank i + P/2 near the top of the range and of opposite signs,
the first half of the ranks one sign: partial sums in rank order overflow,
the total does not) and subnormals (every rank below the dtype's smallest
normal). :func:`one_call_bound` is the analytic
bound on ``|y - S|`` of one call without carried error, from the scales
that call put on the wire (``echo_vllm.quant``, Range).
"""

from __future__ import annotations

import math

import torch

from echo_vllm import quant
from echo_vllm.quant import WireLayout

PATTERNS = ("sweep", "cancel", "subnormal")

#: |u - dequant(q)| <= CQ * scale: half a step, plus the fp32 rounding of
#: u * fl(1 / scale) (|u / scale| <= 7.03: below 2**-20 of a step).
CQ = 0.5 + 2.0**-19
U32 = 2.0**-24


def error_steps(encoder: str) -> float:
    """``|u - dequant(q)| <= error_steps * |scale|`` for every value of a
    finite group. absmax: :data:`CQ`. signed_mse: a code clamped to 7 while
    ``u / scale`` reaches ``quant.code_bound(m)`` (the smallest multiplier's
    is the largest) errs by that minus 7 steps (a clamp to -8 by less), an
    unclamped one by half a step; its product is exact, and the error is
    rounded once (2**-24 of itself, below 2**-20 of a step)."""
    if encoder == "absmax":
        return CQ
    return max(0.5, quant.code_bound(min(quant.clip_multipliers())) - 7) + 2.0**-19


def _smallest_subnormal(dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype)
    return fi.tiny * fi.eps  # 2**(min_exp - mantissa bits)


def extreme_inputs(pattern: str, world: int, rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[world, rows, cols]`` finite values of ``dtype`` (see the module
    docstring) whose exact sum is finite and within ``dtype``'s range."""
    gen = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    big, sub = fi.max, _smallest_subnormal(dtype)
    mant = 0.5 + 0.5 * torch.rand(world, rows, cols, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(world, rows, cols, generator=gen) < 0.5, -1.0, 1.0).double()
    if pattern == "sweep":
        lo, hi = math.log2(sub), math.log2(big)
        e = torch.linspace(lo, hi, rows, dtype=torch.float64)[:, None]  # one magnitude per row
        x = torch.zeros(world, rows, cols, dtype=torch.float64)
        x[0] = sign[0] * torch.minimum(mant[0] * 2.0 ** (e + 1), torch.tensor(big))
        x[0, -1, ::3] = sign[0, -1, ::3] * big  # the largest finite value itself
        x[1:] = -x[0].sign() * mant[1:] * x[0].abs() * 2.0**-6  # the others pull the sum inward
    elif pattern == "cancel":
        e = torch.linspace(math.log2(big) - 8, math.log2(big), rows, dtype=torch.float64)[:, None]
        a = torch.minimum(mant[0] * 2.0 ** (e + 1), torch.tensor(big))
        x = torch.zeros(world, rows, cols, dtype=torch.float64)
        half = world // 2
        for r in range(half):  # rank r and rank r + half: the same magnitude, opposite signs
            x[r] = sign[0] * a
            x[r + half] = -x[r] * (1.0 - 2.0**-4 * torch.rand(rows, cols, generator=gen, dtype=torch.float64))
        x[:, :, ::5] = x[:, :, ::5].sign() * big  # exact cancellation at the top: +max - max
    elif pattern == "subnormal":
        e = torch.linspace(math.log2(sub), math.log2(fi.tiny) + 1, rows, dtype=torch.float64)[:, None]
        x = sign * mant * 2.0**e
    else:
        raise ValueError(f"pattern={pattern!r}: one of {PATTERNS}")
    out = x.to(dtype)
    assert torch.isfinite(out).all()
    s = exact_sum(out)
    assert torch.isfinite(s).all() and (s.abs() <= big).all(), "the exact sum must stay within the range"
    return out


def exact_sum(x: torch.Tensor) -> torch.Tensor:
    """The ranks' sum of ``x [P, ...]`` in float64 (exact to 2**-53)."""
    return x.double().sum(0)


def _per_value(v: torch.Tensor, g: int) -> torch.Tensor:
    """Group values ``[..., G]`` -> one per element ``[..., G * g]``."""
    return v.unsqueeze(-1).expand(*v.shape, g).reshape(*v.shape[:-1], -1)


def _wire_scales(wire: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """fp64 scales of the groups of ``wire [..., chunk_bytes]``, ``[..., chunk_groups]``."""
    return quant.decode_codes(wire, layout)[1][..., 0].double()


def one_call_bound(x: torch.Tensor, layout: WireLayout, out_dtype: torch.dtype, *, hadamard: bool,
                   encoder: str = "absmax"):
    """``(y, S, bound)`` of one Echo call of ``x [P, numel]`` without carried
    error through the references (quantizing with ``encoder``): the output,
    the exact sum and an elementwise bound on ``|y - S|`` (all ``[numel]``,
    fp64 but ``y``).

    In the wire domain (values times ``quant.input_scale``, rotated) stage 1
    errs by at most ``cq * |s1_r|`` on rank r (``cq``: :func:`error_steps`),
    stage 2 by ``cq * |s2|``, its fp32
    rank-order sum by ``(P - 1) u32 sum_r |D_r|``, and the fp32 rotation by
    ``gamma_log2(g) <= 1.01 log2(g) u32`` of the sum of the group's
    ``|x c|``; the output is
    ``OUTPUT_SCALE * rot`` of the wire values, exact but for its final
    rounding (at most ``2 u_out |y|`` plus half the smallest subnormal; a
    saturated value only moves toward S), and ``|rot(e)_i| <= sum_j |e_j|``.
    An fp32 input's ``x * c`` may round in the subnormal range: ``2**-150``
    per value."""
    p, g = layout.world_size, layout.group_size
    wire = quant.stage1_reference(x, None, layout, hadamard=hadamard, encoder=encoder)
    q2 = quant.stage2_reference(wire.transpose(0, 1).contiguous(), None, list(range(p)), layout, encoder=encoder)
    y = quant.output_reference(q2, layout, out_dtype, hadamard=hadamard)
    s = exact_sum(x)
    s1 = _per_value(_wire_scales(wire, layout), g).reshape(p, layout.padded_numel).abs()  # rank r's, wire order
    s2 = _per_value(_wire_scales(q2, layout), g).reshape(1, layout.padded_numel).abs()
    d = quant.decode_chunks(wire, layout).double().abs().sum(0).reshape(1, layout.padded_numel)  # sum_r |D_r|
    c = quant.input_scale(g, hadamard)
    xc = quant.to_wire_order(x.double().abs() * c, layout).sum(0, keepdim=True)  # sum_r |x_r c|
    per_value = error_steps(encoder) * (s1.sum(0, keepdim=True) + s2) + (p - 1) * U32 * d  # |error| of each
    if x.dtype == torch.float32:
        per_value = per_value + p * 2.0**-150
    if hadamard:  # |rot(e)_i| <= sum over the group; the rotation's own rounding, on the group's sum
        grp = per_value.reshape(1, -1, g).sum(-1) + 1.01 * math.log2(g) * U32 * g * xc.reshape(1, -1, g).sum(-1)
        per_value = _per_value(grp, g)
    bound = quant.OUTPUT_SCALE * quant.from_wire_order(per_value, layout)[0]
    fo = torch.finfo(out_dtype)
    bound = bound + 2 * fo.eps * y.double().abs() + _smallest_subnormal(out_dtype) / 2
    return y, s, bound
