"""The fused Echo all-reduce: one Triton kernel over peer-mapped (symmetric) memory.

What one launch does on rank ``rank`` of P (every rank launches the same
grid on the same message layout):

1. phase 1, for each of the program's tiles (``BG`` groups of one chunk
   index) and each destination chunk j: load x (the position-owned layout,
   :func:`tile.message_offsets`), rotate, add the carried error, quantize,
   write the new error into the local feedback buffer (wire order), store
   the packed codes and bf16 scales into *peer j's* ``recv`` slot ``rank``;
2. barrier with every peer's same program;
3. phase 2, for each tile of the own chunk: decode the P ``recv`` slots, sum
   in fp32 in rank order 0..P-1, requantize, add the error into the own
   chunk of the feedback buffer, store the result into *every peer's*
   ``gathered`` slot ``rank``;
4. barrier;
5. phase 3, for each tile and chunk j: decode ``gathered`` slot j, unrotate,
   cast, store y.

The bits are those of ``quant.stage1_reference`` -> exchange ->
``stage2_reference`` -> ``output_reference``: the same tile bodies
(:mod:`.bodies`) as the stage kernels, compiled without FMA contraction.
Phases 1 and 3 issue the loads of a tile's next chunk (phase 3: the
chunk after next) before the arithmetic of the current one (phase 1 with
the next chunk's peer base from ``table``); phase 2 issues its feedback load with the ``recv`` loads
and loads the P peer bases together before its stores. The compiler
cannot move a ``table`` load above a store (they may alias), so one
placed at its use waits a load latency after the stores before it.

Memory
------
``table`` is an int64 tensor ``[2, P]`` *as seen by this rank*: row 0 the
base address of each rank's symmetric buffer, row 1 of each rank's flag
area (``signal_slots`` int32, zeroed once). A buffer holds ``recv`` at byte 0 (P slots of ``chunk_bytes``: slot i
written by rank i in phase 1) and ``gathered`` at byte ``gathered_offset``
(P slots: slot j written by rank j in phase 2). Those 4-bit areas are the
only HBM intermediates.

Why two barriers per program suffice, and none at the start of a call
--------------------------------------------------------------------
Every rank maps tile ``t`` to program ``t % programs`` in all three phases,
so program p of rank r only reads (phase 2: ``recv``; phase 3:
``gathered``) what program p of the other ranks wrote before their barrier
signal. Reuse across calls: rank i's next launch starts after its current
one ended, which needed every rank's program q (for every q) to pass
phase 2, so all ``recv`` reads of this call are done before anyone writes
``recv`` again; and rank i writes a peer's ``gathered`` (next call, phase
2) only after that peer's same program signalled barrier 1 of the next
call, i.e. after the peer's previous launch (its phase 3 reads) ended.
The buffers therefore must be used by one stream at a time.

Barriers
--------
Flags are int32 slots ``[program][peer]`` in each rank's flag area, and
they reset themselves, so no host-side round counter exists (one would be
frozen into a CUDA graph): the sender CASes 0 -> 1 on the peer's slot
``[program][rank]`` (release, system scope; it spins while the slot still
holds its previous, unconsumed signal), the receiver CASes 1 -> 0 on its
own slots (acquire, system scope). ``tl.debug_barrier`` before the signal
orders every thread's stores before it (they precede the signalling
thread's release); one after the wait orders every thread's loads after
the acquire. The same slot serves both barriers of a call and every call:
a second signal cannot be sent before the first is consumed.

The wait is bounded: compiled, a program that has spun ``timeout_ns``
nanoseconds of ``%globaltimer`` executes ``trap``, which aborts the kernel;
the host sees a CUDA error (sticky: the process's CUDA context is lost) at
its next synchronisation, never a hang. Before the trap it stores a status
word (:class:`TrapStatus`: rank, program, barrier, side, the first peer
still missing) into pinned host memory the caller passed, with a
system-scope store and fence, which the host reads without CUDA. Under Triton's interpreter (no
inline assembly) the wait is unbounded; the CPU tests run emulated ranks in
processes they kill on a deadline.

Grid
----
Persistent: each program loops over tiles ``pid, pid + programs, ...``,
and every program of the launch must be resident at once, so that no
spinning program waits for one that cannot be scheduled while it spins.
:data:`TILE_TABLE` picks the tile, the warps and the programs per SM from
the chunk size; the kernel is compiled with a register cap
(``maxnreg``) that lets that many programs fit an SM, and before the first
launch of each ``LaunchPlan`` :func:`check_resident` reads the compiled
kernel's registers and shared memory and refuses a grid that could not be
resident.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs

from ..quant import WireLayout
from . import contract
from .direct_launch import Launcher, LaunchPlan
from .bodies import output_finish, output_load, stage1_finish, stage1_load, stage2_tile
from ..rmsnorm_plan import MAX_PROGRAMS_PER_SM, NormTiling
from .rmsnorm_tile import output_norm_tile, tile_groups
from .tile import block_offsets, group_rows, store_chunk_groups

#: Compiled kernels bound their barrier waits with ``%globaltimer`` and
#: ``trap`` (inline PTX); Triton's interpreter has neither.
TIMED_WAIT: tl.constexpr = tl.constexpr(not knobs.runtime.interpret)

#: The status word a trapping program stores before its ``trap``, in bit
#: fields from the low end: the late peer (16 bits), this rank (16), the
#: program (16), the barrier (4: 1 or 2), the side (4: signalling or
#: waiting), a magic byte; read by :func:`decode_trap`.
TRAP_PEER_MASK: tl.constexpr = tl.constexpr(0xFFFF)
TRAP_RANK_SHIFT: tl.constexpr = tl.constexpr(16)
TRAP_PROGRAM_SHIFT: tl.constexpr = tl.constexpr(32)
TRAP_BARRIER_SHIFT: tl.constexpr = tl.constexpr(48)
TRAP_SIDE_SHIFT: tl.constexpr = tl.constexpr(52)
TRAP_MAGIC_SHIFT: tl.constexpr = tl.constexpr(56)
TRAP_MAGIC: tl.constexpr = tl.constexpr(0x45)
#: Sides of a barrier: raising the peer's flag (it still held the previous
#: signal), or waiting for the peer's signal.
TRAP_SIGNALLING: tl.constexpr = tl.constexpr(1)
TRAP_WAITING: tl.constexpr = tl.constexpr(2)

#: ``phase=`` values: every phase with barriers (what the backend runs), or
#: one phase alone without barriers (tests and per-phase timing drive the
#: ranks' phases in order themselves).
ALL_PHASES = 0
PHASES = (ALL_PHASES, 1, 2, 3)


# -- barrier -----------------------------------------------------------------------


@triton.jit
def _clock_ns():
    """The GPU's global nanosecond timer (same clock on every SM)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _trap(status_addr, code):
    """Abort the kernel (PTX ``trap``), first storing ``code`` at the host
    address ``status_addr`` (unless 0) with system scope and a system-wide
    fence: the CUDA context is lost after a trap, so the host learns why
    from mapped host memory it reads without CUDA (:func:`decode_trap`)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred %q; setp.ne.s64 %q, $1, 0; @%q st.relaxed.sys.b64 [$1], $2; fence.sc.sys; trap; "
        "mov.u32 $0, 0; }",
        "=r,l,l", [status_addr, code], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cas_each(flags, todo, peers, EXPECT: tl.constexpr, NEW: tl.constexpr, SEM: tl.constexpr, timeout_ns,
              status_addr, code, SIDE: tl.constexpr):
    """CAS each flag of ``flags`` (int32 pointers) whose ``todo`` is nonzero
    from ``EXPECT`` to ``NEW`` once, retrying while it holds another value;
    system scope. Past ``timeout_ns`` it traps, leaving ``code`` with the
    barrier side ``SIDE`` and the first peer (of ``peers``) still to do
    (:func:`_trap`).

    A flag not (or no longer) to swap is passed compare value -1, which no
    flag ever holds, so it is left alone (``atomic_cas`` takes no mask)."""
    start = 0
    if TIMED_WAIT:
        start = _clock_ns()
    while tl.max(todo, axis=0) > 0:
        live = todo > 0
        old = tl.atomic_cas(flags, tl.where(live, EXPECT, -1), tl.where(live, NEW, -1), sem=SEM, scope="sys")
        todo = tl.where(old == EXPECT, 0, todo)
        if TIMED_WAIT:
            if _clock_ns() - start > timeout_ns:
                late = tl.min(tl.where(todo > 0, peers, TRAP_PEER_MASK), axis=0)
                _trap(status_addr, code | (SIDE << TRAP_SIDE_SHIFT) | late.to(tl.int64))


@triton.jit
def _barrier(table_ptr, rank, timeout_ns, status_addr, P: tl.constexpr, BARRIER: tl.constexpr):
    """Wait until program ``pid`` of every rank has reached barrier
    ``BARRIER`` (1 or 2); its stores before it are visible to theirs after
    it, and vice versa."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, triton.next_power_of_2(P))  # arange needs a power of two
    peers = tl.minimum(lanes, P - 1)  # lanes past P repeat the last peer, with nothing to do
    todo = (lanes < P).to(tl.int32)
    pads = tl.load(table_ptr + P + peers).to(tl.pointer_type(tl.int32))
    mine = tl.load(table_ptr + P + rank).to(tl.pointer_type(tl.int32))
    code = 0  # the status word if a wait traps (compiled only: the interpreter never does)
    if TIMED_WAIT:
        code = (TRAP_MAGIC << TRAP_MAGIC_SHIFT) | (BARRIER << TRAP_BARRIER_SHIFT) \
            | (pid.to(tl.int64) << TRAP_PROGRAM_SHIFT) | (rank.to(tl.int64) << TRAP_RANK_SHIFT)
    tl.debug_barrier()  # every thread's stores precede the release below
    _cas_each(pads + pid * P + rank, todo, peers, 0, 1, "release", timeout_ns, status_addr, code, TRAP_SIGNALLING)
    _cas_each(mine + pid * P + peers, todo, peers, 1, 0, "acquire", timeout_ns, status_addr, code, TRAP_WAITING)
    tl.debug_barrier()  # every thread's loads follow the acquire above


