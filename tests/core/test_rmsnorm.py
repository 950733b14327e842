"""The norm after the all-reduce: vLLM's op to the bit, and the kernels' variance.

``rmsnorm.add_rms_norm`` / ``rmsnorm.rms_norm`` with ``variance="torch"`` must be
vLLM 0.26's IR ops (their ``native`` implementation, what vLLM runs under
Inductor) bit for bit; with ``variance="kernel"`` they differ only in the
variance's sum, which is bounded here against an exact sum.
"""

from __future__ import annotations

import math

import pytest
import torch

from echo_vllm import rmsnorm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HIDDEN = [1, 2, 7, 8, 9, 31, 100, 1000, 4096, 5120, 8192, 16384]


def _rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp32 rows with a wide range: log-normal magnitudes, outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, cols, generator=gen))
    x[:, ::17] *= 30.0
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bits, any NaN equal to any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    differ = (_bits(got) != _bits(want)) & ~(got.float().isnan() & want.float().isnan())
    assert not differ.any(), f"{what}: {int(differ.sum())} of {differ.numel()} differ, first at {differ.nonzero()[0]}"


@pytest.fixture(scope="module")
def vllm_ops():
    ir = pytest.importorskip("vllm.ir")
    return ir.ops


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("cols", HIDDEN)
def test_reference_is_vllms_op_bit_for_bit(vllm_ops, dt, cols):
    dtype = DTYPES[dt]
    rows = 3 if cols >= 4096 else 17
    x = _rows(rows, cols, cols).to(dtype)
    res = _rows(rows, cols, cols + 1).to(dtype)
    w = (1 + 0.1 * _rows(1, cols, cols + 2)[0]).to(dtype)
    eps = 1e-6
    out, new_res = rmsnorm.add_rms_norm(x, res, w, eps)
    v_out, v_res = vllm_ops.fused_add_rms_norm(x.clone(), res.clone(), w, eps)
    assert_same(new_res, v_res, f"residual {dt} H={cols}")
    assert_same(out, v_out, f"fused_add_rms_norm {dt} H={cols}")
    assert_same(rmsnorm.rms_norm(x, w, eps), vllm_ops.rms_norm(x, w, eps), f"rms_norm {dt} H={cols}")
    assert_same(rmsnorm.rms_norm(x, None, eps), vllm_ops.rms_norm(x, None, eps), f"rms_norm no weight {dt} H={cols}")


def test_reference_casts_to_the_weight_dtype_as_vllm(vllm_ops):
    """A weight of another dtype (fp32, as Gemma's 1 + w): cast before the multiply."""
    x, res = _rows(9, 300, 1).to(torch.bfloat16), _rows(9, 300, 2).to(torch.bfloat16)
    w = 1 + 0.01 * _rows(1, 300, 3)[0]
    out, new_res = rmsnorm.add_rms_norm(x, res, w, 1e-5)
    v_out, v_res = vllm_ops.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert_same(out, v_out, "fp32 weight")
    assert_same(new_res, v_res, "fp32 weight residual")


def test_variance_is_on_the_unrounded_sum():
    """The residual is rounded to bf16, the variance is not: a row whose
    rounded sum has another mean square normalises by the unrounded one."""
    x = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    res = torch.tensor([[2.0**-9, 2.0**-9]], dtype=torch.bfloat16)  # 1 + 2**-9 rounds to 1 in bf16
    out, new_res = rmsnorm.add_rms_norm(x, res, None, 0.0, variance="kernel")
    assert torch.equal(new_res, torch.ones(1, 2, dtype=torch.bfloat16))
    s = torch.full((1, 2), 1 + 2.0**-9)
    assert torch.equal(out, (s * torch.rsqrt((s * s).mean(-1, keepdim=True))).to(torch.bfloat16))


