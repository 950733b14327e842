"""Device code of Echo's output with the residual add and RMSNorm: whole rows per tile.

A tile is ``K`` rows (:mod:`echo_vllm.rmsnorm_plan`): of every chunk, the ``K *
RGP`` groups ``lg`` of those rows (:func:`tile_groups`), in the lane layout
of :mod:`.tile`. :func:`output_norm_tile` decodes the tile's groups of every
chunk (``tile.decode_output``: Echo's output, rounded to the output dtype),
adds the residual in fp32, and once the rows' mean squares are known
stores the new residual and ``rmsnorm(sum) * weight`` -- the bits of
``quant.output_reference`` followed by ``rmsnorm.add_rms_norm(...,
variance="kernel")`` (``rmsnorm.rms_norm`` without a residual; with
``KEEP_OUTPUT`` Echo's output itself is stored as the new residual). The composed
output kernel (:mod:`.output_norm_kernel`) and the fused kernel's phase 3
share it, so the two give the same bits by construction.

The mean square is ``rmsnorm.kernel_mean_square``: each lane's 8 squares
summed in registers as its pairwise tree (:func:`lane_sums`), the lanes'
sums of a row combined as integers (:func:`row_total`), which ``tl.sum``
may add in any order.

Rows of few enough values are read once (:func:`_one_pass`): a step's
rows of every chunk at once, chunk-major in one ``[P * R * RGP]`` group
tile (the chunks padded to a power of two), 16 values a thread for one
row of 4096 on 8 warps. Holding a whole tile instead (64 fp32 values a
thread at P = 8, hidden 4096) spilled and made the fused norm slower than
Echo followed by the norm (BENCHMARKS.md, "Dropped ideas worth knowing"), so wider rows
are read twice (:func:`_two_passes`), a thread holding one chunk's values
at a time; the second pass reads back Echo's output that the first stored
in the output buffer, or, for large tiles (``NormTiling.decode_once``),
decodes the chunks again.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..rmsnorm import FIXED_BITS as _FIXED_BITS
from ..rmsnorm import MAX_SHIFT as _MAX_SHIFT
from .bodies import output_load, output_load_chunks
from .tile import (
    as_lanes, block_offsets, block_shift, decode_output, from_f32, group_amax, group_rows, lanes_hold, load_values,
    nan_max, store_values, to_f32,
)

FIXED_BITS: tl.constexpr = tl.constexpr(_FIXED_BITS)
MAX_SHIFT: tl.constexpr = tl.constexpr(_MAX_SHIFT)
#: ``RESIDUAL`` of the norm kernels (``output_norm_kernel.residual_mode``): ``rms_norm`` alone;
#: ``fused_add_rms_norm`` (the residual added, the sum stored as the new one); ``rms_norm`` of an
#: output that is also the next residual (a decoder's first norm: Echo's output stored beside it).
NO_RESIDUAL: tl.constexpr = tl.constexpr(0)
ADD_RESIDUAL: tl.constexpr = tl.constexpr(1)
KEEP_OUTPUT: tl.constexpr = tl.constexpr(2)
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
    if K != 0:
        tl.static_assert(K * RGP == BG, "a row tile is K rows of RGP groups")
    return groups_at(t, tl.arange(0, BG), BG, row_groups, chunk_groups, K, RGP, ALIGNED)


@triton.jit
def groups_at(t, i, BG: tl.constexpr, row_groups, chunk_groups, K: tl.constexpr = 0, RGP: tl.constexpr = 0,
              ALIGNED: tl.constexpr = False):
    """:func:`tile_groups` at positions ``i`` (int32, each in ``[0, BG)``) of the tile."""
    if K == 0 or ALIGNED:
        return tl.cast(t, tl.int64) * BG + i
    else:
        b = i % RGP
        row = tl.cast(t, tl.int64) * K + i // RGP
        return tl.where(b < row_groups, row * row_groups + b, tl.cast(chunk_groups, tl.int64))


@triton.jit
def lane_sums(sq):
    """``[BG, L, V]`` -> ``[BG, L]``: each lane's ``V`` (8) values summed as
    ``rmsnorm.block_sums``' tree, in registers."""
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
    """int32 ``k`` of ``rmsnorm.fixed_shift``: rows whose largest lane sum is
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
def row_scale(mx):
    """``(finite, k, up)`` of rows whose largest lane sum is ``mx``: whether
    it is finite, :func:`fixed_shift` and ``2**k`` (0 for a non-finite row,
    whose terms are then 0)."""
    finite = mx < float("inf")  # false for inf and NaN
    k = fixed_shift(tl.where(finite, mx, 0.0))
    return finite, k, tl.where(finite, _power_of_two(k), 0.0)


@triton.jit
def row_rstd(total, finite, k, mx, cols, eps):
    """``1 / sqrt(mean square + eps)`` of rows whose terms (:func:`fixed`
    with :func:`row_scale`'s ``2**k``) sum to ``total``; a non-finite row's
    mean square is its largest lane sum ``mx``."""
    ssq = tl.where(finite, total.to(tl.float32) * _power_of_two(-k), mx)
    # tl.cast: a width of 1 comes in as a constant int
    return tl.math.rsqrt(tl.math.div_rn(ssq, tl.cast(cols, tl.float32)) + eps)


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
    if RESIDUAL == ADD_RESIDUAL:
        r = load_values(res_ptr + d, offs, m, G, EVICT)
    return words, s, r, m


@triton.jit
def _plus_residual(a, r, RESIDUAL: tl.constexpr):
    """fp32 ``[BG, L, V]``: Echo's output ``a`` (in the output dtype) plus the
    residual ``r`` when there is one -- the same instructions in both passes,
    so the same bits."""
    x = to_f32(a)
    if RESIDUAL == ADD_RESIDUAL:
        x = x + to_f32(r)
    return x


@triton.jit
def _store_rows(x, rstd, d, offs, c, m, w_ptr, out_ptr, res_out_ptr, OUT: tl.constexpr, G: tl.constexpr,
                RESIDUAL: tl.constexpr):
    """Chunk values ``x`` (fp32, at ``d`` of the rows): the new residual (``x`` rounded: the sum, or
    with ``KEEP_OUTPUT`` Echo's output, exact) and ``rmsnorm(x) * weight``."""
    if RESIDUAL != NO_RESIDUAL:
        store_values(res_out_ptr + d, offs, m, from_f32(x, OUT))
    w = load_values(w_ptr + d, c, m, G)
    store_values(out_ptr + d, offs, m, weighted(x * rstd, w, OUT))


@triton.jit
def _second_pass_decoded(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd, offs,
                         c, live, lg, row_groups, cols, chunk_groups, P: tl.constexpr, G: tl.constexpr,
                         HADAMARD: tl.constexpr, RESIDUAL: tl.constexpr, SHUFFLE: tl.constexpr,
                         FLIPS: tl.constexpr):
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
        x = _plus_residual(decode_output(words, s, OUT, G, HADAMARD, SHUFFLE, FLIPS), r, RESIDUAL)
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
    if RESIDUAL == ADD_RESIDUAL:
        r = load_values(res_ptr + d, offs, m, G, DROP)
    for j in range(P):
        dn, limit_n = block_shift(tl.minimum(j + 1, P - 1), row_groups, cols, G)
        m_n = live & (c < limit_n) & (j + 1 < P)
        a_n = load_values(out_ptr + dn, offs, m_n, G, DROP)
        r_n = m_n
        if RESIDUAL == ADD_RESIDUAL:
            r_n = load_values(res_ptr + dn, offs, m_n, G, DROP)
        _store_rows(_plus_residual(a, r, RESIDUAL), rstd, d, offs, c, m, w_ptr, out_ptr, res_out_ptr, OUT, G,
                    RESIDUAL)
        a, r, m, d = a_n, r_n, m_n, dn


@triton.jit
def output_norm_tile(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, t,
                     row_groups, cols, msg_groups, chunk_groups, eps, P: tl.constexpr, G: tl.constexpr,
                     K: tl.constexpr, RGP: tl.constexpr, HADAMARD: tl.constexpr, RESIDUAL: tl.constexpr,
                     LANES: tl.constexpr, STEP: tl.constexpr, DECODE_ONCE: tl.constexpr, ALIGNED: tl.constexpr,
                     ONE_PASS_ROWS: tl.constexpr, FLIPS: tl.constexpr = 0):
    """Tile ``t``'s ``K`` rows (:func:`tile_groups`) from the gathered
    chunks at bytes ``first + j * chunk_bytes`` of ``buf_ptr``: the new
    residual into ``res_out_ptr`` (``RESIDUAL`` not ``NO_RESIDUAL``; with
    ``ADD_RESIDUAL`` it may be ``res_ptr`` itself), the normalised rows into ``out_ptr`` (message layout,
    ``out_ptr``'s dtype; module docstring). ``LANES``:
    ``contract.lane_layout`` of the rows' tensors (else the decode takes the
    layout-agnostic butterflies, same bits). ``ONE_PASS_ROWS`` > 0 (``==
    K``): in one pass (:func:`_one_pass`); 0: two passes
    (:func:`_two_passes`, ``STEP`` and ``DECODE_ONCE``). ``FLIPS``: the
    rotation's sign flips (``tile.flip``), undone in the decode."""
    if ONE_PASS_ROWS > 0:
        tl.static_assert(K == ONE_PASS_ROWS, "one pass: callers give tiles of ONE_PASS_ROWS rows")
        _one_pass(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, t, row_groups,
                  cols, msg_groups, chunk_groups, eps, P, G, K, RGP, HADAMARD, RESIDUAL, LANES, ALIGNED, FLIPS)
    else:
        lg = tile_groups(t, K * RGP, row_groups, chunk_groups, K, RGP, ALIGNED)
        _two_passes(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, lg, row_groups,
                    cols, msg_groups, chunk_groups, eps, P, G, K, RGP, HADAMARD, RESIDUAL, LANES, STEP, DECODE_ONCE,
                    FLIPS)


@triton.jit
def _two_passes(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, lg,
                row_groups, cols, msg_groups, chunk_groups, eps, P: tl.constexpr, G: tl.constexpr,
                K: tl.constexpr, RGP: tl.constexpr, HADAMARD: tl.constexpr, RESIDUAL: tl.constexpr,
                LANES: tl.constexpr, STEP: tl.constexpr, DECODE_ONCE: tl.constexpr, FLIPS: tl.constexpr):
    """:func:`output_norm_tile` of groups ``lg`` in two passes over the
    chunks, so that a thread holds one chunk's values
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
            a = decode_output(words, s, OUT, G, HADAMARD, SHUFFLE, FLIPS)
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
    finite, k, up = row_scale(mx)
    up = to_groups(up, RGP)
    terms = fixed(sums[0], up)
    for j in tl.static_range(1, P):
        terms += fixed(sums[j], up)  # exact: the sum stays below 2**53
    rstd = to_groups(row_rstd(row_total(terms, K, RGP), finite, k, mx, cols, eps), RGP)[:, None, None]
    # pass 2: store the new residual and the normalised, weighted rows
    if DECODE_ONCE:
        _second_pass_stored(res_ptr, w_ptr, out_ptr, res_out_ptr, rstd, offs, c, live, row_groups, cols, P, G,
                            RESIDUAL)
    else:
        _second_pass_decoded(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd,
                             offs, c, live, lg, row_groups, cols, chunk_groups, P, G, HADAMARD, RESIDUAL, SHUFFLE,
                             FLIPS)


# -- one pass: a step's rows of every chunk at once ---------------------------------


@triton.jit
def step_row_max(s, PP: tl.constexpr, R: tl.constexpr):
    """``[R]``: the largest lane sum of each row of a step (``s [PP * R * RGP, L] >= 0``, chunk-major; NaN
    if any is). One row: over all of ``s`` at once. Several: each group's lanes, then ``[PP, R, RGP]``
    along its last axis and its first (as :func:`row_max`), no permute: reduced across a permuted view,
    steps of several rows gave other rows' bits in the compiled fused kernel on the H200
    (``tests/kernels/test_layouts.py`` checks every reduction's lanes)."""
    if R == 1:
        return tl.reduce(tl.reshape(s, (1, s.shape[0] * s.shape[1])), 1, nan_max)
    else:
        g = tl.reshape(tl.reduce(s, 1, nan_max), (PP, R, s.shape[0] // (PP * R)))
        return tl.reduce(tl.reduce(g, 2, nan_max), 0, nan_max)


@triton.jit
def step_row_total(t, PP: tl.constexpr, R: tl.constexpr):
    """``[R]`` int64: the sum of each row's terms ``t [PP * R * RGP, L]`` of a step (exact, any order),
    reduced as :func:`step_row_max`."""
    if R == 1:
        return tl.sum(tl.reshape(t, (1, t.shape[0] * t.shape[1])), 1)
    else:
        return tl.sum(tl.sum(tl.reshape(tl.sum(t, 1), (PP, R, t.shape[0] // (PP * R))), 2), 0)


@triton.jit
def _on_groups(v, PP: tl.constexpr, RGP: tl.constexpr):
    """A row value ``[R]`` on each of the step's groups: ``[PP * R * RGP]``."""
    R: tl.constexpr = v.shape[0]
    return tl.reshape(tl.broadcast_to(v[None, :, None], (PP, R, RGP)), (PP * R * RGP,))


@triton.jit
def _step_groups(t, row_groups, chunk_groups, P: tl.constexpr, PP: tl.constexpr, R: tl.constexpr,
                 RGP: tl.constexpr, ALIGNED: tl.constexpr):
    """``(groups, (row, block), chunks, real)``, each ``[PP * R * RGP]``:
    step ``t``'s rows (:func:`tile_groups` of ``R`` rows) of every chunk,
    chunk-major, their :func:`~.tile.group_rows`, the chunks (int64, clamped
    to the last) and whether the chunk is one of the ``P`` (``PP``, a power
    of two, may exceed it). Aligned rows take their row and block from the
    position (``row_groups == RGP``): no division, and a step of one row
    indexes it by a scalar."""
    B: tl.constexpr = R * RGP
    i = tl.arange(0, PP * B)
    j = i // B
    k = i % B
    if ALIGNED:
        row = tl.cast(t, tl.int64) * R + k // RGP
        b = k % RGP
        lg = row * RGP + b
        rows = (row, b)
    else:
        lg = groups_at(t, k, B, row_groups, chunk_groups, R, RGP, False)
        rows = group_rows(lg, row_groups)
    return lg, rows, tl.minimum(j, P - 1).to(tl.int64), j < P


@triton.jit
def _step_in(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, t, row_groups, cols, msg_groups,
             chunk_groups, P: tl.constexpr, PP: tl.constexpr, G: tl.constexpr, R: tl.constexpr, RGP: tl.constexpr,
             RESIDUAL: tl.constexpr, ALIGNED: tl.constexpr):
    """Step ``t``'s loads: ``(words, scales, residual, weight, start,
    offsets, mask)`` of :func:`_step_groups` (the residual: the mask itself
    when there is none), the rows' values at ``start + offsets`` (offsets
    and mask ``[PP * R * RGP, G]``). One aligned row starts at a scalar and
    its offsets are int32 (fewer registers: int64 offsets spilled at P = 8)."""
    lg, rows, j, real = _step_groups(t, row_groups, chunk_groups, P, PP, R, RGP, ALIGNED)
    words, s = output_load_chunks(buf_ptr, first, chunk_bytes, payload_bytes, j, lg, real & (lg < chunk_groups), G,
                                  DROP)
    d, limit = block_shift(j, row_groups, cols, G)
    if ALIGNED and R == 1:
        row = tl.cast(t, tl.int64)
        start = row * cols
        c = rows[1].to(tl.int32)[:, None] * G + tl.arange(0, G)[None, :]
        offs = d.to(tl.int32)[:, None] + c  # below cols
        live = row * RGP < msg_groups
    else:
        start = tl.cast(t, tl.int64) * 0
        offs, c, live = block_offsets(lg, rows, cols, msg_groups, G)
        offs = offs + d[:, None]
    m = live & real[:, None] & (c < limit[:, None])
    r = m
    if RESIDUAL == ADD_RESIDUAL:
        r = load_values(res_ptr + start, offs, m, G, DROP)
    # the weight again each step (from L1): kept across the steps it cost 8 registers and spilled at P = 8
    w = load_values(w_ptr, d[:, None] + c, m, G)
    return words, s, r, w, start, offs, m


@triton.jit
def _step_out(words, s, r, w, start, offs, m, out_ptr, res_out_ptr, cols, eps, PP: tl.constexpr, RGP: tl.constexpr,
              G: tl.constexpr, HADAMARD: tl.constexpr, RESIDUAL: tl.constexpr, SHUFFLE: tl.constexpr,
              FLIPS: tl.constexpr):
    """Decode a step's loads (:func:`_step_in`), add the residual, and store
    the new residual and the normalised, weighted rows: the same
    instructions per value as :func:`_two_passes`, so the same bits."""
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    R: tl.constexpr = words.shape[0] // (PP * RGP)
    x = _plus_residual(decode_output(words, s, OUT, G, HADAMARD, SHUFFLE, FLIPS), r, RESIDUAL)
    sq = lane_sums(tl.where(as_lanes(m, G), x * x, 0.0))  # padding lanes and columns past the row: not in the row
    mx = step_row_max(sq, PP, R)
    finite, k, up = row_scale(mx)
    terms = fixed(sq, _on_groups(up, PP, RGP))
    rstd = _on_groups(row_rstd(step_row_total(terms, PP, R), finite, k, mx, cols, eps), PP, RGP)
    if RESIDUAL != NO_RESIDUAL:
        store_values(res_out_ptr + start, offs, m, from_f32(x, OUT))
    store_values(out_ptr + start, offs, m, weighted(x * rstd[:, None, None], w, OUT))


@triton.jit
def _one_pass(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, t, row_groups, cols,
              msg_groups, chunk_groups, eps, P: tl.constexpr, G: tl.constexpr, R: tl.constexpr, RGP: tl.constexpr,
              HADAMARD: tl.constexpr, RESIDUAL: tl.constexpr, LANES: tl.constexpr, ALIGNED: tl.constexpr,
              FLIPS: tl.constexpr):
    """:func:`output_norm_tile` in one pass: tile ``t``'s ``R`` rows of every
    chunk decoded, added, summed and stored together (a thread holds ``P * R
    * RGP * G`` values over the program's threads: few enough where
    ``rmsnorm_plan`` chooses this). The residual is loaded before the new one
    is stored, so it may be updated in place, and ``out`` is written once.
    Callers loop over such tiles in one loop: a loop over a larger tile's
    steps inside theirs kept every step's loop-invariant offsets in
    registers (compiled for sm_90: 90 registers at P = 8, against 48)."""
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    SHUFFLE: tl.constexpr = lanes_hold(OUT, res_ptr.dtype.element_ty, w_ptr.dtype.element_ty) and LANES
    PP: tl.constexpr = triton.next_power_of_2(P)
    words, s, r, w, start, offs, m = _step_in(buf_ptr, first, chunk_bytes, payload_bytes, res_ptr, w_ptr, t,
                                              row_groups, cols, msg_groups, chunk_groups, P, PP, G, R, RGP,
                                              RESIDUAL, ALIGNED)
    _step_out(words, s, r, w, start, offs, m, out_ptr, res_out_ptr, cols, eps, PP, RGP, G, HADAMARD, RESIDUAL,
              SHUFFLE, FLIPS)