class TrapStatus(NamedTuple):
    """Why a fused kernel trapped: program ``program`` of rank ``rank``
    waited past its timeout at barrier ``barrier`` for rank ``peer``."""

    rank: int
    peer: int
    program: int
    barrier: int
    signalling: bool
    """True: raising ``peer``'s flag, which still held the previous call's
    signal; False: waiting for ``peer``'s signal."""

    def describe(self, timeout_s: float | None = None) -> str:
        """The error a user sees: Echo, the phase, the peer, what to do."""
        after = f" after {timeout_s:g} s" if timeout_s is not None else ""
        if self.signalling:
            what = (f"signalling rank {self.peer}, whose flag still held the previous call's signal: rank "
                    f"{self.peer} stopped inside its previous Echo all-reduce")
        else:
            what = (f"waiting for rank {self.peer}'s signal: rank {self.peer} did not reach this Echo all-reduce "
                    "(it is hung, dead, or making other calls: every rank must make the same Echo calls in the "
                    "same order)")
        return (f"echo fused all-reduce timed out{after}: rank {self.rank} (program {self.program}) at barrier "
                f"{self.barrier}, {BARRIER_PHASES.get(self.barrier, 'unknown')}, {what}. The kernel trapped, so "
                "this process's CUDA context is lost: restart it (--echo-timeout-s sets the wait)")


#: Where each barrier sits in a call.
BARRIER_PHASES = {
    1: "between phase 1 (stage 1: quantize, send the chunks) and phase 2 (reduce the own chunk)",
    2: "between phase 2 and phase 3 (decode the gathered result)",
}


