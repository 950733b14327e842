"""Echo's output with the residual add and RMSNorm: the kernel against
``quant.output_reference`` followed by ``rmsnorm.add_rms_norm(...,
variance="kernel")``, bit for bit (any NaN equal to any NaN), and the tile
plan that keeps rows whole.

Without a GPU the kernel runs in Triton's interpreter (small shapes); the
``gpu`` cases run Qwen3-8B's 8192 x 4096 at P = 8 and P = 2 on the device.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import CUDA, DEVICE, DTYPES, _values, assert_same_bits, in_kernel_process

from echo_vllm import rmsnorm, quant
from echo_vllm.quant import WireLayout

QMAX = 7
EPS = 1e-6


def partials(shape, seed: int, *, special: bool = False) -> torch.Tensor:
    """``test_kernels._values`` where the kernels run, drawn on the GPU when
    there is one (Qwen3-8B's 8192 x 4096 at P = 8 is 268 M values)."""
    if not CUDA or special:
        return _values(shape, seed, special=special).to(DEVICE)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=gen, device="cuda") * torch.exp(2 * torch.randn(shape, generator=gen,
                                                                                      device="cuda"))
    x.view(-1)[::13] *= 50.0
    return x


def gathered_of(x: torch.Tensor, layout: WireLayout, *, hadamard: bool, flips: int = 0) -> torch.Tensor:
    """The all-gathered chunks of one Echo call of ``x [P, numel]`` (references)."""
    wire = quant.stage1_reference(x, None, layout, qmax=QMAX, hadamard=hadamard, has_incoming=False, flips=flips)
    return quant.stage2_reference(wire.transpose(0, 1).contiguous(), None, list(range(layout.world_size)), layout,
                                  qmax=QMAX)


def norm_operands(rows: int, cols: int, dtype, w_dtype, seed: int, device=DEVICE):
    """(residual [rows, cols], weight [cols]) with a wide range."""
    res = partials((rows, cols), seed).to(dtype).to(device)
    w = (1 + 0.2 * torch.randn(cols, generator=torch.Generator().manual_seed(seed))).to(w_dtype).to(device)
    return res, w


def expected(gathered, layout, dtype, res, w, *, hadamard, flips=0):
    """``(out, new residual)`` of the spec: Echo's output, then the norm."""
    y = quant.output_reference(gathered, layout, dtype, hadamard=hadamard, flips=flips).view(layout.rows, layout.cols)
    if res is None:
        return rmsnorm.rms_norm(y, w, EPS, variance="kernel"), None
    return rmsnorm.add_rms_norm(y, res, w, EPS, variance="kernel")


