"""Echo's 4-bit wire format and the plain-torch reference of every stage.

Format (what travels between ranks)
-----------------------------------
A message is ``rows`` token rows of ``cols`` values (``[tokens, hidden]``; a
1-D message is one row). Its layout is *row-aligned* and *position-owned*:

* each row is cut into ``world_size`` column blocks of ``row_groups``
  groups each (the row is padded with zeros, in index math only, to
  ``world_size * row_groups * group_size`` columns), so a quantization
  group -- and the Hadamard block, which is the group -- never spans two
  rows;
* chunk ``j`` (reduced by rank ``j``) holds column block ``j`` of every
  row, row after row: group ``m`` of chunk ``j`` is row ``m // row_groups``,
  columns ``(j * row_groups + m % row_groups) * group_size`` onwards. Which
  rank owns a value (and keeps its stage-2 error) depends only on its
  column, never on how many rows came along;
* a chunk is padded with zero groups to a multiple of ``ALIGN_GROUPS``
  groups, and is one contiguous byte string, ready for an all-to-all::

    [ payload: chunk_numel / 2 bytes | scales: chunk_numel / group_size bf16 ]

So a row's output bits depend only on that row's inputs and carried error:
reducing rows A alone or inside [A; B] gives the same bits for A.

* payload: two 4-bit codes per byte, element ``2i`` in the low nibble,
  ``2i+1`` in the high nibble; code = q + 8 with q in [-7, 7] (absmax:
  symmetric, zero is exact and round-to-nearest is unbiased; code 0 is
  never written) or [-8, 7] (signed_mse); the value is ``q * scale``
  whatever the encoder (Encoders, below).
* scales: one bf16 per group. bf16 has fp32's exponent range, so no finite
  input overflows it (fp16 scales overflow above 65504 * 7) and groups with
  max below 1e-3 keep full precision (fp16 reciprocals underflow there).
  A group holding NaN or Inf gets a NaN scale and codes 0, so it decodes to
  NaN: non-finite input never comes out finite.

The 8-group alignment makes every chunk a multiple of 16 bytes long (and the
scale block 16-byte aligned inside it) for every supported group size, so
kernels can use 16-byte accesses on the wire buffers.

Encoders (how a group's scale and codes are chosen)
---------------------------------------------------
``EchoConfig.encoder``, in stage 1 and stage 2 alike (the int8 feedback
format keeps absmax with qmax 127); same wire, same 4.5 bits, same decoder.

* ``absmax`` (the default): ``s = bf16(max(amax * fp32(1/7), FLT_MIN))``,
  ``q = round(fp32(u * fp32(1/s)))``, in [-7, 7] without a clamp.
* ``signed_mse``: the scale carries the sign that puts the group's
  largest-magnitude value on q = -8 (of a tie between +amax and -amax,
  the negative value; of zeros, a -0), so all 16 codes are used; each
  ratio ``c`` of :data:`SIGNED_MSE_CLIPS` gives a candidate ``s = -+
  bf16(max(amax * fp32(c) / 8, FLT_MIN))``, quantized as ``q = clamp(
  round(u * fp32(1/s)), -8, 7)`` -- the product rounded once, exact -- and
  the group keeps the first candidate with the least :func:`tree_sum` of
  its squared errors ``(u - q s)**2``. 8/7 is absmax's step: a group of
  values all +-amax (what the rotation makes of one outlier) stays exact,
  where with the extreme on -8 its other sign would clip to +7 -- on
  SmolLM2's real partials signed scales alone erred more than absmax
  (pooled over the calls), with 8/7 beside them less. 1 puts the extreme
  exactly on -8, 0.95 clips it.

  The set is chosen from two measurements (EVAL.md, "The signed_mse
  encoder"): the one-shot error of stage 1's rotated partials of real
  all-reduces and of Gaussian groups (``scripts/experiments/encoder_clips.py``),
  and what each candidate costs the quantizing kernels -- a rounding, a
  dequantization and a sum of squares per value from the same registers,
  a reciprocal per group (``python -m echo_vllm.bench.sass_report
  --encoders absmax,signed_mse``). Three ratios take nearly all of the
  gain; ratios below 0.95 are never kept.

  Range: no candidate decodes beyond ``(1 + 2**-8) amax`` (q >= -8 times a
  ratio-<=-1 scale, ``|q| <= 7`` times 8/7's, :func:`code_bound`), the
  bound of absmax's ``7 * bf16(amax / 7)``, and the largest candidate
  scale, 8/7's, is absmax's, so the same groups are non-finite: the
  guarantees of Range below hold for both encoders. A value the clip cuts
  errs by up to ``code_bound(m) - 7`` steps (1.45 at 0.95), not half a
  step; the group's sum of squares is at most the 8/7 candidate's.
  Stochastic rounding uses the scale the round-to-nearest search chose.

Feedback buffer (what each rank keeps between calls)
----------------------------------------------------
One tensor per local rank, ``[R, row length]``, allocated once at its
largest size and reused at every message size. It holds the carried error
``e`` in *wire order* (chunk after chunk, rotated domain: value ``i`` of
the ``padded_numel`` values of a message is value ``i`` of its stage-1
``u``, sign flips included), so stage 2 updates one contiguous slice, its
own chunk. The rotation (Hadamard and sign flips, ``rotation``) is a
function of the configuration, the same on every call of a chain, so the
error one call leaves is in the domain the next one adds it in. Three
storage formats (``EchoConfig.feedback_dtype``, :data:`FEEDBACK_STORAGE`):

* ``float32`` / ``bfloat16``: value ``i`` is element ``i``, rounded to the
  dtype (round to nearest even) when stored; 4 / 2 bytes per value.
* ``int8``: the buffer is ``torch.int8`` bytes in *blocks* of
  ``ALIGN_GROUPS`` (8) quantization groups of ``g`` values (the wire's
  groups: groups never span two rows, blocks never span two chunks, since
  chunks are whole blocks)::

    block b = groups 8b .. 8b + 7, at bytes b * (8g + 16) onwards:
      [ codes: 8 * g int8, group after group | scales: 8 bf16, same order ]

  so value ``i`` of group ``m = i // g`` is code byte
  ``(m // 8) * (8g + 16) + (m % 8) * g + i % g`` and its scale is the bf16
  at byte ``(m // 8) * (8g + 16) + 8g + 2 * (m % 8)``: a function of ``i``
  alone, never of the message size; every block is 16-byte aligned
  (``8g + 16`` is a multiple of 16 for every supported g), and a buffer of
  ``n`` values takes ``n * (1 + 2 / g)`` bytes (1.0625 bytes per value at
  g = 32: 3.8x less traffic than float32's 4, 1.9x less than bfloat16's 2).
  A group's error ``e`` is stored (:func:`encode_feedback`) as scale
  ``t = bf16(max(amax|e| * fp32(1/127), FLT_MIN))`` and codes
  ``c = round_half_even(e * fp32(1/t))`` in [-127, 127] -- exactly
  :func:`quantize_groups`' scale and rounding with qmax = 127 -- and read
  back (:func:`decode_feedback`) as ``c * t``, an exact product in fp32
  (7 by 8 significant bits, never below FLT_MIN unless 0). A group holding
  NaN or Inf gets a NaN scale and codes 0, so it decodes to NaN; an
  all-zero group (and a zero-filled buffer) decodes to zeros.

  *No clamp is needed*: bf16 rounds ``s32 = amax * fp32(1/127)`` to
  ``t >= s32 / (1 + 2^-8)``, so ``|e| * fp32(1/t) <= 127 * (1 + 2^-8) *
  (1 + 3 * 2^-24) < 127.497`` rounds to at most 127 (the same argument
  gives at most 7 on the wire).

  *Error bound* (the only difference to a float32 buffer besides rounding
  order): ``|e - decode(encode(e))| <= t * (1/2 + 2^-16)`` per value -- half a
  step from rounding to the integer grid, plus ``|e / t| * 2^-23 <= 2^-16``
  steps from the two fp32 roundings in ``e * fp32(1/t)`` -- with ``t <=
  amax|e| / 127 * (1 + 2^-8)``, i.e. at most 0.40% of the group's largest
  carried error (bfloat16 storage: at most 2^-8 = 0.39% of each value
  itself).
  After stage 1 ``|e| <= s / 2`` (``s`` the group's 4-bit step), so the
  stored error moves by at most ``s / 506``, 1/253 of the quantization error
  it carries; unlike that error it does not telescope, and adds up over
  the calls of a forward pass like independent roundings (measured:
  EVAL.md, "Feedback storage").

Range (finite in, finite out)
-----------------------------
Every stage holds the values at a power-of-two fraction of their size:
stage 1 multiplies the input by ``c = 1 / (2 g)`` with the rotation, ``1 /
2`` without (:func:`input_scale`; exact for 16-bit inputs), before the
butterflies, so ``u = W(x c) [+ e]`` never exceeds ``max |x| / 2`` plus the
carried error (``W W = g I``: the unnormalized ``W(x)`` reached ``g max |x|``
and overflowed fp32 above ~3.4e38 / g); the scales, the wire and the
feedback buffer are in that domain, and the output is ``W(D(q2)) *
OUTPUT_SCALE`` (``D(q2) * OUTPUT_SCALE`` without rotation; 2). Stage 2 sums
the P decoded chunks at a further ``2**-k``, ``k = ceil(log2 P)``
(:func:`stage2_shift`), and quantizes that sum as of its full size
(``quantize_groups(shift=k)``), so no partial sum exceeds the largest
decoded value however the ranks' values cancel. Each factor is a power of
two applied where it is exact: wherever the old unscaled arithmetic did not
overflow and no scale clamps, every code and every output is the same (the
scales and the carried error are ``c`` times theirs), so accuracy results
measured before hold.

What that guarantees, ``M`` the largest finite value of the input dtype
(fp32's for fp32):

* one call without carried error, any finite input: ``|u| <= M / 2`` on
  every rank, the rank-order sum stays below ``M``, and every internal
  value is finite for P <= 13 (the stage-2 scale of a sum beyond the range
  stays finite up to there);
* chains of calls whose exact sums are within the range: the carried error
  converges to at most 0.29 M per rank at P = 8 in the worst case (every
  rank's errors aligned, call after call), so ``|u| <= 0.8 M``: finite for
  P <= 9, whatever the inputs (beyond, only if the errors align);
* outputs saturate (:func:`saturate`): a finite result beyond the output
  dtype's range -- an exact sum at the top of the range plus its 4-bit
  error, or an exact sum that itself overflows -- comes out as +-max, never
  +-inf; NaN stays NaN. The exact path's input ``x + rot^-1(e)``
  (:func:`consume_reference`) saturates where ``x`` is finite (an infinite
  ``x`` stays infinite); its 16-bit sum is the transport's (NCCL's partial
  sums overflow near the top as they do without Echo);
* a group whose scale would round to bf16 infinity (reaches
  :data:`BF16_SCALE_LIMIT`: only a stage-2 sum beyond ~7 x bf16 max, P >=
  14 or chains beyond the bounds above) is a non-finite group: NaN out, no
  carried error.

Tiny values pay for this: scales clamp at ``FLT_MIN`` in the wire domain,
``1 / c`` (2 g, or 2) times larger in the input's units, so a group whose
largest rotated value is below about ``7 FLT_MIN / c`` (5.3e-36 at g = 32)
is quantized at a step of ``FLT_MIN``: each quantization errs by at most
``g FLT_MIN`` per output value (3.8e-37 at g = 32; ``FLT_MIN`` without
rotation), an absolute error, so one call without carried error is within
``(P + 1) g FLT_MIN`` of the exact sum. Measured (bf16, P = 4, g = 32,
rotation, one call, RMS error over RMS sum): 0.14 down to magnitudes of
2**-120, 0.22 at 2**-122, 0.77 at 2**-124, everything 0 (relative error 1)
below 2**-126; before, the same curve 2g = 64 times lower (0.77 at
2**-130).

Reference functions
-------------------
``stage1_reference``, ``stage2_reference``, ``output_reference`` and
``consume_reference`` are the specification of the Triton kernels in
``echo_vllm.kernels`` and the numba loops in ``echo_vllm.kernels.cpu_loops``:
same fp32 operations in the same order, so the kernels are compared bit for
bit. Every stage reads and writes the feedback buffer only through
:func:`read_feedback` and :func:`write_feedback` (the formats above).
Three details make the bit-for-bit comparison possible: division
appears only as one correctly rounded ``1 / scale`` per group;
round-to-nearest-even uses the ``(y + 1.5 * 2**23) - 1.5 * 2**23`` identity
(valid for |y| <= 2**22) instead of a library call; and a product is fused
into its sum (one rounding, :func:`fma_exact_product`) exactly where it is
exact -- a code times a scale: the stage-1 error ``u - r * s`` and the
stage-2 sum -- while every other product and sum is rounded on its own (the
kernels are compiled with FMA contraction off and call ``fma`` there).
signed_mse adds two: its codes round the exact product ``u * fp32(1/s)``
(float64 here and in the numba loops, ``fma(u, inv, magic)`` compiled),
and its sums of squares add in :func:`tree_sum`'s order. Stage 2's sum
starts from -0, the additive identity, so that a signed scale's code 8,
which decodes as -0, keeps its sign as in the kernels (which start from the
first chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .config import ENCODERS, FEEDBACK_DTYPES, SUPPORTED_GROUP_SIZES, EchoConfigError
from .rotation import fwht, sign_vector

#: Values per kernel alignment unit, in groups: keeps chunks 16-byte aligned.
ALIGN_GROUPS = 8

#: Smallest normal fp32 (and bf16) number. Scales are clamped to it so that
#: 1 / scale stays finite; an all-zero group quantizes to zeros exactly.
FLT_MIN = 2.0**-126

#: The smallest fp32 that rounds to bf16 infinity (bf16 max plus half its
#: last place, a tie that rounds to even, up): a group whose scale reaches it
#: is treated as non-finite (module docstring, Range).
BF16_SCALE_LIMIT = float.fromhex("0x1.ff0000p+127")

#: The output is ``rot(D(q2)) * OUTPUT_SCALE``: the stages hold the values at
#: half their size (:func:`input_scale`).
OUTPUT_SCALE = 2.0

#: (y + RNE_MAGIC) - RNE_MAGIC rounds y to the nearest integer, ties to even,
#: for |y| <= 2**22 in fp32 arithmetic.
RNE_MAGIC = 12582912.0

#: Code offset: q in [-8, 7] is stored as q + 8 in [0, 15].
CODE_OFFSET = 8

#: The 4-bit wire's largest code magnitude: absmax's qmax (codes in [-7, 7]);
#: signed_mse's codes reach -8.
WIRE_QMAX = 7

#: ``EchoConfig.encoder="signed_mse"``: the ratios ``c`` of the signed
#: scale ``c * amax / 8`` tried for each group, in order (a later one is
#: kept only where it errs strictly less): 8/7 is absmax's step (both signs
#: of a group whose values are all +-amax, as the rotation makes of one
#: outlier, stay exact), 1 the extreme value on -8, 0.95 clips it. Chosen
#: from measurement (module docstring, Encoders).
SIGNED_MSE_CLIPS = (8 / 7, 1.0, 0.95)

#: Wire and scale dtypes.
SCALE_DTYPE = torch.bfloat16
WIRE_DTYPE = torch.uint8

#: ``EchoConfig.feedback_dtype`` -> the feedback buffer's torch dtype
#: (int8: codes and scales in blocks, see the module docstring).
FEEDBACK_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
assert tuple(FEEDBACK_STORAGE) == FEEDBACK_DTYPES, "config.FEEDBACK_DTYPES and quant disagree"

#: Largest code magnitude of the int8 feedback format.
FEEDBACK_QMAX = 127


def inv_qmax_f32(qmax: int) -> torch.Tensor:
    """fp32(1 / qmax): scales are ``amax * inv_qmax`` (a multiply, identical
    in every backend) rather than ``amax / qmax``."""
    return torch.tensor(1.0 / qmax, dtype=torch.float32)


def input_scale(group_size: int, hadamard: bool) -> float:
    """The power of two stage 1 multiplies the input by before anything else:
    ``1 / (2 g)`` with the rotation (``W W = g I``: ``W(x / (2 g))`` holds
    ``x`` at half its size, and no butterfly exceeds ``max |x| / 2``), ``1 / 2``
    without; :data:`OUTPUT_SCALE` undoes it (module docstring, Range)."""
    return 0.5 / group_size if hadamard else 0.5


def stage2_shift(world_size: int) -> int:
    """``k = ceil(log2 P)``: stage 2 sums the P decoded chunks at ``2**-k`` of
    their size, so no partial sum exceeds the largest decoded value."""
    return (world_size - 1).bit_length()


@dataclass(frozen=True)
class WireLayout:
    """Sizes of one all-reduce of ``numel`` values (``numel // cols`` rows of
    ``cols``) over ``world_size`` ranks. ``cols=0`` means one row.

    The sizes are worked out once per layout (``cached_property``: the
    fields are frozen, so they cannot go stale); a call asks for them
    several times, and the communicator keeps one layout per message shape.
    """

    numel: int
    world_size: int
    group_size: int
    cols: int = 0

    def __post_init__(self) -> None:
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise EchoConfigError(f"group_size={self.group_size}: not in {SUPPORTED_GROUP_SIZES}")
        if self.world_size < 2:
            raise EchoConfigError(f"world_size={self.world_size}: Echo needs at least 2 ranks")
        if self.numel < 1:
            raise EchoConfigError(f"numel={self.numel}: nothing to reduce")
        if self.cols == 0:
            object.__setattr__(self, "cols", self.numel)
        if self.cols < 1 or self.numel % self.cols:
            raise EchoConfigError(f"cols={self.cols}: must divide numel={self.numel}")

    @cached_property
    def rows(self) -> int:
        return self.numel // self.cols

    @cached_property
    def row_groups(self) -> int:
        """Groups of one row each rank owns (its column block)."""
        return -(-self.cols // (self.world_size * self.group_size))

    @cached_property
    def padded_cols(self) -> int:
        """Row length with the zero columns that make the blocks whole groups."""
        return self.world_size * self.row_groups * self.group_size

    @cached_property
    def chunk_groups(self) -> int:
        return -(-(self.rows * self.row_groups) // ALIGN_GROUPS) * ALIGN_GROUPS

    @cached_property
    def chunk_numel(self) -> int:
        return self.chunk_groups * self.group_size

    @cached_property
    def padded_numel(self) -> int:
        """Values per rank in wire order (all chunks): the feedback buffer's size."""
        return self.world_size * self.chunk_numel

    @cached_property
    def payload_bytes(self) -> int:
        """Bytes of packed codes in one chunk."""
        return self.chunk_numel // 2

    @cached_property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk on the wire: payload then scales."""
        return self.payload_bytes + 2 * self.chunk_groups

    @cached_property
    def wire_bytes_per_rank(self) -> int:
        """Bytes one rank sends per call: (P-1) chunks in the all-to-all and
        (P-1) copies of its reduced chunk in the all-gather."""
        return 2 * (self.world_size - 1) * self.chunk_bytes

    def ring_bytes_per_rank(self, elem_bytes: int = 2) -> int:
        """Bytes one rank sends in a bandwidth-optimal 16-bit all-reduce of the
        same message (reduce-scatter + all-gather), for comparison."""
        p = self.world_size
        return int(2 * (p - 1) * self.numel * elem_bytes / p)


def to_wire_order(x: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """Message values ``[R, numel]`` -> ``[R, padded_numel]`` in wire order
    (chunk j = column block j of every row; zeros in the padding)."""
    r, lay = x.shape[0], layout
    v = torch.zeros(r, lay.rows, lay.padded_cols, dtype=x.dtype, device=x.device)
    v[:, :, : lay.cols] = x.reshape(r, lay.rows, lay.cols)
    blocks = v.reshape(r, lay.rows, lay.world_size, -1).transpose(1, 2)
    out = torch.zeros(r, lay.world_size, lay.chunk_numel, dtype=x.dtype, device=x.device)
    out[:, :, : lay.rows * lay.row_groups * lay.group_size] = blocks.reshape(r, lay.world_size, -1)
    return out.reshape(r, lay.padded_numel)


def from_wire_order(v: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """Inverse of :func:`to_wire_order`: ``[R, padded_numel]`` -> ``[R, numel]``."""
    r, lay = v.shape[0], layout
    used = lay.rows * lay.row_groups * lay.group_size
    blocks = v.reshape(r, lay.world_size, lay.chunk_numel)[:, :, :used]
    rows = blocks.reshape(r, lay.world_size, lay.rows, -1).transpose(1, 2).reshape(r, lay.rows, -1)
    return rows[:, :, : lay.cols].reshape(r, lay.numel)


# --------------------------------------------------------------------------
# Group quantization
# --------------------------------------------------------------------------


def quantize_groups(
    u: torch.Tensor, qmax: int, noise: torch.Tensor | None = None, *, shift: int = 0, encoder: str = "absmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize fp32 ``u[..., G, g]`` group-wise with ``encoder`` (module
    docstring, Encoders).

    Returns ``(codes uint8 [..., G, g] in [8 + lo, 8 + hi], scales bf16 [..., G],
    err fp32 [..., G, g])`` with ``err = u - dequant`` and ``(lo, hi)`` =
    :func:`code_range`; ``err`` is 0 for non-finite groups (their scale is
    NaN). ``noise`` (uniform [0, 1), same shape as ``u``) switches to
    stochastic rounding ``floor(y + noise)`` (``signed_mse``: with the scale
    its round-to-nearest search chose).

    ``shift``: ``u`` holds the values to quantize times ``2**-shift`` (stage
    2's sum, :func:`stage2_shift`); scales and codes are those of the values
    themselves, ``err`` is in ``u``'s units. Every step is the unshifted one
    times a power of two (the scale's multiplier ``fp32(1/qmax) * 2**shift``,
    the rounding's magic number ``RNE_MAGIC * 2**-shift``): the same bits
    wherever the unshifted arithmetic does not overflow.

    Error bound (absmax): for finite groups, |err| <= scale / 2 element-wise
    for round-to-nearest (< scale for stochastic), scale = bf16(amax / qmax).
    """
    assert u.dtype == torch.float32
    scales, s, inv, bad = group_scales(u, qmax, shift, encoder)
    lo, hi = code_range(qmax, encoder)
    unit = 2.0**-shift
    if noise is None:
        r = _nearest(u, inv.unsqueeze(-1), lo, hi, shift, encoder)
    else:
        y = u * inv.unsqueeze(-1)  # code * 2**-shift
        r = torch.clamp(torch.floor(y * 2.0**shift + noise), float(lo), float(hi)) * unit
    r = torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=r.dtype), r)
    codes = (r * 2.0**shift + CODE_OFFSET).to(WIRE_DTYPE)
    err = fma_exact_product(-r, s.unsqueeze(-1), u)
    err = torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=err.dtype), err)
    return codes, scales, err


