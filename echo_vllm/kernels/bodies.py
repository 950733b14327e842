"""One tile of each Echo stage: the device code the composed stage kernels
and the fused kernel's phases share (so both give the same bits by construction).

A tile is ``BG`` groups ``lg`` of one chunk (see :mod:`.tile` for the layout).
Stage 1 and output are split into a load and a finish so that the fused
kernel's loops can issue the next tile's loads before finishing this one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import quant

from .tile import (
    LOG2_OUTPUT_SCALE, accumulate_chunk, as_groups, block_shift, chunk_lanes, clamp_finite, codes_of, decode_output,
    feedback_values, flip, from_f32, fwht, group_rows, lanes_hold, load_chunk_groups, load_feedback, load_lanes,
    load_values, message_offsets, quantize, store_chunk_groups, store_feedback, store_values, to_f32,
)


#: ``quant.input_scale`` and ``quant.stage2_shift``, evaluated at compile time.
_input_scale = triton.constexpr_function(quant.input_scale)
_stage2_shift = triton.constexpr_function(quant.stage2_shift)


@triton.constexpr_function
def _exact_times_power_of_two(dtype) -> bool:
    """Whether every value of ``dtype`` times ``quant.input_scale`` is exact
    in fp32: 16-bit types (their smallest subnormals are far above fp32's)."""
    return dtype.primitive_bitwidth <= 16


@triton.jit
def stage1_load(x_ptr, fb_ptr, j, lg, rows, row_groups, cols, msg_groups, chunk_numel, chunk_groups,
                G: tl.constexpr, HAS_FB: tl.constexpr, HAS_INCOMING: tl.constexpr):
    """``(x, e)``: the message values of groups ``lg`` of chunk ``j`` (``rows``:
    ``tile.group_rows(lg)``) and their carried error (``x`` itself, unused,
    when there is none)."""
    xi, xm = message_offsets(j, lg, rows, row_groups, cols, msg_groups, G)
    x = load_values(x_ptr, xi, xm, G)
    if HAS_FB and HAS_INCOMING:
        e = load_feedback(fb_ptr, j * chunk_numel, lg, lg < chunk_groups, G)
    else:
        e = x
    return x, e


@triton.jit
def stage1_finish(x, e, fb_ptr, wire_ptr, wire_first, payload_bytes, j, lg, chunk_numel, chunk_groups,
                  G: tl.constexpr, INV_QMAX: tl.constexpr, ENCODER: tl.constexpr, HADAMARD: tl.constexpr,
                  HAS_FB: tl.constexpr, HAS_INCOMING: tl.constexpr, LANES: tl.constexpr, FLIPS: tl.constexpr = 0):
    """u = rot(flip(x) * c) [+ e] (``c = quant.input_scale``, ``FLIPS``:
    ``tile.flip``'s, exact like the product); quantize (``tile.quantize``'s
    ``ENCODER``); the new
    error into the feedback buffer (wire order), the codes and scales into
    the chunk at byte ``wire_first`` (``LANES``: ``contract.lane_layout`` of
    the message). A 16-bit ``x`` times ``c`` is exact,
    so the product is fused into the first butterflies, or into the add of
    the error (no extra instruction); an fp32 ``x`` is multiplied first."""
    SHUFFLE: tl.constexpr = lanes_hold(x.dtype, fb_ptr.dtype.element_ty) and LANES
    C: tl.constexpr = _input_scale(G, HADAMARD)
    FUSED: tl.constexpr = _exact_times_power_of_two(x.dtype)
    u = flip(to_f32(x), FLIPS)
    if HADAMARD:
        if x.dtype == tl.float16 and HAS_FB and HAS_INCOMING:
            # fp16's rotation cannot overflow and stays normal, so rot(x) * c is
            # rot(x * c) exactly: the product goes into the add of the error
            u = tl.fma(fwht(u, G, SHUFFLE), C, feedback_values(fb_ptr, e))
        else:
            if FUSED:
                u = fwht(u, G, SHUFFLE, C)
            else:
                u = fwht(u * C, G, SHUFFLE)
            if HAS_FB and HAS_INCOMING:
                u = u + feedback_values(fb_ptr, e)
    elif HAS_FB and HAS_INCOMING:
        if FUSED:
            u = tl.fma(u, C, feedback_values(fb_ptr, e))
        else:
            u = u * C + feedback_values(fb_ptr, e)
    else:
        u = u * C
    words, s_bits, err = quantize(u, INV_QMAX, 0, ENCODER, SHUFFLE)
    gmask = lg < chunk_groups
    if HAS_FB:
        store_feedback(fb_ptr, j * chunk_numel, lg, gmask, err, True)  # quantize's err: finite
    store_chunk_groups(wire_ptr, wire_first, payload_bytes, lg, gmask, words, s_bits, G)


@triton.jit
def stage2_tile(recv_ptr, recv_first, chunk_bytes, payload_bytes, fb_ptr, own_first, lg, chunk_groups,
                P: tl.constexpr, G: tl.constexpr, INV_QMAX: tl.constexpr, ENCODER: tl.constexpr, HAS_FB: tl.constexpr,
                LANES: tl.constexpr):
    """Sum the ``P`` received chunks (at ``recv_first + i * chunk_bytes``) of
    groups ``lg`` in fp32 in rank order, requantize (``tile.quantize``'s
    ``ENCODER``), add the error into the feedback buffer's own chunk (its
    value 0 at ``own_first``; 16-bit feedback is loaded with the chunks, its
    latency hidden under theirs). ``LANES``: the tile has a lane for every
    thread (``contract.lane_layout``). Returns ``(words, scale bits)``."""
    gmask = lg < chunk_groups
    # feedback in the lane layout is loaded with the chunks (one memory
    # latency per tile, not two); a 32-bit tile is converted through shared
    # memory right at its load, which would wait for it there and double the
    # conversions
    EARLY: tl.constexpr = lanes_hold(fb_ptr.dtype.element_ty)
    # the sum at 2**-K of its size (quant.stage2_shift), the power of two in
    # the codes' unit (free); the reference's -0 + dequant(chunk 0) is
    # dequant(chunk 0)
    K: tl.constexpr = _stage2_shift(P)
    wp, sp = chunk_lanes(recv_ptr, recv_first, payload_bytes, lg, G)
    words, s = load_lanes(wp, sp, gmask)
    if HAS_FB and EARLY:
        e = load_feedback(fb_ptr, own_first, lg, gmask, G)
    acc = codes_of(words, -K) * s[:, :, None]
    # chunk i's pointers are chunk 0's plus i chunks (in words, in scales:
    # chunk_bytes is a multiple of 16), added in the loop: the sums
    # base + i * chunk_bytes, loop-invariant, would be hoisted out of a
    # caller's tile loop into 2 registers per chunk and per pointer
    for i in tl.static_range(1, P):  # rank order: the reference's sum
        acc = accumulate_chunk(acc, wp + i * (chunk_bytes // 4), sp + i * (chunk_bytes // 2), gmask, -K)
    words, s_bits, err = quantize(acc, INV_QMAX, K, ENCODER, EARLY and LANES)
    if HAS_FB:
        if not EARLY:
            e = load_feedback(fb_ptr, own_first, lg, gmask, G)
        # the error at its full size (exact), one rounding with the sum
        store_feedback(fb_ptr, own_first, lg, gmask, tl.fma(err, 2.0 ** K, feedback_values(fb_ptr, e)))
    return words, s_bits


@triton.jit
def output_load(buf_ptr, chunk_first, payload_bytes, lg, chunk_groups, G: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
    """``(words, scales)`` of groups ``lg`` of the gathered chunk at byte ``chunk_first`` (``EVICT``: the words' cache hint)."""
    return load_chunk_groups(buf_ptr, chunk_first, payload_bytes, lg, lg < chunk_groups, G, EVICT)


@triton.jit
def output_load_chunks(buf_ptr, first, chunk_bytes, payload_bytes, j, lg, gmask, G: tl.constexpr,
                       EVICT: tl.constexpr = tl.constexpr("")):
    """:func:`output_load` of groups from several gathered chunks at once:
    group ``i`` is group ``lg[i]`` of chunk ``j[i]`` (int64), at byte ``first
    + j[i] * chunk_bytes`` (a multiple of 16), read where ``gmask``."""
    wp, sp = chunk_lanes(buf_ptr, first, payload_bytes, lg, G)
    jb = j * chunk_bytes
    return load_lanes(wp + (jb >> 2)[:, None], sp + (jb >> 1)[:, None], gmask, EVICT)


@triton.jit
def output_finish(words, s, y_ptr, y_tile, j, row_groups, cols, G: tl.constexpr, HADAMARD: tl.constexpr,
                  LANES: tl.constexpr, FLIPS: tl.constexpr = 0):
    """Decode, unrotate (``FLIPS``: the signs flipped back) and store into the
    message ``y`` the groups of ``y_tile`` (:func:`tile.block_offsets`) of
    chunk ``j``. ``LANES``: ``contract.lane_layout`` of ``y``."""
    offs, c, live = y_tile
    SHUFFLE: tl.constexpr = lanes_hold(y_ptr.dtype.element_ty) and LANES
    v = decode_output(words, s, y_ptr.dtype.element_ty, G, HADAMARD, SHUFFLE, FLIPS)
    d, limit = block_shift(j, row_groups, cols, G)
    # the scalar added to the pointer first: one add per chunk
    tl.store((y_ptr + d) + offs, as_groups(v), mask=live & (c < limit))


@triton.jit
def consume_tile(x_ptr, fb_ptr, out_ptr, j, lg, row_groups, cols, msg_groups, chunk_numel, G: tl.constexpr,
                 HADAMARD: tl.constexpr, LANES: tl.constexpr, FLIPS: tl.constexpr = 0):
    """out = x + flip(rot(e)) * OUTPUT_SCALE for groups ``lg`` of chunk ``j``
    (e in wire order), as ``quant.consume_reference``: saturated where x is
    finite; ``LANES``: ``contract.lane_layout`` of ``x`` and ``out``."""
    xi, xm = message_offsets(j, lg, group_rows(lg, row_groups), row_groups, cols, msg_groups, G)
    e = feedback_values(fb_ptr, load_feedback(fb_ptr, j * chunk_numel, lg, lg < msg_groups, G))
    if HADAMARD:
        SHUFFLE: tl.constexpr = lanes_hold(x_ptr.dtype.element_ty, fb_ptr.dtype.element_ty) and LANES
        e = fwht(e, G, SHUFFLE)
    e = flip(e, FLIPS)
    x = to_f32(load_values(x_ptr, xi, xm, G))
    y = x + e * (2.0 ** LOG2_OUTPUT_SCALE)
    y = tl.where(tl.abs(x) == float("inf"), y, clamp_finite(y, x_ptr.dtype.element_ty))
    store_values(out_ptr, xi, xm, from_f32(y, x_ptr.dtype.element_ty))
