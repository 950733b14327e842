"""The fused backend: its kernel against the references bit for bit, and the
pure functions that decide where it runs.

Triton's interpreter reads, writes and runs atomics through int64 addresses
cast to pointers, so on CPU the ranks are emulated with plain tensors and an
address table (``fused.local_buffers``):

* in the interpreter worker, every rank's phase 1, then every rank's phase
  2, then phase 3 (``phase=`` 1, 2, 3: no barrier), each compared with the
  reference stage it replaces -- ``recv`` slots, ``gathered`` slots,
  feedback buffers, outputs (compiled, on the device, on a CUDA host);
* in P processes forked from the interpreter worker, sharing memory, the
  whole kernel with its barriers, for a chain of calls: the flags'
  protocol, self-reset and the persistent grid's tile loop, with real
  atomics across processes.

Not covered here: the compiled barrier (acquire/release on a GPU, the
``%globaltimer`` timeout and ``trap``: the interpreter has no inline
assembly; checked here only as PTX), CUDA-graph replay and real peer
memory. ``scripts/gpu_fused_check.py`` runs those on a GPU host (processes
sharing one GPU); ``test_gpu_check`` runs it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from test_kernels import (
    CUDA, DEVICE, DTYPES, FB_DTYPES, INTERPRETER_ONLY, _compiler_pool, _feedback, _interpreter_pool, _reporting,
    _values, assert_same_bits, in_kernel_process,
)

from support.extremes import PATTERNS, extreme_inputs

from echo_vllm import quant
from echo_vllm.backends import BACKENDS, choose_backend
from echo_vllm.backends import fused as fused_mod
from echo_vllm.backends.fused import FusedFacts, fused_availability
from echo_vllm.config import BACKEND_CHOICES, SUPPORTED_GROUP_SIZES, EchoConfig, EchoConfigError
from echo_vllm.quant import WireLayout

QMAX = 7
ROOT = Path(__file__).resolve().parents[2]


def reference_chain(xs, fb, layout, *, hadamard, incoming, flips=0, encoder="absmax"):
    """The composed pipeline for P ranks (``xs [P, numel]``; ``fb [P, ...]``
    or None, updated in place; ``flips``: the rotation's sign flips;
    ``encoder``: stages 1 and 2's): ``(wire [P, P, B], q2 [P, B], y [numel])``."""
    wire = quant.stage1_reference(xs, fb, layout, qmax=QMAX, hadamard=hadamard, has_incoming=incoming, flips=flips,
                                  encoder=encoder)
    q2 = quant.stage2_reference(wire.transpose(0, 1).contiguous(), fb, list(range(layout.world_size)), layout,
                                qmax=QMAX, encoder=encoder)
    return wire, q2, quant.output_reference(q2, layout, xs.dtype, hadamard=hadamard, flips=flips)


# -- every phase of every rank, one at a time ------------------------------------------


def _phases_match_reference(numel, world, group, cols, dt, fb_dtype, hadamard, incoming, tile_groups, programs,
                            special=False, pattern=None, rotation_seed=0, encoder="absmax"):
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.rotation import sign_flips

    lay = WireLayout(numel, world, group, cols)
    flips = sign_flips(rotation_seed, group)
    tag = (f"numel={numel} cols={lay.cols} P={world} g={group} {dt} fb={fb_dtype} had={hadamard} inc={incoming} "
           f"rotation seed {rotation_seed} {encoder}")
    if pattern is None:
        x = _values((world, numel), numel + world, special=special).to(DTYPES[dt]).to(DEVICE)
    else:  # the edges of the range (support.extremes)
        x = extreme_inputs(pattern, world, lay.rows, lay.cols, DTYPES[dt], numel).reshape(world, numel).to(DEVICE)
        tag += f" {pattern}"
    fb_ref = _feedback(world, lay, FB_DTYPES[fb_dtype], 7) if fb_dtype else None
    fbs = [fb_ref[r:r + 1].clone() if fb_dtype else None for r in range(world)]
    # buffers sized for larger chunks, as the backend's are: this call's
    # slots are packed at the start of each area
    cb = lay.chunk_bytes + 48
    table, bufs, _ = fused_mod.local_buffers(world, cb, fk.signal_slots(programs, world), DEVICE)
    for b in bufs:
        b.fill_(0xA5)  # stale bytes: every byte compared below must have been written
    tiling = fk.FusedTiling(tile_groups, 2, programs)
    ys = [torch.empty(numel, dtype=x.dtype, device=DEVICE) for _ in range(world)]
    wire, q2, y = reference_chain(x, fb_ref, lay, hadamard=hadamard, incoming=incoming, flips=flips, encoder=encoder)
    fb_after = {1: None, 2: fb_ref}
    if fb_dtype:  # the reference's feedback after stage 1 alone
        fb1 = _feedback(world, lay, FB_DTYPES[fb_dtype], 7)
        quant.stage1_reference(x, fb1, lay, qmax=QMAX, hadamard=hadamard, has_incoming=incoming, flips=flips,
                               encoder=encoder)
        fb_after[1] = fb1
    n = world * lay.chunk_bytes
    for phase in (1, 2, 3):
        for r in range(world):
            fk.fused_all_reduce(x[r:r + 1], fbs[r], table, lay, rank=r, gathered_offset=world * cb, qmax=QMAX,
                                hadamard=hadamard, has_incoming=incoming, tiling=tiling, timeout_ns=0, flips=flips,
                                encoder=encoder, out=ys[r], phase=phase)
        for r in range(world):
            if phase == 1:
                recv = bufs[r][:n].view(world, lay.chunk_bytes)
                assert_same_bits(recv, wire[:, r], f"phase 1 recv of rank {r} [{tag}]")
            if phase == 2:
                gathered = bufs[r][world * cb:world * cb + n].view(world, lay.chunk_bytes)
                assert_same_bits(gathered, q2, f"phase 2 gathered of rank {r} [{tag}]")
            if phase < 3 and fb_dtype:
                assert_same_bits(fbs[r], fb_after[phase][r:r + 1], f"phase {phase} feedback of rank {r} [{tag}]")
            if phase == 3:
                assert_same_bits(ys[r], y, f"output of rank {r} [{tag}]", nan_any=True)


# numel, P, g, cols (0: one row), dtype, feedback, hadamard, incoming, groups per tile, programs;
# most cases have more tiles than programs (programs loop over tiles, unevenly where noted)
PHASE_CASES = [
    (1000, 2, 32, 0, "bf16", "fp32", True, True, 4, 3),           # 4 tiles on 3 programs
    (7 * 77, 3, 16, 77, "bf16", "bf16", True, True, 4, 2),        # cols not a multiple of g
    (3 * 96, 4, 32, 96, "fp16", "fp32", True, False, 8, 1),
    (5 * 200, 3, 64, 200, "fp32", None, False, True, 8, 1),       # no feedback buffer
    (2 * 256, 2, 128, 256, "bf16", "fp32", True, True, 8, 1),
    (9, 2, 64, 1, "fp32", "fp32", False, True, 4, 2),             # one column: a group per row
    (7 * 333, 3, 32, 333, "bf16", "int8", True, True, 8, 2),      # int8 feedback: blocks of 8 groups
    (1000, 4, 16, 0, "fp16", "int8", True, False, 16, 3),
    (3 * 256, 2, 128, 256, "fp32", "int8", False, True, 4, 1),
]
#: PHASE_CASES again with signed_mse (``EchoConfig.encoder``): pairwise over
#: g, dtype, feedback, rotation and a tile plan that loops unevenly.
SIGNED_PHASE_CASES = [PHASE_CASES[i] for i in (0, 1, 3, 5, 7)]


@pytest.mark.parametrize("numel,world,group,cols,dt,fb,hadamard,incoming,tile_groups,programs,encoder",
                         [(*c, "absmax") for c in PHASE_CASES] + [(*c, "signed_mse") for c in SIGNED_PHASE_CASES])
def test_phases_match_reference(numel, world, group, cols, dt, fb, hadamard, incoming, tile_groups, programs,
                                encoder):
    in_kernel_process(_phases_match_reference, numel, world, group, cols, dt, fb, hadamard, incoming, tile_groups,
                      programs, encoder=encoder)


#: PHASE_CASES under a rotation seed: every group size, both 16-bit inputs and fp32, int8 feedback.
FLIP_PHASE_CASES = [(c, seed) for seed, c in enumerate((PHASE_CASES[1], PHASE_CASES[2], PHASE_CASES[4],
                                                        PHASE_CASES[6], PHASE_CASES[7]), start=1)]


@pytest.mark.parametrize("case,rotation_seed", FLIP_PHASE_CASES, ids=str)
def test_phases_under_a_rotation_seed_match_reference(case, rotation_seed):
    in_kernel_process(_phases_match_reference, *case, rotation_seed=rotation_seed)


@pytest.mark.parametrize("fb,encoder", [("fp32", "absmax"), ("int8", "absmax"), ("bf16", "signed_mse")])
def test_phases_special_values_match_reference(fb, encoder):
    """NaN/Inf groups decode to NaN on every rank; huge, tiny and zero groups
    as the reference."""
    in_kernel_process(_phases_match_reference, 40 * 32 + 9, 2, 32, 0, "bf16", fb, True, True, 8, 2,
                      special=True, encoder=encoder)  # 3 tiles on 2 programs


@pytest.mark.parametrize("pattern,dt,hadamard,fb,encoder", [
    ("sweep", "bf16", True, "bf16", "absmax"), ("cancel", "fp32", False, "int8", "absmax"),
    ("subnormal", "fp16", True, "fp32", "absmax"), ("sweep", "fp32", False, "int8", "signed_mse"),
    ("cancel", "bf16", True, "bf16", "signed_mse"), ("subnormal", "bf16", True, "fp32", "signed_mse")])
def test_phases_at_the_edges_of_the_range_match_reference(pattern, dt, hadamard, fb, encoder):
    """Magnitudes up to the dtype's max, cancelling pairs, subnormals
    (support.extremes): every phase of every rank gives the references' bits."""
    in_kernel_process(_phases_match_reference, 6 * 40, 3, 16, 40, dt, fb, hadamard, True, 4, 2, pattern=pattern,
                      encoder=encoder)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("encoder", ["absmax", "signed_mse"])
@pytest.mark.parametrize("fb", ["bf16", "int8"])
@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_phases_at_the_edges_of_the_range_on_gpu(pattern, dt, fb, encoder):
    """The same compiled (the bf16x2 output decode and its saturation, the
    fused prescale of stage 1, signed_mse's shuffled sums), 1000 rows of
    2880 over 8 ranks."""
    _phases_match_reference(1000 * 2880, 8, 32, 2880, dt, fb, True, True, 64, 132, pattern=pattern, encoder=encoder)


# -- the whole kernel, barriers included, over processes sharing memory ---------------


def run_forked_ranks(world, one_rank, deadline_s):
    """Fork ``world`` processes of this (interpreter worker) process, each
    running ``one_rank(rank)``; assert that each exited cleanly. A failed
    rank leaves its peers waiting, and a lost flag would hang the
    interpreter's unbounded wait: everyone still running then, or at the
    deadline, is stopped."""
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # one rank; never returns into the worker's code
            code = 1
            try:
                one_rank(rank)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    deadline, codes = time.monotonic() + deadline_s, {}
    while len(codes) < world and time.monotonic() < deadline and not any(codes.values()):
        for pid in pids:
            done, status = os.waitpid(pid, os.WNOHANG) if pid not in codes else (0, 0)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for pid in set(pids) - set(codes):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert list(codes.values()) == [0] * world, (
        f"emulated ranks' exit codes {codes} (missing: still waiting after {deadline_s} s or stopped)")


def _emulate_ranks(world, rows, cols, group, calls, tile_groups, programs, hadamard=True, deadline_s=60.0,
                   fb_dtype="fp32", encoder="absmax"):
    """In the interpreter worker: ``world`` forked processes (one per rank)
    run ``calls`` chained calls of the whole kernel on buffers in shared
    memory (mapped at the same addresses in every child, so one table
    serves all); compared with the reference chain. Forking the warm worker
    instead of spawning fresh interpreters saves their imports."""
    from echo_vllm.kernels import fused_kernel as fk

    lay = WireLayout(rows * cols, world, group, cols)
    table, bufs, pads = fused_mod.local_buffers(world, lay.chunk_bytes, fk.signal_slots(programs, world), "cpu")
    for t in (*bufs, *pads):
        t.share_memory_()  # moves the storage: the table is rebuilt below
    table = torch.tensor([[b.data_ptr() for b in bufs], [p.data_ptr() for p in pads]], dtype=torch.int64)
    xs = torch.stack([_values((world, lay.numel), 50 + c, special=c == 1).to(torch.bfloat16) for c in range(calls)])
    fb0 = _feedback(world, lay, FB_DTYPES[fb_dtype], 51, device="cpu")
    fbs = fb0.clone().share_memory_()
    ys = torch.zeros(calls, world, lay.numel, dtype=torch.bfloat16).share_memory_()
    tiling = fk.FusedTiling(tile_groups, 2, programs)
    def one_rank(rank):
        for c in range(calls):
            fk.fused_all_reduce(xs[c, rank:rank + 1], fbs[rank:rank + 1], table, lay, rank=rank,
                                gathered_offset=bufs[0].numel() // 2, qmax=QMAX, hadamard=hadamard,
                                has_incoming=c > 0, tiling=tiling, timeout_ns=0, encoder=encoder, out=ys[c, rank])

    run_forked_ranks(world, one_rank, deadline_s)
    fb_ref = fb0.clone()
    for c in range(calls):
        _, _, y = reference_chain(xs[c], fb_ref, lay, hadamard=hadamard, incoming=c > 0, encoder=encoder)
        for r in range(world):
            assert_same_bits(ys[c, r], y, f"call {c}, rank {r}", nan_any=True)
    assert_same_bits(fbs, fb_ref, "feedback after the chain")
    assert all(int(p.abs().sum()) == 0 for p in pads), [p.tolist() for p in pads]


@INTERPRETER_ONLY
@pytest.mark.parametrize("fb,encoder,deadline_s", [("fp32", "absmax", 60.0), ("int8", "absmax", 60.0),
                                                   ("bf16", "signed_mse", 180.0)])
def test_whole_kernel_with_barriers_over_processes(fb, encoder, deadline_s):
    """P = 3 processes run 3 chained calls of the whole kernel (two programs
    looping over four tiles, barriers between the phases; NaN/Inf in call
    1): every rank returns the reference chain's bits, the feedback buffers
    hold its errors, and every flag is back to 0 at the end. (signed_mse's
    three candidates take the interpreter about three times as long.)"""
    _interpreter_pool().submit(_reporting, _emulate_ranks, world=3, rows=5, cols=77, group=16, calls=3,
                               tile_groups=4, programs=2, fb_dtype=fb, encoder=encoder,
                               deadline_s=deadline_s).result(timeout=600)


def test_compile_only_launches_nothing():
    """``compile_only``: not a byte of the buffers, the feedback or ``out``
    written (the interpreter compiles nothing); on a GPU the kernel is
    compiled and checked resident, and the emulated whole kernel then gives
    the reference's bits (``gpu_fused_check.py``'s sweep compiles its
    cases this way, each rank its share, before the calls)."""
    from echo_vllm.kernels import fused_kernel as fk

    world, lay = 2, WireLayout(3 * 256, 2, 32, 256)
    x = _values((world, lay.numel), 11).to(torch.bfloat16).to(DEVICE)
    fb = _feedback(world, lay, FB_DTYPES["bf16"], 7).to(DEVICE)
    fb_before = fb.clone()
    tiling = fk.tiling_for(lay, 4)
    table, bufs, pads = fused_mod.local_buffers(world, lay.chunk_bytes, fk.signal_slots(tiling.programs, world), DEVICE)
    for b in bufs:
        b.fill_(0xA5)
    out = torch.full((world, lay.numel), 3.0, dtype=torch.bfloat16, device=DEVICE)
    resident = len(fk._RESIDENT)
    got = fk.fused_all_reduce(x, fb, table, lay, rank=0, gathered_offset=world * lay.chunk_bytes, qmax=QMAX,
                              hadamard=True, has_incoming=True, tiling=tiling, timeout_ns=5 * 10**9, out=out,
                              sms=4, compile_only=True)
    assert got.data_ptr() == out.data_ptr() and bool((out == 3.0).all())
    assert torch.equal(fb, fb_before) and all(bool((b == 0xA5).all()) for b in bufs)
    assert all(not p.any() for p in pads)
    if not CUDA:
        return
    assert len(fk._RESIDENT) == resident + 1
    y = fk.fused_all_reduce(x, fb, table, lay, rank=0, gathered_offset=world * lay.chunk_bytes, qmax=QMAX,
                            hadamard=True, has_incoming=True, tiling=tiling, timeout_ns=5 * 10**9, sms=4)
    _, _, want = reference_chain(x.cpu(), fb_before.cpu(), lay, hadamard=True, incoming=True)
    for r in range(world):
        assert_same_bits(y[r].cpu(), want, f"rank {r} after compile_only", nan_any=True)


# -- compiled for sm_90 (no GPU needed) -------------------------------------------------


def _compiled_ptx(fp_fusion: bool = False) -> str:
    """The fused kernel's PTX as the backend compiles it (``fp_fusion`` off),
    or with multiply-add contraction allowed, for comparison."""
    from echo_vllm.bench.host_overhead import compile_only
    from echo_vllm.kernels import fused_kernel as fk

    lay = WireLayout(4 * 4096, 4, 32, 4096)
    x, fb, y = torch.zeros(1, lay.numel, dtype=torch.bfloat16), torch.zeros(1, lay.padded_numel), torch.empty(1, lay.numel, dtype=torch.bfloat16)
    with compile_only():
        tiling = fk.tiling_for(lay, 132)
        lp = fk._launch_plan(lay, tiling, 1, 4 * lay.chunk_bytes, QMAX, True, True, True, fk.ALL_PHASES,
                             fk.tiling_lanes(tiling, lay, x, y))
        options = lp.launcher.options
        try:
            lp.launcher.options = {**options, "enable_fp_fusion": fp_fusion}
            k = lp.launcher.compile(lp.grid, (x, fb, y, torch.zeros(2, 4, dtype=torch.int64)),
                                    fk.launch_ints(lp, x, fb, lay, rank=1, timeout_ns=5 * 10**9, status_addr=1 << 46),
                                    lp.constexprs)
        finally:
            lp.launcher.options = options
        return k.asm["ptx"]


def test_compiled_kernel_has_system_scope_barriers_and_a_timeout():
    """Compiled for sm_90 on the CPU: the flags are CASed with release
    (signal) and acquire (wait) semantics at system scope, the waits read
    ``%globaltimer`` and can ``trap``; the kernel keeps its explicit fused
    multiply-adds (exact products) and contracts no other: allowing
    contraction adds some."""
    pool = _compiler_pool()
    ptx = pool.submit(_reporting, _compiled_ptx).result(timeout=600)
    assert len(re.findall(r"atom\.global\.release\.sys\.cas\.b32", ptx)) == 2
    assert len(re.findall(r"atom\.global\.acquire\.sys\.cas\.b32", ptx)) == 2
    assert "%globaltimer" in ptx
    # each of the 4 waits can trap, first storing its status word to host memory, fenced system-wide
    assert len(re.findall(r"st\.relaxed\.sys\.b64 \[%rd\d+\], %rd\d+; fence\.sc\.sys; trap;", ptx)) == 4, ptx
    explicit = len(re.findall(r"\bfma\.rn\.f32", ptx))
    contracted = len(re.findall(r"\bfma\.rn\.f32", pool.submit(_reporting, _compiled_ptx, True).result(timeout=600)))
    assert 0 < explicit < contracted, (explicit, contracted)


def test_a_trapped_kernel_leaves_a_status_word_that_names_echo_the_barrier_and_the_peer():
    """The word a timed-out program stores before ``trap`` decodes to its
    rank, program, barrier and late peer, and reads as an error naming
    Echo, the phase and the peer; a zero word (no trap) decodes to None.
    (The bit fields as the kernel builds them; the kernel's store is checked
    as PTX above and on the GPU by ``scripts/gpu_fused_check.py``.)"""
    from echo_vllm.kernels import fused_kernel as fk

    def word(rank, program, barrier, side, peer):
        return ((fk.TRAP_MAGIC.value << fk.TRAP_MAGIC_SHIFT.value) | (barrier << fk.TRAP_BARRIER_SHIFT.value)
                | (side.value << fk.TRAP_SIDE_SHIFT.value) | (program << fk.TRAP_PROGRAM_SHIFT.value)
                | (rank << fk.TRAP_RANK_SHIFT.value) | peer)

    got = fk.decode_trap(word(3, 395, 1, fk.TRAP_WAITING, 6))
    assert got == fk.TrapStatus(rank=3, peer=6, program=395, barrier=1, signalling=False)
    text = got.describe(2.5)
    assert text.startswith("echo fused all-reduce timed out after 2.5 s: rank 3 (program 395) at barrier 1")
    assert "phase 1" in text and "waiting for rank 6's signal" in text and "CUDA context is lost" in text
    late = fk.decode_trap(word(0, 0, 2, fk.TRAP_SIGNALLING, 1))
    assert late.signalling and late.barrier == 2 and "phase 3" in late.describe() and "rank 1 stopped" in late.describe()
    assert fk.decode_trap(0) is None and fk.decode_trap(12345) is None
    status = fk.trap_word()
    assert status.dtype == torch.int64 and status.numel() == 1 and int(status[0]) == 0 and not status.is_cuda


# -- the grid table ---------------------------------------------------------------------


def test_tile_table_and_plans():
    from echo_vllm.kernels import fused_kernel as fk

    rows = fk.TILE_TABLE
    assert [r.max_chunk_numel for r in rows] == sorted(r.max_chunk_numel for r in rows)
    assert rows[-1].max_chunk_numel >= 1 << 40, "the last row takes every size"
    for r in rows:
        assert r.tile_values & (r.tile_values - 1) == 0 and r.tile_values >= max(SUPPORTED_GROUP_SIZES)
        assert r.num_warps in (1, 2, 4, 8)
    for numel, cols in [(1, 0), (8192, 8192), (64 * 8192, 8192), (4096 * 8192, 8192), (3 * 1000, 1000)]:
        for p in (2, 3, 8):
            for g in SUPPORTED_GROUP_SIZES:
                lay = WireLayout(numel, p, g, cols)
                for sms in (1, 7, 132):
                    tiling = fk.tiling_for(lay, sms)
                    row = next(r for r in rows if lay.chunk_numel <= r.max_chunk_numel)
                    # every slot of every SM filled (so the SMs get the same number), or a program per tile
                    assert tiling.programs == min(tiling.tiles(lay), sms * row.per_sm)
                    assert tiling.groups_per_tile * g == row.tile_values and tiling.num_warps == row.num_warps
                    assert tiling.tiles(lay) * tiling.groups_per_tile >= lay.chunk_groups
                    # the register cap lets per_sm programs share an SM, and no more fit by registers
                    assert fk.resident_programs(tiling.registers, 0, tiling.num_warps) >= row.per_sm
                    assert tiling.registers == 255 or fk.resident_programs(tiling.registers + 8, 0, tiling.num_warps) < row.per_sm
    with pytest.raises(ValueError, match="sms"):
        fk.tiling_for(WireLayout(64, 2, 32), 0)


def test_residency_follows_the_sm_limits():
    """Hopper: 64 K registers, 64 warps, 228 KiB shared per SM (the CUDA occupancy calculator's numbers)."""
    from echo_vllm.kernels import fused_kernel as fk

    assert fk.resident_programs(64, 0, 8) == 4       # 64 x 256 threads: 16 K registers a program
    assert fk.resident_programs(80, 0, 8) == 3
    assert fk.resident_programs(81, 0, 8) == 2       # allocated per warp in units of 256: 88 a thread
    assert fk.resident_programs(32, 0, 8) == 8       # bound by warps
    assert fk.resident_programs(16, 0, 1) == 32      # bound by programs per SM
    assert fk.resident_programs(32, 100 * 1024, 4) == 2  # bound by shared memory (+1 KiB reserved each)
    assert [fk.register_cap(n, 8) for n in (1, 2, 3, 4)] == [255, 128, 80, 64]


def test_a_grid_that_cannot_be_resident_is_refused():
    """Barriers need every program of the launch resident: the check reads
    the compiled kernel's resources (stubbed here) and refuses more."""
    from echo_vllm.kernels import fused_kernel as fk

    lay = WireLayout(4096 * 8192, 8, 32, 8192)
    tiling = fk.tiling_for(lay, 132)
    lp = fk._launch_plan(lay, tiling, 1, 8 * lay.chunk_bytes, QMAX, True, True, True, fk.ALL_PHASES, True)
    try:
        fk._RESIDENT[lp] = (tiling.registers, 0, 0)
        fk.check_resident(lp, (), (), 132, fk.SMLimits())  # as planned: fits
        with pytest.raises(fk.ResidencyError, match="cannot be resident on 100 SMs"):
            fk.check_resident(lp, (), (), 100, fk.SMLimits())
        fk._RESIDENT[lp] = (tiling.registers + 8, 0, 0)  # a specialization that needed more registers
        with pytest.raises(fk.ResidencyError, match="registers/thread"):
            fk.check_resident(lp, (), (), 132, fk.SMLimits())
    finally:
        fk._RESIDENT.pop(lp, None)


def test_bad_arguments_raise_clear_errors():
    from echo_vllm.kernels import fused_kernel as fk

    lay = WireLayout(256, 2, 32)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    table = torch.zeros(2, 2, dtype=torch.int64)
    kw = dict(rank=0, gathered_offset=2 * lay.chunk_bytes, qmax=QMAX, hadamard=True, has_incoming=False,
              tiling=fk.tiling_for(lay, 4), timeout_ns=1)
    with pytest.raises(ValueError, match="table"):
        fk.fused_all_reduce(x, None, torch.zeros(2, 3, dtype=torch.int64), lay, **kw)
    with pytest.raises(ValueError, match="rank"):
        fk.fused_all_reduce(x, None, table, lay, **{**kw, "rank": 2})
    with pytest.raises(ValueError, match="gathered_offset"):
        fk.fused_all_reduce(x, None, table, lay, **{**kw, "gathered_offset": lay.chunk_bytes})
    with pytest.raises(ValueError, match="phase"):
        fk.fused_all_reduce(x, None, table, lay, phase=4, **kw)
    with pytest.raises(ValueError, match="257 values, layout says 256"):
        fk.fused_all_reduce(torch.zeros(1, 257, dtype=torch.bfloat16), None, table, lay, **kw)
    with pytest.raises(ValueError, match="feedback"):
        fk.fused_all_reduce(x, torch.zeros(1, 10), table, lay, **kw)
    with pytest.raises(ValueError, match="feedback"):  # as many bytes as values: short of the scales
        fk.fused_all_reduce(x, torch.zeros(1, lay.padded_numel, dtype=torch.int8), table, lay, **kw)


# -- where it runs: pure functions ---------------------------------------------------------


def _facts(**kw) -> FusedFacts:
    n = len(kw.get("devices", (0, 1)))
    full = tuple((True,) * n for _ in range(n))
    base = dict(device_type="cuda", transport="process_group", symm_mem=True, hosts=("h",) * n, devices=(0, 1),
                peer_access=full, sm_counts=(132,) * n, native_atomics=full, nvlink=full)
    return FusedFacts(**{**base, **kw})


def _pcie(n: int, linked=frozenset()):
    """NVLink matrix of ``n`` GPUs where only the pairs in ``linked`` are on NVLink."""
    return tuple(tuple(a == b or frozenset((a, b)) in linked for b in range(n)) for a in range(n))


@pytest.mark.parametrize("facts,ok,reason", [
    (_facts(), True, "2 ranks on GPU"),
    (_facts(device_type="cpu"), False, "cpu tensors"),
    (_facts(transport="virtual"), False, "virtual ranks"),
    (_facts(transport="PyncclTransport"), False, "not a torch.distributed process group"),
    (_facts(symm_mem=False), False, "_symmetric_memory"),
    (_facts(hosts=("a", "b")), False, "2 hosts"),
    (_facts(devices=(0, 0)), False, "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1"),
    (_facts(devices=(0, 0), allow_overlap=True), True, "GPU(s) [0, 0]"),
    (_facts(peer_access=((True, False), (True, True))), False, "GPU 0 (rank 0) cannot access GPU 1"),
    # native atomics over the link: the barriers need them
    (_facts(native_atomics=((True, True), (False, True))), False, "from GPU 1 (rank 1) to GPU 0 (rank 0) not supported"),
    (_facts(native_atomics=((True, None), (True, True))), False, "to GPU 1 (rank 1) unknown"),
    (_facts(native_atomics=()), False, "unknown"),
    # vLLM's custom all-reduce rule: two PCIe GPUs run, more need NVLink between every pair
    (_facts(nvlink=_pcie(2)), True, "2 ranks on GPU(s) [0, 1] with peer access and native atomics"),
    (_facts(devices=(0, 1, 2), nvlink=_pcie(3)), False, "3 GPUs not all on NVLink (GPU 0 and GPU 1: PCIe only)"),
    (_facts(devices=(0, 1, 2, 3), nvlink=_pcie(4, {frozenset((0, 1)), frozenset((2, 3))})), False,
     "4 GPUs not all on NVLink (GPU 0 and GPU 2: PCIe only): more than two PCIe-only GPUs are refused"),
    (_facts(devices=(0, 1, 2), nvlink=()), False, "(GPU 0 and GPU 1: unknown)"),
    (_facts(devices=(0, 1, 2, 3)), True, "4 ranks on GPU(s) [0, 1, 2, 3] with NVLink and native atomics"),
    # ranks that share one GPU need no link at all
    (_facts(devices=(0, 0, 0, 0), allow_overlap=True, native_atomics=(), nvlink=()), True, "GPU(s) [0, 0, 0, 0]"),
])
def test_fused_availability(facts, ok, reason):
    got, why = fused_availability(facts)
    assert got is ok and reason in why


def test_sms_share_the_smallest_gpu():
    assert fused_mod.sms_for(_facts(sm_counts=(132, 78))) == 78
    assert fused_mod.sms_for(_facts(devices=(0, 0, 0, 1), sm_counts=(132,) * 4,
                                    hosts=("h",) * 4)) == 44  # three ranks share GPU 0
    assert fused_mod.sms_for(_facts(sm_counts=(1, 1), devices=(0, 0))) == 1


def test_choose_backend_picks_fused_only_with_peer_access():
    assert choose_backend("auto", device_type="cuda", stochastic=False, p2p=True)[0] == "fused"
    assert choose_backend("auto", device_type="cuda", stochastic=False)[0] == "triton"  # p2p defaults to False
    assert choose_backend("auto", device_type="cuda", stochastic=True, p2p=True)[0] == "reference"
    assert choose_backend("auto", device_type="cuda", stochastic=False, env_kernels="triton", p2p=True)[0] == "triton"
    assert choose_backend("auto", device_type="cpu", stochastic=False, p2p=True)[0] == "reference"
    assert choose_backend("fused", device_type="cuda", stochastic=False) == ("fused", "configured")
    with pytest.raises(EchoConfigError, match="cpu"):
        choose_backend("fused", device_type="cpu", stochastic=False)
    with pytest.raises(EchoConfigError, match="stochastic"):
        choose_backend("fused", device_type="cuda", stochastic=True)
    assert "fused" in BACKENDS and "fused" in BACKEND_CHOICES and EchoConfig(backend="fused").backend == "fused"


def test_virtual_and_cpu_groups_are_not_probed():
    """No collective runs for groups that cannot use the fused kernel, and
    they are told why."""
    from echo_vllm import VirtualTransport

    tr = VirtualTransport(3)
    assert fused_mod.fused_support(tr) == (False, "in-process virtual ranks have no peer memory")
    assert fused_mod.probe(tr, "cpu").device_type == "cpu"
    assert fused_mod.fused_support(tr, "cpu")[0] is False


class _OneRank:
    """The transport attributes the backend reads (its facts are given)."""

    world_size, rank, local_ranks, capturable = 2, 0, (0,), False


class _Recorder:
    capturable = True

    def __init__(self):
        self.calls = []

    def all_reduce(self, xs, layout, feedback, *, has_incoming, out=None):
        self.calls.append(layout)
        return "fallback"

    def close(self):
        pass


def test_messages_that_do_not_fit_take_the_fallback_or_raise():
    """Chunks larger than the buffers' slots never reach the kernel: the
    fallback runs them, or, without one, a clear error."""
    from echo_vllm.kernels import fused_kernel as fk

    cfg = EchoConfig(group_size=32)
    small = WireLayout(4096, 2, 32)
    table, bufs, pads = fused_mod.local_buffers(2, small.chunk_bytes, fk.signal_slots(4 * fk.max_per_sm(), 2), "cpu")
    buffers = fused_mod.SymmBuffers(bufs[0], None, table, 0, small.chunk_bytes, pads[0].numel())
    rec = _Recorder()
    b = fused_mod.FusedSymmMemBackend(cfg, _OneRank(), sms=4, fallback=rec, facts=_facts(),
                                      buffers=buffers)
    big = WireLayout(4096 + 32 * 2 * 8, 2, 32)
    assert b.fits(small) and not b.fits(big) and not b.fits(WireLayout(4096, 3, 32))
    assert b.fits(WireLayout(4096 // 64 * 63, 2, 32, 4096 // 64 * 63 // 7))
    x = torch.zeros(1, big.numel, dtype=torch.bfloat16)
    assert b.all_reduce(x, big, None, has_incoming=False) == "fallback" and rec.calls == [big]
    assert b.capturable
    bare = fused_mod.FusedSymmMemBackend(cfg, _OneRank(), sms=4, facts=_facts(), buffers=buffers)
    with pytest.raises(fused_mod.MessageTooLarge, match="fused buffers hold"):
        bare.all_reduce(x, big, None, has_incoming=False)
    with pytest.raises(ValueError, match="flags"):
        fused_mod.FusedSymmMemBackend(cfg, _OneRank(), sms=8, facts=_facts(), buffers=buffers)
    with pytest.raises(RuntimeError, match="cannot run here: in-process"):
        fused_mod.FusedSymmMemBackend(cfg, _OneRank(), facts=_facts(transport="virtual"), buffers=buffers)
    with pytest.raises(ValueError, match="nearest"):
        fused_mod.FusedSymmMemBackend(EchoConfig(rounding="stochastic"), _OneRank(), facts=_facts(),
                                      buffers=buffers)


def test_the_backend_compiles_what_fits_and_leaves_the_rest_to_its_fallback(monkeypatch):
    """``FusedSymmMemBackend.compile``: a message that fits reaches the kernel
    with ``compile_only`` (nothing written); one that does not is the
    fallback's, which compiles nothing here and is not called."""
    from echo_vllm.kernels import fused_kernel as fk

    buffers = _cpu_buffers()
    small, big = WireLayout(4096, 2, 32), WireLayout(4 * 4096, 2, 32)
    assert small.chunk_bytes <= buffers.chunk_bytes < big.chunk_bytes
    rec = _Recorder()
    b = fused_mod.FusedSymmMemBackend(EchoConfig(group_size=32), _OneRank(), sms=4, fallback=rec, facts=_facts(),
                                      buffers=buffers)
    seen, real = [], fk.fused_all_reduce
    monkeypatch.setattr(fused_mod, "fused_all_reduce",
                        lambda *a, **kw: seen.append(kw["compile_only"]) or real(*a, **kw))
    assert b.compile(torch.zeros(1, big.numel, dtype=torch.bfloat16), big, None, has_incoming=False) is None
    b.compile(torch.zeros(1, small.numel, dtype=torch.bfloat16), small, None, has_incoming=False)
    assert seen == [True] and rec.calls == []
    assert not buffers.buffer.any()


def _cpu_buffers(world=2, chunk_bytes=4096, slots=None):
    from echo_vllm.kernels import fused_kernel as fk

    slots = slots or fk.signal_slots(4 * fk.max_per_sm(), world)
    table, bufs, pads = fused_mod.local_buffers(world, chunk_bytes, slots, "cpu")
    return fused_mod.SymmBuffers(bufs[0], None, table, 0, chunk_bytes, pads[0].numel())


def test_local_buffers_live_as_long_as_their_table():
    # the table holds raw addresses: buffers freed under it would be written by the next kernel
    import gc
    import weakref

    table, bufs, pads = fused_mod.local_buffers(2, 64, 4, "cpu")
    refs = [weakref.ref(t) for t in bufs + pads]
    assert table.tolist() == [[b.data_ptr() for b in bufs], [p.data_ptr() for p in pads]]
    del bufs, pads
    gc.collect()
    assert all(r() is not None for r in refs)
    del table
    gc.collect()
    assert all(r() is None for r in refs)


def test_close_frees_the_shared_buffers_when_the_last_user_closes(monkeypatch):
    """Backends of one group share its buffers (one rendezvous); each close
    gives them back, the last frees them: nothing stays cached, and the
    memory goes once the backends are gone. (CPU: the rendezvous and this
    rank's GPU are stood in for.)"""
    import weakref
    from types import SimpleNamespace

    made = []

    def allocate(group, device, chunk_bytes, signal_slots):
        made.append(_cpu_buffers(chunk_bytes=chunk_bytes, slots=signal_slots))
        return made[-1]

    monkeypatch.setattr(fused_mod, "_allocate", allocate, raising=False)
    monkeypatch.setattr(fused_mod, "_local_device", lambda: torch.device("cpu"), raising=False)
    monkeypatch.setattr(fused_mod, "_group", lambda transport: SimpleNamespace(group_name="g"))
    monkeypatch.setattr(fused_mod, "_BUFFERS", {})
    cfg = EchoConfig(group_size=32)
    a = fused_mod.FusedSymmMemBackend(cfg, _OneRank(), sms=4, max_numel=4096, facts=_facts())
    b = fused_mod.FusedSymmMemBackend(cfg, _OneRank(), sms=4, max_numel=4096, facts=_facts())
    assert a.buffers is b.buffers and len(made) == 1 and len(fused_mod._BUFFERS) == 1
    alive = weakref.ref(made.pop().buffer)
    a.close()
    assert len(fused_mod._BUFFERS) == 1 and b.buffers is not None  # b still uses them
    b.close()
    assert fused_mod._BUFFERS == {} and a.buffers is None and b.buffers is None
    assert alive() is None  # nothing holds the memory any more
    c = fused_mod.FusedSymmMemBackend(cfg, _OneRank(), sms=4, max_numel=4096, facts=_facts())
    assert len(made) == 1 and c.buffers is made[0]  # a new backend allocates anew
    c.close()


def test_a_call_from_a_second_stream_on_the_same_buffers_is_refused(monkeypatch):
    """The buffers serve one stream: the first call claims it; another
    stream is refused while the first has calls in flight, and takes over
    once it is idle; calls under graph capture are not checked. (CPU: the
    streams and the kernel launch are stood in for.)"""
    busy = {"A": True, "B": False}
    on = ["A"]
    monkeypatch.setattr(fused_mod, "_current_stream", lambda device: on[0], raising=False)
    monkeypatch.setattr(fused_mod, "_stream_idle", lambda stream: not busy[stream], raising=False)
    buffers = _cpu_buffers()
    launches = []
    backends = [fused_mod.FusedSymmMemBackend(EchoConfig(group_size=32), _OneRank(), sms=4, facts=_facts(),
                                              buffers=buffers) for _ in range(2)]
    monkeypatch.setattr(fused_mod, "fused_all_reduce", lambda *a, **k: launches.append(on[0]) or "y")
    lay = WireLayout(256, 2, 32)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert backends[0].all_reduce(x, lay, None, has_incoming=False) == "y"
    on[0] = "B"
    for b in backends:  # the same buffers: either backend is refused
        with pytest.raises(fused_mod.FusedStreamError, match="one stream at a time"):
            b.all_reduce(x, lay, None, has_incoming=False)
    monkeypatch.setattr(fused_mod, "capturing", lambda: True)  # capture: a replay runs no host code
    backends[1].all_reduce(x, lay, None, has_incoming=False)
    monkeypatch.setattr(fused_mod, "capturing", lambda: False)
    busy["A"] = False  # A's calls are done: B takes over, and A is now the second stream
    backends[1].all_reduce(x, lay, None, has_incoming=False)
    on[0], busy["B"] = "A", True
    with pytest.raises(fused_mod.FusedStreamError):
        backends[0].all_reduce(x, lay, None, has_incoming=False)
    assert launches == ["A", "B", "B"]


def test_the_timeout_comes_from_the_config():
    """``EchoConfig.timeout_s`` (``--echo-timeout-s``) is what the kernel's
    barriers wait, in nanoseconds; an explicit argument still wins."""
    buffers = _cpu_buffers()
    b = fused_mod.FusedSymmMemBackend(EchoConfig(timeout_s=2.5), _OneRank(), sms=4, facts=_facts(), buffers=buffers)
    assert b.timeout_ns == 2_500_000_000
    assert fused_mod.FusedSymmMemBackend(EchoConfig(), _OneRank(), sms=4, facts=_facts(), buffers=buffers,
                                         timeout_s=3).timeout_ns == 3_000_000_000
    assert EchoConfig().timeout_s == 60.0
    with pytest.raises(EchoConfigError, match="timeout_s"):
        EchoConfig(timeout_s=0)
    assert EchoConfig.from_mapping({"echo_timeout_s": "7.5"}, prefix="echo_").timeout_s == 7.5


def test_a_trap_is_logged_once_and_every_later_call_raises_it(caplog, monkeypatch):
    """Once a kernel of the backend trapped (its status word set, as the
    kernel does before ``trap``), the watcher logs an error naming Echo, the
    barrier and the peer, once, and each later call raises it instead of
    launching onto a lost CUDA context. (CPU: the word is set by hand.)"""
    from echo_vllm.kernels import fused_kernel as fk

    monkeypatch.setattr(fused_mod, "_current_stream", lambda device: "A", raising=False)
    b = fused_mod.FusedSymmMemBackend(EchoConfig(group_size=32, timeout_s=2.0), _OneRank(), sms=4, facts=_facts(),
                                      buffers=_cpu_buffers())
    launches = []
    monkeypatch.setattr(fused_mod, "fused_all_reduce", lambda *a, **k: launches.append(k["status"]) or "y")
    lay, x = WireLayout(256, 2, 32), torch.zeros(1, 256, dtype=torch.bfloat16)
    assert b.all_reduce(x, lay, None, has_incoming=False) == "y" and launches == [b.status]
    assert b.trap() is None and b.trap_error() is None and fused_mod.TRAPS.poll() == []
    assert b in set(fused_mod.TRAPS._backends)
    b.status[0] = ((fk.TRAP_MAGIC.value << fk.TRAP_MAGIC_SHIFT.value) | (2 << fk.TRAP_BARRIER_SHIFT.value)
                   | (fk.TRAP_WAITING.value << fk.TRAP_SIDE_SHIFT.value) | (7 << fk.TRAP_PROGRAM_SHIFT.value) | 1)
    with caplog.at_level("ERROR", logger=fused_mod.__name__):
        reports = fused_mod.TRAPS.poll()
        assert fused_mod.TRAPS.poll() == []  # once
    assert reports == [b.trap().describe(2.0)] == [b.trap_error()]
    assert [r.getMessage() for r in caplog.records] == reports
    assert "after 2 s: rank 0 (program 7) at barrier 2" in reports[0] and "rank 1's signal" in reports[0]
    with pytest.raises(fused_mod.FusedTimeoutError, match="echo fused all-reduce timed out .* barrier 2, between phase 2"):
        b.all_reduce(x, lay, None, has_incoming=False)
    assert len(launches) == 1


# -- GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_check():
    """scripts/gpu_fused_check.py: P = 2 and 4 processes sharing the GPU,
    bits against the references, eager and graph replay, a chain, NaN/Inf,
    an absent peer turned into an error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_fused_check.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
