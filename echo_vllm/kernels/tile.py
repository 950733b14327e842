"""Device functions on one tile of quantization groups, shared by the stage kernels.

A tile is ``[BG, G]``: ``BG`` groups of ``G`` values. Every function here is
the Triton twin of a piece of ``echo_vllm.quant`` and performs the same fp32
operations in the same order, so that the kernels match the references bit
for bit:

* fp32 <-> bf16 conversions are done on the bit patterns (round to nearest
  even, NaN -> 0x7FC0, as ``c10::BFloat16`` does). Hardware conversions
  give the same numbers on the GPU, but Triton's interpreter truncates and
  rounds ties away from zero, and CI checks the kernels in the interpreter;
  the bit version is exact in both and costs ~6 integer ops per value.
  Outputs (not feedback buffers) use the hardware when compiled
  (:func:`to_output`): same values, a hardware NaN payload.
* the only division is one correctly rounded ``1 / scale`` per group
  (``div_rn``); rounding to integers uses the magic-number add/sub.
* the Walsh-Hadamard butterflies run in the order of
  ``echo_vllm.rotation.fwht`` (stride 1, 2, 4, ...; outputs ``(a+b, a-b)``).

Thread layouts (``SPREAD``, the wrappers' ``spread=`` argument; the bits
are the same either way):

* ``SPREAD`` (default): 2-D offsets ``[BG, G]``, a group across lanes, so a
  warp reads contiguous memory; the amax and the cross-lane butterfly
  stages become shuffles. Faster on the H200 (BENCHMARKS.md, section 2).
* one group per thread (``spread=False``): tiles are loaded
  through 3-D offsets ``[BG, G // VEC, VEC]`` (``VEC`` values = 16 bytes of
  fp32 per vector access), with which Triton gives each thread whole
  groups, so the amax and every butterfly stay in registers: no shared
  memory, no shuffles. Lanes read 8-16 contiguous bytes each, a group
  apart; slower on the H200 (BENCHMARKS.md, section 2).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

#: Compiled kernels (not Triton's interpreter) round fp32 results to bf16 in
#: hardware (``cvt.rn.bf16x2.f32``: round to nearest even, one instruction
#: per two values) where only the values matter; see :func:`to_output`.
HW_BF16_OUTPUT: tl.constexpr = tl.constexpr(not knobs.runtime.interpret)

#: Values per vector access: 16 bytes of fp32.
VEC: tl.constexpr = tl.constexpr(4)
#: Contiguous values per lane in the ``SPREAD`` layout of kernels whose
#: per-value traffic is bf16/fp16 (output, consume): 16-byte accesses of
#: 16-bit values, four lanes per group of 32. (Stage 1 keeps ``VEC``: with 8
#: its fp32 feedback store, capped at 16 bytes per lane by Triton, goes
#: through a shared-memory conversion; see BENCHMARKS.md, 2.8.)
WIDE_VEC: tl.constexpr = tl.constexpr(8)
#: (y + RNE_MAGIC) - RNE_MAGIC rounds y to an integer, ties to even (|y| <= 2**22).
RNE_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
#: Smallest normal fp32: scales are clamped to it so 1/scale stays finite.
FLT_MIN: tl.constexpr = tl.constexpr(2.0**-126)
#: Code of a value: q + CODE_OFFSET, q in [-qmax, qmax].
CODE_OFFSET: tl.constexpr = tl.constexpr(8.0)
#: bf16 NaN written for the scale of a non-finite group (torch's NaN bits).
BF16_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC0)


# -- conversions -------------------------------------------------------------


@triton.jit
def bf16_bits_to_f32(bits):
    """uint16 bf16 bit patterns -> fp32 (exact)."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(v):
    """fp32 -> uint16 bf16 bits, round to nearest even; NaN -> 0x7FC0."""
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


@triton.jit
def to_output(v, dtype: tl.constexpr):
    """fp32 -> ``dtype`` for a value the caller receives (the all-reduce
    result, consume's input): round to nearest even, as :func:`from_f32`,
    but in hardware when compiled. The two agree bit for bit on every
    finite and infinite value; a NaN stays a NaN with the hardware's payload
    (0x7FFF) instead of torch's (0x7FC0), which no consumer can tell apart
    (the tests compare outputs with any NaN equal to any NaN). Feedback
    buffers, compared exactly, keep :func:`from_f32`. Saves ~6 integer
    instructions per value of the output kernel's ~25."""
    if dtype == tl.bfloat16 and HW_BF16_OUTPUT:
        return v.to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:
        return from_f32(v, dtype)


# -- addressing --------------------------------------------------------------


