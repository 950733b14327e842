"""Device functions on one tile of quantization groups, shared by every Echo kernel.

Layout
------
A tile is ``[BG, L, V]``: ``BG`` groups of ``G = L * V`` values, each group
spread over ``L`` lanes holding ``V`` (:data:`V`, 8) contiguous values each.
Triton gives such a tensor the blocked layout ``sizePerThread [1, 1, V]``,
``threadsPerWarp [32 / L, L, 1]``: a lane reads and writes 16 contiguous
bytes of 16-bit values (a warp covers ``32 / L`` whole groups of contiguous
memory), its 8 codes are one 32-bit word on the wire and its 8 int8 codes
of an int8 feedback buffer one 64-bit word, the three butterfly
stages of stride 1, 2, 4 and the first steps of the amax stay in registers,
and only the ``log2 L`` stages of stride ``V * m`` cross lanes -- as
``shfl.bfly`` with lane mask ``m`` (:func:`lane_partner`), the value at the
same register of lane ``lane ^ m``. Every kernel keeps every tensor of a
tile in this shape from its loads to its stores, so the compiler inserts no
layout conversion; ``tests/kernels/test_layouts.py`` compiles the kernels
for sm_90 and checks that (the shuffle assumes it).

Arithmetic
----------
Every function is the Triton twin of a piece of ``echo_vllm.quant`` and
gives the same bits:

* fp32 -> bf16 rounds to nearest even: in hardware when compiled
  (``cvt.rn.bf16.f32``), on the bit patterns in Triton's interpreter (which
  truncates). The two agree on every value but NaN's payload; the feedback
  buffers never hold a computed NaN (a non-finite group's error is 0; an
  int8 buffer's NaN scale is written as the constant 0x7FC0) and outputs
  are compared with any NaN equal to any NaN.
* products that are exact (a 4-bit code times a bf16 scale) are fused into
  their sum (``tl.fma``): one rounding, as the reference (which forms them
  in float64) has.
* the only division is one correctly rounded ``1 / scale`` per group;
  rounding to integers uses the magic-number add/sub, whose low mantissa
  bits then hold the code.
* butterflies run in the order of ``echo_vllm.rotation.fwht`` (stride 1, 2,
  4, ...; outputs ``(a + b, a - b)``); a cross-lane one is
  ``fma(+-1, mine, partner)``, exactly ``a + b`` or ``a - b``.
* a power of two the reference multiplies by is folded into an operation
  the kernel makes anyway wherever that gives the same bits: stage 1's
  ``x * input_scale`` (exact for 16-bit inputs) into the first butterflies
  (:func:`fwht`'s ``PRESCALE``) or the add of the carried error; stage 2's
  ``2**-k`` and the output's ``OUTPUT_SCALE`` into the exponent under which
  the codes are unpacked (:func:`codes_of`'s ``UNIT``), the quantizer's
  multiplier and magic number (:func:`quantize`'s ``SHIFT``) and the
  ``fma`` that adds stage 2's error to the buffer.
* outputs saturate (``quant.saturate``): compiled, a 16-bit cast is one
  ``cvt.rn.satfinite`` per two values, as the plain cast.
* compiled, the output decode to bf16 of groups up to 32 runs in bf16x2
  (:func:`_packed_output_asm`, two values a register, about 6.5 instructions
  a value instead of 11) and gives the fp32 path's bits: with ``u =
  OUTPUT_SCALE`` (2) every intermediate is an integer multiple of ``u``
  of at most 256 in magnitude (8 significant bits), exact in bf16, so the
  butterflies may run in any order; a code decodes as ``magic | c`` =
  ``2**7 u + c u`` (the magic's unit in the last place is ``u``) and loses
  its offset in the first butterfly (``x0 - x1``; ``2 x0 - 2 off - (x0 -
  x1)``); the one rounding is ``(n u) * scale``, the exact real
  ``2 n * scale`` rounded to nearest even with subnormals kept -- the
  fp32 path's exact product then cast -- and ``min.NaN.xorsign.abs`` with
  bf16 max saturates it as ``cvt.rn.satfinite`` would (an infinity from
  the rounding becomes bf16 max, a NaN stays NaN). Taking ``u`` into the
  codes rather than into the scale keeps that true for every scale (a
  scale times 2 would overflow bf16 at the top of its range). Zero signs
  match (no intermediate is -0; ``+0 * scale + -0`` has the sign of the
  scale) and NaN scales give NaN as the fp32 path does.
  ``tests/kernels/test_packed_output.py`` runs the PTX in an emulator
  against the reference on every bf16 scale.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from triton import knobs

from ..quant import ALIGN_GROUPS as _ALIGN_GROUPS
from ..quant import BF16_SCALE_LIMIT as _BF16_SCALE_LIMIT
from ..quant import FEEDBACK_QMAX, clip_multipliers, code_bound, inv_qmax_f32
from ..quant import OUTPUT_SCALE as _OUTPUT_SCALE

#: Compiled (not Triton's interpreter): hardware conversions and lane shuffles.
COMPILED: tl.constexpr = tl.constexpr(not knobs.runtime.interpret)

#: Contiguous values per lane (16 bytes of bf16/fp16; one 32-bit word of codes).
V: tl.constexpr = tl.constexpr(8)
#: (y + RNE_MAGIC) - RNE_MAGIC rounds y to an integer, ties to even (|y| <= 2**22).
RNE_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
#: Smallest normal fp32: scales are clamped to it so 1/scale stays finite.
FLT_MIN: tl.constexpr = tl.constexpr(2.0**-126)
#: bf16 NaN written for the scale of a non-finite group (torch's NaN bits).
BF16_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC0)
#: bf16's largest finite value, as bits (what outputs saturate to).
BF16_MAX_BITS: tl.constexpr = tl.constexpr(0x7F7F)
#: Eight codes of value 0 (code 8 each): a non-finite group's word.
ZERO_WORD: tl.constexpr = tl.constexpr(0x88888888)
#: float(0x4B000000 | code) == 2**23 + code; minus this gives code - 8.
CODE_MAGIC: tl.constexpr = tl.constexpr(8388616.0)
#: Groups per block of the int8 feedback format (``quant.ALIGN_GROUPS``).
ALIGN_GROUPS: tl.constexpr = tl.constexpr(_ALIGN_GROUPS)
#: fp32(1/127): the int8 feedback format's scale multiplier (``quant.group_scales``).
FB_INV_QMAX: tl.constexpr = tl.constexpr(float(inv_qmax_f32(FEEDBACK_QMAX)))
#: A group whose unrounded scale reaches this is non-finite (``quant.BF16_SCALE_LIMIT``).
BF16_SCALE_LIMIT: tl.constexpr = tl.constexpr(_BF16_SCALE_LIMIT)
#: signed_mse's scale multipliers (``quant.clip_multipliers``; a kernel reads
#: them through :func:`_signed_mse_multipliers`), and the largest. Constexprs,
#: so that Triton's cache key holds their values.
SIGNED_MSE_MULTIPLIERS: tl.constexpr = tl.constexpr(clip_multipliers())
SIGNED_MSE_TOP: tl.constexpr = tl.constexpr(max(clip_multipliers()))
#: Per candidate, whether a clamp of its codes to -8 / 7 can act
#: (``quant.code_bound`` at 8.5 / 7.5); where not, it is left out, as absmax's.
SIGNED_MSE_CLAMPS: tl.constexpr = tl.constexpr(
    tuple((code_bound(m) >= 8.5, code_bound(m) >= 7.5) for m in clip_multipliers()))
#: log2 of ``quant.OUTPUT_SCALE``: decoded codes come out times 2**this.
LOG2_OUTPUT_SCALE: tl.constexpr = tl.constexpr(int(_OUTPUT_SCALE).bit_length() - 1)


# -- conversions -------------------------------------------------------------


@triton.jit
def bf16_bits_to_f32(bits):
    """uint16 bf16 bit patterns -> fp32 (exact)."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(v):
    """fp32 -> uint16 bf16 bits, round to nearest even (NaN -> 0x7FC0 in the
    interpreter, a hardware NaN when compiled)."""
    if COMPILED:
        return v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.uint16, bitcast=True)
    else:
        b = v.to(tl.uint32, bitcast=True)
        rounded = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
        return tl.where(v != v, BF16_NAN_BITS, rounded).to(tl.uint16)