def decode_trap(word: int) -> TrapStatus | None:
    """The :class:`TrapStatus` in a status word, or None if it holds none
    (0, or not written by :func:`_trap`)."""
    def field(shift, bits=16):
        return (word >> shift.value) & ((1 << bits) - 1)

    if field(TRAP_MAGIC_SHIFT, 8) != TRAP_MAGIC.value:
        return None
    return TrapStatus(rank=field(TRAP_RANK_SHIFT), peer=word & TRAP_PEER_MASK.value,
                      program=field(TRAP_PROGRAM_SHIFT), barrier=field(TRAP_BARRIER_SHIFT, 4),
                      signalling=field(TRAP_SIDE_SHIFT, 4) == TRAP_SIGNALLING.value)


def trap_word() -> torch.Tensor:
    """A zeroed status word for :func:`fused_all_reduce`'s ``status``: int64
    host memory, pinned (so mapped into every GPU's address space) when CUDA
    is there."""
    return torch.zeros(1, dtype=torch.int64, pin_memory=torch.cuda.is_available())


# -- the three phases ------------------------------------------------------------


@triton.jit
def _peer_buffer(table_ptr, i):
    """Rank ``i``'s symmetric buffer, as bytes (16-byte lanes allocations)."""
    return tl.multiple_of(tl.load(table_ptr + i).to(tl.pointer_type(tl.uint8)), 16)


@triton.jit
def _phase1(x_ptr, fb_ptr, table_ptr, rank, row_groups, cols, msg_groups,
            chunk_numel, chunk_groups, chunk_bytes, payload_bytes, n_tiles,
            P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, INV_QMAX: tl.constexpr, ENCODER: tl.constexpr,
            HADAMARD: tl.constexpr, HAS_FB: tl.constexpr, HAS_INCOMING: tl.constexpr, LANES: tl.constexpr,
            K: tl.constexpr = 0, RGP: tl.constexpr = 0, ALIGNED: tl.constexpr = False, FLIPS: tl.constexpr = 0):
    """Stage 1 of every chunk of the program's tiles, each chunk stored into
    its owner's ``recv`` slot ``rank``; the next chunk's loads (and its
    owner's buffer address) are issued before this chunk's arithmetic.
    Tiles: ``BG`` consecutive groups, or ``K`` whole rows (``rmsnorm_tile.tile_groups``)."""
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        lg = tile_groups(t, BG, row_groups, chunk_groups, K, RGP, ALIGNED)
        rows = group_rows(lg, row_groups)
        # rank r starts with chunk r + 1: at any moment the ranks write to
        # different peers instead of all to the same one
        j = tl.cast((rank + 1) % P, tl.int64)
        x, e = stage1_load(x_ptr, fb_ptr, j, lg, rows, row_groups, cols, msg_groups, chunk_numel, chunk_groups,
                           G, HAS_FB, HAS_INCOMING)
        dest = _peer_buffer(table_ptr, j)
        for k in tl.static_range(P):
            if k + 1 < P:
                j_n = tl.cast((rank + 2 + k) % P, tl.int64)
                x_n, e_n = stage1_load(x_ptr, fb_ptr, j_n, lg, rows, row_groups, cols, msg_groups, chunk_numel,
                                       chunk_groups, G, HAS_FB, HAS_INCOMING)
                dest_n = _peer_buffer(table_ptr, j_n)
            stage1_finish(x, e, fb_ptr, dest, rank * chunk_bytes, payload_bytes, j, lg,
                          chunk_numel, chunk_groups, G, INV_QMAX, ENCODER, HADAMARD, HAS_FB, HAS_INCOMING, LANES, FLIPS)
            if k + 1 < P:
                x, e, j, dest = x_n, e_n, j_n, dest_n


@triton.jit
def _phase2(fb_ptr, table_ptr, rank, gathered_offset, row_groups, chunk_numel, chunk_groups, chunk_bytes,
            payload_bytes, n_tiles, P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, INV_QMAX: tl.constexpr,
            ENCODER: tl.constexpr, HAS_FB: tl.constexpr, LANES: tl.constexpr, K: tl.constexpr = 0,
            RGP: tl.constexpr = 0, ALIGNED: tl.constexpr = False):
    """Stage 2 of the own chunk's tiles, the result stored into every rank's
    ``gathered`` slot ``rank``; the P peer bases are loaded together before
    the stores, one latency per tile instead of one per peer (kept out of
    the loop they would hold 2 P registers through the sum)."""
    mine = _peer_buffer(table_ptr, rank)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        lg = tile_groups(t, BG, row_groups, chunk_groups, K, RGP, ALIGNED)
        words, s_bits = stage2_tile(mine, 0, chunk_bytes, payload_bytes, fb_ptr, tl.cast(rank, tl.int64) * chunk_numel,
                                    lg, chunk_groups, P, G, INV_QMAX, ENCODER, HAS_FB, LANES)
        gmask = lg < chunk_groups
        peers = ()
        for k in tl.static_range(P):
            peers = peers + (_peer_buffer(table_ptr, (rank + 1 + k) % P),)
        for k in tl.static_range(P):
            store_chunk_groups(peers[k], gathered_offset + rank * chunk_bytes, payload_bytes, lg, gmask, words,
                               s_bits, G)


@triton.jit
def _phase3(y_ptr, table_ptr, rank, gathered_offset, row_groups, cols, msg_groups, chunk_groups, chunk_bytes,
            payload_bytes, n_tiles, G: tl.constexpr, BG: tl.constexpr, P: tl.constexpr, HADAMARD: tl.constexpr,
            LANES: tl.constexpr, FLIPS: tl.constexpr):
    """Decode every chunk's tiles from the local ``gathered`` area into y,
    the loads of the chunk after next issued before this chunk's arithmetic
    (a chunk's codes are only 6 bytes per lane: one ahead leaves too few
    bytes in flight to cover the latency)."""
    mine = _peer_buffer(table_ptr, rank)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        lg = tl.cast(t, tl.int64) * BG + tl.arange(0, BG)
        y_tile = block_offsets(lg, group_rows(lg, row_groups), cols, msg_groups, G)
        w0, s0 = output_load(mine, gathered_offset, payload_bytes, lg, chunk_groups, G)
        w1, s1 = output_load(mine, gathered_offset + chunk_bytes, payload_bytes, lg, chunk_groups, G)
        for j in tl.static_range(P):
            if j + 2 < P:
                w2, s2 = output_load(mine, gathered_offset + (j + 2) * chunk_bytes, payload_bytes, lg,
                                     chunk_groups, G)
            output_finish(w0, s0, y_ptr, y_tile, j, row_groups, cols, G, HADAMARD, LANES, FLIPS)
            if j + 1 < P:
                w0, s0 = w1, s1
            if j + 2 < P:
                w1, s1 = w2, s2


