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
them (round to nearest even, as the reference does).
"""

from __future__ import annotations

import numpy as np
import torch

from ..quant import WireLayout
from . import launch

try:
    import numba
except Exception:  # pragma: no cover - depends on the installation
    AVAILABLE = False
else:
    AVAILABLE = True

_F = np.float32
MAGIC = _F(12582912.0)
FLT_MIN = _F(2.0**-126)
CODE_BIAS = _F(8.0)


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
def _quantize(u, ub, g, qmax, inv_qmax, codes, err, one, one_bits):
    """Quantize ``u[:g]`` as ``quant.quantize_groups``; fills ``codes`` and
    ``err``, returns the scale's bf16 bits (0x7FC0 for a non-finite group).
    ``one``/``one_bits`` are a 1-element fp32 array and its uint32 view."""
    amax_bits = np.uint32(0)
    bad = False
    for k in range(g):
        a = ub[k] & np.uint32(0x7FFFFFFF)
        if a >= np.uint32(0x7F800000):
            bad = True
        elif a > amax_bits:
            amax_bits = a
    if bad:
        for k in range(g):
            codes[k] = 8
            err[k] = _F(0.0)
        return np.uint16(0x7FC0)
    one_bits[0] = amax_bits
    s32 = one[0] * inv_qmax
    if s32 < FLT_MIN:
        s32 = FLT_MIN
    one[0] = s32
    s_bits = _bf16_round(one_bits[0])
    one_bits[0] = np.uint32(s_bits) << np.uint32(16)
    s = one[0]
    inv = _F(1.0) / s
    for k in range(g):
        y = u[k] * inv
        y = min(max(y, -qmax), qmax)
        r = (y + MAGIC) - MAGIC
        codes[k] = np.int32(r) + 8
        err[k] = _F(np.float64(u[k]) - np.float64(r) * np.float64(s))  # one rounding (the product is exact)
    return s_bits


@_njit
def _decode_group(wire, chunk_first, pb, lg, g, dst, one, one_bits, accumulate, scale=True):
    """Dequantize group ``lg`` of the chunk at byte ``chunk_first`` into
    ``dst`` (``dst += value`` if ``accumulate``; ``code - 8`` alone if not
    ``scale``); returns the group's scale."""
    so = chunk_first + pb + 2 * lg
    one_bits[0] = (np.uint32(wire[so]) | (np.uint32(wire[so + 1]) << np.uint32(8))) << np.uint32(16)
    s = one[0]
    po = chunk_first + lg * (g // 2)
    for k in range(g // 2):
        byte = wire[po + k]
        q0 = _F(byte & 0x0F) - CODE_BIAS
        q1 = _F(byte >> 4) - CODE_BIAS
        if accumulate:  # dst + q * s rounded once (the product is exact)
            dst[2 * k] = _F(np.float64(dst[2 * k]) + np.float64(q0) * np.float64(s))
            dst[2 * k + 1] = _F(np.float64(dst[2 * k + 1]) + np.float64(q1) * np.float64(s))
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
def _stage1_row(x, x_bf16, msg, fb, fb_bf16, has_fb, incoming, wire, c, cb, pb, g, qmax, inv_qmax, hadamard):
    u, ub, e, eb, codes, one, one_bits = _scratch(g)
    groups_per_chunk = c // g
    n_groups = (wire.shape[0] // cb) * groups_per_chunk
    for gi in range(n_groups):
        base = gi * g
        j = gi // groups_per_chunk
        src, valid = _message_group(j, gi - j * groups_per_chunk, msg[0], msg[1], msg[2], g)
        _load_group(x, x_bf16, src, valid, u, ub, g)
        if hadamard:
            _fwht(u, g)
        if has_fb and incoming:
            _load_group(fb, fb_bf16, base, g, e, eb, g)
            for k in range(g):
                u[k] = u[k] + e[k]
        s_bits = _quantize(u, ub, g, qmax, inv_qmax, codes, e, one, one_bits)
        if has_fb:
            _store_group(fb, fb_bf16, base, g, e, eb, g)
        _write_group(wire, j * cb, pb, gi - j * groups_per_chunk, g, codes, s_bits)


@_njit
def _stage2_row(recv, p, fb, fb_bf16, has_fb, own, out, c, cb, pb, g, qmax, inv_qmax):
    acc, ab, e, eb, codes, one, one_bits = _scratch(g)
    err = np.empty(g, np.float32)
    for lg in range(c // g):
        for k in range(g):
            acc[k] = _F(0.0)
        for i in range(p):
            _decode_group(recv, i * cb, pb, lg, g, acc, one, one_bits, True)
        s_bits = _quantize(acc, ab, g, qmax, inv_qmax, codes, err, one, one_bits)
        if has_fb:
            base = own * c + lg * g
            _load_group(fb, fb_bf16, base, g, e, eb, g)
            for k in range(g):
                e[k] = e[k] + err[k]
            _store_group(fb, fb_bf16, base, g, e, eb, g)
        _write_group(out, 0, pb, lg, g, codes, s_bits)


@_njit
def _output_all(gathered, p, out, out_bf16, msg, c, cb, pb, g, hadamard):
    v, vb, _, _, _, one, one_bits = _scratch(g)
    inv_g = _F(1.0) / _F(g)
    for j in range(p):
        for lg in range(c // g):
            if hadamard:  # rot(q) * (scale / g): quant.output_reference
                s = _decode_group(gathered, j * cb, pb, lg, g, v, one, one_bits, False, False)
                _fwht(v, g)
                sg = s * inv_g
                for k in range(g):
                    v[k] = v[k] * sg
            else:
                _decode_group(gathered, j * cb, pb, lg, g, v, one, one_bits, False)
            dst, valid = _message_group(j, lg, msg[0], msg[1], msg[2], g)
            _store_group(out, out_bf16, dst, valid, v, vb, g)


@_njit
def _consume_row(x, x_bf16, msg, fb, fb_bf16, out, p, c, g, hadamard):
    u, ub, e, eb, _, _, _ = _scratch(g)
    inv_g = _F(1.0) / _F(g)
    groups_per_chunk = c // g
    for gi in range(p * groups_per_chunk):
        j = gi // groups_per_chunk
        src, valid = _message_group(j, gi - j * groups_per_chunk, msg[0], msg[1], msg[2], g)
        if valid == 0:
            continue
        _load_group(fb, fb_bf16, gi * g, g, e, eb, g)
        if hadamard:
            _fwht(e, g)
            for k in range(g):
                e[k] = e[k] * inv_g
        _load_group(x, x_bf16, src, valid, u, ub, g)
        for k in range(valid):
            u[k] = u[k] + e[k]
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


def _qmax(qmax: int) -> tuple[np.float32, np.float32]:
    return _F(qmax), _F(launch.qmax_constants(qmax)["INV_QMAX"])


def _feedback_rows(feedback: torch.Tensor | None):
    """Per-row numpy views of the feedback buffer that write through."""
    if feedback is None:
        return None, False
    if not feedback.is_contiguous():
        raise ValueError("feedback: the CPU loops need a contiguous buffer")
    if feedback.dtype == torch.bfloat16:
        return feedback.view(torch.int16).numpy().view(np.uint16), True
    return feedback.numpy(), False


def stage1(x, feedback, layout: WireLayout, *, qmax, hadamard, has_incoming, out=None):
    """CPU loop version of ``quant.stage1_reference`` (see ``kernels.stage1``)."""
    _require(x, feedback, out)
    rows = x.shape[0] if x.dim() == 2 else -1
    launch.check_rows("x", x, rows, layout.numel, launch.INPUT_DTYPES)
    if feedback is not None:
        launch.check_rows("feedback", feedback, rows, layout.padded_numel, launch.FEEDBACK_DTYPES)
    p = layout.world_size
    wire = launch.wire_or_new(out, (rows, p, layout.chunk_bytes), x)
    fb, fb_bf16 = _feedback_rows(feedback)
    q, inv_q = _qmax(qmax)
    wire_np = wire.numpy()
    dummy = np.empty(1, np.float32)
    for r in range(rows):
        xr, x_bf16 = _as_loop_input(x[r])
        _stage1_row(xr, x_bf16, launch.message_ints(layout), fb[r] if fb is not None else dummy, fb_bf16,
                    fb is not None, bool(has_incoming), wire_np[r].reshape(-1), layout.chunk_numel,
                    layout.chunk_bytes, layout.payload_bytes, layout.group_size, q, inv_q, bool(hadamard))
    return wire


def stage2(recv, feedback, own_chunks, layout: WireLayout, *, qmax, out=None):
    """CPU loop version of ``quant.stage2_reference`` (see ``kernels.stage2``)."""
    from .stage2_kernel import own_chunk_progression

    _require(recv, feedback, out)
    p = layout.world_size
    rows = recv.shape[0] if recv.dim() == 3 else -1
    launch.check_wire("recv", recv, (rows, p, layout.chunk_bytes))
    if len(own_chunks) != rows:
        raise ValueError(f"own_chunks: {len(own_chunks)} entries for {rows} local ranks")
    own_chunk_progression(own_chunks, p)
    if feedback is not None:
        launch.check_rows("feedback", feedback, rows, layout.padded_numel, launch.FEEDBACK_DTYPES)
    wire = launch.wire_or_new(out, (rows, layout.chunk_bytes), recv)
    fb, fb_bf16 = _feedback_rows(feedback)
    q, inv_q = _qmax(qmax)
    recv_np, out_np = recv.numpy(), wire.numpy()
    dummy = np.empty(1, np.float32)
    for r in range(rows):
        _stage2_row(recv_np[r].reshape(-1), p, fb[r] if fb is not None else dummy, fb_bf16, fb is not None,
                    int(own_chunks[r]), out_np[r], layout.chunk_numel, layout.chunk_bytes,
                    layout.payload_bytes, layout.group_size, q, inv_q)
    return wire


def output(gathered, layout: WireLayout, out_dtype, *, hadamard, out=None):
    """CPU loop version of ``quant.output_reference`` (see ``kernels.output``)."""
    _require(gathered, out)
    launch.check_wire("gathered", gathered, (layout.world_size, layout.chunk_bytes))
    if out_dtype not in launch.INPUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not in {launch.INPUT_DTYPES}")
    bf16 = out_dtype == torch.bfloat16
    buf = torch.empty(layout.numel, dtype=torch.int16 if bf16 else torch.float32)
    dst = buf.numpy().view(np.uint16) if bf16 else buf.numpy()
    _output_all(gathered.numpy().reshape(-1), layout.world_size, dst, bf16, launch.message_ints(layout),
                layout.chunk_numel, layout.chunk_bytes, layout.payload_bytes, layout.group_size, bool(hadamard))
    y = buf.view(torch.bfloat16) if bf16 else buf.to(out_dtype)
    if out is None:
        return y
    out.copy_(y.view(out.shape))
    return out


def consume(x, feedback, layout: WireLayout, *, hadamard, out=None):
    """CPU loop version of ``quant.consume_reference`` (see ``kernels.consume``)."""
    _require(x, feedback, out)
    rows = x.shape[0] if x.dim() == 2 else -1
    launch.check_rows("x", x, rows, layout.numel, launch.INPUT_DTYPES)
    launch.check_rows("feedback", feedback, rows, layout.padded_numel, launch.FEEDBACK_DTYPES)
    fb, fb_bf16 = _feedback_rows(feedback)
    bf16 = x.dtype == torch.bfloat16
    res = torch.empty(rows, layout.numel, dtype=torch.int16 if bf16 else torch.float32)
    res_np = res.numpy().view(np.uint16) if bf16 else res.numpy()
    for r in range(rows):
        xr, _ = _as_loop_input(x[r])
        _consume_row(xr, bf16, launch.message_ints(layout), fb[r], fb_bf16, res_np[r], layout.world_size,
                      layout.chunk_numel, layout.group_size, bool(hadamard))
    y = res.view(torch.bfloat16) if bf16 else res.to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