@triton.jit
def to_f32(v):
    """Any float tile -> fp32 (exact)."""
    if v.dtype == tl.bfloat16:
        return bf16_bits_to_f32(v.to(tl.uint16, bitcast=True))
    else:
        return v.to(tl.float32)


@triton.jit
def from_f32(v, dtype: tl.constexpr):
    """fp32 -> ``dtype`` with round to nearest even."""
    if dtype == tl.bfloat16:
        return f32_to_bf16_bits(v).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        return v.to(tl.float16)
    else:
        return v


@triton.constexpr_function
def _finite_max(dtype) -> float:
    """The largest finite value of the float type ``dtype``."""
    if dtype.is_bf16():
        return float.fromhex("0x1.fep127")
    if dtype.is_fp16():
        return 65504.0
    return float.fromhex("0x1.fffffep127")


@triton.jit
def clamp_finite(v, dtype: tl.constexpr):
    """fp32 ``v`` clamped to ``dtype``'s finite range (NaN stays NaN)."""
    big: tl.constexpr = _finite_max(dtype)
    return tl.clamp(v, -big, big, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def saturate(v, dtype: tl.constexpr, PAIRS: tl.constexpr = False):
    """fp32 -> ``dtype`` as ``quant.saturate``: round to nearest even, values
    beyond the finite range (infinities too) to its largest finite value of
    their sign, NaN stays NaN. Compiled, on a tile in the lane layout
    (``PAIRS``: a lane's values in pairs), 16-bit types convert two values
    in one ``cvt.rn.satfinite`` (as the plain conversion, plus a byte
    permute a pair to put the halves in memory order); otherwise
    :func:`clamp_finite`, then the cast (the same bits)."""
    if COMPILED and PAIRS and dtype == tl.bfloat16:
        # cvt's first source goes to the upper half: element 1 ($2), element 0 ($1) below
        return tl.inline_asm_elementwise("cvt.rn.satfinite.bf16x2.f32 $0, $2, $1;", "=r,r,r", [v],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    elif COMPILED and PAIRS and dtype == tl.float16:
        return tl.inline_asm_elementwise("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;", "=r,r,r", [v],
                                         dtype=tl.float16, is_pure=True, pack=2)
    else:
        return from_f32(clamp_finite(v, dtype), dtype)


# -- addressing --------------------------------------------------------------
#
# Values are loaded and stored as [BG, G] (contiguous groups: Triton gives a
# lane 16 bytes, consecutive lanes the rest of the group) and reshaped to
# [BG, L, V] in registers, which moves no data. Words and scales are
# addressed as [BG, L] -- one word per lane, a group's scale read by each of
# its lanes and written by the first -- with their contiguity hidden
# (``max_contiguous`` 1): told the truth, Triton would give one lane a
# group's four words, which the registers do not hold there, and convert
# the tile through shared memory to get them.


@triton.jit
def value_offsets(first, lg, G: tl.constexpr):
    """int64 offsets ``[BG, G]`` of the values of groups ``lg`` of a buffer
    in wire order whose group 0 starts at ``first``."""
    return first + lg.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]


@triton.jit
def group_rows(lg, row_groups):
    """``(row, block)``: group ``m`` of every chunk lies in message row
    ``m // row_groups``, ``m % row_groups`` groups into the chunk's column
    block (the position-owned layout of ``quant``); the same for every chunk,
    so a kernel divides once per tile."""
    t = lg // row_groups
    return t, lg - t * row_groups


@triton.jit
def _row_index(t):
    """The row index ``t`` of each group, its regularity hidden from Triton
    (a ``mov``, free after ptxas), so that the offsets ``t * cols + c`` are
    contiguous along each group's values only, as they are for any width.
    Without it, Triton specializes ``cols == 1`` to a constant, sees
    consecutive groups as contiguous too, lays the load's threads out along
    the groups, re-materializes the butterflies' lane shuffles in that
    layout and pairs the wrong values: rows of width 1 came out ~g/8 times
    the true sum on the H200 (``tests/kernels/test_layouts.py`` checks every
    shuffle's layout). ``t * cols`` keeps the divisibility ``cols`` has."""
    if COMPILED and t.dtype == tl.int64:
        return tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [t], dtype=tl.int64, is_pure=True, pack=1)
    elif COMPILED:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [t], dtype=t.dtype, is_pure=True, pack=1)
    else:
        return t


@triton.jit
def message_offsets(j, lg, rows, row_groups, cols, msg_groups, G: tl.constexpr):
    """Offsets ``[BG, G]`` into the message ``[rows, cols]`` of groups ``lg``
    of chunk ``j`` (``rows`` = :func:`group_rows` of ``lg``), and their mask:
    the first column of group ``m`` is ``(j * row_groups + m % row_groups) * G``.
    Masked: padding groups (``m >= msg_groups``) and the zero columns past ``cols``."""
    t, b = rows
    col0 = (j * row_groups + b) * G
    e = tl.arange(0, G)[None, :]
    live = (lg < msg_groups)[:, None] & (col0[:, None] + e < cols)
    return (_row_index(t) * cols + col0)[:, None] + e, live


@triton.jit
def block_offsets(lg, rows, cols, msg_groups, G: tl.constexpr):
    """:func:`message_offsets` of groups ``lg`` split for a loop over chunks
    (computed once per tile, :func:`block_shift` once per chunk): ``(offsets
    [BG, G] of chunk 0, columns [BG, G] in the column block, live rows [BG, 1])``;
    the columns in int32 (a block has ``row_groups * G < 2**31``, checked by
    ``contract.message_ints``)."""
    t, b = rows
    c = b.to(tl.int32)[:, None] * G + tl.arange(0, G)[None, :]
    return _row_index(t)[:, None] * cols + c, c, (lg < msg_groups)[:, None]


@triton.jit
def block_shift(j, row_groups, cols, G: tl.constexpr):
    """``(d, limit)``: chunk ``j``'s offsets are :func:`block_offsets`' plus
    ``d``, its mask ``live & (columns < limit)`` (column ``d + c`` below
    ``cols``; ``limit`` clamped to the block to fit int32)."""
    d = j * tl.cast(row_groups, tl.int64) * G
    return d, tl.minimum(cols - d, row_groups * G).to(tl.int32)