@triton.jit(do_not_specialize=["rank", "timeout_ns", "status_addr", "n_tiles"])
def _fused_kernel(
    x_ptr, fb_ptr, y_ptr, table_ptr,
    rank, timeout_ns, status_addr, x_rank_stride, fb_rank_stride, y_rank_stride, gathered_offset, row_groups, cols, msg_groups,
    chunk_numel, chunk_groups, chunk_bytes, payload_bytes, n_tiles,
    P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, INV_QMAX: tl.constexpr, ENCODER: tl.constexpr,
    HADAMARD: tl.constexpr, HAS_FB: tl.constexpr, HAS_INCOMING: tl.constexpr, PHASE: tl.constexpr, LANES: tl.constexpr,
    FLIPS: tl.constexpr,
):
    # one rank per launch (grid [programs, 1]), or every rank of one address
    # space in one launch (grid [programs, P], rank = program_id(1), the
    # ranks' tensors ``*_rank_stride`` elements apart: the emulation)
    emulated = tl.program_id(1)
    rank = rank + emulated
    x_ptr += emulated.to(tl.int64) * x_rank_stride  # int64: P ranks of 1 GiB pass 2**31 values
    fb_ptr += emulated.to(tl.int64) * fb_rank_stride
    y_ptr += emulated.to(tl.int64) * y_rank_stride
    # byte offsets of chunks, in int64 whatever the specialization of the ints
    chunk_bytes = chunk_bytes.to(tl.int64)
    gathered_offset = gathered_offset.to(tl.int64)
    if PHASE == 0 or PHASE == 1:
        _phase1(x_ptr, fb_ptr, table_ptr, rank, row_groups, cols, msg_groups, chunk_numel, chunk_groups,
                chunk_bytes, payload_bytes, n_tiles, P, G, BG, INV_QMAX, ENCODER, HADAMARD, HAS_FB, HAS_INCOMING,
                LANES, FLIPS=FLIPS)
    if PHASE == 0:
        _barrier(table_ptr, rank, timeout_ns, status_addr, P, 1)
    if PHASE == 0 or PHASE == 2:
        _phase2(fb_ptr, table_ptr, rank, gathered_offset, row_groups, chunk_numel, chunk_groups, chunk_bytes,
                payload_bytes, n_tiles, P, G, BG, INV_QMAX, ENCODER, HAS_FB, LANES)
    if PHASE == 0:
        _barrier(table_ptr, rank, timeout_ns, status_addr, P, 2)
    if PHASE == 0 or PHASE == 3:
        _phase3(y_ptr, table_ptr, rank, gathered_offset, row_groups, cols, msg_groups, chunk_groups, chunk_bytes,
                payload_bytes, n_tiles, G, BG, P, HADAMARD, LANES, FLIPS)


@triton.jit
def _one_pass_step(mine, gathered_offset, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, step,
                   row_groups, cols, msg_groups, chunk_groups, eps, P: tl.constexpr, G: tl.constexpr,
                   RGP: tl.constexpr, HADAMARD: tl.constexpr, RESIDUAL: tl.constexpr, LANES: tl.constexpr,
                   ALIGNED: tl.constexpr, ONE_PASS_ROWS: tl.constexpr, FLIPS: tl.constexpr):
    """One step of :func:`_phase3_norm`'s one-pass loop: ``ONE_PASS_ROWS`` rows of every chunk."""
    output_norm_tile(mine, gathered_offset, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr, step,
                     row_groups, cols, msg_groups, chunk_groups, eps, P, G, ONE_PASS_ROWS, RGP, HADAMARD, RESIDUAL,
                     LANES, 1, False, ALIGNED, ONE_PASS_ROWS, FLIPS)


