"""The fused kernel with the residual add and RMSNorm in its phase 3
(``fused_kernel.fused_all_reduce_norm``): every phase against the
reference pipeline, the output and new residual against the composed
``output_norm`` spec, bit for bit; whole rows per tile in every phase.

On CPU (Triton's interpreter) the ranks' phases run one at a time, as in
``test_fused.py``, and the whole kernel with its barriers runs in forked
processes sharing memory; the ``gpu`` cases run every rank of Qwen3-8B's
8192 x 4096 in one launch with barriers (P = 8 and P = 2) against the
composed kernels.
"""

from __future__ import annotations

import pytest
import torch
from test_fused import reference_chain, run_forked_ranks
from test_kernels import (CUDA, DEVICE, DTYPES, FB_DTYPES, INTERPRETER_ONLY, _feedback, _interpreter_pool, _reporting,
                          _values, assert_same_bits, in_kernel_process)
from test_output_norm import EPS, expected, norm_operands, partials

from echo_vllm import quant
from echo_vllm.backends import fused as fused_mod
from echo_vllm.rmsnorm_plan import NormTiling, norm_tiling
from echo_vllm.quant import WireLayout

QMAX = 7


def _norm_phases_match(rows, cols, world, group, dt, fb_dtype, hadamard, incoming, tile_rows, programs, residual=True,
                       w_dt=None, special=False, aligned=None, one_pass_rows=0, keep=False,
                       decode_once=True, rotation_seed=0, encoder="absmax"):
    """``keep`` (without ``residual``): Echo's output also written into a
    buffer of its own (a decoder's first norm's next residual); phases 1
    and 2 quantize with ``encoder``."""
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.rotation import sign_flips

    dtype = DTYPES[dt]
    flips = sign_flips(rotation_seed, group)
    lay = WireLayout(rows * cols, world, group, cols)
    plan = norm_tiling(lay)[0]
    aligned = plan.aligned if aligned is None else aligned
    tiling = NormTiling(tile_rows, plan.padded_row_groups, 1, aligned=aligned, one_pass_rows=one_pass_rows,
                        decode_once=decode_once)
    tag = (f"rows={rows} cols={cols} P={world} g={group} {dt} fb={fb_dtype} K={tile_rows} res={residual} al={aligned} "
           f"one pass={one_pass_rows} keep={keep} decode once={decode_once} rotation seed {rotation_seed} {encoder}")
    assert not (keep and residual)
    x = _values((world, lay.numel), rows + cols, special=special).to(dtype).to(DEVICE)
    fb_ref = _feedback(world, lay, FB_DTYPES[fb_dtype], 7) if fb_dtype else None
    fbs = [fb_ref[r:r + 1].clone() if fb_dtype else None for r in range(world)]
    cb = lay.chunk_bytes + 48
    table, bufs, _ = fused_mod.local_buffers(world, cb, fk.signal_slots(programs, world), DEVICE)
    for b in bufs:
        b.fill_(0xA5)  # stale bytes: every byte compared below must have been written
    fused_tiling = fk.FusedTiling(tiling.groups_per_tile, 1, programs, norm=tiling)
    assert fused_tiling.tiles(lay) > programs or programs == 1
    res0, w = norm_operands(rows, cols, dtype, DTYPES[w_dt or dt], 5)
    ress = [res0.clone() if residual else None for _ in range(world)]
    outs = [torch.empty(lay.numel, dtype=dtype, device=DEVICE) for _ in range(world)]
    unwritten = torch.full((lay.numel,), float("nan"), dtype=dtype, device=DEVICE)
    kept = [unwritten.clone() if keep else None for _ in range(world)]
    fb1 = None
    if fb_dtype:  # the reference's feedback after stage 1 alone
        fb1 = _feedback(world, lay, FB_DTYPES[fb_dtype], 7)
        quant.stage1_reference(x, fb1, lay, qmax=QMAX, hadamard=hadamard, has_incoming=incoming, flips=flips,
                               encoder=encoder)
    wire, q2, _ = reference_chain(x, fb_ref, lay, hadamard=hadamard, incoming=incoming, flips=flips, encoder=encoder)
    want_out, want_res = expected(q2, lay, dtype, res0 if residual else None, w, hadamard=hadamard, flips=flips)
    want_kept = quant.output_reference(q2, lay, dtype, hadamard=hadamard, flips=flips)
    n = world * lay.chunk_bytes
    for phase in (1, 2, 3):
        for r in range(world):
            got_out, got_res = fk.fused_all_reduce_norm(
                x[r:r + 1], fbs[r], table, lay, w, EPS, residual=ress[r], rank=r, gathered_offset=world * cb,
                qmax=QMAX, hadamard=hadamard, has_incoming=incoming, tiling=fused_tiling, timeout_ns=0, flips=flips,
                encoder=encoder, out=outs[r], residual_out=kept[r], phase=phase)
        for r in range(world):
            if phase == 1:
                assert_same_bits(bufs[r][:n].view(world, lay.chunk_bytes), wire[:, r], f"phase 1 recv {r} [{tag}]")
            if phase == 2:
                gathered = bufs[r][world * cb:world * cb + n].view(world, lay.chunk_bytes)
                assert_same_bits(gathered, q2, f"phase 2 gathered of rank {r} [{tag}]")
            if phase < 3 and fb_dtype:
                want_fb = fb1 if phase == 1 else fb_ref
                assert_same_bits(fbs[r], want_fb[r:r + 1], f"phase {phase} feedback of rank {r} [{tag}]")
            if phase < 3 and residual:
                assert_same_bits(ress[r], res0, f"residual before phase 3 [{tag}]")
            if phase < 3 and keep:
                assert_same_bits(kept[r], unwritten, f"kept output before phase 3 [{tag}]", nan_any=True)
            if phase == 3:
                assert got_out.data_ptr() == outs[-1].data_ptr()
                assert_same_bits(outs[r].view(rows, cols), want_out, f"normed output of rank {r} [{tag}]",
                                 nan_any=True)
                if residual:
                    assert_same_bits(ress[r], want_res, f"new residual of rank {r} [{tag}]", nan_any=True)
                if keep:
                    assert got_res.data_ptr() == kept[-1].data_ptr()
                    assert_same_bits(kept[r], want_kept, f"kept output of rank {r} [{tag}]", nan_any=True)