@triton.jit
def as_lanes(t, G: tl.constexpr):
    """``[BG, G]`` -> ``[BG, L, V]`` (no data moves)."""
    return tl.reshape(t, (t.shape[0], G // V, V))


@triton.jit
def as_groups(t):
    """``[BG, L, V]`` -> ``[BG, G]`` (no data moves)."""
    return tl.reshape(t, (t.shape[0], t.shape[1] * t.shape[2]))


@triton.jit
def load_values(ptr, offs, mask, G: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
    """``[BG, L, V]`` values at ``offs [BG, G]`` (0 where masked); ``EVICT``: ``tl.load``'s ``eviction_policy``."""
    return as_lanes(tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT), G)


@triton.jit
def store_values(ptr, offs, mask, v):
    """Store ``v [BG, L, V]`` at ``offs [BG, G]``."""
    tl.store(ptr + offs, as_groups(v), mask=mask)


@triton.jit
def _opaque(offs):
    """``offs`` with its contiguity and constancy hidden from Triton (see above)."""
    return tl.max_constancy(tl.max_contiguous(offs, (1, 1)), (1, 1))


@triton.constexpr_function
def _log2(n: int) -> int:
    """log2 of the power of two ``n``."""
    return n.bit_length() - 1


@triton.jit
def _lane_grid(lg, G: tl.constexpr):
    """``(word offsets [BG, L], scale offsets [BG, L], lane [BG, L])`` of
    groups ``lg`` (in words and in scales), their regularity hidden."""
    L: tl.constexpr = G // V
    lane = tl.arange(0, L)[None, :] + tl.zeros(lg.shape, tl.int32)[:, None]
    wi = _opaque(lg.to(tl.int64)[:, None] * L + lane)
    # wi // L as a shift (wi >= 0, L a power of two): // of a signed int64
    # costs a sign fixup the compiler cannot prove away
    return wi, wi >> _log2(L), lane


@triton.jit
def chunk_words(buf_ptr, chunk_first):
    """The payload of the chunk at byte ``chunk_first`` of ``buf_ptr`` as
    32-bit words (chunks start at multiples of 16 bytes)."""
    return tl.multiple_of((buf_ptr + chunk_first).to(tl.pointer_type(tl.uint32)), 4)


@triton.jit
def chunk_scales(buf_ptr, chunk_first, payload_bytes):
    """The bf16 scales (as uint16 bits) of the chunk at byte ``chunk_first``."""
    return (buf_ptr + chunk_first + payload_bytes).to(tl.pointer_type(tl.uint16))


# -- the feedback buffer -----------------------------------------------------
#
# The formats of ``quant`` (module docstring), told apart by the element
# type of the buffer's pointer: float32 / bfloat16 hold value ``i`` at
# element ``i`` (``value_offsets``); int8 holds blocks of ``ALIGN_GROUPS``
# groups, ``[8 G codes | 8 bf16 scales]``. A lane's ``V`` codes are ``V``
# contiguous bytes (one 64-bit access) and its group's scale is read by each
# of the group's lanes and written by the first, as on the wire, so every
# int8 tensor stays in the lane layout (the shuffles stay valid).


@triton.jit
def _fb_int8_grid(first, lg, G: tl.constexpr):
    """``(code offsets [BG, G] in bytes, scale offsets [BG, L] in bf16s, lane
    [BG, L])`` of groups ``lg`` of an int8 buffer whose group 0 starts at
    value ``first`` (a block's first value: chunks are whole blocks). Group
    ``m``'s codes start at byte ``m * G + (m // 8) * 16`` (its block's
    predecessors' scales before it), its scale is bf16 ``(m // 8) * (4 G + 8)
    + 4 G + m % 8``."""
    m = first // G + lg.to(tl.int64)
    b = m // ALIGN_GROUPS
    co = (m * G + b * 16)[:, None] + tl.arange(0, G)[None, :]
    # 8 contiguous bytes per lane: told the group's G, Triton would give a lane 16
    co = tl.max_contiguous(co, (1, V))
    _, _, lane = _lane_grid(lg, G)
    si = _opaque(tl.broadcast_to((b * (4 * G + 8) + 4 * G + (m - b * ALIGN_GROUPS))[:, None], lane.shape))
    return co, si, lane


@triton.jit
def load_feedback(fb_ptr, first, lg, gmask, G: tl.constexpr):
    """The carried errors of groups ``lg`` (group 0 at value ``first`` of the
    buffer; 0 where not ``gmask [BG]``) as stored: ``[BG, L, V]`` of the
    buffer's float type, or for int8 ``(codes int8 [BG, L, V], scale bits
    uint16 [BG, L])``. :func:`feedback_values` makes fp32 of either: apart,
    so that a tile loaded ahead is held in its compact form."""
    if fb_ptr.dtype.element_ty == tl.int8:
        co, si, _ = _fb_int8_grid(first, lg, G)
        codes = as_lanes(tl.load(fb_ptr + co, mask=gmask[:, None], other=0), G)
        return codes, _load_u16(fb_ptr.to(tl.pointer_type(tl.uint16)) + si, tl.broadcast_to(gmask[:, None], si.shape))
    else:
        return load_values(fb_ptr, value_offsets(first, lg, G), gmask[:, None], G)


@triton.jit
def feedback_values(fb_ptr, e):
    """fp32 ``[BG, L, V]`` of ``e`` as :func:`load_feedback` of ``fb_ptr``
    returned it, as ``quant.read_feedback``: int8 ``code * scale`` (exact in
    fp32, and rounded apart from any sum, as the reference has it)."""
    if fb_ptr.dtype.element_ty == tl.int8:
        codes, s_bits = e
        return codes.to(tl.float32) * bf16_bits_to_f32(s_bits)[:, :, None]
    else:
        return to_f32(e)


@triton.jit
def store_feedback(fb_ptr, first, lg, gmask, e, FINITE: tl.constexpr = False):
    """Store fp32 errors ``e [BG, L, V]`` of groups ``lg`` (masked by ``gmask
    [BG]``, addressed as by :func:`load_feedback`) in the buffer's format, as
    ``quant.write_feedback``: rounded to its float type, or int8-encoded as
    ``quant.encode_feedback`` (scale from :func:`group_scale` with qmax 127;
    NaN scale and codes 0 for a non-finite group). ``FINITE``: the caller
    guarantees every value finite (a quantizer's error), so no group needs
    the non-finite case's selects."""
    G: tl.constexpr = e.shape[1] * e.shape[2]
    if fb_ptr.dtype.element_ty == tl.int8:
        good, t_bits, _, inv = group_scale(e, FB_INV_QMAX)
        # e / t + 1.5 * 2**23 = 1.5 * 2**23 + round(e / t) exactly: its low
        # byte is the code in two's complement (no clamp: quant's docstring)
        y = (e * inv[:, None, None] + RNE_MAGIC).to(tl.int32, bitcast=True)
        if not FINITE:
            y = tl.where(good[:, None, None], y, 0)
            t_bits = tl.where(good, t_bits, BF16_NAN_BITS).to(tl.uint16)
        co, si, lane = _fb_int8_grid(first, lg, G)
        tl.store(fb_ptr + co, as_groups(y.to(tl.int8)), mask=gmask[:, None])
        _store_u16(fb_ptr.to(tl.pointer_type(tl.uint16)) + si, tl.broadcast_to(t_bits[:, None], si.shape),
                   gmask[:, None] & (lane == 0))
    else:
        store_values(fb_ptr, value_offsets(first, lg, G), gmask[:, None], from_f32(e, fb_ptr.dtype.element_ty))


# -- rotation ----------------------------------------------------------------


@triton.constexpr_function
def lanes_hold(*dtypes) -> bool:
    """Whether a tile whose loads and stores move elements of ``dtypes``
    stays in the lane layout (so :func:`lane_partner` may shuffle, and no
    load is converted through shared memory): 16-bit values or int8
    feedback codes, 8 a lane; a 32-bit access gives a lane 4 values."""
    return all(d.primitive_bitwidth <= 16 for d in dtypes)


@triton.jit
def lane_partner(v, M: tl.constexpr, L: tl.constexpr, SHUFFLE: tl.constexpr):
    """The value at the same position of lane ``lane ^ M`` of the group: one
    ``shfl.sync.bfly`` when compiled and ``SHUFFLE`` (the tile is in the lane
    layout: a group's lanes on consecutive lanes of a warp), otherwise a
    flip of that lane pair's values, which Triton lowers for any layout.
    Callers pass ``SHUFFLE`` only where :func:`lanes_hold` for every tensor
    of the tile: a 32-bit load gives a lane 4 values, Triton may lay the
    whole tile out that way, and the lane arithmetic no longer holds (seen
    on the H200 with fp32 feedback)."""
    if COMPILED and SHUFFLE:
        bits = v.to(tl.int32, bitcast=True)
        if M == 1:
            p = tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 1, 0x1f, -1;", "=r,r", [bits],
                                          dtype=tl.int32, is_pure=True, pack=1)
        elif M == 2:
            p = tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, -1;", "=r,r", [bits],
                                          dtype=tl.int32, is_pure=True, pack=1)
        elif M == 4:
            p = tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, -1;", "=r,r", [bits],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            tl.static_assert(M == 8, "groups span at most 16 lanes")
            p = tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 8, 0x1f, -1;", "=r,r", [bits],
                                          dtype=tl.int32, is_pure=True, pack=1)
        return p.to(tl.float32, bitcast=True)
    else:
        BG: tl.constexpr = v.shape[0]
        w = tl.flip(tl.reshape(v, (BG, L // (2 * M), 2, M, V)), 2)
        return tl.reshape(w, (BG, L, V))


@triton.jit
def fwht(v, G: tl.constexpr, SHUFFLE: tl.constexpr = False, PRESCALE: tl.constexpr = 1.0):
    """Unnormalized Walsh-Hadamard transform of each group of ``v [BG, L, V]``,
    butterfly for butterfly as ``echo_vllm.rotation.fwht``: strides below
    ``V`` in registers (split/join), the others across lanes (shuffles when
    ``SHUFFLE``, see :func:`lane_partner`).

    ``PRESCALE`` (a power of two): the transform of ``v * PRESCALE``, the
    products fused into the first butterflies, ``fma(b, c, a * c)`` and
    ``fma(b, -c, a * c)`` (one instruction a pair more than the plain
    butterflies, half of a multiply per value): the bits of ``fwht(v * c)``
    wherever ``a * c`` is exact, i.e. for every value of a 16-bit input
    (the caller's business: an fp32 input multiplies first)."""
    BG: tl.constexpr = v.shape[0]
    L: tl.constexpr = G // V
    for i in tl.static_range(3):  # strides h = 1, 2, 4 (V = 8)
        w = tl.permute(tl.reshape(v, (BG, L, V // (2 << i), 2, 1 << i)), (0, 1, 2, 4, 3))
        a, b = tl.split(w)
        if i == 0 and PRESCALE != 1.0:
            ac = a * PRESCALE  # in a's register: the pair needs no third one
            v = tl.reshape(tl.permute(tl.join(tl.fma(b, PRESCALE, ac), tl.fma(b, -PRESCALE, ac)), (0, 1, 2, 4, 3)),
                           (BG, L, V))
        else:
            v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 2, 4, 3)), (BG, L, V))
    lane = tl.arange(0, L)[None, :, None]
    for i in tl.static_range(4):  # strides 8, 16, 32, 64: lane masks 1, 2, 4, 8
        if (1 << i) < L:
            # the lower lane of a pair holds a (a + b = mine + partner), the
            # upper b (a - b = partner - mine); +-1 * mine is exact
            v = tl.fma(tl.where((lane & (1 << i)) == 0, 1.0, -1.0), v, lane_partner(v, 1 << i, L, SHUFFLE))
    return v


# -- sign flips --------------------------------------------------------------
#
# ``FLIPS`` (``rotation.sign_flips``: bit ``i`` set where value ``i`` of every
# group is negated) is a compile-time constant: a lane's eight sign bits are
# its byte of the pattern (lane ``l`` holds values ``8 l .. 8 l + 7``), built
# per lane from ``tl.arange`` and constants (loop-invariant: computed once per
# program), and a value is flipped by one XOR of its sign bit -- exactly the
# reference's product by -1, but for the sign of a NaN, which the
# comparisons ignore. ``FLIPS = 0`` compiles to nothing.


@triton.constexpr_function
def _flip_word(FLIPS: int, i: int) -> int:
    """Bits ``32 i .. 32 i + 31`` of ``FLIPS`` (lanes ``4 i .. 4 i + 3``'s
    bytes) as a signed int32."""
    w = (FLIPS >> (32 * i)) & 0xFFFFFFFF
    return w - (1 << 32) if w >> 31 else w


@triton.jit
def _flip_masks(FLIPS: tl.constexpr, L: tl.constexpr):
    """uint32 ``[1, L, V]``: the fp32 sign bit where ``FLIPS`` flips value
    ``k`` of lane ``l`` (bit ``8 l + k``), else 0."""
    lane = tl.arange(0, L)[None, :]
    w = tl.full(lane.shape, _flip_word(FLIPS, 0), tl.int32)
    for i in tl.static_range(1, L // 4):
        w = tl.where((lane >> 2) == i, _flip_word(FLIPS, i), w)
    b = (w >> ((lane & 3) * 8)).to(tl.uint32, bitcast=True)  # bit k: value k of the lane
    return _values8(b << 31, b << 30, b << 29, b << 28, b << 27, b << 26, b << 25, b << 24) & 0x80000000


@triton.jit
def flip(v, FLIPS: tl.constexpr):
    """``v [BG, L, V]`` (fp32 or a 16-bit float) with value ``i`` of every
    group negated where ``FLIPS`` has bit ``i`` set, as ``quant._flip``;
    ``v`` itself for ``FLIPS = 0``."""
    if FLIPS != 0:
        m = _flip_masks(FLIPS, v.shape[1])
        if v.dtype == tl.float32:
            return (v.to(tl.uint32, bitcast=True) ^ m).to(tl.float32, bitcast=True)
        else:
            return (v.to(tl.uint16, bitcast=True) ^ (m >> 16).to(tl.uint16)).to(v.dtype, bitcast=True)
    else:
        return v


# -- quantization ------------------------------------------------------------


@triton.jit
def nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def group_amax(u):
    """``[BG]`` max of ``|u|`` over each group; NaN if the group holds a NaN."""
    return tl.reduce(tl.reduce(tl.abs(u), 2, nan_max), 1, nan_max)


@triton.jit
def group_scale(u, INV_QMAX: tl.constexpr):
    """``(good, scale bits uint16, scale fp32, 1 / scale)``, each ``[BG]``, of
    the groups of fp32 ``u [BG, L, V]`` for codes in ``[-qmax, qmax]``, as
    ``quant.group_scales`` (``INV_QMAX``: its multiplier, ``fp32(1/qmax) *
    2**shift``): ``bf16(max(amax * INV_QMAX, FLT_MIN))``, one correctly
    rounded division; ``good`` false for a group holding NaN or Inf or whose
    scale would round to infinity (the caller replaces its bits by NaN)."""
    amax = group_amax(u)
    s32 = amax * INV_QMAX
    good = s32 < BF16_SCALE_LIMIT  # false for inf and NaN too
    s_bits = f32_to_bf16_bits(tl.maximum(s32, FLT_MIN))
    s = bf16_bits_to_f32(s_bits)
    return good, s_bits, s, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def quantize(u, INV_QMAX: tl.constexpr, SHIFT: tl.constexpr = 0, ENCODER: tl.constexpr = "absmax",
             SHUFFLE: tl.constexpr = False):
    """Group-quantize fp32 ``u [BG, L, V]`` as ``quant.quantize_groups``
    with ``ENCODER`` (round to nearest; ``u`` holds the values times
    ``2**-SHIFT``: the scale's multiplier and the rounding's magic number are
    scaled, nothing else). ``INV_QMAX``: absmax's ``fp32(1/qmax)``; signed_mse
    (:func:`_quantize_signed_mse`, whose lane sums shuffle when ``SHUFFLE``)
    quantizes for the 4-bit wire with :data:`SIGNED_MSE_MULTIPLIERS`.

    Returns ``(words uint32 [BG, L], scale bits uint16 [BG] or [BG, L], err
    fp32 [BG, L, V])``: a lane's ``V`` codes packed in one word (value ``k``
    in bits ``4k..4k+3``); signed_mse's scale bits per lane (the same on
    each of a group's lanes). absmax leaves out the reference's clamp of
    ``u / scale`` to ``[-qmax, qmax]``: ``scale >= amax / qmax * (1 -
    2**-9)`` bounds it by ``qmax + 0.03``, which rounds to ``qmax`` anyway.
    """
    if ENCODER == "signed_mse":
        return _quantize_signed_mse(u, SHIFT, SHUFFLE)
    else:
        tl.static_assert(ENCODER == "absmax", "encoders: absmax, signed_mse")
        good, s_bits, s, inv = group_scale(u, INV_QMAX * 2.0 ** SHIFT)
        MAGIC: tl.constexpr = RNE_MAGIC * 2.0 ** -SHIFT
        t = u * inv[:, None, None] + MAGIC
        r = t - MAGIC
        err = tl.where(good[:, None, None], tl.fma(r, -s[:, None, None], u), 0.0)
        # t = 1.5 * 2**(23 - SHIFT) + r exactly, its last place 2**-SHIFT: its
        # low 4 bits are the code's r mod 16, and (r mod 16) ^ 8 = r + 8, the code
        words = tl.where(good[:, None], pack_codes(t.to(tl.uint32, bitcast=True) & 0xF) ^ ZERO_WORD, ZERO_WORD)
        return words, tl.where(good, s_bits, BF16_NAN_BITS).to(tl.uint16), err


@triton.jit
def _umax(a, b):
    return tl.maximum(a, b)


@triton.jit
def _round_product(u, inv, MAGIC: tl.constexpr):
    """``MAGIC + round_half_even(u * inv)``, rounded to ``MAGIC``'s last place,
    of the exact product (``quant._nearest`` for signed_mse): one ``fma``
    compiled; in Triton's interpreter, whose ``fma`` rounds twice, the
    product is formed in float64 (exact) and rounded there by float64's own
    magic number in the same unit."""
    if COMPILED:
        return tl.fma(u, inv, MAGIC)
    else:
        W: tl.constexpr = MAGIC * 2.0**29  # 1.5 * 2**52 units: rounds to the unit in float64
        q = (u.to(tl.float64) * inv.to(tl.float64) + W) - W
        return (q + MAGIC).to(tl.float32)


@triton.jit
def _register_sum(v):
    """``[BG, L, V]`` -> ``[BG, L]``: each lane's ``V`` values summed as
    ``quant.tree_sum`` (pairs ``2i, 2i + 1``, then pairs of those), in registers."""
    BG: tl.constexpr = v.shape[0]
    L: tl.constexpr = v.shape[1]
    a, b = tl.split(tl.reshape(v, (BG, L, V // 2, 2)))
    a, b = tl.split(tl.reshape(a + b, (BG, L, V // 4, 2)))
    a, b = tl.split(a + b)
    return a + b


@triton.constexpr_function
def _shuffle_asm(M) -> str:
    """PTX of a butterfly shuffle with lane mask ``M``."""
    return f"shfl.sync.bfly.b32 $0, $1, {M}, 0x1f, -1;"


@triton.jit
def lane_sum(s, SHUFFLE: tl.constexpr):
    """``[BG, L]`` lane partials -> each lane holds its group's sum, added as
    ``quant.tree_sum`` (lane pairs ``lane ^ 1``, then ``lane ^ 2``, ...;
    ``mine + partner`` gives both lanes the same bits). The partner's value
    travels as bits: a flip (:func:`lane_partner` without ``SHUFFLE``)
    multiplies by 0 and 1, which would make NaN of an infinite sum."""
    BG: tl.constexpr = s.shape[0]
    L: tl.constexpr = s.shape[1]
    for i in tl.static_range(4):  # lane masks 1, 2, 4, 8
        if (1 << i) < L:
            bits = s.to(tl.int32, bitcast=True)
            if COMPILED and SHUFFLE:
                p = tl.inline_asm_elementwise(_shuffle_asm(1 << i), "=r,r", [bits], dtype=tl.int32, is_pure=True,
                                              pack=1)
            else:
                p = tl.reshape(tl.flip(tl.reshape(bits, (BG, L // (2 << i), 2, 1 << i)), 2), (BG, L))
            s = s + p.to(tl.float32, bitcast=True)
    return s


@triton.jit
def reciprocal(s):
    """``fp32(1 / s)``, correctly rounded (``quant.group_scales``' ``inv``):
    compiled, one ``rcp.rn.f32`` (a few instructions fewer than the
    division ``div_rn`` makes of ``1 / s``)."""
    if COMPILED:
        return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=r,r", [s], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.constexpr_function
def _signed_mse_multipliers() -> tuple:
    """:data:`SIGNED_MSE_MULTIPLIERS`, as a tuple a kernel can index."""
    return SIGNED_MSE_MULTIPLIERS.value


@triton.constexpr_function
def _signed_mse_clamps(k) -> tuple:
    """``(lower, upper)``: whether candidate ``k`` of signed_mse needs its
    codes clamped to -8 / 7 (:data:`SIGNED_MSE_CLAMPS`); ``k = -1``: whether
    any candidate does."""
    if k < 0:
        return tuple(any(c[i] for c in SIGNED_MSE_CLAMPS.value) for i in (0, 1))
    return SIGNED_MSE_CLAMPS.value[k]


@triton.jit
def _signed_codes(u, inv, s, SHIFT: tl.constexpr, LOWER: tl.constexpr, UPPER: tl.constexpr):
    """``(t, err)`` of the scale ``s`` (``inv = 1 / s``, both broadcast to
    ``u``): ``t = MAGIC + clamp(round(u * inv), -8, 7)`` (the clamps that
    can act, ``LOWER`` / ``UPPER``), ``err = u - (t - MAGIC) * s``."""
    MAGIC: tl.constexpr = RNE_MAGIC * 2.0 ** -SHIFT
    t = _round_product(u, inv, MAGIC)
    if UPPER:
        t = tl.minimum(t, MAGIC + 7.0 * 2.0 ** -SHIFT)
    if LOWER:
        t = tl.maximum(t, MAGIC - 8.0 * 2.0 ** -SHIFT)
    return t, tl.fma(t - MAGIC, -s, u)


@triton.jit
def _quantize_signed_mse(u, SHIFT: tl.constexpr, SHUFFLE: tl.constexpr):
    """:func:`quantize` for signed_mse (``quant._signed_mse_scales``): the
    scale's sign puts the group's largest-magnitude value on code -8; each
    candidate ratio (``quant.clip_multipliers``) is quantized from the same
    registers for its :func:`lane_sum` of squared errors, and the first
    with the least is quantized again to keep (a later one where strictly
    less): fewer registers than carrying each candidate's codes and errors.
    The largest magnitude and its sign come from one unsigned max of each
    value's bits rotated left by one (magnitude above, sign as the last bit:
    a tie goes to the negative value; NaN and Inf rank above every finite
    value). A clamp to [-8, 7] is left out where it cannot act
    (:data:`SIGNED_MSE_CLAMPS`). Scale bits come back per lane when there
    are several candidates (each lane chose for its group), per group for one."""
    M: tl.constexpr = _signed_mse_multipliers()
    CLAMPS: tl.constexpr = _signed_mse_clamps(-1)
    bits = u.to(tl.uint32, bitcast=True)
    key = tl.reduce(tl.reduce((bits << 1) | (bits >> 31), 2, _umax), 1, _umax)
    top = (key >> 1) | (key << 31)  # the bits of the largest-magnitude value
    amax = (top & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    good = amax * (SIGNED_MSE_TOP * 2.0 ** SHIFT) < BF16_SCALE_LIMIT  # false for Inf and NaN too
    sign = (((top >> 16) & 0x8000) ^ 0x8000).to(tl.uint16)  # the scale's: opposite to the value's
    for k in tl.static_range(len(M)):
        s_bits = f32_to_bf16_bits(tl.maximum(amax * (M[k] * 2.0 ** SHIFT), FLT_MIN)) | sign
        s = bf16_bits_to_f32(s_bits)
        inv = reciprocal(s)
        if len(M) == 1:
            s_best, sf_best, inv_best = s_bits, s[:, None], inv[:, None]
        else:
            _, err = _signed_codes(u, inv[:, None, None], s[:, None, None], SHIFT, _signed_mse_clamps(k)[0],
                                   _signed_mse_clamps(k)[1])
            sse = lane_sum(_register_sum(err * err), SHUFFLE)
            if k == 0:
                sse_best = sse
                s_best = tl.broadcast_to(s_bits[:, None], sse.shape)
                sf_best = tl.broadcast_to(s[:, None], sse.shape)
                inv_best = tl.broadcast_to(inv[:, None], sse.shape)
            else:
                better = sse < sse_best
                sse_best = tl.where(better, sse, sse_best)
                s_best = tl.where(better, s_bits[:, None], s_best)
                sf_best = tl.where(better, s[:, None], sf_best)
                inv_best = tl.where(better, inv[:, None], inv_best)
    t, err = _signed_codes(u, inv_best[:, :, None], sf_best[:, :, None], SHIFT, CLAMPS[0], CLAMPS[1])
    # the codes are t's low 4 bits, as for absmax (r in [-8, 7]: (r mod 16) ^ 8 = r + 8)
    words = tl.where(good[:, None], pack_codes(t.to(tl.uint32, bitcast=True) & 0xF) ^ ZERO_WORD, ZERO_WORD)
    good_s = good if len(M) == 1 else good[:, None]
    return words, tl.where(good_s, s_best, BF16_NAN_BITS).to(tl.uint16), tl.where(good[:, None, None], err, 0.0)


@triton.jit
def pack_codes(nib):
    """``[BG, L, V]`` uint32 nibbles -> ``[BG, L]`` words (value ``k`` in
    bits ``4k..4k+3``), in registers (no layout of its own: split, not a
    tensor of shift amounts)."""
    BG: tl.constexpr = nib.shape[0]
    L: tl.constexpr = nib.shape[1]
    lo, hi = tl.split(tl.reshape(nib, (BG, L, 4, 2)))
    lo, hi = tl.split(tl.reshape(lo | (hi << 4), (BG, L, 2, 2)))
    lo, hi = tl.split(lo | (hi << 8))
    return lo | (hi << 16)


@triton.jit
def _values8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight ``[BG, L]`` tensors -> ``[BG, L, 8]`` (value k from ``vk``).
    Joins only add register dimensions to the operands' layout; nested as
    here, the flattened order is v0..v7 (a tensor of per-value constants
    would bring a layout of its own and a conversion)."""
    a = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    b = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(a, b), (v0.shape[0], v0.shape[1], V))


@triton.constexpr_function
def _field_exponent(UNIT: int) -> int:
    """The fp32 exponent bits of 2**(23 + UNIT): a 23-bit mantissa under
    them counts in units of 2**UNIT."""
    return (127 + 23 + UNIT) << 23


@triton.jit
def _nibble_fields(words, UNIT: tl.constexpr = 0):
    """``(lo, hi)``: the word's low and high 16 bits as the mantissa of
    2**(23 + UNIT) (exponent bits set): one AND then isolates a code in
    place, in units of 2**UNIT."""
    E: tl.constexpr = _field_exponent(UNIT)
    return (words & 0xFFFF) | E, (words >> 16) | E


@triton.jit
def _code_shifted(fields, K: tl.constexpr, UNIT: tl.constexpr = 0):
    """``(code - 8) * 16**(K % 4) * 2**UNIT`` of value ``K`` of each word
    (exact): float(2**(23 + UNIT) + code * 16**k * 2**UNIT) minus its
    offset, the code masked in place in its 16-bit half
    (:func:`_nibble_fields` of the same ``UNIT``): one AND, no shift."""
    lo, hi = fields
    w = lo if K < 4 else hi
    k: tl.constexpr = K % 4
    E: tl.constexpr = _field_exponent(UNIT)
    return (w & (E | (0xF << (4 * k)))).to(tl.float32, bitcast=True) - (2.0 ** (23 + UNIT) + 8.0 * (16 ** k) * 2.0 ** UNIT)


@triton.jit
def _code(fields, K: tl.constexpr, UNIT: tl.constexpr = 0):
    """``(code - 8) * 2**UNIT`` of value ``K`` (exact): :func:`_code_shifted` times 16**-k."""
    return _code_shifted(fields, K, UNIT) * (1.0 / (16 ** (K % 4)))


@triton.jit
def codes_of(words, UNIT: tl.constexpr = 0):
    """``[BG, L]`` words -> ``[BG, L, V]`` fp32 ``(code - 8) * 2**UNIT``
    (exact; the power of two costs nothing: :func:`_nibble_fields`)."""
    f = _nibble_fields(words, UNIT)
    return _values8(_code(f, 0, UNIT), _code(f, 1, UNIT), _code(f, 2, UNIT), _code(f, 3, UNIT), _code(f, 4, UNIT),
                    _code(f, 5, UNIT), _code(f, 6, UNIT), _code(f, 7, UNIT))


# -- the wire ----------------------------------------------------------------


@triton.jit
def _store_u16(ptrs, values, mask):
    """``tl.store`` of 16-bit values in the layout they are in: compiled, one
    predicated ``st.global.b16`` per element, so Triton picks no layout of
    its own for the scales (which would cost a conversion through shared
    memory and a barrier per tile)."""
    if COMPILED:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b16 [$1], $2; mov.u32 $0, 0; }", "=r,l,h,r",
            [ptrs.to(tl.uint64, bitcast=True), values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def _load_u16(ptrs, mask):
    """``tl.load`` of 16-bit values (0 where masked) in the layout of ``ptrs``
    (see :func:`_store_u16`); a plain weak load, ordered by the barriers' fences."""
    if COMPILED:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u16 $0, 0; @p ld.global.b16 $0, [$1]; }", "=h,l,r",
            [ptrs.to(tl.uint64, bitcast=True), mask.to(tl.int32)], dtype=tl.uint16, is_pure=False, pack=1)
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def store_chunk_groups(buf_ptr, chunk_first, payload_bytes, lg, gmask, words, s_bits, G: tl.constexpr):
    """Write groups ``lg`` of the chunk at byte ``chunk_first``: their words
    (``[BG, L]``), then their scales (``[BG]`` or per lane ``[BG, L]``; the
    first lane of a group writes it) at ``payload_bytes + 2 * lg``."""
    wi, si, lane = _lane_grid(lg, G)
    m = gmask[:, None]
    tl.store(chunk_words(buf_ptr, chunk_first) + wi, words, mask=m)
    _store_u16(chunk_scales(buf_ptr, chunk_first, payload_bytes) + si, _per_lane(s_bits, wi), m & (lane == 0))


@triton.jit
def _per_lane(s, like):
    """A group's value ``s`` (``[BG]``, or ``[BG, L]`` already per lane) on each of its lanes, as ``like [BG, L]``."""
    if len(s.shape) == 1:
        return tl.broadcast_to(s[:, None], like.shape)
    else:
        return s


@triton.jit
def chunk_lanes(buf_ptr, chunk_first, payload_bytes, lg, G: tl.constexpr):
    """``(word pointers [BG, L], scale pointers [BG, L])`` of groups ``lg`` of
    the chunk at byte ``chunk_first`` (a group's scale on each of its lanes)."""
    wi, si, _ = _lane_grid(lg, G)
    return chunk_words(buf_ptr, chunk_first) + wi, chunk_scales(buf_ptr, chunk_first, payload_bytes) + si


@triton.jit
def load_lanes(wp, sp, gmask, EVICT: tl.constexpr = tl.constexpr("")):
    """``(words [BG, L], scales fp32 [BG, L])`` at the pointers of
    :func:`chunk_lanes` (0 where ``gmask`` is false); ``EVICT``: the words'
    ``eviction_policy``."""
    m = gmask[:, None]
    return tl.load(wp, mask=m, other=0, eviction_policy=EVICT), bf16_bits_to_f32(_load_u16(sp, m))


@triton.jit
def load_chunk_groups(buf_ptr, chunk_first, payload_bytes, lg, gmask, G: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
    """Read groups ``lg`` of the chunk at byte ``chunk_first``: ``(words [BG, L],
    scales fp32 [BG, L])`` (a group's scale on each of its lanes; ``EVICT``: :func:`load_lanes`')."""
    wp, sp = chunk_lanes(buf_ptr, chunk_first, payload_bytes, lg, G)
    return load_lanes(wp, sp, gmask, EVICT)


@triton.jit
def accumulate_chunk(acc, wp, sp, gmask, UNIT: tl.constexpr = 0):
    """``acc + dequant(chunk groups) * 2**UNIT`` at the pointers of
    :func:`chunk_lanes` with one rounding per value (the product of a code
    and a scale is exact). Value k's code comes scaled by 16**(k % 4) * 2**UNIT
    (:func:`_code_shifted`) and meets the scale times 16**-(k % 4) (exact:
    a power of two, kept subnormal if need be): the same product, one
    instruction fewer per value."""
    words, s = load_lanes(wp, sp, gmask)
    s1, s2, s3 = s * 0.0625, s * 0.00390625, s * 0.000244140625
    f = _nibble_fields(words, UNIT)
    q = _values8(_code_shifted(f, 0, UNIT), _code_shifted(f, 1, UNIT), _code_shifted(f, 2, UNIT),
                 _code_shifted(f, 3, UNIT), _code_shifted(f, 4, UNIT), _code_shifted(f, 5, UNIT),
                 _code_shifted(f, 6, UNIT), _code_shifted(f, 7, UNIT))
    return tl.fma(q, _values8(s, s1, s2, s3, s, s1, s2, s3), acc)


# -- the output decode in bf16x2 --------------------------------------------
#
# Compiled, for bf16 output of groups up to 32 values, a lane's eight values
# are decoded, rotated and scaled two at a time in bf16x2 registers by one
# inline-PTX block (:func:`_packed_output_asm`); the fp32 path of
# :func:`decode_output` gives the same bits (tile docstring, Arithmetic).


@triton.constexpr_function
def _bf16x2(x: float) -> int:
    """Both halves of a 32-bit word hold the bf16 ``x`` (a normal bf16 or a zero)."""
    m, e = math.frexp(math.fabs(x))  # |x| = m * 2**e, 1/2 <= m < 1
    bits = (e + 126) << 7 | int(m * 256 - 128) if x != 0 else 0
    bits |= 0x8000 if math.copysign(1.0, x) < 0 else 0
    return bits | bits << 16


@triton.constexpr_function
def _packed_top() -> tuple[float, float]:
    """``(top, u)``: a power of two and its bf16 unit in the last place,
    ``u = quant.OUTPUT_SCALE`` (with rotation or without)."""
    u = 2.0 ** LOG2_OUTPUT_SCALE.value
    return 2.0**7 * u, u


@triton.constexpr_function
def _packed_magic() -> int:
    """bf16x2 ``top`` (:func:`_packed_top`): ``magic | c`` in a half is
    ``top + c * u``, exactly."""
    return _bf16x2(_packed_top()[0])


@triton.constexpr_function
def _packed_offset() -> float:
    """``top + 8 u``: a decoded half minus this is ``(code - 8) * u``."""
    top, u = _packed_top()
    return top + 8.0 * u


@triton.constexpr_function
def _bf16x2_bits(b: int) -> int:
    """Both halves of a 32-bit word hold the bf16 of bits ``b``."""
    return b | b << 16


@triton.constexpr_function
def _fma(d: str, a: str, b: str, c: str) -> str:
    """``d = a * b + c`` on both halves, rounded once."""
    return f"fma.rn.bf16x2 {d}, {a}, {b}, {c}; "


@triton.constexpr_function
def _packed_output_asm(G: int, HADAMARD: bool) -> str:
    """PTX for one lane: ``$0..$3`` the outputs (values ``2k, 2k + 1`` in
    register ``k``), ``$4..$7`` the lane's word shifted right by ``4 k``
    (the codes of values ``k, k + 4`` in bits 0..3 and 16..19), ``$12`` the
    scale in both halves, ``$16`` and ``$24`` the butterfly signs of lane
    masks 1 and 2 (:func:`_lane_signs`). All arithmetic is ``fma.rn.bf16x2``
    (sm_80 has no bf16x2 add or mul; ptxas picks HADD2/HMUL2 where it can),
    but the saturation: ``min.NaN.xorsign.abs.bf16x2`` with bf16 max, the
    magnitude clamped, the sign and NaN kept (sm_86 and later)."""
    off = _packed_offset()
    consts = (f"magic, {_packed_magic():#010x}", f"one, {_bf16x2(1.0):#010x}",
              f"mone, {_bf16x2(-1.0):#010x}", f"two, {_bf16x2(2.0):#010x}", f"mzero, {_bf16x2(-0.0):#010x}",
              f"moff, {_bf16x2(-off):#010x}", f"moff2, {_bf16x2(-2.0 * off):#010x}",
              f"big, {_bf16x2_bits(BF16_MAX_BITS.value):#010x}")
    asm = ("{ .reg .b32 magic, one, mone, two, mzero, moff, moff2, big, p, e, x0, x1, x2, x3, a0, a1, a2, a3, "
           "b0, b1, b2, b3, m0, m1, m2, m3, y0, y1, y2, y3, z0, z1, z2, z3; "
           + "".join(f"mov.b32 {c}; " for c in consts))
    for i in range(4):  # magic | code of values i, i + 4 (one LOP3: (w & 0x000F000F) | magic)
        asm += f"lop3.b32 x{i}, ${i + 4}, 0x000F000F, magic, 0xEA; "
    if HADAMARD:
        for i in (0, 2):  # stride 1, the decode's offset folded in (exact: tile docstring)
            asm += _fma(f"b{i + 1}", f"x{i + 1}", "mone", f"x{i}")  # x0 - x1 = (q0 - q1) u
            asm += _fma("e", f"x{i}", "two", "moff2")  # 2 x0 - 2 off = 2 q0 u
            asm += _fma(f"b{i}", f"b{i + 1}", "mone", "e")  # (q0 + q1) u
        for i in (0, 1):  # stride 2
            asm += _fma(f"a{i}", f"b{i + 2}", "one", f"b{i}") + _fma(f"a{i + 2}", f"b{i + 2}", "mone", f"b{i}")
        for m in range(_log2(G // V.value)):  # strides 8, 16: lane masks 1, 2 (as fwht's lane_partner)
            for i in range(4):
                asm += f"shfl.sync.bfly.b32 p, a{i}, {1 << m}, 0x1f, -1; "
                asm += _fma(f"a{i}", f"${16 + 8 * m}", f"a{i}", "p")
    else:
        for i in range(4):
            asm += _fma(f"a{i}", f"x{i}", "one", "moff")
    # memory order: pairs (0, 1) (2, 3) (4, 5) (6, 7) from (0, 4) (1, 5) (2, 6) (3, 7)
    r = "m" if HADAMARD else "y"
    asm += (f"prmt.b32 {r}0, a0, a1, 0x5410; prmt.b32 {r}1, a2, a3, 0x5410; "
            f"prmt.b32 {r}2, a0, a1, 0x7632; prmt.b32 {r}3, a2, a3, 0x7632; ")
    if HADAMARD:
        for i in (0, 1):  # stride 4, now between registers
            asm += _fma(f"y{i}", f"m{i + 2}", "one", f"m{i}") + _fma(f"y{i + 2}", f"m{i + 2}", "mone", f"m{i}")
    for i in range(4):  # the one rounding: (n u) * scale (+ -0 keeps the product's zero sign), saturated
        asm += _fma(f"z{i}", f"y{i}", "$12", "mzero") + f"min.NaN.xorsign.abs.bf16x2 ${i}, z{i}, big; "
    return asm + "}"


@triton.constexpr_function
def _packed_output_constraints(G: int, HADAMARD: bool) -> str:
    """Four bf16x2 outputs; eight words of pairs, four of the scale (two
    bf16 each), eight of each lane mask's signs."""
    signs = _log2(G // V.value) if HADAMARD else 0
    return ",".join(["=r"] * 4 + ["r"] * (12 + 8 * signs))


@triton.jit
def _lane_signs(M: tl.constexpr, L: tl.constexpr, like):
    """bf16x2 +1 on the lower lane of each pair ``lane ^ M``, -1 on the
    upper, in the shape of ``like [BG, L, V]``."""
    lane = tl.arange(0, L)[None, :, None]
    return tl.broadcast_to(tl.where((lane & M) == 0, 0x3F803F80, 0xBF80BF80), like.shape)


@triton.jit
def _decode_output_bf16(words, s, G: tl.constexpr, HADAMARD: tl.constexpr):
    """:func:`decode_output` cast to bf16, in bf16x2 (compiled, ``G <= 32``,
    the lane layout)."""
    L: tl.constexpr = G // V
    # the word shifted to each pair's codes; an operand that varies along V
    # (Triton moves a broadcast after an elementwise op of broadcasts only)
    w1, w2, w3 = words >> 4, words >> 8, words >> 12
    pairs = _values8(words, w1, w2, w3, words, w1, w2, w3)
    sb = (s.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    sb = tl.broadcast_to(sb[:, :, None], pairs.shape)
    ASM: tl.constexpr = _packed_output_asm(G, HADAMARD)
    CONSTRAINTS: tl.constexpr = _packed_output_constraints(G, HADAMARD)
    if HADAMARD and L == 4:
        return tl.inline_asm_elementwise(ASM, CONSTRAINTS,
                                         [pairs, sb, _lane_signs(1, L, pairs), _lane_signs(2, L, pairs)],
                                         dtype=tl.bfloat16, is_pure=True, pack=8)
    elif HADAMARD:
        tl.static_assert(L == 2, "packed output: groups of 16 or 32")
        return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [pairs, sb, _lane_signs(1, L, pairs)],
                                         dtype=tl.bfloat16, is_pure=True, pack=8)
    else:
        return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [pairs, sb], dtype=tl.bfloat16, is_pure=True, pack=8)


@triton.jit
def decode_output(words, s, dtype: tl.constexpr, G: tl.constexpr, HADAMARD: tl.constexpr,
                  SHUFFLE: tl.constexpr = False, FLIPS: tl.constexpr = 0):
    """The values ``[BG, L, V]`` of gathered groups (``words``, ``s`` as
    :func:`load_chunk_groups` returns them) as ``quant.output_reference``,
    in ``dtype``: ``fwht(2 q) * scale`` with rotation, else ``2 q * scale``
    (``quant.OUTPUT_SCALE``; each exact until this one product), the signs
    ``FLIPS`` flipped back (:func:`flip`), saturated to ``dtype``
    (:func:`saturate`: symmetric, so flipping after it is the same);
    compiled, bf16 of groups up to 32 in bf16x2 (:func:`_decode_output_bf16`)."""
    if COMPILED and SHUFFLE and dtype == tl.bfloat16 and G <= 32:
        return flip(_decode_output_bf16(words, s, G, HADAMARD), FLIPS)
    else:
        q = codes_of(words, LOG2_OUTPUT_SCALE)
        if HADAMARD:
            q = fwht(q, G, SHUFFLE)
        return saturate(flip(q * s[:, :, None], FLIPS), dtype, SHUFFLE)