def _output_norm_matches(rows, cols, world, group, dt, w_dt, hadamard, residual, special=False, seed=0,
                         one_pass=True, decode_once=True, rotation_seed=0):
    from echo_vllm import kernels
    from echo_vllm.rotation import sign_flips
    from echo_vllm.kernels.output_norm_kernel import output_norm as kernel
    from echo_vllm.rmsnorm_plan import norm_tiling

    dtype = DTYPES[dt]
    lay = WireLayout(rows * cols, world, group, cols)
    tiling = norm_tiling(lay, one_pass=one_pass)[0]
    if not decode_once:
        tiling = tiling._replace(decode_once=False)
    flips = sign_flips(rotation_seed, group)
    tag = (f"rows={rows} cols={cols} P={world} g={group} {dt} w={w_dt} had={hadamard} res={residual} "
           f"one pass={tiling.one_pass_rows} decode once={tiling.decode_once} rotation seed {rotation_seed}")

    def output_norm(*args, **kw):
        return kernel(*args, **kw, flips=flips, tiling=tiling)

    x = partials((world, lay.numel), seed + cols, special=special).to(dtype)
    g = gathered_of(x, lay, hadamard=hadamard, flips=flips)
    res, w = norm_operands(rows, cols, dtype, DTYPES[w_dt], seed + 1)
    want_out, want_res = expected(g, lay, dtype, res if residual else None, w, hadamard=hadamard, flips=flips)
    res_k = res.clone() if residual else None
    out, new_res = output_norm(g, lay, dtype, w, EPS, hadamard=hadamard, residual=res_k)
    assert_same_bits(out.view(rows, cols), want_out, f"normed output [{tag}]", nan_any=True)
    if residual:
        assert new_res.data_ptr() == res_k.data_ptr()  # in place by default
        assert_same_bits(new_res.view(rows, cols), want_res, f"new residual [{tag}]", nan_any=True)
        # into a separate buffer, the residual left alone
        res_in = res.clone()
        res_out = torch.empty_like(res)
        out2, _ = output_norm(g, lay, dtype, w, EPS, hadamard=hadamard, residual=res_in, residual_out=res_out)
        assert_same_bits(res_out, want_res, f"new residual, separate buffer [{tag}]", nan_any=True)
        assert_same_bits(res_in, res, f"residual input untouched [{tag}]")
        assert_same_bits(out2.view(rows, cols), want_out, f"normed output, separate buffer [{tag}]", nan_any=True)
    y_ref = quant.output_reference(g, lay, dtype, hadamard=hadamard, flips=flips)
    if not residual:
        assert new_res is None
        # a decoder's first norm: Echo's output kept beside it, as the next residual
        kept = torch.full_like(y_ref, float("nan"))
        out3, got_kept = output_norm(g, lay, dtype, w, EPS, hadamard=hadamard, residual_out=kept)
        assert got_kept.data_ptr() == kept.data_ptr()
        assert_same_bits(out3.view(rows, cols), want_out, f"normed output, output kept [{tag}]", nan_any=True)
        assert_same_bits(kept, y_ref, f"kept output [{tag}]", nan_any=True)
    # the plain output kernel is unchanged beside it
    y = kernels.output(g, lay, dtype, hadamard=hadamard, flips=flips)
    assert_same_bits(y, y_ref, f"plain output [{tag}]", nan_any=True)


# rows, cols, P, g, dtype, weight dtype, hadamard, residual (without one, also
# with Echo's output kept as the next residual): width 1, widths
# not a multiple of P * g (or of 8), several rows per program, rows of
# several programs, each dtype; a fp32 weight under a bf16 model
CASES = [
    (5, 1, 2, 32, "bf16", "bf16", True, True),
    (3, 1, 3, 16, "fp32", "fp32", False, True),
    (4, 1, 2, 32, "bf16", "bf16", True, False),
    (4, 100, 2, 32, "bf16", "bf16", True, True),
    (3, 333, 3, 16, "fp16", "fp16", True, True),
    (2, 256, 4, 64, "fp32", "fp32", True, False),
    (9, 77, 2, 16, "bf16", "fp32", False, True),
    (2, 1000, 8, 32, "bf16", "bf16", True, True),
    (6, 48, 4, 16, "fp16", "fp16", False, False),
    (2, 640, 2, 128, "bf16", "bf16", True, True),
    (3, 90, 5, 16, "fp16", "fp16", True, True),  # P not a multiple of the first pass's chunks per step
]


@pytest.mark.parametrize("one_pass", [True, False], ids=["plan", "two-passes"])
@pytest.mark.parametrize("rows,cols,world,group,dt,w_dt,hadamard,residual", CASES)
def test_output_norm_matches_reference(rows, cols, world, group, dt, w_dt, hadamard, residual, one_pass):
    in_kernel_process(_output_norm_matches, rows, cols, world, group, dt, w_dt, hadamard, residual,
                      one_pass=one_pass)


@pytest.mark.parametrize("one_pass", [True, False], ids=["plan", "two-passes"])
@pytest.mark.parametrize("case,rotation_seed", [(CASES[0], 1), (CASES[4], 2), (CASES[9], 3)], ids=str)
def test_output_norm_under_a_rotation_seed_matches_reference(case, rotation_seed, one_pass):
    """The norm's decode undoes the sign flips (bf16 rows of one column, fp16, g = 128)."""
    in_kernel_process(_output_norm_matches, *case, one_pass=one_pass, rotation_seed=rotation_seed)