def test_block_sums_are_the_pairwise_tree():
    v = torch.tensor([1.0, 2.0**-24, 2.0**-24, 2.0**-24, 3.0, 2.0**24, -(2.0**24), 5.0, 7.0])
    f = [torch.tensor(a, dtype=torch.float32) for a in v.tolist()]
    want0 = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]))
    got = rmsnorm.block_sums(v)
    assert got.shape == (2,) and got[0] == want0 and got[1] == 7.0
    assert got[0] != sum(f[:8], torch.tensor(0.0))  # the order shows


def _exact_bound(b: torch.Tensor, got: float) -> tuple[float, float]:
    """(|got - exact sum of the block sums|, the bound of the module docstring:
    each block truncated to a multiple of 2**-k, then half an fp32 unit of
    the result)."""
    exact = math.fsum(b.double().tolist())
    k = int(rmsnorm.fixed_shift(b.max().reshape(1)))
    trunc = b.numel() * 2.0 ** -k
    ulp = float(torch.nextafter(torch.tensor(got), torch.tensor(math.inf)) - torch.tensor(got))
    return abs(got - exact), trunc + ulp / 2


@pytest.mark.parametrize("cols", [1, 9, 1000, 4096, 16384])
@pytest.mark.parametrize("spread,scale", [(0.0, 1.0), (4.0, 1.0), (8.0, 1.0), (1.0, 1e15), (1.0, 1e-25),
                                          (1.0, 1e-35)])
def test_kernel_sum_is_within_its_bound_of_the_exact_sum(cols, spread, scale):
    """Wide ranges (blocks truncated against the largest), huge rows, tiny
    rows (2**k clamped to 2**MAX_SHIFT), subnormal squares."""
    gen = torch.Generator().manual_seed(cols)
    x = scale * torch.randn(4, cols, generator=gen) * torch.exp(spread * torch.randn(4, cols, generator=gen))
    got = rmsnorm.kernel_sum_squares(x)
    b = rmsnorm.block_sums(x * x)
    for r in range(4):
        err, bound = _exact_bound(b[r], float(got[r, 0]))
        assert err <= bound, (r, err, bound)


def test_kernel_sum_of_equal_blocks_is_exact():
    x = torch.full((2, 4096), 0.75)
    assert torch.equal(rmsnorm.kernel_sum_squares(x), torch.full((2, 1), 4096 * 0.5625))


def test_kernel_sum_overflows_as_torchs():
    """Squares or sums past fp32's range give inf, as torch's sum does."""
    x = torch.tensor([[2.0e19, 1.0], [1.5e19, 1.5e19]])
    assert torch.isinf((x * x).sum(-1)).all()
    assert torch.equal(rmsnorm.kernel_sum_squares(x), torch.full((2, 1), math.inf))


def test_nonfinite_rows_normalise_as_torch_does():
    x = _rows(5, 64, 7)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2, 1] = float("-inf")
    x[2, 9] = float("nan")
    x[3, :] = 0.0
    x = x.to(torch.bfloat16)
    res = torch.zeros_like(x)
    w = torch.ones(64, dtype=torch.bfloat16)
    out_t, res_t = rmsnorm.add_rms_norm(x, res, w, 1e-6)
    out_k, res_k = rmsnorm.add_rms_norm(x, res, w, 1e-6, variance="kernel")
    assert_same(res_k, res_t, "residual")
    assert_same(out_k[:4], out_t[:4], "non-finite and zero rows")
    assert torch.isnan(out_k[0]).all() and torch.equal(out_k[3], torch.zeros(64, dtype=torch.bfloat16))


def test_kernel_variance_differs_from_torchs_only_through_the_variance():
    """Same residual always; the normalised rows equal wherever the two
    variances are equal (everything but the sum is shared)."""
    x, res = _rows(64, 4096, 11).to(torch.bfloat16), _rows(64, 4096, 12).to(torch.bfloat16)
    w = (1 + 0.1 * _rows(1, 4096, 13)[0]).to(torch.bfloat16)
    out_t, res_t = rmsnorm.add_rms_norm(x, res, w, 1e-6)
    out_k, res_k = rmsnorm.add_rms_norm(x, res, w, 1e-6, variance="kernel")
    assert_same(res_k, res_t, "residual")
    s = x.float() + res.float()
    same_var = (s.pow(2).mean(-1, keepdim=True) == rmsnorm.kernel_mean_square(s)).squeeze(-1)
    assert same_var.any()
    assert_same(out_k[same_var], out_t[same_var], "rows with equal variances")


