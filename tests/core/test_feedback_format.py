"""The feedback buffer's storage formats (``echo_vllm.quant``'s docstring):
the int8 blocks' byte layout, the round trip's error bound, the no-clamp
argument, non-finite groups, and the float formats through the same
read/write functions every reference stage uses."""

import pytest
import torch

from echo_vllm.quant import (
    ALIGN_GROUPS,
    FEEDBACK_QMAX,
    FEEDBACK_STORAGE,
    FLT_MIN,
    SCALE_DTYPE,
    WireLayout,
    decode_feedback,
    encode_feedback,
    feedback_block_bytes,
    feedback_row_len,
    group_scales,
    read_feedback,
    round_half_even,
    write_feedback,
)

#: |e - decode(encode(e))| <= t * BOUND_STEPS (module docstring: half a step
#: from rounding, 2^-16 steps from the fp32 roundings in e * fp32(1/t)).
BOUND_STEPS = 0.5 + 2.0**-16


def _errors(rows: int, n: int, seed: int, g: int) -> torch.Tensor:
    """Carried-error-like fp32 values: per group of ``g`` a log-normal
    magnitude over 40 binades; group 0 zero, group 1 subnormal, group 2 one
    outlier."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(rows, n, generator=gen)
    mag = torch.exp(torch.randn(rows, n // g, 1, generator=gen) * 9).expand(-1, -1, g).reshape(rows, n)
    e = e * mag
    e[:, :g] = 0.0  # an all-zero group
    e[:, g : 2 * g] = 1e-41 * torch.randn(rows, g, generator=gen)  # subnormal group (scale clamped)
    e[:, 2 * g + 3] = 1e4  # one outlier: the rest of its group rounds to few codes
    return e


def _steps(blocks: torch.Tensor, g: int) -> torch.Tensor:
    """The scale t of each value's group, read straight from the bytes
    (the documented offsets, independently of decode_feedback)."""
    b = blocks.reshape(blocks.shape[0], -1, feedback_block_bytes(g))
    t = b[..., ALIGN_GROUPS * g :].contiguous().view(SCALE_DTYPE).float()
    return t.repeat_interleave(g, dim=-1).reshape(blocks.shape[0], -1)


@pytest.mark.parametrize("g", [16, 32, 64, 128])
def test_int8_round_trip_within_its_bound(g):
    n = 40 * ALIGN_GROUPS * g
    e = _errors(3, n, g, g)
    blocks = encode_feedback(e, g)
    assert blocks.dtype == torch.int8 and blocks.shape == (3, feedback_row_len(n, torch.int8, g))
    d = decode_feedback(blocks, g)
    t = _steps(blocks, g)
    err = (e - d).abs()
    assert bool((err <= t * BOUND_STEPS).all()), (err / t).max().item()
    # not vacuous: some value sits almost half a step off the grid
    assert (err / t).max() > 0.49
    # the scale is bf16(amax * fp32(1/127)): amax's code is 126 or 127 (never
    # a wasted bit, never an overflow), for every group but the clamped ones
    codes = blocks.reshape(3, -1, feedback_block_bytes(g))[..., : ALIGN_GROUPS * g].reshape(3, -1, g)
    assert int(codes.min()) >= -FEEDBACK_QMAX and int(codes.max()) <= FEEDBACK_QMAX
    amax = e.reshape(3, -1, g).abs().amax(-1)
    top = codes.abs().amax(-1)
    normal = amax * (1 / 127) >= 2 * FLT_MIN
    assert bool((top[normal] >= 126).all())
    # the all-zero group: scale FLT_MIN, codes 0, decodes to zeros exactly
    assert t[0, 0].item() == FLT_MIN and torch.equal(d[:, :g], torch.zeros(3, g))


def test_int8_codes_need_no_clamp_for_any_mantissa():
    """Exhaustive over every fp32 amax of one binade (the ratio amax / t is
    the same in every binade above the FLT_MIN clamp): the group's largest
    value times fp32(1/t) stays below 127.5, so rounds to at most 127 --
    the docstring's bound 127 * (1 + 2^-8) * (1 + 3 * 2^-24). The wire's
    qmax = 7 likewise stays below 7.5."""
    amax = (torch.arange(1 << 23, dtype=torch.int32) | (133 << 23)).view(torch.float32)  # [64, 128)
    assert amax.min().item() == 64.0 and amax.max().item() < 128.0
    for qmax, bound in ((FEEDBACK_QMAX, 127 * (1 + 2**-8) * (1 + 3 * 2**-24)), (7, 7 * (1 + 2**-8) * (1 + 3 * 2**-24))):
        _, _, inv, _ = group_scales(amax.unsqueeze(-1), qmax)
        y = amax * inv
        assert y.max().item() <= bound < qmax + 0.5
        assert round_half_even(y).max().item() == qmax
        assert y.max().item() > qmax * (1 + 2**-9)  # the worst case is near the bound


def test_int8_non_finite_groups_decode_to_nan_and_stay_in_their_group():
    g = 32
    e = torch.randn(2, 2 * ALIGN_GROUPS * g)
    e[0, 5] = float("nan")
    e[1, 3 * g + 1] = float("inf")
    d = decode_feedback(encode_feedback(e, g), g)
    bad = torch.zeros_like(e, dtype=torch.bool)
    bad[0, :g] = True
    bad[1, 3 * g : 4 * g] = True
    assert bool(d[bad].isnan().all()) and bool(d[~bad].isfinite().all())
    blocks = encode_feedback(e, g).reshape(2, -1, feedback_block_bytes(g))
    assert int(blocks[0, 0, :g].abs().max()) == 0  # codes 0 under a NaN scale
    assert _steps(encode_feedback(e, g), g)[0, 0].isnan()


@pytest.mark.parametrize("g", [16, 128])
def test_int8_byte_of_each_value_is_where_the_docstring_says(g):
    """Value i of group m = i // g: code at (m // 8) (8g + 16) + (m % 8) g +
    i % g, its scale at (m // 8) (8g + 16) + 8g + 2 (m % 8); a buffer's
    prefix is the encoding of the prefix (positions do not depend on the
    message size); every block is a multiple of 16 bytes."""
    n = 3 * ALIGN_GROUPS * g
    assert feedback_block_bytes(g) % 16 == 0
    for i in (0, g - 1, 5 * g + 3, 8 * g, n - 1):
        e = torch.zeros(1, n)
        e[0, i] = -2.5
        blocks = encode_feedback(e, g)[0]
        m = i // g
        block = (m // 8) * (8 * g + 16)
        codes = blocks.reshape(-1, 8 * g + 16)[:, : 8 * g].flatten()  # drop the scales (zero groups: FLT_MIN)
        assert codes.nonzero().flatten().tolist() == [(m // 8) * 8 * g + (m % 8) * g + i % g]
        assert int(blocks[block + (m % 8) * g + i % g]) == -127
        scale = blocks[block + 8 * g + 2 * (m % 8) :][:2].contiguous().view(SCALE_DTYPE)
        assert scale.item() == torch.tensor(2.5 / 127).to(SCALE_DTYPE).item()
    e = _errors(2, n, 1, g)
    short = 2 * ALIGN_GROUPS * g
    assert torch.equal(encode_feedback(e[:, :short], g), encode_feedback(e, g)[:, : feedback_row_len(short, torch.int8, g)])


@pytest.mark.parametrize("dtype", list(FEEDBACK_STORAGE))
def test_read_write_feedback_in_every_format(dtype):
    """write then read at a chunk offset: float32 exact, bfloat16 rounded to
    nearest, int8 within its bound; the rest of the buffer untouched."""
    lay = WireLayout(5 * 96, 3, 32, 96)
    g, c = lay.group_size, lay.chunk_numel
    torch_dtype = FEEDBACK_STORAGE[dtype]
    row = feedback_row_len(lay.padded_numel, torch_dtype, g) + 40
    assert row == (lay.padded_numel + 40 if dtype != "int8" else lay.padded_numel * (g + 2) // g + 40)
    fb = torch.zeros(2, row, dtype=torch_dtype)
    before = fb.clone()
    e = _errors(2, c, 7, g)
    write_feedback(fb, c, e, g)  # chunk 1
    back = read_feedback(fb, c, c, g)
    if dtype == "float32":
        assert torch.equal(back, e)
    elif dtype == "bfloat16":
        assert torch.equal(back, e.bfloat16().float())
    else:
        t = _steps(fb[:, feedback_row_len(c, torch.int8, g) : feedback_row_len(2 * c, torch.int8, g)], g)
        assert bool(((back - e).abs() <= t * BOUND_STEPS).all())
    assert torch.equal(read_feedback(fb, 0, c, g), torch.zeros(2, c))
    assert torch.equal(read_feedback(fb, 2 * c, c, g), torch.zeros(2, c))
    changed = (fb != before).any(0).nonzero().flatten()
    lo = feedback_row_len(c, torch_dtype, g)
    assert changed.min() >= lo and changed.max() < feedback_row_len(2 * c, torch_dtype, g)
