"""The 4-bit group format: packing, error bound, adversarial groups, layout."""

import math

import pytest
import torch

from echo_vllm.config import ENCODERS, EchoConfigError
from echo_vllm.quant import (
    ALIGN_GROUPS,
    FLT_MIN,
    WireLayout,
    decode_chunks,
    dequantize_groups,
    encode_chunks,
    pack_nibbles,
    quantize_groups,
    unpack_nibbles,
)

QMAX = 7


def _quant(u: torch.Tensor, g: int, encoder: str = "absmax"):
    codes, scales, err = quantize_groups(u.reshape(-1, g), QMAX, encoder=encoder)
    return codes, scales, err, dequantize_groups(codes, scales)


def test_pack_unpack_round_trip_is_exact():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)
    # element 2i in the low nibble, 2i+1 in the high nibble
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)


@pytest.mark.parametrize("g", [16, 32, 64, 128])
@pytest.mark.parametrize("scale", [1.0, 1e-5, 3.0e5, 1.0e30])
def test_error_within_half_scale(g, scale):
    torch.manual_seed(g)
    u = torch.randn(200, g) * scale
    u[::7, 3] *= 40  # outliers set the scale of their group
    codes, scales, err, dq = _quant(u, g)
    s = scales.float().unsqueeze(-1)
    # Round-to-nearest: |u - q*s| <= s/2 for every element (clamping at
    # +-7 costs at most amax - 7*bf16(amax/7) <= 7*s*2^-8 < s/2).
    assert torch.all(err.abs() <= s / 2)
    assert torch.equal(err, u - dq)
    assert int(codes.min()) >= 1 and int(codes.max()) <= 15
    # the scale is bf16(amax / 7): within bf16's half-ULP relative rounding
    amax = u.abs().amax(-1)
    assert torch.allclose(scales.float(), amax / 7, rtol=2**-8, atol=0)


def test_scale_neither_overflows_nor_underflows():
    g = 32
    big = torch.full((1, g), 333824.0)  # gpt-oss activations: > fp16 max
    tiny = torch.linspace(-9e-4, 9e-4, g).reshape(1, g)  # max below 1e-3
    huge = torch.full((1, g), 1.0e38)
    for u in (big, tiny, huge):
        _, scales, err, dq = _quant(u, g)
        assert torch.isfinite(scales.float()).all()
        assert torch.isfinite(dq).all()
        # relative error of the group bounded by half a step / amax = 1/14
        assert (err.abs().max() / u.abs().max()).item() <= 1 / 14 + 2**-8
    # a tiny group keeps its precision: not flushed to zero
    _, _, _, dq = _quant(tiny, g)
    assert (dq != 0).sum() > g // 2


@pytest.mark.parametrize("encoder", ENCODERS)
def test_zero_and_signed_zero_groups_are_exact(encoder):
    g = 32
    u = torch.zeros(3, g)
    u[1] = -0.0
    u[2, ::2] = -0.0
    codes, scales, err, dq = _quant(u, g, encoder)
    assert torch.equal(dq, torch.zeros_like(dq))  # -0 == 0
    assert torch.equal(err.abs(), torch.zeros_like(err))
    assert torch.all(scales.float().abs() == FLT_MIN)


def test_one_outlier_group():
    g = 32
    u = torch.zeros(1, g)
    u[0, 5] = 100.0
    u[0, 6] = 1.0
    _, scales, _, dq = _quant(u, g)
    assert dq[0, 5].item() == pytest.approx(100.0, rel=2**-8)
    # |1| < s/2 = 100/14: rounds to zero, as the bound allows
    assert dq[0, 6].item() == 0.0


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_groups_come_out_non_finite(bad, encoder):
    g = 32
    u = torch.randn(4, g)
    u[2, 7] = bad
    codes, scales, err, dq = _quant(u, g, encoder)
    assert not torch.isfinite(dq[2]).any(), "a non-finite group must never decode finite"
    assert torch.isfinite(dq[[0, 1, 3]]).all(), "other groups are untouched"
    assert torch.isfinite(err).all(), "carried error stays finite (not spread to later calls)"
    assert torch.isnan(scales[2].float())


