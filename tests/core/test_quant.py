"""The 4-bit group format: packing, error bound, adversarial groups, layout."""

import math

import pytest
import torch

from echo_vllm.config import EchoConfigError
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


def _quant(u: torch.Tensor, g: int):
    codes, scales, err = quantize_groups(u.reshape(-1, g), QMAX)
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


def test_zero_and_signed_zero_groups_are_exact():
    g = 32
    u = torch.zeros(3, g)
    u[1] = -0.0
    u[2, ::2] = -0.0
    codes, scales, err, dq = _quant(u, g)
    assert torch.equal(dq, torch.zeros_like(dq))  # -0 == 0
    assert torch.equal(err.abs(), torch.zeros_like(err))
    assert torch.all(scales.float() == FLT_MIN)


def test_one_outlier_group():
    g = 32
    u = torch.zeros(1, g)
    u[0, 5] = 100.0
    u[0, 6] = 1.0
    _, scales, _, dq = _quant(u, g)
    assert dq[0, 5].item() == pytest.approx(100.0, rel=2**-8)
    # |1| < s/2 = 100/14: rounds to zero, as the bound allows
    assert dq[0, 6].item() == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_groups_come_out_non_finite(bad):
    g = 32
    u = torch.randn(4, g)
    u[2, 7] = bad
    codes, scales, err, dq = _quant(u, g)
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