@triton.jit
def _phase3_norm(table_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rank, gathered_offset, row_groups, cols,
                 msg_groups, chunk_groups, chunk_bytes, payload_bytes, n_tiles, eps, G: tl.constexpr,
                 P: tl.constexpr, K: tl.constexpr, RGP: tl.constexpr, HADAMARD: tl.constexpr,
                 RESIDUAL: tl.constexpr, LANES: tl.constexpr, STEP: tl.constexpr,
                 DECODE_ONCE: tl.constexpr, ALIGNED: tl.constexpr, ONE_PASS_ROWS: tl.constexpr, FLIPS: tl.constexpr):
    """Phase 3 with the residual add and RMSNorm: each tile's whole rows
    from every chunk of the local ``gathered`` area (``rmsnorm_tile.output_norm_tile``,
    the composed output-norm kernel's device code)."""
    mine = _peer_buffer(table_ptr, rank)
    if ONE_PASS_ROWS > 0:
        # the program's tiles (those its twins on the peers gathered), ONE_PASS_ROWS rows at a time, in one loop
        S: tl.constexpr = K // ONE_PASS_ROWS
        pid, programs = tl.program_id(0), tl.num_programs(0)
        steps = (n_tiles - pid + programs - 1) // programs * S
        for n in range(0, steps):
            _one_pass_step(mine, gathered_offset, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr,
                           res_out_ptr, (pid + (n // S) * programs) * S + n % S, row_groups, cols, msg_groups,
                           chunk_groups, eps, P, G, RGP, HADAMARD, RESIDUAL, LANES, ALIGNED, ONE_PASS_ROWS, FLIPS)
    else:
        for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            output_norm_tile(mine, gathered_offset, chunk_bytes, payload_bytes, res_ptr, w_ptr, out_ptr, res_out_ptr,
                             t, row_groups, cols, msg_groups, chunk_groups, eps, P, G, K, RGP, HADAMARD, RESIDUAL,
                             LANES, STEP, DECODE_ONCE, ALIGNED, ONE_PASS_ROWS, FLIPS)


@triton.jit(do_not_specialize=["rank", "timeout_ns", "status_addr", "n_tiles"])
def _fused_norm_kernel(
    x_ptr, fb_ptr, table_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    rank, timeout_ns, status_addr, x_rank_stride, fb_rank_stride, out_rank_stride, res_rank_stride, gathered_offset,
    row_groups, cols, msg_groups, chunk_numel, chunk_groups, chunk_bytes, payload_bytes, n_tiles, eps,
    P: tl.constexpr, G: tl.constexpr, K: tl.constexpr, RGP: tl.constexpr, INV_QMAX: tl.constexpr,
    ENCODER: tl.constexpr, HADAMARD: tl.constexpr, HAS_FB: tl.constexpr, HAS_INCOMING: tl.constexpr, PHASE: tl.constexpr,
    RESIDUAL: tl.constexpr, LANES: tl.constexpr, STEP: tl.constexpr, DECODE_ONCE: tl.constexpr,
    ALIGNED: tl.constexpr, ONE_PASS_ROWS: tl.constexpr, FLIPS: tl.constexpr,
):
    # :func:`_fused_kernel` with whole rows per tile in every phase (a
    # program reads in phase 3 only what its twins on the peers wrote) and
    # phase 3 followed by the residual add and RMSNorm
    emulated = tl.program_id(1)
    rank = rank + emulated
    x_ptr += emulated.to(tl.int64) * x_rank_stride
    fb_ptr += emulated.to(tl.int64) * fb_rank_stride
    out_ptr += emulated.to(tl.int64) * out_rank_stride
    res_ptr += emulated.to(tl.int64) * res_rank_stride
    res_out_ptr += emulated.to(tl.int64) * res_rank_stride
    chunk_bytes = chunk_bytes.to(tl.int64)
    gathered_offset = gathered_offset.to(tl.int64)
    BG: tl.constexpr = K * RGP
    if PHASE == 0 or PHASE == 1:
        _phase1(x_ptr, fb_ptr, table_ptr, rank, row_groups, cols, msg_groups, chunk_numel, chunk_groups,
                chunk_bytes, payload_bytes, n_tiles, P, G, BG, INV_QMAX, ENCODER, HADAMARD, HAS_FB, HAS_INCOMING,
                LANES, K, RGP, ALIGNED, FLIPS)
    if PHASE == 0:
        _barrier(table_ptr, rank, timeout_ns, status_addr, P, 1)
    if PHASE == 0 or PHASE == 2:
        _phase2(fb_ptr, table_ptr, rank, gathered_offset, row_groups, chunk_numel, chunk_groups, chunk_bytes,
                payload_bytes, n_tiles, P, G, BG, INV_QMAX, ENCODER, HAS_FB, LANES, K, RGP, ALIGNED)
    if PHASE == 0:
        _barrier(table_ptr, rank, timeout_ns, status_addr, P, 2)
    if PHASE == 0 or PHASE == 3:
        _phase3_norm(table_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rank, gathered_offset, row_groups, cols,
                     msg_groups, chunk_groups, chunk_bytes, payload_bytes, n_tiles, eps, G, P, K, RGP, HADAMARD,
                     RESIDUAL, LANES, STEP, DECODE_ONCE, ALIGNED, ONE_PASS_ROWS, FLIPS)


# -- grid: size -> tile, warps, programs -------------------------------------------


class TileRow(NamedTuple):
    """One row of :data:`TILE_TABLE`: chunks of up to ``max_chunk_numel``
    values run tiles of ``tile_values`` values (``tile_values // g`` groups)
    with ``num_warps`` warps, ``per_sm`` programs resident on every SM."""

    max_chunk_numel: int
    tile_values: int
    num_warps: int
    per_sm: int


#: Chunk size -> tile, warps and programs per SM, first row that fits.
#: Small chunks (decode) take small tiles, so that even they spread over
#: several programs; large ones fill every SM with ``per_sm`` programs
#: (measured: BENCHMARKS.md, the roofline table and "Dropped ideas worth knowing"
#: on programs per SM). Tile sizes are powers of two of at least 256 values
#: (32 lanes of 8), so every group size gives a
#: power-of-two number of whole groups and a warp holds whole groups.
TILE_TABLE: tuple[TileRow, ...] = (
    TileRow(max_chunk_numel=1 << 12, tile_values=1 << 8, num_warps=1, per_sm=4),
    TileRow(max_chunk_numel=1 << 16, tile_values=1 << 10, num_warps=4, per_sm=4),
    TileRow(max_chunk_numel=1 << 62, tile_values=1 << 11, num_warps=8, per_sm=3),
)


def max_per_sm() -> int:
    """The most programs per SM any :data:`TILE_TABLE` row or norm tiling
    (:func:`tiling_for_norm`) asks for (sizes the flag areas)."""
    return max(max(r.per_sm for r in TILE_TABLE), MAX_PROGRAMS_PER_SM)


class FusedTiling(NamedTuple):
    """How one fused launch covers a message: ``groups_per_tile`` groups a
    tile, ``num_warps`` warps a program, ``programs`` programs per rank
    (persistent: each loops over tiles), compiled for at most ``registers``
    registers per thread so that ``per_sm`` of them fit on an SM."""

    groups_per_tile: int
    num_warps: int
    programs: int
    registers: int = 255
    norm: NormTiling | None = None
    """Whole rows per tile (:func:`fused_all_reduce_norm`), or None."""

    def tiles(self, layout: WireLayout) -> int:
        if self.norm is not None:
            return self.norm.tiles(layout)
        return -(-layout.chunk_groups // self.groups_per_tile)


@dataclass(frozen=True)
class SMLimits:
    """What one streaming multiprocessor holds (Hopper's numbers by default;
    :func:`sm_limits` reads the device's)."""

    registers: int = 65536
    max_warps: int = 64
    max_programs: int = 32
    shared_bytes: int = 233472
    shared_reserved_bytes: int = 1024
    """Shared memory the driver reserves per resident program."""
    register_unit: int = 256
    """Registers are allocated per warp in multiples of this."""


def sm_limits(device: torch.device | int | None = None) -> SMLimits:
    """The limits of ``device``'s SMs (torch's device properties)."""
    props = torch.cuda.get_device_properties(device)
    d = SMLimits()
    return SMLimits(
        registers=getattr(props, "regs_per_multiprocessor", d.registers),
        max_warps=getattr(props, "max_threads_per_multi_processor", 32 * d.max_warps) // 32,
        shared_bytes=getattr(props, "shared_memory_per_multiprocessor", d.shared_bytes),
    )


def resident_programs(registers: int, shared_bytes: int, num_warps: int, sm: SMLimits = SMLimits()) -> int:
    """Programs of ``num_warps`` warps using ``registers`` registers per
    thread and ``shared_bytes`` of shared memory that one SM holds at once."""
    unit = sm.register_unit
    per_warp = -(-max(registers, 1) * 32 // unit) * unit
    return min(sm.registers // (per_warp * num_warps), sm.max_warps // num_warps, sm.max_programs,
               sm.shared_bytes // (shared_bytes + sm.shared_reserved_bytes))


def register_cap(per_sm: int, num_warps: int, sm: SMLimits = SMLimits()) -> int:
    """The most registers per thread (a multiple of 8, at most 255) with
    which ``per_sm`` programs of ``num_warps`` warps fit an SM's registers."""
    return min(255, sm.registers // (per_sm * num_warps * 32) // 8 * 8)


def tiling_for(layout: WireLayout, sms: int, sm: SMLimits = SMLimits()) -> FusedTiling:
    """The tiling of ``layout`` on ``sms`` SMs (those one rank may fill; at
    least 1): the :data:`TILE_TABLE` row of its chunk size, one program per
    tile up to ``per_sm`` programs on each of the ``sms``, compiled for the
    registers that let them all be resident at once."""
    row = next(r for r in TILE_TABLE if layout.chunk_numel <= r.max_chunk_numel)
    groups = row.tile_values // layout.group_size
    return _persistent(-(-layout.chunk_groups // groups), groups, row.num_warps, row.per_sm, sms, sm)


def tiling_for_norm(layout: WireLayout, norm: NormTiling, sms: int, sm: SMLimits = SMLimits()) -> FusedTiling:
    """:func:`tiling_for` with the residual add and RMSNorm: ``norm``'s whole
    rows per tile (``echo_vllm.rmsnorm_plan.norm_tiling``), its warps,
    ``norm.per_sm()`` programs per SM."""
    return _persistent(norm.tiles(layout), norm.groups_per_tile, norm.num_warps, norm.per_sm(), sms, sm, norm)


def _persistent(tiles: int, groups: int, num_warps: int, per_sm: int, sms: int, sm: SMLimits,
                norm: NormTiling | None = None) -> FusedTiling:
    """One program per tile up to ``per_sm`` programs on each of the ``sms``:
    every slot filled, so every SM gets the same number of programs (fewer
    programs, each with the same number of tiles, left some SMs a program
    short: BENCHMARKS.md, "Dropped ideas worth knowing")."""
    if sms < 1:
        raise ValueError(f"sms={sms}: need at least one SM")
    return FusedTiling(groups, num_warps, min(tiles, sms * per_sm), register_cap(per_sm, num_warps, sm), norm)


# -- launch ------------------------------------------------------------------------


def tiling_lanes(tiling: FusedTiling, layout: WireLayout, *tensors: torch.Tensor) -> bool:
    """:func:`contract.lane_layout` of ``tiling``'s tiles over ``tensors``."""
    return contract.lane_layout(layout.cols, tiling.groups_per_tile * layout.group_size, tiling.num_warps, *tensors)


@functools.lru_cache(maxsize=None)
def _launcher(num_warps: int, registers: int, norm: bool = False) -> Launcher:
    return Launcher(_fused_norm_kernel if norm else _fused_kernel,
                    {**contract.LAUNCH_OPTIONS, "num_warps": num_warps, "maxnreg": registers})


@functools.lru_cache(maxsize=contract.PLAN_CACHE_SIZE, typed=True)
def _launch_plan(layout: WireLayout, tiling: FusedTiling, ranks: int, gathered_offset: int, qmax: int, hadamard: bool,
                 has_fb: bool, has_incoming: bool, phase: int, lanes: bool, flips: int = 0,
                 encoder: str = "absmax") -> LaunchPlan:
    """``ints`` after :func:`launch_ints`' per-call ones:
    gathered_offset, :func:`contract.message_ints`, :func:`contract.chunk_ints`, tiles."""
    la = _launcher(tiling.num_warps, tiling.registers)
    return LaunchPlan(
        launcher=la,
        grid=(tiling.programs, ranks, 1),
        ints=(gathered_offset, *contract.message_ints(layout), *contract.chunk_ints(layout), tiling.tiles(layout)),
        constexprs=la.constexprs(
            P=layout.world_size, G=layout.group_size, BG=tiling.groups_per_tile,
            **contract.quantizer_constants(qmax, encoder),
            HADAMARD=hadamard, HAS_FB=has_fb, HAS_INCOMING=has_incoming, PHASE=phase, LANES=lanes, FLIPS=flips,
        ),
    )


@functools.lru_cache(maxsize=contract.PLAN_CACHE_SIZE, typed=True)
def _norm_launch_plan(layout: WireLayout, tiling: FusedTiling, ranks: int, gathered_offset: int, qmax: int,
                      hadamard: bool, has_fb: bool, has_incoming: bool, phase: int, residual: int,
                      lanes: bool, flips: int = 0, encoder: str = "absmax") -> LaunchPlan:
    """:func:`_launch_plan` of :func:`_fused_norm_kernel` (``tiling.norm`` set)."""
    la = _launcher(tiling.num_warps, tiling.registers, True)
    t = tiling.norm
    return LaunchPlan(
        launcher=la,
        grid=(tiling.programs, ranks, 1),
        ints=(gathered_offset, *contract.message_ints(layout), *contract.chunk_ints(layout), tiling.tiles(layout)),
        constexprs=la.constexprs(
            P=layout.world_size, G=layout.group_size, K=t.rows, RGP=t.padded_row_groups,
            **contract.quantizer_constants(qmax, encoder), HADAMARD=hadamard, HAS_FB=has_fb, HAS_INCOMING=has_incoming,
            PHASE=phase, RESIDUAL=residual, LANES=lanes, STEP=t.chunks_per_step,
            DECODE_ONCE=t.decode_once, ALIGNED=t.aligned, ONE_PASS_ROWS=t.one_pass_rows, FLIPS=flips,
        ),
    )


def launch_ints(lp: LaunchPlan, x: torch.Tensor, fb: torch.Tensor, layout: WireLayout, *, rank: int, timeout_ns: int,
                status_addr: int = 0) -> tuple[int, ...]:
    """The kernel's integer arguments for one launch of ``lp``: the call's
    (rank, timeout, status address, the ranks' strides), then the plan's."""
    return (rank, timeout_ns, status_addr, x.stride(0), fb.stride(0), layout.numel, *lp.ints)


class ResidencyError(RuntimeError):
    """A grid whose spinning programs could not all be resident at once."""


#: Launch plans whose grid was checked against the compiled kernel's resources.
_RESIDENT: dict[LaunchPlan, tuple[int, int, int]] = {}


def compiled_resources(lp: LaunchPlan, tensors, ints) -> tuple[int, int, int]:
    """``(registers, spilled bytes, shared bytes)`` of the kernel ``lp`` launches
    on ``tensors`` (compiling it if needed; nothing is launched)."""
    k = lp.launcher.compile(lp.grid, tensors, ints, lp.constexprs)
    return k.n_regs, k.n_spills, k.metadata.shared


def check_resident(lp: LaunchPlan, tensors, ints, sms: int, sm: SMLimits) -> None:
    """Refuse (:class:`ResidencyError`) a grid with barriers that ``sms`` SMs
    cannot hold at once: every program of every rank in the launch spins
    until its peers arrive, so one that waits for an SM deadlocks them."""
    if lp not in _RESIDENT:
        _RESIDENT[lp] = compiled_resources(lp, tensors, ints)
    regs, _, shared = _RESIDENT[lp]
    per_sm = resident_programs(regs, shared, lp.launcher.options["num_warps"], sm)
    need = lp.grid[0] * lp.grid[1]
    if need > per_sm * sms:
        raise ResidencyError(f"the fused kernel's grid of {need} programs ({lp.grid[1]} rank(s) x {lp.grid[0]}) cannot "
                             f"be resident on {sms} SMs: {per_sm} per SM at {regs} registers/thread, {shared} bytes "
                             f"of shared memory, {lp.launcher.options['num_warps']} warps")


def buffer_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes of one rank's symmetric buffer for chunks of up to ``chunk_bytes``:
    ``recv`` then ``gathered``, P slots each."""
    return 2 * world_size * chunk_bytes


def signal_slots(programs: int, world_size: int) -> int:
    """int32 flags one rank's flag area needs for ``programs`` programs."""
    return programs * world_size


def fused_all_reduce(
    x: torch.Tensor,
    feedback: torch.Tensor | None,
    table: torch.Tensor,
    layout: WireLayout,
    *,
    rank: int,
    gathered_offset: int,
    qmax: int,
    hadamard: bool,
    has_incoming: bool,
    tiling: FusedTiling,
    timeout_ns: int,
    flips: int = 0,
    encoder: str = "absmax",
    out: torch.Tensor | None = None,
    phase: int = ALL_PHASES,
    sms: int | None = None,
    status: torch.Tensor | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """One Echo all-reduce of this rank's ``x [1, numel]`` -> ``[numel]`` of
    ``x.dtype``, through the symmetric buffers ``table`` describes (see the
    module docstring); ``feedback [1, >= padded_numel]``, ``flips`` (the
    rotation's sign flips) and ``encoder`` as in ``quant.stage1_reference`` /
    ``stage2_reference``.

    ``x [P, numel]`` (with ``rank=0``, ``feedback [P, ...]``, ``out [P,
    numel]``) runs every rank of one address space in this one launch
    (``table`` the same for all): the emulation of P GPUs on one.

    Every rank must call it with the same layout, options and tiling (the
    barriers pair program p of every rank), and ``gathered_offset >= P *
    layout.chunk_bytes``. ``phase`` 1, 2 or 3 runs that phase alone, without
    barriers, and returns ``out`` (filled only by phase 3). With barriers,
    the grid must be resident at once on ``sms`` SMs (default: the device's;
    checked against the compiled kernel, :func:`check_resident`). Checks
    shapes, dtypes and devices on the host; does not check that the buffers
    hold ``gathered_offset * 2`` bytes (the caller sized them).

    ``status`` (:func:`trap_word`): where a program that times out at a
    barrier leaves its :class:`TrapStatus` before it traps (none: 0 there).

    ``compile_only``: compile the kernel this call would launch (into
    Triton's caches, the on-disk one that other processes read included)
    and check its grid resident, but launch nothing; ``out`` comes back
    unwritten. No peer takes part, so each rank may compile other messages'
    kernels ahead of the calls.
    """
    ranks = _check_call(x, feedback, table, layout, rank, gathered_offset, phase, status)
    if out is None:
        out = torch.empty(ranks, layout.numel, dtype=x.dtype, device=x.device)
    elif out.dtype != x.dtype or out.numel() != ranks * layout.numel or not out.is_contiguous():
        raise ValueError(f"out: expected {ranks * layout.numel} contiguous {x.dtype} values, got {out.dtype} "
                         f"{tuple(out.shape)}")
    contract.check_device(x, feedback, table, out)
    lp = _launch_plan(layout, tiling, ranks, gathered_offset, qmax, bool(hadamard), feedback is not None,
                      bool(has_incoming), phase, tiling_lanes(tiling, layout, x, out),
                      contract.check_flips(flips, layout), encoder)
    fb = feedback if feedback is not None else x
    ints = launch_ints(lp, x, fb, layout, rank=rank, timeout_ns=timeout_ns,
                       status_addr=status.data_ptr() if status is not None else 0)
    tensors = (x, fb, out, table)
    _check_grid(lp, tensors, ints, x, phase, sms)
    if not compile_only:
        lp.launcher(lp.grid, tensors, ints, lp.constexprs)
    elif x.is_cuda:  # the interpreter compiles nothing; _check_grid's compilation is found in Triton's cache
        lp.launcher.compile(lp.grid, tensors, ints, lp.constexprs)
    return out.view(layout.numel) if ranks == 1 else out.view(ranks, layout.numel)


def fused_all_reduce_norm(
    x: torch.Tensor,
    feedback: torch.Tensor | None,
    table: torch.Tensor,
    layout: WireLayout,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    rank: int,
    gathered_offset: int,
    qmax: int,
    hadamard: bool,
    has_incoming: bool,
    tiling: FusedTiling,
    timeout_ns: int,
    flips: int = 0,
    encoder: str = "absmax",
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    phase: int = ALL_PHASES,
    sms: int | None = None,
    status: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`fused_all_reduce` followed by the residual add and RMSNorm in
    its phase 3: ``(out, new residual)``, the bits of its output then
    ``rmsnorm.add_rms_norm(y, residual, weight, eps, variance="kernel")``
    (``rmsnorm.rms_norm`` without ``residual``, and ``residual_out`` holding
    Echo's output, or None when not given), the same as the
    composed ``output_norm`` kernel's. ``tiling``: :func:`tiling_for_norm`'s
    (whole rows per tile in every phase). ``residual`` (``[numel]``
    values, ``[P, numel]`` for every rank in one launch) gets the new
    residual in place unless ``residual_out`` is given; ``out`` likewise
    shaped. ``x``, ``feedback``, ``flips``, ``phase``, ``sms``, ``status``:
    as :func:`fused_all_reduce`'s."""
    from .output_norm_kernel import check_norm_operands, residual_mode

    if tiling.norm is None:
        raise ValueError("tiling: not a norm tiling (tiling_for_norm)")
    ranks = _check_call(x, feedback, table, layout, rank, gathered_offset, phase, status)
    emulated = ranks if ranks > 1 else 0
    out, residual_out = check_norm_operands(layout, x.dtype, weight, residual, out, residual_out, ranks=emulated)
    contract.check_device(x, feedback, table, weight, residual, out, residual_out)
    fb = feedback if feedback is not None else x
    res = residual if residual is not None else out  # unused pointers without a residual
    res_out = residual_out if residual_out is not None else out
    lp = _norm_launch_plan(layout, tiling, ranks, gathered_offset, qmax, bool(hadamard), feedback is not None,
                           bool(has_incoming), phase, residual_mode(residual, residual_out),
                           tiling_lanes(tiling, layout, x, out, weight, res, res_out),
                           contract.check_flips(flips, layout), encoder)
    ints = (rank, timeout_ns, status.data_ptr() if status is not None else 0, x.stride(0), fb.stride(0),
            layout.numel, layout.numel, *lp.ints, float(eps))
    tensors = (x, fb, table, res, weight, out, res_out)
    _check_grid(lp, tensors, ints, x, phase, sms)
    lp.launcher(lp.grid, tensors, ints, lp.constexprs)
    shape = (layout.numel,) if ranks == 1 else (ranks, layout.numel)
    return out.view(shape), residual_out.view(shape) if residual_out is not None else None


def _check_call(x, feedback, table, layout: WireLayout, rank: int, gathered_offset: int, phase: int,
                status) -> int:
    """The host checks every fused launch shares; returns the ranks in the launch."""
    p = layout.world_size
    ranks = x.shape[0] if x.dim() == 2 else 0
    if ranks not in (1, p) or (ranks == p > 1 and rank != 0):
        raise ValueError(f"x: expected [1, {layout.numel}] (one rank) or [{p}, {layout.numel}] (every rank, "
                         f"rank=0), got {tuple(x.shape)} with rank={rank}")
    contract.check_rows("x", x, ranks, layout.numel, contract.INPUT_DTYPES)
    if x.shape[1] != layout.numel:
        raise ValueError(f"x: {x.shape[1]} values, layout says {layout.numel}")
    if feedback is not None:
        contract.check_feedback(feedback, ranks, layout)
    if tuple(table.shape) != (2, p) or table.dtype != torch.int64 or not table.is_contiguous():
        raise ValueError(f"table: expected contiguous int64 [2, {p}], got {table.dtype} {tuple(table.shape)}")
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank}: not in [0, {p})")
    if gathered_offset < p * layout.chunk_bytes or gathered_offset % 16:
        raise ValueError(f"gathered_offset={gathered_offset}: must be a multiple of 16 and hold "
                         f"{p} chunks of {layout.chunk_bytes} bytes")
    if phase not in PHASES:
        raise ValueError(f"phase={phase}: one of {PHASES}")
    if status is not None and (status.dtype != torch.int64 or status.numel() != 1 or status.is_cuda
                               or (x.is_cuda and not status.is_pinned())):
        raise ValueError(f"status: expected one int64 of host memory{', pinned' if x.is_cuda else ''} "
                         f"(trap_word()), got {status.dtype} {tuple(status.shape)} on {status.device}")
    return ranks


def _check_grid(lp: LaunchPlan, tensors, ints, x: torch.Tensor, phase: int, sms: int | None) -> None:
    """Before a launch of ``lp`` with barriers, its grid checked resident on
    ``sms`` SMs (:func:`check_resident`, which compiles the kernel)."""
    if phase == ALL_PHASES and x.is_cuda:
        check_resident(lp, tensors, ints, sms or torch.cuda.get_device_properties(x.device).multi_processor_count,
                       sm_limits(x.device))


__all__ = [
    "ALL_PHASES", "BARRIER_PHASES", "FusedTiling", "PHASES", "ResidencyError", "SMLimits", "TILE_TABLE", "TileRow",
    "TrapStatus", "buffer_bytes", "check_resident", "compiled_resources", "decode_trap", "fused_all_reduce",
    "fused_all_reduce_norm", "launch_ints", "max_per_sm", "tiling_for", "tiling_for_norm", "register_cap",
    "resident_programs", "signal_slots", "sm_limits", "trap_word",
]
