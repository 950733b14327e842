"""Fused CPU loops of Echo's stages (numba), the CPU twin of the Triton kernels.

The torch references in ``echo_vllm.quant`` make some thirty passes over
memory per stage, each allocating a full-size temporary: readable, and slow
(~10 s per stage for 32 M values on one core). These loops make one pass,
one group at a time in a small scratch array, with the same fp32 operations
in the same order -- so they return the references' bits (tested in
``tests/kernels/test_kernels.py``). LLVM gets no fast-math flags from numba, so it
neither contracts ``a - b * c`` into an FMA nor simplifies the magic-number
rounding away; where the spec fuses an exact product into its sum, the
loops form it in float64 as the reference does.

Used by the ``numba`` backend (``echo_vllm.backends``): the gloo benchmark and
CPU deployments opt in; the default CPU path stays the references.
Signatures match ``echo_vllm.kernels`` (``AVAILABLE`` says whether numba
imports). bf16 travels as its uint16 bits; fp16 inputs are widened to fp32
(exact) by torch before the loops and fp16 outputs narrowed by torch after
them (round to nearest even, as the reference does). Feedback buffers come
in the three formats of ``quant`` (float32, bfloat16, int8 blocks; the int8
buffer travels as its uint8 bytes), read and written one group at a time by
:func:`_load_fb_group` / :func:`_store_fb_group` as ``quant.read_feedback``
/ ``write_feedback`` do (the Triton kernels: ``tile.load_feedback`` /
``store_feedback``).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import quant
from ..quant import ALIGN_GROUPS, FEEDBACK_QMAX, WireLayout
from ..rotation import sign_vector
from . import contract

try:
    import numba
except Exception:  # pragma: no cover - depends on the installation
    AVAILABLE = False
else:
    AVAILABLE = True

_F = np.float32
MAGIC = _F(12582912.0)
#: 1.5 * 2**52: (y + this) - this rounds a float64 y to an integer, ties to even (|y| <= 2**51).
RNE_MAGIC_64 = 6755399441055744.0
FLT_MIN = _F(2.0**-126)
CODE_BIAS = _F(8.0)
#: bf16 bits of the NaN scale of a non-finite group.
NAN_BF16 = np.uint16(0x7FC0)
#: fp32(1/127): the int8 feedback format's scale multiplier (quant.group_scales).
FB_INV_QMAX = _F(float(quant.inv_qmax_f32(FEEDBACK_QMAX)))
#: A group whose unrounded scale reaches this is non-finite (quant.BF16_SCALE_LIMIT).
SCALE_LIMIT = _F(quant.BF16_SCALE_LIMIT)
#: quant.OUTPUT_SCALE.
OUTPUT_SCALE = _F(quant.OUTPUT_SCALE)
#: Feedback buffer formats, as the loops are told them.
FB_F32, FB_BF16, FB_INT8 = 0, 1, 2


def _njit(fn):
    return numba.njit(nogil=True, cache=True, boundscheck=False)(fn) if AVAILABLE else fn



# -- per-group helpers (inlined by LLVM) ---------------------------------------


@_njit
def _bf16_round(bits):
    """fp32 bits (uint32) -> bf16 bits, round to nearest even, NaN -> 0x7FC0."""
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@_njit
def _butterfly(u, k, h):
    a = u[k]
    b = u[k + h]
    u[k] = a + b
    u[k + h] = a - b


@_njit
def _fwht(u, g):
    """In-place butterflies of ``rotation.fwht``. Stages never mix values of
    different 2h-blocks, so the four strides below 16 run block by block of
    16 (loops of constant length, which LLVM unrolls); the wider strides
    then run in 16-wide sweeps. Every value sees the same adds as in the
    reference."""
    for b in range(0, g, 16):
        for k in range(b, b + 16, 2):
            _butterfly(u, k, 1)
        for s in range(b, b + 16, 4):
            for k in range(s, s + 2):
                _butterfly(u, k, 2)
        for s in range(b, b + 16, 8):
            for k in range(s, s + 4):
                _butterfly(u, k, 4)
        for k in range(b, b + 8):
            _butterfly(u, k, 8)
    h = 16
    while h < g:
        for s in range(0, g, 2 * h):
            for k0 in range(s, s + h, 16):
                for k in range(k0, k0 + 16):
                    _butterfly(u, k, h)
        h *= 2


@_njit
def _group_scale(ub, g, inv_qmax, one, one_bits):
    """bf16 bits of ``quant.group_scales``' scale of the fp32 group whose
    bits are ``ub[:g]``: ``NAN_BF16`` if it holds NaN or Inf or its scale
    reaches ``SCALE_LIMIT`` (no finite scale rounds to it). ``one``/``one_bits`` are a 1-element fp32 array
    and its uint32 view."""
    amax_bits = np.uint32(0)
    bad = False
    for k in range(g):
        a = ub[k] & np.uint32(0x7FFFFFFF)
        if a >= np.uint32(0x7F800000):
            bad = True
        elif a > amax_bits:
            amax_bits = a
    if bad:
        return NAN_BF16
    one_bits[0] = amax_bits
    s32 = one[0] * inv_qmax
    if not s32 < SCALE_LIMIT:  # it would round to infinity
        return NAN_BF16
    if s32 < FLT_MIN:
        s32 = FLT_MIN
    one[0] = s32
    return _bf16_round(one_bits[0])


@_njit
def _quantize(u, ub, g, qmax, inv_qmax, codes, err, one, one_bits, shift=0):
    """Quantize ``u[:g]`` as ``quant.quantize_groups`` (``shift``: ``u`` holds
    the values times 2**-shift; ``inv_qmax`` is the unshifted multiplier);
    fills ``codes`` and ``err``, returns the scale's bf16 bits (0x7FC0 for a
    non-finite group)."""
    up = np.float64(2.0) ** shift  # exact powers of two
    unit = _F(1.0 / up)
    lim = qmax * unit
    magic = MAGIC * unit
    s_bits = _group_scale(ub, g, _F(inv_qmax * _F(up)), one, one_bits)
    if s_bits == NAN_BF16:
        for k in range(g):
            codes[k] = 8
            err[k] = _F(0.0)
        return s_bits
    one_bits[0] = np.uint32(s_bits) << np.uint32(16)
    s = one[0]
    inv = _F(1.0) / s
    for k in range(g):
        y = u[k] * inv
        y = min(max(y, -lim), lim)
        r = (y + magic) - magic
        codes[k] = np.int32(np.float64(r) * up) + 8
        err[k] = _F(np.float64(u[k]) - np.float64(r) * np.float64(s))  # one rounding (the product is exact)
    return s_bits


@_njit
def _signed_mse_top(ub, g):
    """``(amax bits, negative, bad)`` of the group whose bits are ``ub[:g]``:
    the largest magnitude, whether a value of that magnitude is negative
    (``quant._signed_mse_scales``: a tie goes to the negative one), whether
    the group holds NaN or Inf."""
    amax_bits = np.uint32(0)
    neg = False
    for k in range(g):
        a = ub[k] & np.uint32(0x7FFFFFFF)
        if a >= np.uint32(0x7F800000):
            return amax_bits, neg, True
        sign = ub[k] >= np.uint32(0x80000000)
        if a > amax_bits:
            amax_bits, neg = a, sign
        elif a == amax_bits:
            neg = neg or sign
    return amax_bits, neg, False


@_njit
def _quantize_signed_mse(u, ub, g, mults, codes, err, cand, one, one_bits, shift=0):
    """Quantize ``u[:g]`` as ``quant.quantize_groups(encoder="signed_mse")``:
    each multiplier of ``mults`` (``quant.clip_multipliers``) gives a signed
    scale; its codes round the exact product ``u * (1 / scale)`` (in
    float64) and clamp to [-8, 7]; the first candidate with the least
    ``quant.tree_sum`` of squared errors is kept. ``cand``: scratch, an
    int32 and two fp32 arrays of ``g``. Fills ``codes`` and ``err``, returns
    the scale's bf16 bits (0x7FC0 for a non-finite group)."""
    c_codes, c_err, sq = cand
    up = np.float64(2.0) ** shift
    amax_bits, neg, bad = _signed_mse_top(ub, g)
    one_bits[0] = amax_bits
    amax = one[0]
    if bad or not amax * _F(mults.max() * _F(up)) < SCALE_LIMIT:
        for k in range(g):
            codes[k] = 8
            err[k] = _F(0.0)
        return NAN_BF16
    sign = np.uint16(0) if neg else np.uint16(0x8000)
    best_bits = NAN_BF16
    best_sse = _F(0.0)
    for m in range(mults.shape[0]):
        s32 = amax * _F(mults[m] * _F(up))
        if s32 < FLT_MIN:
            s32 = FLT_MIN
        one[0] = s32
        s_bits = _bf16_round(one_bits[0]) | sign
        one_bits[0] = np.uint32(s_bits) << np.uint32(16)
        s = one[0]
        inv = np.float64(_F(1.0) / s)
        for k in range(g):
            q = (np.float64(u[k]) * inv * up + RNE_MAGIC_64) - RNE_MAGIC_64  # exact: one rounding
            q = min(max(q, -8.0), 7.0)
            c_codes[k] = np.int32(q) + 8
            c_err[k] = _F(np.float64(u[k]) - q / up * np.float64(s))  # one rounding (the product is exact)
            sq[k] = c_err[k] * c_err[k]
        h = 1
        while h < g:  # quant.tree_sum: adjacent pairs, then pairs of those
            for k in range(0, g, 2 * h):
                sq[k] = sq[k] + sq[k + h]
            h *= 2
        if m == 0 or sq[0] < best_sse:
            best_bits, best_sse = s_bits, sq[0]
            for k in range(g):
                codes[k] = c_codes[k]
                err[k] = c_err[k]
    return best_bits