@pytest.mark.parametrize("case", [CASES[3], CASES[5]], ids=str)
def test_output_norm_decoding_twice_matches_reference(case):
    """Two passes, the second decoding the chunks again (large tiles' choice): with a residual, and
    without one (Echo's output also kept)."""
    in_kernel_process(_output_norm_matches, *case, one_pass=False, decode_once=False)


@pytest.mark.parametrize("one_pass", [True, False], ids=["plan", "two-passes"])
def test_output_norm_special_values_match_reference(one_pass):
    """NaN/Inf groups (whole rows of NaN), huge and tiny scales, zeros."""
    in_kernel_process(_output_norm_matches, 3, 450, 2, 32, "bf16", "bf16", True, True, special=True,
                      one_pass=one_pass)


def test_plan_cases_cover_the_one_pass_paths():
    """Under the plan the cases above take one pass with steps of fewer rows
    than a tile, chunks padded to a power of two and unaligned rows (and
    ``two-passes`` runs them all in two)."""
    from echo_vllm.rmsnorm_plan import norm_tiling

    one = [(norm_tiling(WireLayout(r * c, p, g, c))[0], p) for r, c, p, g, *_ in CASES]
    assert all(t.one_pass_rows for t, _ in one)
    assert any(t.one_pass_rows < t.rows for t, _ in one) and any(p & (p - 1) for _, p in one)
    assert any(not t.aligned for t, _ in one)


def _stage_ops_agree(impl):
    """``StageOps.output_norm`` of every implementation: the same bits."""
    from echo_vllm.backends.stages import ReferenceStages

    if impl == "numba":
        pytest.importorskip("numba")
        from echo_vllm.backends.numba_stages import NumbaStages as ops
    elif impl == "triton":
        from echo_vllm.backends.triton_stages import TritonStages as ops
    else:
        ops = ReferenceStages
    ops = ops()
    device = "cpu" if impl == "numba" else DEVICE
    lay = WireLayout(7 * 200, 3, 32, 200)
    x = _values((3, lay.numel), 9).to(torch.bfloat16).to(device)
    g = gathered_of(x, lay, hadamard=True)
    res, w = norm_operands(7, 200, torch.bfloat16, torch.bfloat16, 10, device=device)
    want_out, want_res = expected(g, lay, torch.bfloat16, res, w, hadamard=True)
    out = torch.empty(lay.numel, dtype=torch.bfloat16, device=device)
    got_out, got_res = ops.output_norm(g, lay, torch.bfloat16, w, EPS, hadamard=True, residual=res, out=out)
    assert got_out.data_ptr() == out.data_ptr() and got_res.data_ptr() == res.data_ptr()
    assert_same_bits(got_out.view(7, 200), want_out, f"{impl} out", nan_any=True)
    assert_same_bits(res, want_res, f"{impl} residual (in place)", nan_any=True)


@pytest.mark.parametrize("impl", ["reference", "triton", "numba"])
def test_stage_ops_output_norm_agree(impl):
    if impl == "triton":
        in_kernel_process(_stage_ops_agree, impl)
    else:
        _stage_ops_agree(impl)