def code_range(qmax: int, encoder: str = "absmax") -> tuple[int, int]:
    """``(lo, hi)``: the codes ``q`` (stored as ``q + 8``) ``encoder`` writes:
    ``[-qmax, qmax]`` for absmax, ``[-8, 7]`` for signed_mse (the 4-bit
    wire's only: ``qmax`` must be :data:`WIRE_QMAX`)."""
    if encoder == "absmax":
        return -qmax, qmax
    if qmax != WIRE_QMAX:
        raise ValueError(f"qmax={qmax}: signed_mse is defined for the 4-bit wire (qmax {WIRE_QMAX})")
    return -(WIRE_QMAX + 1), WIRE_QMAX


def _nearest(u: torch.Tensor, inv: torch.Tensor, lo: int, hi: int, shift: int, encoder: str) -> torch.Tensor:
    """``u * inv`` rounded to the nearest multiple of ``2**-shift`` (ties to
    even), clamped to ``[lo, hi] * 2**-shift``. absmax rounds the fp32
    product ``u * inv`` (two roundings); signed_mse the exact product (one
    rounding, what ``fma(u, inv, magic)`` computes; formed in float64, where
    a product of two fp32 values is exact)."""
    unit = 2.0**-shift
    if encoder == "absmax":
        return round_half_even(torch.clamp(u * inv, lo * unit, hi * unit), shift)
    # torch.round: ties to even; + 0.0 makes a code 0 of a negative product +0,
    # as the magic-number rounding's (its t - magic) is
    q = torch.round(u.double() * inv.double() * 2.0**shift) + 0.0
    return (torch.clamp(q, lo, hi) * unit).float()