@triton.jit
def value_offsets(first, lg, G: tl.constexpr, SPREAD: tl.constexpr, SPREAD_VEC: tl.constexpr = VEC):
    """int64 offsets of the values of groups ``lg`` (group indices relative
    to ``first``, the offset of group 0): ``[BG, G // VEC, VEC]`` (one group
    per thread) or, if ``SPREAD``, ``[BG, G]`` with lanes along the group
    (coalesced; ``SPREAD_VEC`` contiguous values per lane: ``VEC`` gives
    every dtype the same layout, :data:`WIDE_VEC` 16-byte 16-bit accesses)."""
    if SPREAD:
        e = tl.max_contiguous(tl.arange(0, G), SPREAD_VEC)
        return first + lg.to(tl.int64)[:, None] * G + e[None, :]
    else:
        k = tl.arange(0, G // VEC)[None, :, None]
        v = tl.arange(0, VEC)[None, None, :]
        return first + lg.to(tl.int64)[:, None, None] * G + (k * VEC + v)


@triton.jit
def message_offsets(j, lg, row_groups, cols, msg_groups, G: tl.constexpr, SPREAD: tl.constexpr,
                    SPREAD_VEC: tl.constexpr = VEC):
    """Offsets into the message ``[rows, cols]`` of groups ``lg`` of chunk
    ``j``, and their mask (the position-owned layout of ``quant``): group
    ``m`` is row ``m // row_groups``, first column ``(j * row_groups +
    m % row_groups) * G``. Masked: padding groups (``m >= msg_groups``) and
    the zero columns past ``cols``. Shapes as :func:`value_offsets`."""
    t = lg // row_groups
    col0 = (j * row_groups + (lg - t * row_groups)) * G
    first = t * cols + col0
    live = lg < msg_groups
    if SPREAD:
        e = tl.max_contiguous(tl.arange(0, G), SPREAD_VEC)[None, :]
        return first[:, None] + e, live[:, None] & (col0[:, None] + e < cols)
    else:
        e = tl.arange(0, G // VEC)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]
        return first[:, None, None] + e, live[:, None, None] & (col0[:, None, None] + e < cols)


@triton.jit
def byte_offsets(first, lg, NB: tl.constexpr, SPREAD: tl.constexpr):
    """int64 offsets of ``NB`` bytes per group: ``[BG, NB // W, W]`` (W <= 16)
    or, if ``SPREAD``, ``[BG, NB]``."""
    if SPREAD:
        return first + lg.to(tl.int64)[:, None] * NB + tl.arange(0, NB)[None, :]
    else:
        W: tl.constexpr = NB if NB < 16 else 16
        k = tl.arange(0, NB // W)[None, :, None]
        v = tl.arange(0, W)[None, None, :]
        return first + lg.to(tl.int64)[:, None, None] * NB + (k * W + v)


@triton.jit
def group_mask(gmask, SPREAD: tl.constexpr):
    """The per-group mask ``[BG]`` broadcastable to the access shape."""
    if SPREAD:
        return gmask[:, None]
    else:
        return gmask[:, None, None]


@triton.jit
def as_groups(t, BG: tl.constexpr, G: tl.constexpr):
    """Access tile -> ``[BG, G]``."""
    return tl.reshape(t, (BG, G))


@triton.jit
def as_access(t, BG: tl.constexpr, G: tl.constexpr, SPREAD: tl.constexpr):
    """``[BG, G]`` -> the shape of :func:`value_offsets`."""
    if SPREAD:
        return t
    else:
        return tl.reshape(t, (BG, G // VEC, VEC))


@triton.jit
def as_bytes_access(t, BG: tl.constexpr, NB: tl.constexpr, SPREAD: tl.constexpr):
    """``[BG, NB]`` bytes -> the shape of :func:`byte_offsets`."""
    if SPREAD:
        return t
    else:
        W: tl.constexpr = NB if NB < 16 else 16
        return tl.reshape(t, (BG, NB // W, W))


# -- rotation ----------------------------------------------------------------


@triton.jit
def fwht(v, BG: tl.constexpr, G: tl.constexpr, SPREAD: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform of each row of ``v [BG, G]``,
    butterfly for butterfly as ``echo_vllm.rotation.fwht``.

    One group per thread: split/join in registers. ``SPREAD`` (a group
    across lanes): each stage as two 2-element reductions, ``a + b`` and
    ``a + (-b)`` (= ``a - b`` exactly), which Triton lowers to shuffles
    instead of round trips through shared memory."""
    for i in tl.static_range(8):
        if (2 << i) <= G:
            w = tl.reshape(v, (BG, G >> (i + 1), 2, 1 << i))
            if SPREAD:
                first = (tl.arange(0, 2) == 0)[None, None, :, None]
                s = tl.sum(w, axis=2)
                d = tl.sum(w * tl.where(first, 1.0, -1.0), axis=2)
                w = tl.where(first, s[:, :, None, :], d[:, :, None, :])
            else:
                a, b = tl.split(tl.permute(w, (0, 1, 3, 2)))
                w = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
            v = tl.reshape(w, (BG, G))
    return v


@triton.jit
def unrotate(v, BG: tl.constexpr, G: tl.constexpr, SPREAD: tl.constexpr):
    """Inverse rotation: ``fwht(v) * (1/G)`` (1/G is a power of two)."""
    return fwht(v, BG, G, SPREAD) * (1.0 / G)


# -- quantization ------------------------------------------------------------


@triton.jit
def quantize(u, INV_QMAX: tl.constexpr, QMAX: tl.constexpr):
    """Group-quantize fp32 ``u [BG, G]`` as ``quant.quantize_groups``.

    Returns ``(codes uint8 [BG, G], scale bits uint16 [BG], err fp32 [BG, G])``.
    """
    a = tl.abs(u)
    finite = a < float("inf")
    amax = tl.max(tl.where(finite, a, 0.0), axis=1)
    bad = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    s_bits = f32_to_bf16_bits(tl.maximum(amax * INV_QMAX, FLT_MIN))
    s = bf16_bits_to_f32(s_bits)
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    y = u * inv[:, None]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    t = y + RNE_MAGIC
    r = tl.where(bad[:, None], 0.0, t - RNE_MAGIC)
    # t = 1.5 * 2**23 + r exactly, so its low mantissa bits hold r: the code
    # r + 8 comes out with integer ops instead of a (quarter-rate) F2I.
    codes = ((t.to(tl.uint32, bitcast=True) + 8) & 0xF).to(tl.uint8)
    codes = tl.where(bad[:, None], 8, codes).to(tl.uint8)
    err = u - r * s[:, None]
    err = tl.where(bad[:, None], 0.0, err)
    s_bits = tl.where(bad, BF16_NAN_BITS, s_bits).to(tl.uint16)
    return codes, s_bits, err


@triton.jit
def dequantize(codes, s_bits):
    """fp32 ``(code - 8) * scale`` as ``quant.dequantize_groups``.

    ``code - 8`` is formed exactly as ``float(2**23 + code) - (2**23 + 8)``
    from the bits ``0x4B000000 | code`` (integer or + one add, instead of a
    quarter-rate I2F)."""
    q = (codes.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + CODE_OFFSET)
    return q * bf16_bits_to_f32(s_bits)[:, None]


@triton.jit
def pack(codes, BG: tl.constexpr, G: tl.constexpr):
    """uint8 codes ``[BG, G]`` -> bytes ``[BG, G // 2]``, element 2i low."""
    lo, hi = tl.split(tl.reshape(codes, (BG, G // 2, 2)))
    return lo | (hi << 4)


@triton.jit
def unpack(packed, BG: tl.constexpr, G: tl.constexpr):
    """Inverse of :func:`pack`."""
    return tl.reshape(tl.join(packed & 0x0F, packed >> 4), (BG, G))


# -- the wire ----------------------------------------------------------------


@triton.jit
def store_chunk_groups(wire_ptr, chunk_first, PB, lg, gmask, codes, s_bits,
                       BG: tl.constexpr, G: tl.constexpr, SPREAD: tl.constexpr):
    """Write groups ``lg`` of the chunk starting at byte ``chunk_first``:
    packed codes at ``lg * G/2``, scales at ``PB + 2 * lg``."""
    NB: tl.constexpr = G // 2
    offs = byte_offsets(chunk_first, lg, NB, SPREAD)
    tl.store(wire_ptr + offs, as_bytes_access(pack(codes, BG, G), BG, NB, SPREAD),
             mask=group_mask(gmask, SPREAD))
    scale_ptr = (wire_ptr + chunk_first + PB).to(tl.pointer_type(tl.uint16))
    tl.store(scale_ptr + lg, s_bits, mask=gmask)


@triton.jit
def load_chunk_groups(wire_ptr, chunk_first, PB, lg, gmask, BG: tl.constexpr, G: tl.constexpr,
                      SPREAD: tl.constexpr):
    """Read and dequantize groups ``lg`` of the chunk at byte ``chunk_first``."""
    NB: tl.constexpr = G // 2
    offs = byte_offsets(chunk_first, lg, NB, SPREAD)
    packed = tl.reshape(tl.load(wire_ptr + offs, mask=group_mask(gmask, SPREAD), other=0), (BG, NB))
    scale_ptr = (wire_ptr + chunk_first + PB).to(tl.pointer_type(tl.uint16))
    s_bits = tl.load(scale_ptr + lg, mask=gmask, other=0)
    return dequantize(unpack(packed, BG, G), s_bits)