# rows, cols, P, g, dtype, feedback, hadamard, incoming, rows per tile, programs: the chunks' padding
# groups are virtual rows of the last tiles; rows of a non-power-of-two group count (padded lanes);
# one column; more tiles than programs (programs loop over tiles)
NORM_PHASE_CASES = [
    (7, 77, 3, 16, "bf16", "bf16", True, True, 2, 3),
    (5, 100, 2, 32, "fp16", "fp32", True, False, 1, 2),
    (3, 160, 2, 16, "fp32", "int8", True, True, 1, 2),
    (9, 1, 2, 64, "fp32", "fp32", False, True, 4, 2),
    (4, 256, 4, 32, "bf16", None, True, False, 1, 1),
    (3, 96, 6, 16, "bf16", "bf16", True, True, 1, 2),  # P not a multiple of the first pass's chunks per step
    (10, 512, 4, 32, "bf16", "bf16", True, True, 4, 2),  # one pass: steps of 2 aligned rows (wrong bits on the H200)
]


@pytest.mark.parametrize("passes", ["two", "one"])
@pytest.mark.parametrize("rows,cols,world,group,dt,fb,hadamard,incoming,tile_rows,programs", NORM_PHASE_CASES)
def test_norm_phases_match_reference(rows, cols, world, group, dt, fb, hadamard, incoming, tile_rows, programs,
                                     passes):
    """``one``: phase 3 in one pass, in steps of half a tile's rows where it has several (the steps of every
    tile of a program in one loop)."""
    in_kernel_process(_norm_phases_match, rows, cols, world, group, dt, fb, hadamard, incoming, tile_rows, programs,
                      one_pass_rows=0 if passes == "two" else max(1, tile_rows // 2))


@pytest.mark.parametrize("passes", ["two", "one"])
@pytest.mark.parametrize("case,rotation_seed", [(NORM_PHASE_CASES[0], 1), (NORM_PHASE_CASES[2], 2),
                                                (NORM_PHASE_CASES[6], 3)], ids=str)
def test_norm_phases_under_a_rotation_seed_match_reference(case, rotation_seed, passes):
    in_kernel_process(_norm_phases_match, *case, rotation_seed=rotation_seed,
                      one_pass_rows=0 if passes == "two" else max(1, case[8] // 2))


#: Phase 3's paths: two passes (Echo's output read back, or decoded twice), one pass.
PASSES = {"two": {}, "decode-twice": {"decode_once": False}, "one": {"one_pass_rows": 1}}


@pytest.mark.parametrize("passes", PASSES)
@pytest.mark.parametrize("keep", [False, True], ids=["rms_norm", "kept"])
def test_norm_phases_without_residual_and_fp32_weight(keep, passes):
    """rms_norm, a fp32 weight under bf16; ``kept``: Echo's output written
    beside it (a decoder's first norm, whose input is the next residual)."""
    in_kernel_process(_norm_phases_match, 6, 96, 3, 32, "bf16", "bf16", True, True, 2, 2, residual=False,
                      w_dt="fp32", keep=keep, **PASSES[passes])


def test_norm_phases_decoding_twice():
    """Two passes, the second decoding the chunks again (large tiles' choice), with the residual."""
    in_kernel_process(_norm_phases_match, 7, 77, 3, 16, "bf16", "bf16", True, True, 2, 3, decode_once=False)


@pytest.mark.parametrize("case", [NORM_PHASE_CASES[0], NORM_PHASE_CASES[2]], ids=str)
def test_norm_phases_with_signed_mse(case):
    """Phases 1 and 2 of the norm kernel (whole rows per tile) quantizing
    with signed_mse (``EchoConfig.encoder``)."""
    in_kernel_process(_norm_phases_match, *case, encoder="signed_mse")


def test_norm_phases_of_aligned_rows_by_either_index():
    """Rows of a power-of-two number of groups per chunk: the general row
    index and the consecutive one (``NormTiling.aligned``) give the same bits."""
    lay = WireLayout(4 * 256, 4, 32, 256)
    assert norm_tiling(lay)[0].aligned
    for aligned in (False, True):
        in_kernel_process(_norm_phases_match, 4, 256, 4, 32, "bf16", "bf16", True, True, 2, 1, aligned=aligned)


def test_norm_phases_special_values():
    in_kernel_process(_norm_phases_match, 3, 450, 2, 32, "bf16", "fp32", True, True, 1, 2, special=True)


# -- the whole kernel with its barriers, over processes sharing memory ---------------


def _emulate_norm_ranks(world, rows, cols, group, calls, tile_rows, programs, deadline_s=60.0, one_pass_rows=0):
    """``world`` forked ranks run ``calls`` chained calls of the whole norm
    kernel (barriers, tiles looped over fewer programs, the residual
    updated in place call after call) on shared-memory buffers."""
    from echo_vllm.kernels import fused_kernel as fk

    lay = WireLayout(rows * cols, world, group, cols)
    plan = norm_tiling(lay)[0]
    tiling = NormTiling(tile_rows, plan.padded_row_groups, 1, aligned=plan.aligned, one_pass_rows=one_pass_rows)
    fused_tiling = fk.FusedTiling(tiling.groups_per_tile, 1, programs, norm=tiling)
    table, bufs, pads = fused_mod.local_buffers(world, lay.chunk_bytes, fk.signal_slots(programs, world), "cpu")
    for t in (*bufs, *pads):
        t.share_memory_()
    table = torch.tensor([[b.data_ptr() for b in bufs], [p.data_ptr() for p in pads]], dtype=torch.int64)
    xs = torch.stack([_values((world, lay.numel), 60 + c, special=c == 1).to(torch.bfloat16) for c in range(calls)])
    fb0 = _feedback(world, lay, torch.float32, 61, device="cpu")
    fbs = fb0.clone().share_memory_()
    res0, w = norm_operands(rows, cols, torch.bfloat16, torch.bfloat16, 62, device="cpu")
    ress = res0.reshape(1, -1).repeat(world, 1).share_memory_()
    outs = torch.zeros(calls, world, lay.numel, dtype=torch.bfloat16).share_memory_()
    def one_rank(rank):
        for c in range(calls):
            fk.fused_all_reduce_norm(xs[c, rank:rank + 1], fbs[rank:rank + 1], table, lay, w, EPS,
                                     residual=ress[rank], rank=rank, gathered_offset=bufs[0].numel() // 2,
                                     qmax=QMAX, hadamard=True, has_incoming=c > 0, tiling=fused_tiling, timeout_ns=0,
                                     out=outs[c, rank])

    run_forked_ranks(world, one_rank, deadline_s)
    fb_ref, res = fb0.clone(), res0.clone()
    for c in range(calls):
        _, q2, _ = reference_chain(xs[c], fb_ref, lay, hadamard=True, incoming=c > 0)
        want_out, res = expected(q2, lay, torch.bfloat16, res, w, hadamard=True)
        for r in range(world):
            assert_same_bits(outs[c, r].view(rows, cols), want_out, f"call {c}, rank {r}", nan_any=True)
    for r in range(world):
        assert_same_bits(ress[r].view(rows, cols), res, f"residual of rank {r} after the chain", nan_any=True)
    assert_same_bits(fbs, fb_ref, "feedback after the chain")
    assert all(int(p.abs().sum()) == 0 for p in pads), [p.tolist() for p in pads]


@INTERPRETER_ONLY
@pytest.mark.parametrize("one_pass_rows", [0, 1])
def test_whole_norm_kernel_with_barriers_over_processes(one_pass_rows):
    """P = 3 processes, 3 chained calls (NaN/Inf in call 1), 4 tiles of two
    rows on 2 programs (phase 3 in two passes, or in one a row at a time):
    outputs, residuals, feedback as the reference chain; every flag back to 0."""
    _interpreter_pool().submit(_reporting, _emulate_norm_ranks, world=3, rows=7, cols=77, group=16, calls=3,
                               tile_rows=2, programs=2, one_pass_rows=one_pass_rows).result(timeout=300)


# -- every rank in one launch on the GPU ---------------------------------------------------


def _one_launch_matches_composed(rows, cols, world, residual, one_pass=True):
    from echo_vllm import kernels
    from echo_vllm.kernels import fused_kernel as fk

    lay = WireLayout(rows * cols, world, 32, cols)
    tiling, reason = norm_tiling(lay, one_pass=one_pass)
    assert tiling is not None, reason
    sms = torch.cuda.get_device_properties(0).multi_processor_count // world
    fused_tiling = fk.tiling_for_norm(lay, tiling, sms)
    table, bufs, _ = fused_mod.local_buffers(world, lay.chunk_bytes, fk.signal_slots(fused_tiling.programs, world), "cuda")
    x = partials((world, lay.numel), 8).to(torch.bfloat16)
    fb = _feedback(world, lay, torch.bfloat16, 9)
    fb_c = fb.clone()
    res0, w = norm_operands(rows, cols, torch.bfloat16, torch.bfloat16, 10)
    res = res0.reshape(1, -1).repeat(world, 1) if residual is True else None
    keep = residual == "keep"  # no residual, Echo's output kept beside the norm
    kept = torch.full((world, lay.numel), float("nan"), dtype=torch.bfloat16, device="cuda") if keep else None
    out, new_res = fk.fused_all_reduce_norm(x, fb, table, lay, w, EPS, residual=res, rank=0,
                                            gathered_offset=bufs[0].numel() // 2, qmax=QMAX, hadamard=True,
                                            has_incoming=True, tiling=fused_tiling, timeout_ns=10**10, sms=sms * world,
                                            residual_out=kept)
    # the composed stage kernels on the same inputs
    wire = kernels.stage1(x, fb_c, lay, qmax=QMAX, hadamard=True, has_incoming=True)
    q2 = kernels.stage2(wire.transpose(0, 1).contiguous(), fb_c, list(range(world)), lay, qmax=QMAX)
    res_c = res0.clone().reshape(-1) if residual is True else None
    kept_c = torch.full((lay.numel,), float("nan"), dtype=torch.bfloat16, device="cuda") if keep else None
    want_out, _ = kernels.output_norm(q2, lay, torch.bfloat16, w, EPS, hadamard=True, residual=res_c,
                                      residual_out=kept_c)  # the plan's
    torch.cuda.synchronize()
    for r in range(world):
        assert_same_bits(out[r], want_out, f"rank {r} normed output", nan_any=True)
        if residual is True:
            assert_same_bits(new_res[r], res_c, f"rank {r} new residual", nan_any=True)
        if keep:
            assert_same_bits(new_res[r], kept_c, f"rank {r} kept output", nan_any=True)
    assert_same_bits(fb, fb_c, "feedback")
    # and the composed kernel against the spec
    spec_out, spec_res = expected(q2, lay, torch.bfloat16, res0 if residual is True else None, w, hadamard=True)
    assert_same_bits(want_out.view(rows, cols), spec_out, "composed output_norm vs spec", nan_any=True)
    if keep:
        y = quant.output_reference(q2, lay, torch.bfloat16, hadamard=True)
        assert_same_bits(kept_c, y, "composed kept output vs spec", nan_any=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("world", [8, 2])
@pytest.mark.parametrize("residual", [True, False, "keep"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["plan", "two-passes"])
def test_one_launch_qwen3_8b_prefill_matches_composed_on_gpu(world, residual, one_pass):
    _one_launch_matches_composed(8192, 4096, world, residual, one_pass)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,cols,world", [(1, 4096, 8), (333, 5120, 8), (64, 16384, 2), (100, 2880, 3),
                                            (64, 6144, 6), (50, 4096, 5), (7, 8192, 7)])
def test_one_launch_other_shapes_on_gpu(rows, cols, world):
    _one_launch_matches_composed(rows, cols, world, True)


# -- the tiling -------------------------------------------------------------------------


def test_rmsnorm_plan_covers_every_group_with_resident_programs():
    from echo_vllm.kernels import fused_kernel as fk

    for rows, cols in [(1, 4096), (8192, 4096), (333, 5120), (4096, 8192), (64, 16384), (7, 77)]:
        for world in (2, 3, 8):
            lay = WireLayout(rows * cols, world, 32, cols)
            tiling, _ = norm_tiling(lay)
            for sms in (1, 66, 132):
                fused_tiling = fk.tiling_for_norm(lay, tiling, sms)
                assert fused_tiling.norm == tiling and fused_tiling.groups_per_tile == tiling.groups_per_tile
                assert fused_tiling.num_warps == tiling.num_warps and 1 <= fused_tiling.programs <= sms * tiling.per_sm()
                assert fused_tiling.tiles(lay) == tiling.tiles(lay)
                assert fk.resident_programs(fused_tiling.registers, 0, fused_tiling.num_warps) >= tiling.per_sm()
                assert fused_tiling.programs <= sms * fk.max_per_sm()  # the backend's flag areas hold them
    with pytest.raises(ValueError, match="not a norm tiling"):
        lay = WireLayout(64, 2, 32)
        fk.fused_all_reduce_norm(torch.zeros(1, 64), None, torch.zeros(2, 2, dtype=torch.int64), lay,
                                 torch.ones(64), EPS, rank=0, gathered_offset=1024, qmax=QMAX, hadamard=True,
                                 has_incoming=False, tiling=fk.tiling_for(lay, 1), timeout_ns=0)