def group_scales(
    u: torch.Tensor, qmax: int, shift: int = 0, encoder: str = "absmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scale of each group of fp32 ``u[..., G, g]`` (values times
    ``2**-shift``, :func:`quantize_groups`) under ``encoder``:
    ``(scales bf16 [..., G], s fp32, inv fp32, bad bool)``.

    absmax (codes in [-qmax, qmax]): ``s = bf16(max(amax * (fp32(1/qmax) *
    2**shift), FLT_MIN))`` over the finite values; signed_mse:
    :func:`_signed_mse_scales`. ``inv = fp32(1 / s)`` (one correctly rounded
    division per group), ``bad``: the group holds NaN or Inf, or its scale
    reaches :data:`BF16_SCALE_LIMIT` (it would round to infinity); ``scales``
    is ``s`` with NaN where ``bad``. absmax is shared by the wire format and
    the int8 feedback buffer."""
    if encoder not in ENCODERS:
        raise EchoConfigError(f"encoder={encoder!r}: choose one of {', '.join(ENCODERS)}")
    finite = torch.isfinite(u)
    amax = torch.where(finite, u.abs(), torch.zeros((), dtype=u.dtype)).amax(dim=-1)
    if encoder == "signed_mse":
        s16, bad = _signed_mse_scales(u, finite, amax, qmax, shift)
    else:
        s_raw = amax * (inv_qmax_f32(qmax) * 2.0**shift)
        bad = ~finite.all(dim=-1) | ~(s_raw < BF16_SCALE_LIMIT)
        s16 = _bf16_scale(s_raw)
    s = s16.float()
    inv = 1.0 / s
    scales = torch.where(bad, torch.full((), float("nan"), dtype=SCALE_DTYPE), s16)
    return scales, s, inv, bad


def _bf16_scale(s_raw: torch.Tensor) -> torch.Tensor:
    """``bf16(max(s_raw, FLT_MIN))``: a scale as stored (nearest even)."""
    return torch.clamp_min(s_raw, FLT_MIN).to(SCALE_DTYPE)


def clip_multipliers() -> tuple[float, ...]:
    """signed_mse's scale multipliers, one per :data:`SIGNED_MSE_CLIPS`
    ratio ``c``: ``fp32(c) / 8`` (exact: a power of two; ``fp32(1/7)`` for
    8/7), as Python floats: the kernels' constants."""
    return tuple(float(torch.tensor(c, dtype=torch.float32)) / (WIRE_QMAX + 1) for c in SIGNED_MSE_CLIPS)