def test_stochastic_rounding_is_unbiased():
    g = 32
    torch.manual_seed(0)
    u = torch.rand(1, g) * 7.0
    u[0, 0] = 7.0  # fixes the scale at 1.0 (bf16-exact)
    n = 4000
    noise = torch.rand(n, g)
    codes, scales, _ = quantize_groups(u.expand(n, g).contiguous(), QMAX, noise)
    dq = dequantize_groups(codes, scales)
    assert torch.all(scales.float() == 1.0)
    # E[dq] = u; each sample is u +- at most 1 step, variance <= 1/4:
    # the mean of n samples is within 5 standard errors (5 * 0.5 / sqrt(n)).
    assert torch.all((dq.mean(0) - u[0]).abs() <= 5 * 0.5 / math.sqrt(n))
    assert torch.all((dq - u).abs() < 1.0)


@pytest.mark.parametrize("numel", [1, 31, 1000, 4096, 12345])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("g", [16, 32, 128])
def test_layout_pads_and_aligns(numel, world, g):
    lay = WireLayout(numel, world, g)
    assert lay.padded_numel >= numel
    assert lay.padded_numel % (world * ALIGN_GROUPS * g) == 0
    assert lay.padded_numel - numel < world * ALIGN_GROUPS * g
    assert lay.chunk_bytes % 16 == 0 and lay.payload_bytes % 16 == 0
    assert lay.chunk_bytes == lay.chunk_numel // 2 + 2 * (lay.chunk_numel // g)


def test_a_layout_whose_sizes_were_read_is_the_same_key():
    # the sizes are cached on the instance: they must not change its equality
    # or hash, layouts being dictionary keys (the communicator's, plan caches)
    read, fresh = WireLayout(4096, 4, 32, 512), WireLayout(4096, 4, 32, 512)
    sizes = (read.rows, read.padded_cols, read.padded_numel, read.chunk_bytes, read.wire_bytes_per_rank)
    assert sizes == (8, 512, 4096, 576, 3456)  # 1024 values a chunk: 512 bytes of codes, 32 bf16 scales
    assert read == fresh and hash(read) == hash(fresh) and repr(read) == repr(fresh)
    assert {fresh: 1}[read] == 1


def test_layout_rejects_bad_input():
    with pytest.raises(EchoConfigError, match="world_size"):
        WireLayout(100, 1, 32)
    with pytest.raises(EchoConfigError, match="group_size"):
        WireLayout(100, 2, 48)
    with pytest.raises(EchoConfigError, match="numel"):
        WireLayout(0, 2, 32)


def test_encode_decode_chunks_round_trip():
    lay = WireLayout(3000, 3, 32)
    torch.manual_seed(1)
    u = torch.randn(2, lay.padded_numel)
    codes, scales, _ = quantize_groups(u.reshape(2, -1, 32), QMAX)
    wire = encode_chunks(codes.reshape(2, -1), scales.reshape(2, -1), lay)
    assert wire.shape == (2, 3, lay.chunk_bytes) and wire.dtype == torch.uint8
    back = decode_chunks(wire, lay).reshape(2, -1)
    assert torch.equal(back, dequantize_groups(codes, scales).reshape(2, -1))
    # wire bits per value: 4 + 16/g
    assert lay.chunk_bytes * 8 / lay.chunk_numel == pytest.approx(4 + 16 / 32)


# -- range: finite in, finite out (quant's docstring, Range) ---------------------------

from support.extremes import PATTERNS, error_steps, extreme_inputs, one_call_bound  # noqa: E402