def test_rows_do_not_depend_on_their_batch():
    x, res = _rows(6, 333, 21).to(torch.float16), _rows(6, 333, 22).to(torch.float16)
    w = torch.ones(333, dtype=torch.float16)
    out, new_res = rmsnorm.add_rms_norm(x, res, w, 1e-5, variance="kernel")
    for r in (0, 5):
        o, n = rmsnorm.add_rms_norm(x[r:r + 1], res[r:r + 1], w, 1e-5, variance="kernel")
        assert_same(o, out[r:r + 1], f"row {r}")
        assert_same(n, new_res[r:r + 1], f"row {r} residual")


def test_norm_into_writes_each_output_where_asked():
    """In place by default; into ``residual_out`` when given; without a
    residual, ``y`` itself kept in ``residual_out`` (a decoder's first norm)."""
    y, res = _rows(3, 40, 31).to(torch.bfloat16), _rows(3, 40, 32).to(torch.bfloat16)
    w = (1 + 0.1 * _rows(1, 40, 33)[0]).to(torch.bfloat16)
    want_out, want_res = rmsnorm.add_rms_norm(y, res, w, 1e-6, variance="kernel")
    res_in = res.clone()
    out, new = rmsnorm.norm_into(y, w, 1e-6, residual=res_in)
    assert new is res_in
    assert_same(new, want_res, "in place")
    assert_same(out, want_out, "out")
    res_in, sep = res.clone(), torch.empty_like(res)
    out, new = rmsnorm.norm_into(y, w, 1e-6, residual=res_in, residual_out=sep)
    assert new is sep and torch.equal(res_in, res)
    assert_same(sep, want_res, "separate buffer")
    out, new = rmsnorm.norm_into(y, w, 1e-6)
    assert new is None
    assert_same(out, rmsnorm.rms_norm(y, w, 1e-6, variance="kernel"), "rms_norm")
    kept, out_buf = torch.full_like(y, float("nan")), torch.empty_like(y)
    out, new = rmsnorm.norm_into(y, w, 1e-6, out=out_buf, residual_out=kept)
    assert new is kept and out is out_buf
    assert_same(kept, y, "kept output")
    assert_same(out, rmsnorm.rms_norm(y, w, 1e-6, variance="kernel"), "rms_norm, output kept")


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="variance='exact'"):
        rmsnorm.rms_norm(torch.ones(1, 8), None, 1e-6, variance="exact")
    with pytest.raises(ValueError, match=f"rows of {rmsnorm.MAX_COLS + 8} values"):
        rmsnorm.kernel_sum_squares(torch.ones(1, rmsnorm.MAX_COLS + 8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("cols", [160, 2880, 5120])
def test_kernel_mean_square_divides_as_ieee_on_every_device(device, cols):
    """The mean square is the sum over an IEEE division by H, as the
    kernels' ``div_rn``: an fp32 quotient of fp32 operands rounded once
    from fp64 is the correctly rounded one (fp64 holds more than 2 x 24 + 2
    bits). CUDA turns a division by a Python number into a multiply by
    fp32(1 / H), another rounding where H is not a power of two: 1-ulp
    differences on the H200 that this test catches there."""
    s = _rows(4096, cols, cols).to(device)
    total = rmsnorm.kernel_sum_squares(s)
    want = (total.double() / cols).float()
    assert_same(rmsnorm.kernel_mean_square(s), want, f"mean square, H={cols}, {device}")
    reciprocal = total * torch.tensor(1 / cols, dtype=torch.float32)
    assert (reciprocal != want).any(), "these rows must tell the two roundings apart"