def code_bound(multiplier: float) -> float:
    """The largest ``|u * fp32(1 / s)|`` of a group quantized with the
    scale ``s = bf16(max(fp32(amax * multiplier), FLT_MIN))`` (``|u| <=
    amax``): ``fp32(amax * m)`` is at most ``2**-24`` below ``amax * m``,
    the bf16 rounding at most ``2**-8`` below that (the clamp to ``FLT_MIN``
    only raises it), the reciprocal at most ``2**-24`` above ``1 / s``.
    A code of an exact product below 8.5 (7.5) in magnitude rounds to at
    least -8 (at most 7): the clamp there cannot act."""
    return (1.0 / multiplier) * (1 + 2.0**-24) / ((1 - 2.0**-24) * (1 - 2.0**-8))


def _signed_mse_scales(
    u: torch.Tensor, finite: torch.Tensor, amax: torch.Tensor, qmax: int, shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """signed_mse's scales ``(s16 bf16 [..., G], bad bool [..., G])`` of the
    groups of ``u`` (``amax``: their largest finite magnitude).

    The scale's sign puts the group's largest-magnitude value on code -8:
    positive if that value is negative, negative if it is positive; where
    both ``+amax`` and ``-amax`` occur (or only zeros, one of them -0), the
    negative one decides (a positive scale). Candidate ``k`` is ``sign *
    bf16(max(amax * (m_k * 2**shift), FLT_MIN))``, ``m_k`` of
    :func:`clip_multipliers`; its error is that of :func:`_nearest`'s codes
    (the stored scale, its correctly rounded reciprocal, codes clamped to
    [-8, 7]), and the group keeps the first candidate whose :func:`tree_sum`
    of squared errors is the smallest (a later one must be strictly
    smaller). ``bad`` as for absmax, with the largest multiplier (no
    candidate's scale rounds to infinity)."""
    lo, hi = code_range(qmax, "signed_mse")
    mults = clip_multipliers()
    top = finite & (u.abs() == amax.unsqueeze(-1))
    sign = torch.where((top & torch.signbit(u)).any(dim=-1), 1.0, -1.0)
    bad = ~finite.all(dim=-1) | ~(amax * (max(mults) * 2.0**shift) < BF16_SCALE_LIMIT)
    best = best_sse = None
    for m in mults:
        s16 = (_bf16_scale(amax * (m * 2.0**shift)).float() * sign).to(SCALE_DTYPE)  # exact: a sign change
        s = s16.float().unsqueeze(-1)
        err = fma_exact_product(-_nearest(u, 1.0 / s, lo, hi, shift, "signed_mse"), s, u)
        sse = tree_sum(err * err)
        if best is None:
            best, best_sse = s16, sse
        else:
            better = sse < best_sse
            best, best_sse = torch.where(better, s16, best), torch.where(better, sse, best_sse)
    return best, bad


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dimension (a power of two) as a balanced tree:
    adjacent pairs first (elements ``2i`` and ``2i + 1``), then pairs of
    those, each add rounded on its own -- the order the kernels add in
    (registers, then lanes), so the sum has the same bits everywhere."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def round_half_even(y: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """fp32 ``y`` rounded to the nearest multiple of ``2**-shift``, ties to
    even, by the magic-number identity (exact for |y| <= 2**(22 - shift);
    what the kernels compute)."""
    magic = RNE_MAGIC * 2.0**-shift
    return (y + magic) - magic


def fma_exact_product(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once, for fp32 ``a, b`` whose product is
    exact in fp32 (a code times a bf16 scale: at most 11 significant bits)
    -- what the kernels' ``fma`` computes. Formed in float64, where the
    product and the sum are exact (the exponents differ by little: either
    ``a * b`` is the larger or ``c`` is within a few binades of it), then
    rounded to fp32 once; unlike ``c + a * b`` in fp32 it does not overflow
    where only the product would."""
    return (c.double() + a.double() * b.double()).float()


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``(code - 8) * scale`` for ``codes [..., G, g]``, ``scales [..., G]``."""
    q = codes.float() - CODE_OFFSET
    return q * scales.float().unsqueeze(-1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2k] (each < 16) -> bytes [..., k]: even index low."""
    lo = codes[..., 0::2]
    hi = codes[..., 1::2]
    return lo | (hi << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# --------------------------------------------------------------------------
# The feedback buffer (formats: module docstring)
# --------------------------------------------------------------------------


def feedback_block_bytes(group_size: int) -> int:
    """Bytes of one block of the int8 feedback format: ``ALIGN_GROUPS``
    groups of codes, then their ``ALIGN_GROUPS`` bf16 scales."""
    return ALIGN_GROUPS * (group_size + 2)


def feedback_row_len(numel: int, dtype: torch.dtype, group_size: int) -> int:
    """Elements of ``dtype`` one rank's buffer needs to hold wire-order
    values ``0 .. numel - 1`` (int8: whole blocks of ``ALIGN_GROUPS``
    groups; a wire layout's ``padded_numel`` is always whole blocks)."""
    if dtype == torch.int8:
        return -(-numel // (ALIGN_GROUPS * group_size)) * feedback_block_bytes(group_size)
    return numel


def encode_feedback(e: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 errors ``e [..., n]`` (``n`` whole blocks of ``ALIGN_GROUPS *
    group_size`` values) -> int8 blocks ``[..., feedback_row_len(n)]``:
    per group ``t = bf16(max(amax * fp32(1/127), FLT_MIN))`` and codes
    ``round_half_even(e * fp32(1/t))`` (no clamp: they stay in [-127, 127],
    module docstring), NaN scale and codes 0 for a non-finite group.
    ``|e - decode_feedback(encode_feedback(e))| <= t * (1/2 + 2^-16)``."""
    g, lead, n = group_size, e.shape[:-1], e.shape[-1]
    assert e.dtype == torch.float32 and n % (ALIGN_GROUPS * g) == 0, (e.dtype, n, g)
    groups = e.reshape(*lead, n // (ALIGN_GROUPS * g), ALIGN_GROUPS, g)
    scales, _, inv, bad = group_scales(groups, FEEDBACK_QMAX)
    r = round_half_even(groups * inv.unsqueeze(-1))
    r = torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=r.dtype), r)
    codes = r.to(torch.int8).flatten(-2)
    return torch.cat((codes, scales.contiguous().view(torch.int8)), dim=-1).flatten(-2)


def decode_feedback(blocks: torch.Tensor, group_size: int) -> torch.Tensor:
    """int8 blocks ``[..., k * feedback_block_bytes]`` -> fp32 ``code * t``
    ``[..., k * ALIGN_GROUPS * group_size]`` (exact products)."""
    g, lead = group_size, blocks.shape[:-1]
    b = blocks.reshape(*lead, -1, feedback_block_bytes(g))
    codes = b[..., : ALIGN_GROUPS * g].reshape(*b.shape[:-1], ALIGN_GROUPS, g).float()
    scales = b[..., ALIGN_GROUPS * g :].contiguous().view(SCALE_DTYPE).float()
    return (codes * scales.unsqueeze(-1)).reshape(*lead, -1)


def _feedback_span(feedback: torch.Tensor, start: int, n: int, g: int) -> slice:
    """The elements of ``feedback``'s rows that hold values ``start .. start + n``."""
    if feedback.dtype != torch.int8:
        return slice(start, start + n)
    assert start % (ALIGN_GROUPS * g) == 0, (start, g)  # chunks begin on a block
    first = feedback_row_len(start, torch.int8, g)
    return slice(first, first + feedback_row_len(n, torch.int8, g))


def read_feedback(feedback: torch.Tensor, start: int, n: int, group_size: int) -> torch.Tensor:
    """Carried errors ``start .. start + n`` (wire order) of every row of
    ``feedback`` (any format), as fp32 ``[R, n]``."""
    span = feedback[:, _feedback_span(feedback, start, n, group_size)]
    if feedback.dtype == torch.int8:
        return decode_feedback(span, group_size)
    return span.float()


def write_feedback(feedback: torch.Tensor, start: int, e: torch.Tensor, group_size: int) -> None:
    """Store fp32 errors ``e [R, n]`` as values ``start .. start + n`` of
    ``feedback``'s rows, in its format (in place)."""
    span = _feedback_span(feedback, start, e.shape[-1], group_size)
    if feedback.dtype == torch.int8:
        feedback[:, span] = encode_feedback(e, group_size)
    else:
        feedback[:, span] = e.to(feedback.dtype)


# --------------------------------------------------------------------------
# Chunks on the wire
# --------------------------------------------------------------------------


def encode_chunks(codes: torch.Tensor, scales: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """codes [R, K*C] + scales [R, K*C/g] -> wire [R, K, chunk_bytes] for K chunks."""
    r = codes.shape[0]
    c, g = layout.chunk_numel, layout.group_size
    k = codes.numel() // (r * c)
    payload = pack_nibbles(codes.reshape(r, k, c))
    scale_bytes = scales.reshape(r, k, c // g).contiguous().view(WIRE_DTYPE)
    return torch.cat((payload, scale_bytes), dim=-1)


def decode_codes(wire: torch.Tensor, layout: WireLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """wire [..., chunk_bytes] -> ``(q, scales)``: fp32 ``code - 8``
    [..., G, g] and fp32 scales [..., G, 1] (G groups per chunk)."""
    c, g = layout.chunk_numel, layout.group_size
    payload = wire[..., : layout.payload_bytes]
    scales = wire[..., layout.payload_bytes :].contiguous().view(SCALE_DTYPE)
    q = unpack_nibbles(payload).reshape(*wire.shape[:-1], c // g, g).float() - CODE_OFFSET
    return q, scales.float().unsqueeze(-1)


def decode_chunks(wire: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """wire [..., chunk_bytes] -> fp32 values [..., chunk_numel]."""
    q, s = decode_codes(wire, layout)
    return (q * s).reshape(*wire.shape[:-1], layout.chunk_numel)


# --------------------------------------------------------------------------
# The three stages of one Echo all-reduce (reference = kernel specification)
# --------------------------------------------------------------------------


def _rotate(v: torch.Tensor, g: int) -> torch.Tensor:
    return fwht(v.reshape(*v.shape[:-1], -1, g)).reshape(v.shape)


def _flip(v: torch.Tensor, flips: int, g: int) -> torch.Tensor:
    """``v [..., n]`` (whole groups of ``g``) with value ``i`` of every group
    times ``rotation.sign_vector(flips)[i]``: exact, the identity for ``flips = 0``."""
    return (v.reshape(*v.shape[:-1], -1, g) * sign_vector(flips, g, v.device)).reshape(v.shape)


def stage1_reference(
    x: torch.Tensor,
    feedback: torch.Tensor | None,
    layout: WireLayout,
    *,
    qmax: int = 7,
    hadamard: bool = False,
    has_incoming: bool = False,
    noise: torch.Tensor | None = None,
    flips: int = 0,
    encoder: str = "absmax",
) -> torch.Tensor:
    """Quantize each local rank's input plus its carried error (with
    ``encoder``: :func:`quantize_groups`).

    ``x``: [R, numel] (any float dtype). ``feedback``: a buffer holding at
    least ``padded_numel`` values per row (float32, bfloat16 or int8 blocks:
    :func:`feedback_row_len`) or None (no feedback). If ``has_incoming`` the
    buffer's first ``padded_numel`` values are added to the (rotated) input;
    the new stage-1 error is written back in place. Returns wire [R, P, chunk_bytes].
    Order: u = rot(flip(wire_order(x) * input_scale)) [+ e]; quantize;
    e <- u - dequant(q). ``flips``: the sign pattern of ``rotation.sign_flips``
    (0: none), applied before the Hadamard.
    """
    r, np_, g = x.shape[0], layout.padded_numel, layout.group_size
    u = to_wire_order(x.float(), layout) * input_scale(g, hadamard)  # exact for 16-bit inputs
    u = _flip(u, flips, g)
    if hadamard:
        u = _rotate(u, g)
    if feedback is not None and has_incoming:
        u = u + read_feedback(feedback, 0, np_, g)
    codes, scales, err = quantize_groups(
        u.reshape(r, np_ // g, g), qmax, None if noise is None else noise.reshape(r, np_ // g, g), encoder=encoder
    )
    if feedback is not None:
        write_feedback(feedback, 0, err.reshape(r, np_), g)
    return encode_chunks(codes.reshape(r, np_), scales.reshape(r, -1), layout)


def stage2_reference(
    recv: torch.Tensor,
    feedback: torch.Tensor | None,
    own_chunks: list[int],
    layout: WireLayout,
    *,
    qmax: int = 7,
    noise: torch.Tensor | None = None,
    encoder: str = "absmax",
) -> torch.Tensor:
    """Reduce the chunks each local rank received and requantize the sum
    (with ``encoder``: :func:`quantize_groups`).

    ``recv``: [R, P, chunk_bytes], ``recv[r, i]`` = rank i's chunk for local
    rank r (whose chunk index is ``own_chunks[r]``). The sum runs in fp32 in
    rank order 0..P-1 (the same order on every rank and in every transport),
    at ``2**-k`` of its size (:func:`stage2_shift`; each scale times ``2**-k``,
    exact), and is requantized as of its full size (``quantize_groups(shift=k)``).
    The requantization error, times ``2**k``, is added (one fp32 rounding) to
    the feedback buffer's own chunk, which is stored again in the buffer's
    format. Returns wire [R, chunk_bytes].
    """
    r, p = recv.shape[0], recv.shape[1]
    c, g = layout.chunk_numel, layout.group_size
    k = stage2_shift(p)
    # -0 is the additive identity (x + -0 == x for every x, -0 too): the sum is
    # of the P terms alone (a signed_mse scale decodes code 8 as -0)
    acc = torch.full((r, c // g, g), -0.0, dtype=torch.float32, device=recv.device)
    for i in range(p):  # acc + code * scale * 2**-k, rounded once (the product is exact)
        q, s = decode_codes(recv[:, i], layout)
        acc = fma_exact_product(q, s * 2.0**-k, acc)
    codes, scales, err = quantize_groups(acc, qmax, None if noise is None else noise.reshape(r, c // g, g), shift=k,
                                         encoder=encoder)
    if feedback is not None:
        for n, j in enumerate(own_chunks):
            row = feedback[n : n + 1]
            e = fma_exact_product(err[n].reshape(1, c), torch.tensor(2.0**k), read_feedback(row, j * c, c, g))
            write_feedback(row, j * c, e, g)
    return encode_chunks(codes.reshape(r, c), scales.reshape(r, -1), layout)[:, 0]


def output_reference(
    gathered: torch.Tensor, layout: WireLayout, out_dtype: torch.dtype, *, hadamard: bool = False, flips: int = 0
) -> torch.Tensor:
    """Decode the all-gathered chunks [P, chunk_bytes] into [numel] values of
    ``out_dtype``: y = flip(rot(q2 * OUTPUT_SCALE) * scale) with rotation,
    flip(q2 * OUTPUT_SCALE * scale) without, then :func:`saturate`
    (``flips``: :func:`stage1_reference`'s, undone after the inverse
    Hadamard). Every step before the cast is exact (integers below 2**11
    times a bf16 scale, then signs), so this is rot^-1(dequant(q2)) rounded once."""
    q, s = decode_codes(gathered, layout)
    q = q * OUTPUT_SCALE
    v = _flip((fwht(q) if hadamard else q) * s, flips, layout.group_size)
    return saturate(from_wire_order(v.reshape(1, layout.padded_numel), layout)[0], out_dtype)


def consume_reference(
    x: torch.Tensor, feedback: torch.Tensor, layout: WireLayout, *, hadamard: bool = False, flips: int = 0
) -> torch.Tensor:
    """The input of an exact (16-bit) call that absorbs the carried error:
    x + flip(rot(e)) * OUTPUT_SCALE (the error at its full size, unrotated:
    ``flips`` as :func:`output_reference`'s), rounded to x's dtype; where x
    is finite the sum saturates (:func:`saturate`), an infinite x stays
    infinite. ``x``: [R, numel]."""
    e = read_feedback(feedback, 0, layout.padded_numel, layout.group_size)
    if hadamard:
        e = _rotate(e, layout.group_size)
    e = _flip(e, flips, layout.group_size) * OUTPUT_SCALE
    return saturate(x.float() + from_wire_order(e, layout), x.dtype, where=~torch.isinf(x))


def saturate(v: torch.Tensor, dtype: torch.dtype, where: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``v`` rounded to ``dtype`` (nearest even), values beyond its
    finite range (infinities included) to its largest finite value of the
    same sign (only ``where`` true, if given); NaN stays NaN. Clamping first
    or after the cast gives the same: what a saturating conversion computes."""
    big = torch.finfo(dtype).max
    clamped = torch.clamp(v, -big, big)
    return (clamped if where is None else torch.where(where, clamped, v)).to(dtype)