from echo_vllm import CallSlot, EchoConfig, FeedbackChain, Path, StackedCommunicator, VirtualTransport  # noqa: E402
from echo_vllm import quant  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("case", ["one rank at 7e37", "+-3e38 cancelling", "two pairs of +-3e38"])
def test_the_reported_inputs_come_out_finite(case, hadamard, encoder):
    """Values whose exact sum is finite (7e37 on one rank of 4; +3e38 and
    -3e38, or two such pairs, cancelling to 0): finite and within the
    call's bound, not NaN (the unnormalized rotation overflowed above
    ~3.4e38 / g, the rank-order sum when large values cancelled)."""
    x = torch.zeros(4, 2, 256, dtype=torch.bfloat16)
    if case == "one rank at 7e37":
        x[0] = 7e37
    elif case == "+-3e38 cancelling":
        x[0], x[1] = 3e38, -3e38
    else:
        x[0], x[1], x[2], x[3] = 3e38, 3e38, -3e38, -3e38
    comm = StackedCommunicator(EchoConfig(min_bytes=0, first_exact_calls=0, hadamard=hadamard, encoder=encoder),
                               VirtualTransport(4))
    y = comm.all_reduce(x, slot=CallSlot(7))
    assert comm.stats.snapshot()["calls"] == {"echo/echo": 1}
    assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} non-finite outputs"
    lay = WireLayout(512, 4, 32, 256)
    y_ref, s, bound = one_call_bound(x.reshape(4, -1), lay, torch.bfloat16, hadamard=hadamard, encoder=encoder)
    assert torch.equal(y.reshape(-1).view(torch.int16), y_ref.view(torch.int16))
    assert ((y_ref.double() - s).abs() <= bound).all()


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_one_call_is_within_its_bound_at_every_magnitude(pattern, dt, world, hadamard, encoder):
    """From the dtype's smallest subnormal to its largest finite value (one
    rank, the others pulling the sum inward), cancelling pairs at the top of
    the range, subnormals on every rank: every output is finite and within
    the analytic bound of one call (support.extremes.one_call_bound: relative
    to the wire scales, so absolute for tiny groups, whose scales clamp)."""
    g, dtype = 32, DTYPES[dt]
    x = extreme_inputs(pattern, world, 12, 2 * g + 5, dtype, seed=world)
    lay = WireLayout(x[0].numel(), world, g, x.shape[-1])
    y, s, bound = one_call_bound(x.reshape(world, -1), lay, dtype, hadamard=hadamard, encoder=encoder)
    assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} non-finite outputs of finite sums"
    err = (y.double() - s).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), f"|y - S| = {err[worst].item():g} > {bound[worst].item():g} at {worst} (S = {s[worst].item():g})"


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("fb", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_chains_stay_finite_at_every_magnitude(pattern, dt, world, fb, encoder):
    """Four Echo calls of one chain (each call's error carried into the
    next: the worst case of quant's Range analysis) and an exact call that
    absorbs the last error, every call at the edges of the range: every
    Echo output is finite, the carried error stays finite, and so does
    each rank's input plus that error (saturated; what the 16-bit sum then
    makes of inputs near the top is the transport's: partial sums of fp32
    rank order overflow as they would without Echo)."""
    dtype = DTYPES[dt]
    for hadamard in (True, False):
        cfg = EchoConfig(min_bytes=0, hadamard=hadamard, feedback_dtype=fb, encoder=encoder)
        # the exact path hands back its input, the carried error absorbed
        comm = StackedCommunicator(cfg, VirtualTransport(world), exact_all_reduce=lambda xs: xs)
        chain = FeedbackChain.of(cfg, world, "cpu")
        for t in range(4):
            x = extreme_inputs(pattern, world, 12, 69, dtype, seed=10 * t + world)
            y = comm.all_reduce(x, slot=CallSlot(t), path=Path.ECHO, chain=chain)
            assert torch.isfinite(y).all(), f"call {t} (had={hadamard}): {int((~torch.isfinite(y)).sum())} non-finite"
        lay = WireLayout(12 * 69, world, cfg.group_size, 69)
        fb_now = chain.buffer(lay.padded_numel).clone()
        assert torch.isfinite(quant.read_feedback(fb_now, 0, lay.padded_numel, 32)).all()
        x = extreme_inputs(pattern, world, 12, 69, dtype, seed=99)
        consumed = quant.consume_reference(x.reshape(world, -1), fb_now, lay, hadamard=hadamard)
        assert torch.isfinite(consumed).all(), f"input plus carried error (had={hadamard})"
        absorbed = comm.all_reduce(x.clone(), slot=CallSlot(4), path=Path.EXACT, chain=chain)
        assert torch.equal(absorbed.reshape(world, -1), consumed)


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("hadamard", [True, False])
def test_outputs_saturate_at_the_top_of_the_range(dt, hadamard, encoder):
    """An exact sum at the dtype's max, whose 4-bit error may push it past
    (one value at max among smaller ones), and sums beyond the range (every
    rank at max): the output is +-max where it would overflow, never +-inf;
    a NaN input still comes out NaN."""
    dtype = DTYPES[dt]
    big = torch.finfo(dtype).max
    lay = WireLayout(4 * 32, 4, 32)
    x = torch.zeros(4, 4 * 32, dtype=torch.float64)
    x[0, :32] = big * torch.linspace(-1, 1, 32, dtype=torch.float64)  # -max .. max in one group
    x[:, 32:64] = big  # the sum is 4 max
    x[:, 64:96] = -big
    x[0, 96:128] = big
    x[0, 100] = float("nan")  # a non-finite group stays non-finite
    x = x.to(dtype)
    wire = quant.stage1_reference(x, None, lay, hadamard=hadamard, encoder=encoder)
    q2 = quant.stage2_reference(wire.transpose(0, 1).contiguous(), None, [0, 1, 2, 3], lay, encoder=encoder)
    y = quant.output_reference(q2, lay, dtype, hadamard=hadamard)
    assert torch.isfinite(y[:96]).all() and not torch.isinf(y).any()
    assert (y[32:64] == big).all() and (y[64:96] == -big).all()
    assert torch.isnan(y[96:128]).all()


def test_consume_saturates_finite_inputs_and_keeps_infinities():
    """The exact path's input plus the carried error: past the top of the
    range only because of the error, it saturates; an infinite input stays
    infinite (and NaN NaN)."""
    lay = WireLayout(64, 2, 32)
    fb = torch.full((2, lay.padded_numel), 64.0)  # carried error +64 (wire domain) on every value
    x = torch.full((2, 64), 65504.0, dtype=torch.float16)
    x[0, 1], x[0, 2], x[1, 3] = float("inf"), float("-inf"), float("nan")
    for hadamard in (False, True):
        c = quant.consume_reference(x, fb, lay, hadamard=hadamard)
        assert c[0, 1] == float("inf") and c[0, 2] == float("-inf") and torch.isnan(c[1, 3])
        finite = torch.isfinite(x)
        assert (c[finite] == 65504.0).all(), "x + error past fp16 max saturates"


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("shift", [1, 2, 3])
def test_quantizing_at_a_power_of_two_is_the_full_size_quantizer_scaled(shift, encoder):
    """quantize_groups(u * 2**-k, shift=k): the codes and scales of
    quantize_groups(u), the error times 2**-k (normal-range u); and at the top,
    where u itself is not representable in fp32, still finite, within
    support.extremes.error_steps of its scale (whose magnitude is one of the
    encoder's multipliers of the largest value, 2**shift times it)."""
    torch.manual_seed(shift)
    u = torch.randn(500, 32) * torch.exp(4 * torch.randn(500, 1))
    codes, scales, err = quantize_groups(u, QMAX, encoder=encoder)
    codes_k, scales_k, err_k = quantize_groups(u * 2.0**-shift, QMAX, shift=shift, encoder=encoder)
    assert torch.equal(codes, codes_k) and torch.equal(scales, scales_k)
    assert torch.equal(err * 2.0**-shift, err_k)
    top = torch.full((1, 32), 1.5e38) * torch.linspace(-1, 1, 32)  # values 2**shift x larger: past fp32 for k >= 2
    codes_t, scales_t, err_t = quantize_groups(top, QMAX, shift=shift, encoder=encoder)
    s = scales_t.float().abs().item()
    assert math.isfinite(s) and torch.isfinite(err_t).all()
    mults = [1 / 7] if encoder == "absmax" else quant.clip_multipliers()
    assert any(s == pytest.approx(1.5e38 * 2**shift * m, rel=2**-8) for m in mults), s
    assert (err_t.abs() <= s * 2.0**-shift * error_steps(encoder)).all()


@pytest.mark.parametrize("encoder", ENCODERS)
def test_a_scale_that_would_round_to_bf16_infinity_makes_the_group_non_finite(encoder):
    """A group whose scale reaches quant.BF16_SCALE_LIMIT (only a stage-2 sum
    far beyond the range can): NaN scale, codes 0, no carried error --
    as a group holding Inf, never a finite decode. (signed_mse: the largest
    of its candidates' scales, 8/7's, is absmax's.)"""
    u = torch.zeros(2, 32)
    u[0, 0] = 3.0e38  # its full-size value 3e38 * 2**3: scale 3.4e38 rounds to bf16 infinity
    u[1, 0] = 3.0e38 / 8
    codes, scales, err = quantize_groups(u, QMAX, shift=3, encoder=encoder)
    assert torch.isnan(scales[0].float()) and (codes[0] == 8).all() and (err[0] == 0).all()
    assert torch.isfinite(scales[1].float()) and quant.BF16_SCALE_LIMIT == float.fromhex("0x1.ff0000p+127")


def test_no_flip_is_the_identity_on_every_float():
    """``_flip`` with pattern 0 (seed 0) multiplies by +1: every fp32 bit
    pattern a stage can hold comes back unchanged (NaNs quiet, as every
    stage's values are after a product), so seed 0 is the rotation of
    before the seed existed, bit for bit."""
    from echo_vllm import quant

    bits = torch.randint(-2**31, 2**31, (1 << 16,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    v = bits.to(torch.int32).view(torch.float32) * 1.0  # quiet any signalling NaN, as a stage's product does
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 3.4e38])
    v = torch.cat((v[:-8], specials)).reshape(-1, 32)
    for g in (16, 32):
        assert torch.equal(quant._flip(v, 0, g).view(torch.int32), v.view(torch.int32))


@pytest.mark.parametrize("hadamard", [False, True])
def test_seed_0_references_are_those_without_flips(monkeypatch, hadamard):
    """Every reference stage with ``flips=0`` gives the bits it gives with
    the flip taken out (``_flip`` replaced by the identity): the code of
    before the rotation seed, on values that include NaN, infinities,
    signed zeros and subnormals."""
    from echo_vllm import quant

    lay = WireLayout(3 * 77, 3, 16, 77)
    x = torch.randn(3, lay.numel) * torch.exp(3 * torch.randn(3, lay.numel))
    x.view(-1)[[0, 5, 40, 99, 130]] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, -3e38])
    x = x.bfloat16()

    def chain():
        fb = 1e-2 * torch.randn(3, lay.padded_numel, generator=torch.Generator().manual_seed(1))
        wire = quant.stage1_reference(x, fb, lay, hadamard=hadamard, has_incoming=True)
        q2 = quant.stage2_reference(wire.transpose(0, 1).contiguous(), fb, [0, 1, 2], lay)
        return (wire, q2, fb, quant.output_reference(q2, lay, torch.bfloat16, hadamard=hadamard),
                quant.consume_reference(x, fb, lay, hadamard=hadamard))

    seeded = chain()
    monkeypatch.setattr(quant, "_flip", lambda v, flips, g: v)
    for a, b in zip(seeded, chain()):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- the signed_mse encoder (quant's docstring, Encoders) ---------------------------------


def _gaussian_groups(n: int = 4000, g: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(n, g, generator=gen) * torch.exp(2 * torch.randn(n, 1, generator=gen))
    u[::5, 3] *= 20.0  # outlier groups
    u[1::7] = u[1::7].abs().amax(-1, keepdim=True) * torch.where(torch.rand(u[1::7].shape, generator=gen) < 0.5, -1.0,
                                                                 1.0)  # +-amax only: one rotated outlier
    return u


def _candidate_errors(u: torch.Tensor) -> torch.Tensor:
    """float64 ``[K, n]``: each signed_mse candidate's sum of squared errors,
    from the encoder's definition (sign, scale, exact-product rounding,
    codes clamped to [-8, 7]) written out here in float64."""
    amax = u.abs().amax(-1, keepdim=True)
    neg = (torch.signbit(u) & (u.abs() == amax)).any(-1, keepdim=True)
    out = []
    for m in quant.clip_multipliers():
        s = torch.clamp_min((amax * m).float(), FLT_MIN).to(torch.bfloat16).double() * torch.where(neg, 1.0, -1.0)
        inv = (1.0 / s.float()).double()
        q = torch.clamp(torch.round(u.double() * inv), -8, 7)
        out.append(((u.double() - q * s) ** 2).sum(-1))
    return torch.stack(out)


def test_signed_mse_puts_the_extreme_value_on_minus_8_with_the_scale_of_one_candidate():
    """The scale carries the sign opposite to the largest-magnitude value
    (a tie of +amax and -amax: the negative one, a positive scale), its
    magnitude is one candidate's, and with a ratio of at most 1 that value
    decodes as code -8 (8/7, absmax's step, puts it on -7); all 16 codes occur."""
    u = _gaussian_groups()
    u[0, :2] = torch.tensor([5.0, -5.0])  # a tie, larger than the rest
    codes, scales, err = quantize_groups(u, QMAX, encoder="signed_mse")
    s = scales.float()
    amax = u.abs().amax(-1)
    negative = (u == -amax[:, None]).any(-1)  # the extreme is negative, or the tie's negative one wins
    assert negative[0] and (torch.sign(s) == torch.where(negative, 1.0, -1.0)).all()
    idx = torch.where(negative, (u == -amax[:, None]).float().argmax(-1), u.abs().argmax(-1))
    cands = torch.stack([torch.clamp_min(amax * m, FLT_MIN).to(torch.bfloat16).float() for m in quant.clip_multipliers()])
    which = (cands == s.abs()).float().argmax(0)
    assert (cands == s.abs()).any(0).all()
    q_extreme = codes.gather(-1, idx[:, None])[:, 0].int() - 8
    absmax_step = which == 0  # SIGNED_MSE_CLIPS[0] is 8/7
    assert quant.SIGNED_MSE_CLIPS[0] == 8 / 7 and all(c <= 1 for c in quant.SIGNED_MSE_CLIPS[1:])
    assert (q_extreme[~absmax_step] == -8).all() and (q_extreme[absmax_step] == -7).all()
    assert set(codes.unique().tolist()) == set(range(16))
    assert torch.equal(err, u - dequantize_groups(codes, scales))


def test_signed_mse_keeps_the_candidate_with_the_least_squared_error():
    """Each group's kept candidate errs least (sums of squares in float64
    here; the encoder compares fp32 tree sums, each within (log2 g + 3) *
    2**-24 of the exact sum: squares of errors rounded once, products of
    two such, log2 g rounded adds), and the encoder never errs more than
    absmax on any group by more than those roundings (8/7 is absmax's step)."""
    u = _gaussian_groups()
    _, scales, err = quantize_groups(u, QMAX, encoder="signed_mse")
    kept = (err.double() ** 2).sum(-1)
    best = _candidate_errors(u).amin(0)
    delta = (math.log2(32) + 3) * 2.0**-24
    assert (kept <= best * (1 + delta) / (1 - delta)).all()
    _, _, err_abs = quantize_groups(u, QMAX)
    absmax = (err_abs.double() ** 2).sum(-1)
    assert (kept <= absmax * (1 + delta) / (1 - delta) + 1e-300).all()
    assert kept.sum() < absmax.sum()


def test_signed_mse_error_bound():
    """|err| <= support.extremes.error_steps * |scale| for every value (a
    clipped value errs by more than half a step, by at most its bound)."""
    u = _gaussian_groups(seed=3)
    _, scales, err = quantize_groups(u, QMAX, encoder="signed_mse")
    assert (err.abs() <= error_steps("signed_mse") * scales.float().abs().unsqueeze(-1)).all()


def _worst_rounding_groups(m: float) -> torch.Tensor:
    """Groups of +-amax whose scale ``bf16(amax * m)`` rounds down by almost
    all 2**-8 of it (``amax * m`` just below a bf16 midpoint), over many binades."""
    e = torch.arange(-100, 100, 7, dtype=torch.float64)
    mid = (1 + torch.arange(0, 128, 9, dtype=torch.float64)[:, None] / 128 + 2.0**-8 * (1 - 2.0**-15)) * 2.0**e
    amax = (mid.flatten() / m).float()
    return amax[:, None] * torch.tensor([1.0, -1.0] * 16)


def test_the_clamps_the_kernels_leave_out_cannot_act():
    """quant.code_bound: a candidate whose bound is below 8.5 (7.5) never
    rounds a code below -8 (above 7), so the kernels leave that clamp out
    (tile.SIGNED_MSE_CLAMPS); checked on the groups that come closest."""
    for m in quant.clip_multipliers():
        u = torch.cat([_worst_rounding_groups(m), _gaussian_groups(500)])
        amax = u.abs().amax(-1, keepdim=True)
        s = torch.clamp_min(amax * m, FLT_MIN).to(torch.bfloat16).float()
        y = torch.round(u.double() * (1.0 / s).double())
        worst = y.abs().max().item()
        assert worst <= quant.code_bound(m) + 0.5
        if quant.code_bound(m) < 8.5:
            assert worst <= 8
        if quant.code_bound(m) < 7.5:
            assert worst <= 7


def test_signed_mse_decodes_within_the_largest_value():
    """No candidate decodes beyond (1 + 2**-8) amax (code -8 times a ratio
    <= 1's scale, 7 times 8/7's): a group at the top of fp32's range decodes
    finite, as absmax's does (quant's docstring, Range)."""
    for m in quant.clip_multipliers():
        assert min(8, round(quant.code_bound(m))) * m <= 1 + 2.0**-20
    top = torch.finfo(torch.float32).max
    u = torch.stack([torch.linspace(-1, 1, 32), torch.linspace(1, -1, 32), torch.ones(32)]) * top
    u[2, ::2] = -top
    u = torch.cat([u, _gaussian_groups(500)])
    codes, scales, _ = quantize_groups(u, QMAX, encoder="signed_mse")
    dq = dequantize_groups(codes, scales)
    assert torch.isfinite(dq).all()
    assert (dq.abs().amax(-1) <= u.abs().amax(-1).double() * (1 + 2.0**-8) * (1 + 2.0**-23)).all()


def test_tree_sum_adds_adjacent_pairs_first():
    """The order every implementation adds a group's squared errors in:
    (v0 + v1) + (v2 + v3), ... (values whose sum depends on the order)."""
    v = torch.tensor([1.0, 2.0**-24, 2.0**-24, 2.0**-24, -1.0, 3.0, 2.0**-23, 5.0])
    want = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
    assert quant.tree_sum(v).item() == want.item()
    assert want.item() != sum(v.tolist())


def test_signed_mse_stochastic_rounding_is_unbiased_inside_the_code_range():
    """Stochastic rounding with the scale the nearest-rounding search chose:
    E[dq] = u for every value inside the code range (a clipped one is not)."""
    g, n = 32, 4000
    gen = torch.Generator().manual_seed(1)
    u = torch.rand(1, g, generator=gen) * 15.0 - 8.0
    u[0, 0] = -8.0
    noise = torch.rand(n, g, generator=gen)
    codes, scales, _ = quantize_groups(u.expand(n, g).contiguous(), QMAX, noise, encoder="signed_mse")
    assert (scales == scales[0]).all()
    s = scales[0].float().item()
    dq = dequantize_groups(codes, scales)
    inside = ((u[0] / s) >= -8) & ((u[0] / s) <= 7)
    assert inside.sum() > g // 2
    assert torch.all((dq.mean(0) - u[0])[inside].abs() <= 5 * 0.5 * abs(s) / math.sqrt(n))


def test_bad_encoder_arguments_are_refused():
    u = torch.zeros(2, 32)
    with pytest.raises(EchoConfigError, match="encoder='bogus'"):
        quantize_groups(u, QMAX, encoder="bogus")
    with pytest.raises(ValueError, match="qmax=127: signed_mse"):
        quantize_groups(u, 127, encoder="signed_mse")