@_njit
def _decode_group(wire, chunk_first, pb, lg, g, dst, one, one_bits, accumulate, scale=True, unit=_F(1.0)):
    """Dequantize group ``lg`` of the chunk at byte ``chunk_first`` into
    ``dst`` (``dst += value * unit`` if ``accumulate``, ``unit`` a power of
    two; ``code - 8`` alone if not ``scale``); returns the group's scale."""
    so = chunk_first + pb + 2 * lg
    one_bits[0] = (np.uint32(wire[so]) | (np.uint32(wire[so + 1]) << np.uint32(8))) << np.uint32(16)
    s = one[0]
    su = s * unit  # exact: a bf16 scale times a power of two stays above fp32's last place
    po = chunk_first + lg * (g // 2)
    for k in range(g // 2):
        byte = wire[po + k]
        q0 = _F(byte & 0x0F) - CODE_BIAS
        q1 = _F(byte >> 4) - CODE_BIAS
        if accumulate:  # dst + q * s * unit rounded once (the product is exact)
            dst[2 * k] = _F(np.float64(dst[2 * k]) + np.float64(q0) * np.float64(su))
            dst[2 * k + 1] = _F(np.float64(dst[2 * k + 1]) + np.float64(q1) * np.float64(su))
        elif scale:
            dst[2 * k] = q0 * s
            dst[2 * k + 1] = q1 * s
        else:
            dst[2 * k] = q0
            dst[2 * k + 1] = q1
    return s


@_njit
def _write_group(wire, chunk_first, pb, lg, g, codes, s_bits):
    po = chunk_first + lg * (g // 2)
    for k in range(g // 2):
        wire[po + k] = np.uint8(codes[2 * k] | (codes[2 * k + 1] << 4))
    so = chunk_first + pb + 2 * lg
    wire[so] = np.uint8(s_bits & 0xFF)
    wire[so + 1] = np.uint8(s_bits >> 8)


@_njit
def _load_group(src, is_bf16, base, valid, u, ub, g):
    """``u[:valid] = src[base:base+valid]`` as fp32 (bf16 from its bits),
    zeros after ``valid`` (the padding)."""
    if valid == g:  # every group but the last
        if is_bf16:
            for k in range(g):
                ub[k] = np.uint32(src[base + k]) << np.uint32(16)
        else:
            for k in range(g):
                u[k] = _F(src[base + k])
        return
    for k in range(g):
        u[k] = _F(0.0)
    for k in range(valid):
        if is_bf16:
            ub[k] = np.uint32(src[base + k]) << np.uint32(16)
        else:
            u[k] = _F(src[base + k])


@_njit
def _store_group(dst, is_bf16, base, valid, v, vb, g):
    """``dst[base:base+valid] = v[:valid]`` (bf16 rounded to nearest even)."""
    if valid == g:
        if is_bf16:
            for k in range(g):
                dst[base + k] = _bf16_round(vb[k])
        else:
            for k in range(g):
                dst[base + k] = v[k]
        return
    for k in range(valid):
        if is_bf16:
            dst[base + k] = _bf16_round(vb[k])
        else:
            dst[base + k] = v[k]


@_njit
def _fb_int8_offsets(gi, g):
    """(first code byte, first scale byte) of wire-order group ``gi`` in an
    int8 feedback buffer: blocks of ALIGN_GROUPS groups' codes, then their
    bf16 scales (``quant``'s docstring)."""
    blk = gi // ALIGN_GROUPS
    k = gi - blk * ALIGN_GROUPS
    first = blk * ALIGN_GROUPS * (g + 2)
    return first + k * g, first + ALIGN_GROUPS * g + 2 * k


@_njit
def _load_fb_group(fb, fbq, kind, gi, g, e, eb, one, one_bits):
    """``e[:g]`` = the carried errors of wire-order group ``gi`` as fp32
    (``quant.read_feedback``): from ``fb`` (fp32, or bf16 bits) or, for
    ``kind == FB_INT8``, code * scale from the bytes ``fbq``."""
    if kind != FB_INT8:
        _load_group(fb, kind == FB_BF16, gi * g, g, e, eb, g)
        return
    co, so = _fb_int8_offsets(gi, g)
    one_bits[0] = (np.uint32(fbq[so]) | (np.uint32(fbq[so + 1]) << np.uint32(8))) << np.uint32(16)
    t = one[0]
    for k in range(g):
        c = np.int32(fbq[co + k])
        if c >= 128:  # the byte is an int8 code in two's complement
            c -= 256
        e[k] = _F(c) * t  # exact: 7 by 8 significant bits


@_njit
def _store_fb_group(fb, fbq, kind, gi, g, e, eb, one, one_bits):
    """Store ``e[:g]`` as wire-order group ``gi`` (``quant.write_feedback``):
    rounded to fp32 / bf16 in ``fb``, or int8-encoded into ``fbq``
    (``quant.encode_feedback``: qmax 127, no clamp needed)."""
    if kind != FB_INT8:
        _store_group(fb, kind == FB_BF16, gi * g, g, e, eb, g)
        return
    co, so = _fb_int8_offsets(gi, g)
    t_bits = _group_scale(eb, g, FB_INV_QMAX, one, one_bits)
    if t_bits == NAN_BF16:
        for k in range(g):
            fbq[co + k] = np.uint8(0)
    else:
        one_bits[0] = np.uint32(t_bits) << np.uint32(16)
        inv = _F(1.0) / one[0]
        for k in range(g):
            r = (e[k] * inv + MAGIC) - MAGIC
            fbq[co + k] = np.uint8(np.int32(r) & 0xFF)
    fbq[so] = np.uint8(t_bits & 0xFF)
    fbq[so + 1] = np.uint8(t_bits >> 8)


@_njit
def _message_group(j, m, row_groups, cols, msg_groups, g):
    """(offset, valid values) in the message of group ``m`` of chunk ``j``:
    the position-owned layout of ``quant`` (valid 0 for padding groups)."""
    if m >= msg_groups:
        return 0, 0
    t = m // row_groups
    col0 = (j * row_groups + m - t * row_groups) * g
    return t * cols + col0, min(g, max(0, cols - col0))


# -- the stages, one row (local rank) at a time ---------------------------------


@_njit
def _scratch(g):
    """Per-call scratch: two fp32 groups (+ uint32 views), codes, and a
    one-element fp32/uint32 pair for scalar bit casts."""
    u = np.empty(g, np.float32)
    e = np.empty(g, np.float32)
    codes = np.empty(g, np.int32)
    one = np.empty(1, np.float32)
    return u, u.view(np.uint32), e, e.view(np.uint32), codes, one, one.view(np.uint32)


@_njit
def _candidate_scratch(g):
    """signed_mse's per-candidate codes, errors and squared errors (:func:`_quantize_signed_mse`)."""
    return np.empty(g, np.int32), np.empty(g, np.float32), np.empty(g, np.float32)


@_njit
def _stage1_row(x, x_bf16, msg, fb, fbq, fb_kind, has_fb, incoming, wire, c, cb, pb, g, qmax, inv_qmax, mults,
                hadamard, prescale):
    # prescale[k]: quant.input_scale times value k's sign (rotation.sign_vector): one exact product
    u, ub, e, eb, codes, one, one_bits = _scratch(g)
    cand = _candidate_scratch(g)
    groups_per_chunk = c // g
    n_groups = (wire.shape[0] // cb) * groups_per_chunk
    for gi in range(n_groups):
        j = gi // groups_per_chunk
        src, valid = _message_group(j, gi - j * groups_per_chunk, msg[0], msg[1], msg[2], g)
        _load_group(x, x_bf16, src, valid, u, ub, g)
        for k in range(g):  # quant.input_scale (exact for 16-bit inputs), then the flip (exact)
            u[k] = u[k] * prescale[k]
        if hadamard:
            _fwht(u, g)
        if has_fb and incoming:
            _load_fb_group(fb, fbq, fb_kind, gi, g, e, eb, one, one_bits)
            for k in range(g):
                u[k] = u[k] + e[k]
        if mults.shape[0]:
            s_bits = _quantize_signed_mse(u, ub, g, mults, codes, e, cand, one, one_bits)
        else:
            s_bits = _quantize(u, ub, g, qmax, inv_qmax, codes, e, one, one_bits)
        if has_fb:
            _store_fb_group(fb, fbq, fb_kind, gi, g, e, eb, one, one_bits)
        _write_group(wire, j * cb, pb, gi - j * groups_per_chunk, g, codes, s_bits)


@_njit
def _stage2_row(recv, p, fb, fbq, fb_kind, has_fb, own, out, c, cb, pb, g, qmax, inv_qmax, mults, shift):
    acc, ab, e, eb, codes, one, one_bits = _scratch(g)
    cand = _candidate_scratch(g)
    err = np.empty(g, np.float32)
    up = np.float64(2.0) ** shift
    unit = _F(1.0 / up)
    for lg in range(c // g):
        for k in range(g):
            acc[k] = _F(-0.0)  # the additive identity, as the reference's
        for i in range(p):  # the sum at 2**-shift of its size (quant.stage2_reference)
            _decode_group(recv, i * cb, pb, lg, g, acc, one, one_bits, True, True, unit)
        if mults.shape[0]:
            s_bits = _quantize_signed_mse(acc, ab, g, mults, codes, err, cand, one, one_bits, shift)
        else:
            s_bits = _quantize(acc, ab, g, qmax, inv_qmax, codes, err, one, one_bits, shift)
        if has_fb:
            gi = own * (c // g) + lg
            _load_fb_group(fb, fbq, fb_kind, gi, g, e, eb, one, one_bits)
            for k in range(g):  # the error at its full size, one rounding with the sum
                e[k] = _F(np.float64(e[k]) + np.float64(err[k]) * up)
            _store_fb_group(fb, fbq, fb_kind, gi, g, e, eb, one, one_bits)
        _write_group(out, 0, pb, lg, g, codes, s_bits)


@_njit
def _clamp(v, big):
    """``v`` clamped to [-big, big]; NaN stays NaN."""
    if v > big:
        return big
    if v < -big:
        return -big
    return v


@_njit
def _output_all(gathered, p, out, out_bf16, msg, c, cb, pb, g, hadamard, signs, big):
    v, vb, _, _, _, one, one_bits = _scratch(g)
    for j in range(p):
        for lg in range(c // g):
            # flip(rot(q * OUTPUT_SCALE) * scale), saturated to +-big: quant.output_reference
            s = _decode_group(gathered, j * cb, pb, lg, g, v, one, one_bits, False, False)
            for k in range(g):
                v[k] = v[k] * OUTPUT_SCALE
            if hadamard:
                _fwht(v, g)
            for k in range(g):
                v[k] = _clamp(v[k] * s * signs[k], big)
            dst, valid = _message_group(j, lg, msg[0], msg[1], msg[2], g)
            _store_group(out, out_bf16, dst, valid, v, vb, g)


@_njit
def _consume_row(x, x_bf16, msg, fb, fbq, fb_kind, out, p, c, g, hadamard, signs, big):
    u, ub, e, eb, _, one, one_bits = _scratch(g)
    groups_per_chunk = c // g
    for gi in range(p * groups_per_chunk):
        j = gi // groups_per_chunk
        src, valid = _message_group(j, gi - j * groups_per_chunk, msg[0], msg[1], msg[2], g)
        if valid == 0:
            continue
        _load_fb_group(fb, fbq, fb_kind, gi, g, e, eb, one, one_bits)
        if hadamard:
            _fwht(e, g)
        _load_group(x, x_bf16, src, valid, u, ub, g)
        for k in range(valid):  # x + flip(rot(e)) * OUTPUT_SCALE, saturated where x is finite
            y = u[k] + e[k] * signs[k] * OUTPUT_SCALE
            u[k] = y if abs(u[k]) == np.inf else _clamp(y, big)
        _store_group(out, x_bf16, src, valid, u, ub, g)


# -- torch-facing wrappers -------------------------------------------------------


def _as_loop_input(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A 1-D row as numpy: bf16 as uint16 bits, everything else as fp32."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), True
    return t.contiguous().float().numpy(), False


def _require(*tensors: torch.Tensor | None) -> None:
    if not AVAILABLE:
        raise RuntimeError("the CPU loops need numba (pip install numba)")
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"CPU loops got a tensor on {t.device}")


def _quantizer(qmax: int, encoder: str) -> tuple[np.float32, np.float32, np.ndarray]:
    """``(qmax, absmax's multiplier, signed_mse's multipliers)``: the loops
    run signed_mse where the last is not empty (the kernels' constants,
    ``contract.quantizer_constants``)."""
    consts = contract.quantizer_constants(qmax, encoder)
    if encoder == "absmax":
        return _F(qmax), _F(consts["INV_QMAX"]), np.empty(0, np.float32)
    return _F(qmax), _F(consts["INV_QMAX"]), np.array(quant.clip_multipliers(), np.float32)


def _feedback_rows(feedback: torch.Tensor | None, rows: int):
    """``(values, bytes, kind)``: numpy views of the feedback buffer that
    write through -- fp32 or bf16 bits in ``values``, an int8 buffer's bytes
    in ``bytes`` (the other a one-element dummy per row) -- and its
    ``FB_*`` format."""
    dummy_f, dummy_b = np.empty((max(rows, 1), 1), np.float32), np.empty((max(rows, 1), 1), np.uint8)
    if feedback is None:
        return dummy_f, dummy_b, FB_F32
    if not feedback.is_contiguous():
        raise ValueError("feedback: the CPU loops need a contiguous buffer")
    if feedback.dtype == torch.int8:
        return dummy_f, feedback.view(torch.uint8).numpy(), FB_INT8
    if feedback.dtype == torch.bfloat16:
        return feedback.view(torch.int16).numpy().view(np.uint16), dummy_b, FB_BF16
    return feedback.numpy(), dummy_b, FB_F32


def _signs(flips: int, layout: WireLayout) -> np.ndarray:
    """``rotation.sign_vector`` of ``flips`` as the loops take it (fp32 +-1
    per value of a group)."""
    return sign_vector(contract.check_flips(flips, layout), layout.group_size).numpy()


def stage1(x, feedback, layout: WireLayout, *, qmax, hadamard, has_incoming, flips=0, encoder="absmax", out=None):
    """CPU loop version of ``quant.stage1_reference`` (see ``kernels.stage1``)."""
    _require(x, feedback, out)
    rows = x.shape[0] if x.dim() == 2 else -1
    contract.check_rows("x", x, rows, layout.numel, contract.INPUT_DTYPES)
    if feedback is not None:
        contract.check_feedback(feedback, rows, layout)
    p = layout.world_size
    wire = contract.wire_or_new(out, (rows, p, layout.chunk_bytes), x)
    fb, fbq, kind = _feedback_rows(feedback, rows)
    q, inv_q, mults = _quantizer(qmax, encoder)
    wire_np = wire.numpy()
    c = _signs(flips, layout) * _F(quant.input_scale(layout.group_size, bool(hadamard)))
    for r in range(rows):
        xr, x_bf16 = _as_loop_input(x[r])
        _stage1_row(xr, x_bf16, contract.message_ints(layout), fb[r], fbq[r], kind,
                    feedback is not None, bool(has_incoming), wire_np[r].reshape(-1), layout.chunk_numel,
                    layout.chunk_bytes, layout.payload_bytes, layout.group_size, q, inv_q, mults, bool(hadamard), c)
    return wire


def stage2(recv, feedback, own_chunks, layout: WireLayout, *, qmax, encoder="absmax", out=None):
    """CPU loop version of ``quant.stage2_reference`` (see ``kernels.stage2``)."""
    from .stage2_kernel import own_chunk_progression

    _require(recv, feedback, out)
    p = layout.world_size
    rows = recv.shape[0] if recv.dim() == 3 else -1
    contract.check_wire("recv", recv, (rows, p, layout.chunk_bytes))
    if len(own_chunks) != rows:
        raise ValueError(f"own_chunks: {len(own_chunks)} entries for {rows} local ranks")
    own_chunk_progression(own_chunks, p)
    if feedback is not None:
        contract.check_feedback(feedback, rows, layout)
    wire = contract.wire_or_new(out, (rows, layout.chunk_bytes), recv)
    fb, fbq, kind = _feedback_rows(feedback, rows)
    q, inv_q, mults = _quantizer(qmax, encoder)
    recv_np, out_np = recv.numpy(), wire.numpy()
    for r in range(rows):
        _stage2_row(recv_np[r].reshape(-1), p, fb[r], fbq[r], kind, feedback is not None,
                    int(own_chunks[r]), out_np[r], layout.chunk_numel, layout.chunk_bytes,
                    layout.payload_bytes, layout.group_size, q, inv_q, mults, quant.stage2_shift(p))
    return wire


def output(gathered, layout: WireLayout, out_dtype, *, hadamard, flips=0, out=None):
    """CPU loop version of ``quant.output_reference`` (see ``kernels.output``)."""
    _require(gathered, out)
    contract.check_wire("gathered", gathered, (layout.world_size, layout.chunk_bytes))
    if out_dtype not in contract.INPUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not in {contract.INPUT_DTYPES}")
    bf16 = out_dtype == torch.bfloat16
    buf = torch.empty(layout.numel, dtype=torch.int16 if bf16 else torch.float32)
    dst = buf.numpy().view(np.uint16) if bf16 else buf.numpy()
    _output_all(gathered.numpy().reshape(-1), layout.world_size, dst, bf16, contract.message_ints(layout),
                layout.chunk_numel, layout.chunk_bytes, layout.payload_bytes, layout.group_size, bool(hadamard),
                _signs(flips, layout), _F(torch.finfo(out_dtype).max))
    y = buf.view(torch.bfloat16) if bf16 else buf.to(out_dtype)
    if out is None:
        return y
    out.copy_(y.view(out.shape))
    return out


def consume(x, feedback, layout: WireLayout, *, hadamard, flips=0, out=None):
    """CPU loop version of ``quant.consume_reference`` (see ``kernels.consume``)."""
    _require(x, feedback, out)
    rows = x.shape[0] if x.dim() == 2 else -1
    contract.check_rows("x", x, rows, layout.numel, contract.INPUT_DTYPES)
    contract.check_feedback(feedback, rows, layout)
    fb, fbq, kind = _feedback_rows(feedback, rows)
    bf16 = x.dtype == torch.bfloat16
    res = torch.empty(rows, layout.numel, dtype=torch.int16 if bf16 else torch.float32)
    res_np = res.numpy().view(np.uint16) if bf16 else res.numpy()
    signs = _signs(flips, layout)
    for r in range(rows):
        xr, _ = _as_loop_input(x[r])
        _consume_row(xr, bf16, contract.message_ints(layout), fb[r], fbq[r], kind, res_np[r], layout.world_size,
                      layout.chunk_numel, layout.group_size, bool(hadamard), signs, _F(torch.finfo(x.dtype).max))
    y = res.view(torch.bfloat16) if bf16 else res.to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
