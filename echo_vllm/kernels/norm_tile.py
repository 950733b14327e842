"""Device code of Echo's output with the residual add and RMSNorm: whole rows per tile.

A tile is ``K`` rows (:mod:`echo_vllm.norm_plan`): of every chunk, the ``K *
RGP`` groups ``lg`` of those rows (:func:`tile_groups`), in the lane layout
of :mod:`.tile`. :func:`output_norm_tile` decodes the tile's groups of every
chunk (``tile.decode_output``: Echo's output, rounded to the output dtype),
adds the residual in fp32, and once the rows' mean squares are known
stores the new residual and ``rmsnorm(sum) * weight`` -- the bits of
``quant.output_reference`` followed by ``norm.add_rms_norm(...,
variance="kernel")`` (``norm.rms_norm`` without a residual). The composed
output kernel (:mod:`.output_norm_kernel`) and the fused kernel's phase 3
share it, so the two give the same bits by construction.

The mean square is ``norm.kernel_mean_square``: each lane's 8 squares
summed in registers as its pairwise tree (:func:`lane_sums`), the lanes'
sums of a row combined as integers (:func:`row_total`), which ``tl.sum``
may add in any order.

The tile is read twice (:func:`output_norm_tile`), so a thread holds one
chunk's values at a time: holding the row (64 fp32 values a thread at
P = 8, hidden 4096) spilled and made the fused norm slower than Echo
followed by the norm (BENCHMARKS.md, the norm fusion). The second pass
reads back Echo's output that the first stored in the output buffer, or,
for large tiles (``NormTiling.decode_once``), decodes the chunks again.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..norm import FIXED_BITS as _FIXED_BITS
from ..norm import MAX_SHIFT as _MAX_SHIFT
from .bodies import output_load
from .tile import (
    as_lanes, block_offsets, block_shift, decode_output, from_f32, group_amax, group_rows, lanes_hold, load_values,
    store_values, to_f32,
)

FIXED_BITS: tl.constexpr = tl.constexpr(_FIXED_BITS)
MAX_SHIFT: tl.constexpr = tl.constexpr(_MAX_SHIFT)
#: Cache hints of the two passes over a tile's bytes: keep them for the second, then drop them.
KEEP: tl.constexpr = tl.constexpr("evict_last")
DROP: tl.constexpr = tl.constexpr("evict_first")


@triton.jit
def tile_groups(t, BG: tl.constexpr, row_groups, chunk_groups, K: tl.constexpr = 0, RGP: tl.constexpr = 0,
                ALIGNED: tl.constexpr = False):
    """int64 groups ``[BG]`` of tile ``t`` of every chunk: ``BG`` consecutive
    groups (``K == 0``), or whole rows: element ``k * RGP + b`` is group
    ``(t * K + k) * row_groups + b``, and ``chunk_groups`` (masked by every
    load and store) where ``b >= row_groups``. ``ALIGNED`` (``row_groups ==
    RGP``, ``NormTiling.aligned``): the rows' groups are the ``BG``
    consecutive ones, taken as such (fewer registers: the general index
    spilled in the fused kernel's phase 1 at P = 8)."""
    if K == 0 or ALIGNED:
        return tl.cast(t, tl.int64) * BG + tl.arange(0, BG)
    else:
        tl.static_assert(K * RGP == BG, "a row tile is K rows of RGP groups")
        i = tl.arange(0, BG)
        b = i % RGP
        row = tl.cast(t, tl.int64) * K + i // RGP
        return tl.where(b < row_groups, row * row_groups + b, tl.cast(chunk_groups, tl.int64))


@triton.jit
def lane_sums(sq):
    """``[BG, L, V]`` -> ``[BG, L]``: each lane's ``V`` (8) values summed as
    ``norm.block_sums``' tree, in registers."""
    BG: tl.constexpr = sq.shape[0]
    L: tl.constexpr = sq.shape[1]
    a, b = tl.split(tl.reshape(sq, (BG, L, 4, 2)))  # (0, 1) (2, 3) (4, 5) (6, 7)
    a, b = tl.split(tl.reshape(a + b, (BG, L, 2, 2)))  # (01, 23) (45, 67)
    a, b = tl.split(a + b)
    return a + b


@triton.jit
def _rows_of(v, K: tl.constexpr, RGP: tl.constexpr):
    """``[BG]`` -> ``[K, RGP, 1]`` (a row's groups along the second axis)."""
    return tl.reshape(v, (K, RGP))[:, :, None]


@triton.jit
def to_groups(v, RGP: tl.constexpr):
    """A row value ``[K]`` on each of its groups: ``[K * RGP]``."""
    K: tl.constexpr = v.shape[0]
    return tl.reshape(tl.broadcast_to(v[:, None], (K, RGP)), (K * RGP,))


@triton.jit
def row_max(s, K: tl.constexpr, RGP: tl.constexpr):
    """``[K]``: the largest lane sum of each row (``s [BG, L] >= 0``; NaN if any is)."""
    return group_amax(_rows_of(group_amax(s[:, :, None]), K, RGP))


@triton.jit
def _power_of_two(k):
    """fp32 ``2**k`` for int32 ``k`` in [-126, 127], from its bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fixed_shift(m):
    """int32 ``k`` of ``norm.fixed_shift``: rows whose largest lane sum is
    ``m`` (>= 0, finite) scale by ``2**k`` to integers below ``2**FIXED_BITS``."""
    field = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(FIXED_BITS - (tl.maximum(field, 1) - 126), MAX_SHIFT)


@triton.jit
def fixed(s, up):
    """``trunc(s * up)`` in int64 (``s [BG, L]``, ``up [BG]`` the row's
    ``2**k``, 0 for a non-finite row, whose terms are then 0)."""
    u = up[:, None]
    return (tl.where(u > 0, s, 0.0) * u).to(tl.int64)  # truncates toward 0 (never NaN: a poison cast)


@triton.jit
def row_total(t, K: tl.constexpr, RGP: tl.constexpr):
    """``[K]`` int64: the sum of each row's terms ``t [BG, L]`` (exact, any order)."""
    return tl.sum(tl.sum(_rows_of(tl.sum(t, 1), K, RGP), 2), 1)


@triton.jit
def weighted(n, w, dtype: tl.constexpr):
    """``norm``'s step 5: ``dtype(w.dtype(n) * w)``, each product of two
    16-bit values exact in fp32 (one rounding, as torch's)."""
    p = to_f32(from_f32(n, w.dtype)) * to_f32(w)
    return from_f32(to_f32(from_f32(p, w.dtype)), dtype)


@triton.jit
def _chunk_in(buf_ptr, chunk_first, payload_bytes, res_ptr, offs, c, live, lg, j, row_groups, cols, chunk_groups,
              G: tl.constexpr, RESIDUAL: tl.constexpr, EVICT: tl.constexpr):
    """Chunk ``j``'s loads: ``(words, scales, residual, mask [BG, G])``
    (the residual: the mask itself when there is none), with the cache
    hint ``EVICT``."""
    words, s = output_load(buf_ptr, chunk_first, payload_bytes, lg, chunk_groups, G, EVICT)
    d, limit = block_shift(j, row_groups, cols, G)
    m = live & (c < limit)
    r = m
    if RESIDUAL:
        r = load_values(res_ptr + d, offs, m, G, EVICT)
    return words, s, r, m


@triton.jit
def _plus_residual(a, r, RESIDUAL: tl.constexpr):
    """fp32 ``[BG, L, V]``: Echo's output ``a`` (in the output dtype) plus the
    residual ``r`` when there is one -- the same instructions in both passes,
    so the same bits."""
    x = to_f32(a)
    if RESIDUAL:
        x = x + to_f32(r)
    return x


@triton.jit
def _store_rows(x, rstd, d, offs, c, m, w_ptr, out_ptr, res_out_ptr, OUT: tl.constexpr, G: tl.constexpr,
                RESIDUAL: tl.constexpr):
    """Chunk values ``x`` (fp32, at ``d`` of the rows): the new residual and ``rmsnorm(x) * weight``."""
    if RESIDUAL:
        store_values(res_out_ptr + d, offs, m, from_f32(x, OUT))
    w = load_values(w_ptr + d, c, m, G)
    store_values(out_ptr + d, offs, m, weighted(x * rstd, w, OUT))


@triton.jit
def _second_pass_decoded(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd, offs,
                         c, live, lg, row_groups, cols, chunk_groups, P: tl.constexpr, G: tl.constexpr,
                         HADAMARD: tl.constexpr, RESIDUAL: tl.constexpr, SHUFFLE: tl.constexpr):
    """Pass 2, decoding every chunk again (its bytes back from L1/L2). A kept
    loop, the next chunk's loads issued before this one's arithmetic, masked
    off after the last."""
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    words, s, r, m = _chunk_in(buf_ptr, first, payload_bytes, res_ptr, offs, c, live, lg, 0, row_groups, cols,
                               chunk_groups, G, RESIDUAL, DROP)
    for j in range(P):
        more = j + 1 < P
        jn = tl.minimum(j + 1, P - 1)
        words_n, s_n, r_n, m_n = _chunk_in(buf_ptr, first + jn * chunk_bytes, payload_bytes, res_ptr, offs, c,
                                           live & more, lg, jn, row_groups, cols, tl.where(more, chunk_groups, 0),
                                           G, RESIDUAL, DROP)
        x = _plus_residual(decode_output(words, s, OUT, G, HADAMARD, SHUFFLE), r, RESIDUAL)
        d, _ = block_shift(j, row_groups, cols, G)
        _store_rows(x, rstd, d, offs, c, m, w_ptr, out_ptr, res_out_ptr, OUT, G, RESIDUAL)
        words, s, r, m = words_n, s_n, r_n, m_n


@triton.jit
def _second_pass_stored(res_ptr, w_ptr, out_ptr, res_out_ptr, rstd, offs, c, live, row_groups, cols,
                        P: tl.constexpr, G: tl.constexpr, RESIDUAL: tl.constexpr):
    """Pass 2, Echo's output read back from ``out_ptr``, where pass 1 stored
    it (the same thread's stores: no barrier), and the residual again. A kept
    loop, the next chunk's loads issued before this one's arithmetic."""
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    d, limit = block_shift(0, row_groups, cols, G)
    m = live & (c < limit)
    a = load_values(out_ptr + d, offs, m, G, DROP)
    r = m
    if RESIDUAL:
        r = load_values(res_ptr + d, offs, m, G, DROP)
    for j in range(P):
        dn, limit_n = block_shift(tl.minimum(j + 1, P - 1), row_groups, cols, G)
        m_n = live & (c < limit_n) & (j + 1 < P)
        a_n = load_values(out_ptr + dn, offs, m_n, G, DROP)
        r_n = m_n
        if RESIDUAL:
            r_n = load_values(res_ptr + dn, offs, m_n, G, DROP)
        _store_rows(_plus_residual(a, r, RESIDUAL), rstd, d, offs, c, m, w_ptr, out_ptr, res_out_ptr, OUT, G,
                    RESIDUAL)
        a, r, m, d = a_n, r_n, m_n, dn


@triton.jit
def output_norm_tile(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, lg,
                     row_groups, cols, msg_groups, chunk_groups, eps, P: tl.constexpr, G: tl.constexpr,
                     K: tl.constexpr, RGP: tl.constexpr, HADAMARD: tl.constexpr, RESIDUAL: tl.constexpr,
                     LANES: tl.constexpr, STEP: tl.constexpr, DECODE_ONCE: tl.constexpr):
    """The tile's rows (groups ``lg``, :func:`tile_groups`) from the gathered
    chunks at bytes ``first + j * chunk_bytes`` of ``buf_ptr``: the new
    residual into ``res_out_ptr`` (``RESIDUAL``; it may be ``res_ptr``
    itself), the normalised rows into ``out_ptr`` (message layout,
    ``out_ptr``'s dtype; module docstring). ``LANES``:
    ``contract.lane_layout`` of the rows' tensors (else the decode takes the
    layout-agnostic butterflies, same bits).

    Two passes over the chunks, so that a thread holds one chunk's values
    at a time and never the row: the first decodes ``STEP`` chunks at a
    time and sums the squares, keeping each lane's sum of each chunk; the
    second stores. With ``DECODE_ONCE`` the first stores Echo's output into
    ``out_ptr`` and the second reads it back (so ``out_ptr`` must not
    overlap the residual); else the second decodes again (the bytes come
    back from L1/L2: the first pass asks to keep them, the second to drop
    them). The second pass loads a chunk's residual before it stores the
    new one, so the residual may be updated in place."""
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    SHUFFLE: tl.constexpr = lanes_hold(OUT, res_ptr.dtype.element_ty, w_ptr.dtype.element_ty) and LANES
    offs, c, live = block_offsets(lg, group_rows(lg, row_groups), cols, msg_groups, G)
    # pass 1: each lane's sum of squares of every chunk. STEP chunks at a time: the compiler issues
    # their loads at once, the bytes in flight this phase needs, in the registers of STEP chunks
    # (every chunk at once needs 107 registers at P = 8: 2 programs per SM, not 3)
    zero = lane_sums(as_lanes(c, G).to(tl.float32) * 0.0)  # [BG, L] in the layout of a lane's sums
    sums = ()
    for i in tl.static_range(P):
        sums = sums + (zero,)
    for j0 in range(0, P, STEP):
        loads = ()
        for u in tl.static_range(STEP):
            ok = j0 + u < P  # P need not be a multiple of STEP: the chunks past the last are masked off
            loads = loads + (_chunk_in(buf_ptr, first + tl.minimum(j0 + u, P - 1) * chunk_bytes, payload_bytes,
                                       res_ptr, offs, c, live & ok, lg, j0 + u, row_groups, cols,
                                       tl.where(ok, chunk_groups, 0), G, RESIDUAL, KEEP),)
        for u in tl.static_range(STEP):
            words, s, r, m = loads[u]
            a = decode_output(words, s, OUT, G, HADAMARD, SHUFFLE)
            if DECODE_ONCE:  # read back by pass 2, which then decodes nothing
                d, _ = block_shift(j0 + u, row_groups, cols, G)
                store_values(out_ptr + d, offs, m, a)
            x = _plus_residual(a, r, RESIDUAL)
            x = tl.where(as_lanes(m, G), x, 0.0)  # padding lanes and columns past the row: not in the row
            sq = lane_sums(x * x)
            new = ()
            for i in tl.static_range(P):
                new = new + (tl.where(j0 + u == i, sq, sums[i]),)  # the chunk's slot (none past the last)
            sums = new
    # the chunks' lanes combined in registers first: one reduction across the program per row statistic
    lanes_max = sums[0]
    for i in tl.static_range(1, P):
        lanes_max = tl.maximum(lanes_max, sums[i], propagate_nan=tl.PropagateNan.ALL)
    # the rows' sums of squares, as integers scaled by their largest lane sum
    mx = row_max(lanes_max, K, RGP)
    finite = mx < float("inf")  # false for inf and NaN
    k = fixed_shift(tl.where(finite, mx, 0.0))
    up = to_groups(tl.where(finite, _power_of_two(k), 0.0), RGP)  # a non-finite row's terms are 0
    terms = fixed(sums[0], up)
    for j in tl.static_range(1, P):
        terms += fixed(sums[j], up)  # exact: the sum stays below 2**53
    ssq = tl.where(finite, row_total(terms, K, RGP).to(tl.float32) * _power_of_two(-k), mx)
    # tl.cast: a width of 1 comes in as a constant int
    rstd = tl.math.rsqrt(tl.math.div_rn(ssq, tl.cast(cols, tl.float32)) + eps)
    rstd = to_groups(rstd, RGP)[:, None, None]
    # pass 2: store the new residual and the normalised, weighted rows
    if DECODE_ONCE:
        _second_pass_stored(res_ptr, w_ptr, out_ptr, res_out_ptr, rstd, offs, c, live, row_groups, cols, P, G,
                            RESIDUAL)
    else:
        _second_pass_decoded(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd,
                             offs, c, live, lg, row_groups, cols, chunk_groups, P, G, HADAMARD, RESIDUAL, SHUFFLE)