def _residual_only_matches(rows, cols, world, group):
    """Echo's output all zeros (codes of 0), so the rows are the fp32
    residual itself, of a range wide enough that the order of the sum of
    squares shows in the normed fp32 output: the kernel must add a lane's
    squares in the reference's tree and the lanes as integers."""
    from echo_vllm.kernels.output_norm_kernel import output_norm

    lay = WireLayout(rows * cols, world, group, cols)
    g = torch.full((world, lay.chunk_bytes), 0x88, dtype=torch.uint8)  # code 8: value 0
    g[:, lay.payload_bytes:].view(torch.bfloat16).fill_(1.0)
    g = g.to(DEVICE)
    gen = torch.Generator().manual_seed(cols)
    res = (torch.randn(rows, cols, generator=gen) * torch.exp(6 * torch.randn(rows, cols, generator=gen))).to(DEVICE)
    w = torch.ones(cols, device=DEVICE)
    want, want_res = expected(g, lay, torch.float32, res, w, hadamard=False)
    assert_same_bits(want_res, res, "0 + residual")
    y = res.view(rows, cols)
    plain = rmsnorm.rms_norm(y, w, EPS)  # torch's mean, another order: this input tells them apart
    assert (plain != want).any()
    out, _ = output_norm(g, lay, torch.float32, w, EPS, hadamard=False, residual=res.clone())
    assert_same_bits(out.view(rows, cols), want, f"fp32 rows of a wide range (cols={cols}, P={world})")


@pytest.mark.parametrize("rows,cols,world,group", [(64, 64, 2, 32), (16, 300, 3, 16)])
def test_output_norm_sums_squares_in_the_references_order(rows, cols, world, group):
    in_kernel_process(_residual_only_matches, rows, cols, world, group)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("world", [8, 2])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("one_pass", [True, False], ids=["plan", "two-passes"])
def test_output_norm_qwen3_8b_prefill_on_gpu(world, residual, one_pass):
    """Qwen3-8B's 8192 x 4096 bf16, compiled (the bf16x2 decode included)."""
    _output_norm_matches(8192, 4096, world, 32, "bf16", "bf16", True, residual, seed=3, one_pass=one_pass)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cols,world", [(5120, 8), (8192, 4), (16384, 2), (2880, 3), (6144, 6), (4096, 5)])
def test_output_norm_other_hidden_sizes_on_gpu(cols, world):
    _output_norm_matches(64, cols, world, 32, "bf16", "bf16", True, True, seed=4)


def _composed_backend_fuses():
    from echo_vllm.backends.composed import ComposedBackend
    from echo_vllm.backends.triton_stages import TritonStages
    from support.norm_chains import chain_pair, check_pair

    check_pair(chain_pair(2, 3, 160, 3, backend=lambda cfg, t: ComposedBackend(cfg, t, TritonStages()),
                            device=DEVICE), 3, "fused")


def test_composed_backend_runs_the_output_norm_kernel():
    """EchoCommunicator.all_reduce_norm over the Triton stages: the
    output_norm kernel, the same bits as the output kernel then the norm
    over a chain of calls (``tests/core/test_allreduce_norm.py``'s check)."""
    in_kernel_process(_composed_backend_fuses)


def test_output_norm_refuses_an_out_that_overlaps_the_residual():
    from echo_vllm.kernels.output_norm_kernel import check_norm_operands

    lay = WireLayout(4 * 64, 2, 32, 64)
    w = torch.ones(64, dtype=torch.bfloat16)
    buf = torch.zeros(2 * lay.numel, dtype=torch.bfloat16)
    res, out = buf[:lay.numel], buf[lay.numel:]
    assert check_norm_operands(lay, torch.bfloat16, w, res, out, None) == (out, res)  # adjacent: apart
    with pytest.raises(ValueError, match="out overlaps residual"):
        check_norm_operands(lay, torch.bfloat16, w, res, res, None)
    with pytest.raises(ValueError, match="out overlaps residual_out"):
        check_norm_operands(lay, torch.bfloat16, w, res.clone(), buf[32:32 + lay.numel], res)
    # Echo's output kept (no residual): its buffer apart from out's too
    assert check_norm_operands(lay, torch.bfloat16, w, None, out, res) == (out, res)
    with pytest.raises(ValueError, match="out overlaps residual_out"):
        check_norm_operands(lay, torch.bfloat16, w, None, buf[32:32 + lay.numel], res)
    with pytest.raises(TypeError, match="residual_out: dtype"):
        check_norm_operands(lay, torch.bfloat16, w, None, out, res.float())
