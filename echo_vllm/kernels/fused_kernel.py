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
``stage2_reference`` -> ``output_reference``: the same device functions
(:mod:`.tile`) as the stage kernels, compiled without FMA contraction.

Memory
------
``table`` is an int64 tensor ``[2, P]`` *as seen by this rank*: row 0 the
base address of each rank's symmetric buffer, row 1 of each rank's signal
pad. A buffer holds ``recv`` at byte 0 (P slots of ``chunk_bytes``: slot i
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
Flags are int32 slots ``[program][peer]`` in each rank's signal pad, and
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
its next synchronisation, never a hang. Under Triton's interpreter (no
inline assembly) the wait is unbounded; the CPU tests run emulated ranks in
processes they kill on a deadline.

Grid
----
Persistent: ``programs`` <= the SMs available per rank, each program loops
over tiles ``pid, pid + programs, ...``, so no spinning program waits for
a program that cannot be scheduled while it spins (which a grid larger than
the device could cause). :data:`TILE_TABLE` picks the tile size and warps
from the chunk size.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs

from ..quant import WireLayout
from . import launch
from .direct_launch import Launcher
from .tile import (
    WIDE_VEC, as_access, as_groups, from_f32, fwht, group_mask, load_chunk_groups, message_offsets, quantize,
    store_chunk_groups, to_f32, to_output, unrotate, value_offsets,
)

#: Compiled kernels bound their barrier waits with ``%globaltimer`` and
#: ``trap`` (inline PTX); Triton's interpreter has neither.
TIMED_WAIT: tl.constexpr = tl.constexpr(not knobs.runtime.interpret)

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
def _trap_if(cond):
    """Abort the kernel (PTX ``trap``) when ``cond`` holds."""
    tl.inline_asm_elementwise("{ .reg .pred %p; setp.ne.s32 %p, $1, 0; @%p trap; mov.u32 $0, 0; }",
                              "=r,r", [cond.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cas_each(flags, todo, EXPECT: tl.constexpr, NEW: tl.constexpr, SEM: tl.constexpr, timeout_ns):
    """CAS each flag of ``flags`` (int32 pointers) whose ``todo`` is nonzero
    from ``EXPECT`` to ``NEW`` once, retrying while it holds another value;
    system scope.

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
            _trap_if(_clock_ns() - start > timeout_ns)


@triton.jit
def _barrier(table_ptr, rank, timeout_ns, P: tl.constexpr):
    """Wait until program ``pid`` of every rank has reached this point; its
    stores before it are visible to theirs after it, and vice versa."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, triton.next_power_of_2(P))  # arange needs a power of two
    peers = tl.minimum(lanes, P - 1)  # lanes past P repeat the last peer, with nothing to do
    todo = (lanes < P).to(tl.int32)
    pads = tl.load(table_ptr + P + peers).to(tl.pointer_type(tl.int32))
    mine = tl.load(table_ptr + P + rank).to(tl.pointer_type(tl.int32))
    tl.debug_barrier()  # every thread's stores precede the release below
    _cas_each(pads + pid * P + rank, todo, 0, 1, "release", timeout_ns)
    _cas_each(mine + pid * P + peers, todo, 1, 0, "acquire", timeout_ns)
    tl.debug_barrier()  # every thread's loads follow the acquire above


# -- the three phases ------------------------------------------------------------


@triton.jit
def _peer_buffer(table_ptr, i):
    """Rank ``i``'s symmetric buffer, as bytes (16-byte aligned allocations)."""
    return tl.multiple_of(tl.load(table_ptr + i).to(tl.pointer_type(tl.uint8)), 16)


@triton.jit
def _phase1(x_ptr, fb_ptr, table_ptr, rank, row_groups, cols, msg_groups,
            chunk_numel, chunk_groups, chunk_bytes, payload_bytes, n_tiles,
            P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, QMAX: tl.constexpr, INV_QMAX: tl.constexpr,
            HADAMARD: tl.constexpr, HAS_FB: tl.constexpr, HAS_INCOMING: tl.constexpr, SPREAD: tl.constexpr):
    """Stage 1 of every chunk of the program's tiles, each chunk stored into
    its owner's ``recv`` slot ``rank`` (``stage1_kernel``'s body)."""
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        lg = tl.cast(t, tl.int64) * BG + tl.arange(0, BG)
        gmask = lg < chunk_groups
        m3 = group_mask(gmask, SPREAD)
        for k in range(P):
            # rank r starts with chunk r + 1: at any moment the ranks write to
            # different peers instead of all to the same one
            j = tl.cast((rank + 1 + k) % P, tl.int64)
            xi, xm = message_offsets(j, lg, row_groups, cols, msg_groups, G, SPREAD)
            u = to_f32(as_groups(tl.load(x_ptr + xi, mask=xm, other=0.0), BG, G))
            if HADAMARD:
                u = fwht(u, BG, G, SPREAD)
            idx = value_offsets(j * chunk_numel, lg, G, SPREAD)  # wire order: feedback
            if HAS_FB and HAS_INCOMING:
                u = u + to_f32(as_groups(tl.load(fb_ptr + idx, mask=m3, other=0.0), BG, G))
            codes, s_bits, err = quantize(u, INV_QMAX, QMAX)
            if HAS_FB:
                tl.store(fb_ptr + idx, as_access(from_f32(err, fb_ptr.dtype.element_ty), BG, G, SPREAD), mask=m3)
            store_chunk_groups(_peer_buffer(table_ptr, j), rank * chunk_bytes, payload_bytes, lg, gmask,
                               codes, s_bits, BG, G, SPREAD)


@triton.jit
def _phase2(fb_ptr, table_ptr, rank, gathered_offset, chunk_numel, chunk_groups, chunk_bytes, payload_bytes,
            n_tiles, P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, QMAX: tl.constexpr,
            INV_QMAX: tl.constexpr, HAS_FB: tl.constexpr, SPREAD: tl.constexpr):
    """Stage 2 of the own chunk's tiles, the result stored into every rank's
    ``gathered`` slot ``rank`` (``stage2_kernel``'s body)."""
    mine = _peer_buffer(table_ptr, rank)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        lg = tl.cast(t, tl.int64) * BG + tl.arange(0, BG)
        gmask = lg < chunk_groups
        m3 = group_mask(gmask, SPREAD)
        acc = tl.zeros((BG, G), dtype=tl.float32)
        for i in tl.static_range(P):  # rank order: the reference's sum
            acc = acc + load_chunk_groups(mine, i * chunk_bytes, payload_bytes, lg, gmask, BG, G, SPREAD)
        codes, s_bits, err = quantize(acc, INV_QMAX, QMAX)
        if HAS_FB:
            ptrs = fb_ptr + value_offsets(tl.cast(rank, tl.int64) * chunk_numel, lg, G, SPREAD)
            e = to_f32(as_groups(tl.load(ptrs, mask=m3, other=0.0), BG, G))
            tl.store(ptrs, as_access(from_f32(e + err, fb_ptr.dtype.element_ty), BG, G, SPREAD), mask=m3)
        for k in range(P):
            j = (rank + 1 + k) % P
            store_chunk_groups(_peer_buffer(table_ptr, j), gathered_offset + rank * chunk_bytes, payload_bytes,
                               lg, gmask, codes, s_bits, BG, G, SPREAD)


@triton.jit
def _phase3(y_ptr, table_ptr, rank, gathered_offset, row_groups, cols, msg_groups, chunk_groups, chunk_bytes,
            payload_bytes, n_tiles, G: tl.constexpr, BG: tl.constexpr, P: tl.constexpr, HADAMARD: tl.constexpr,
            SPREAD: tl.constexpr):
    """Decode every chunk's tiles from the local ``gathered`` area into y
    (``output_kernel``'s body)."""
    mine = _peer_buffer(table_ptr, rank)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        lg = tl.cast(t, tl.int64) * BG + tl.arange(0, BG)
        gmask = lg < chunk_groups
        for jj in range(P):
            j = tl.cast(jj, tl.int64)
            v = load_chunk_groups(mine, gathered_offset + j * chunk_bytes, payload_bytes, lg, gmask, BG, G, SPREAD)
            if HADAMARD:
                v = unrotate(v, BG, G, SPREAD)
            idx, m = message_offsets(j, lg, row_groups, cols, msg_groups, G, SPREAD, WIDE_VEC)
            tl.store(y_ptr + idx, as_access(to_output(v, y_ptr.dtype.element_ty), BG, G, SPREAD), mask=m)


@triton.jit(do_not_specialize=["rank", "timeout_ns", "n_tiles"])
def _fused_kernel(
    x_ptr, fb_ptr, y_ptr, table_ptr,
    rank, timeout_ns, gathered_offset, row_groups, cols, msg_groups,
    chunk_numel, chunk_groups, chunk_bytes, payload_bytes, n_tiles,
    P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, QMAX: tl.constexpr, INV_QMAX: tl.constexpr,
    HADAMARD: tl.constexpr, HAS_FB: tl.constexpr, HAS_INCOMING: tl.constexpr, SPREAD: tl.constexpr,
    PHASE: tl.constexpr,
):
    if PHASE == 0 or PHASE == 1:
        _phase1(x_ptr, fb_ptr, table_ptr, rank, row_groups, cols, msg_groups, chunk_numel, chunk_groups,
                chunk_bytes, payload_bytes, n_tiles, P, G, BG, QMAX, INV_QMAX, HADAMARD, HAS_FB, HAS_INCOMING,
                SPREAD)
    if PHASE == 0:
        _barrier(table_ptr, rank, timeout_ns, P)
    if PHASE == 0 or PHASE == 2:
        _phase2(fb_ptr, table_ptr, rank, gathered_offset, chunk_numel, chunk_groups, chunk_bytes, payload_bytes,
                n_tiles, P, G, BG, QMAX, INV_QMAX, HAS_FB, SPREAD)
    if PHASE == 0:
        _barrier(table_ptr, rank, timeout_ns, P)
    if PHASE == 0 or PHASE == 3:
        _phase3(y_ptr, table_ptr, rank, gathered_offset, row_groups, cols, msg_groups, chunk_groups, chunk_bytes,
                payload_bytes, n_tiles, G, BG, P, HADAMARD, SPREAD)


# -- grid: size -> tile, warps, programs -------------------------------------------


class TileRow(NamedTuple):
    """One row of :data:`TILE_TABLE`: chunks of up to ``max_chunk_numel``
    values run tiles of ``tile_values`` values (``tile_values // g`` groups)
    with ``num_warps`` warps."""

    max_chunk_numel: int
    tile_values: int
    num_warps: int


#: Chunk size -> tile size and warps, first row that fits. Small chunks
#: (decode) take small tiles, so that even they spread over several programs
#: (programs barrier independently: more of them, more stores in flight);
#: large ones take 2048-value tiles with eight warps: with one program per
#: SM (the co-residency bound of the barriers), the best of the tile x warps
#: sweep at prefill sizes (``scripts/experiments/fused_tuning.py``,
#: BENCHMARKS.md section 9). Tile sizes are powers of two of at least
#: ``max(SUPPORTED_GROUP_SIZES)`` values, so every group size gives a
#: power-of-two number of whole groups.
TILE_TABLE: tuple[TileRow, ...] = (
    TileRow(max_chunk_numel=1 << 12, tile_values=1 << 8, num_warps=1),
    TileRow(max_chunk_numel=1 << 16, tile_values=1 << 10, num_warps=2),
    TileRow(max_chunk_numel=1 << 20, tile_values=1 << 11, num_warps=4),
    TileRow(max_chunk_numel=1 << 62, tile_values=1 << 11, num_warps=8),
)


class FusedPlan(NamedTuple):
    """How one fused launch covers a message: ``groups_per_tile`` groups a
    tile, ``num_warps`` warps a program, ``programs`` programs (persistent:
    each loops over tiles)."""

    groups_per_tile: int
    num_warps: int
    programs: int

    def tiles(self, layout: WireLayout) -> int:
        return -(-layout.chunk_groups // self.groups_per_tile)


def plan_for(layout: WireLayout, max_programs: int) -> FusedPlan:
    """The plan for ``layout`` with at most ``max_programs`` programs (the SMs
    one rank may fill at once; at least 1): the :data:`TILE_TABLE` row of its
    chunk size, and one program per tile up to ``max_programs``."""
    if max_programs < 1:
        raise ValueError(f"max_programs={max_programs}: need at least one program")
    row = next(r for r in TILE_TABLE if layout.chunk_numel <= r.max_chunk_numel)
    groups = row.tile_values // layout.group_size
    tiles = -(-layout.chunk_groups // groups)
    return FusedPlan(groups, row.num_warps, min(tiles, max_programs))


# -- launch ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _launcher(num_warps: int) -> Launcher:
    return Launcher(_fused_kernel, {**launch.LAUNCH_OPTIONS, "num_warps": num_warps})


class _Plan(NamedTuple):
    launcher: Launcher
    grid: tuple[int, int, int]
    ints: tuple[int, ...]
    constexprs: tuple


@functools.lru_cache(maxsize=launch.PLAN_CACHE_SIZE, typed=True)
def _launch_plan(layout: WireLayout, plan: FusedPlan, gathered_offset: int, qmax: int, hadamard: bool,
                 has_fb: bool, has_incoming: bool, spread: bool, phase: int) -> _Plan:
    """``ints`` after ``rank, timeout_ns``: gathered_offset, :func:`launch.message_ints`,
    :func:`launch.chunk_ints`, tiles."""
    la = _launcher(plan.num_warps)
    return _Plan(
        launcher=la,
        grid=(plan.programs, 1, 1),
        ints=(gathered_offset, *launch.message_ints(layout), *launch.chunk_ints(layout), plan.tiles(layout)),
        constexprs=la.constexprs(
            P=layout.world_size, G=layout.group_size, BG=plan.groups_per_tile, **launch.qmax_constants(qmax),
            HADAMARD=hadamard, HAS_FB=has_fb, HAS_INCOMING=has_incoming, SPREAD=spread, PHASE=phase,
        ),
    )


def buffer_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes of one rank's symmetric buffer for chunks of up to ``chunk_bytes``:
    ``recv`` then ``gathered``, P slots each."""
    return 2 * world_size * chunk_bytes


def signal_slots(programs: int, world_size: int) -> int:
    """int32 flags one rank's signal pad needs for ``programs`` programs."""
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
    plan: FusedPlan,
    timeout_ns: int,
    out: torch.Tensor | None = None,
    phase: int = ALL_PHASES,
    spread: bool = True,
) -> torch.Tensor:
    """One Echo all-reduce of this rank's ``x [1, numel]`` -> ``[numel]`` of
    ``x.dtype``, through the symmetric buffers ``table`` describes (see the
    module docstring); ``feedback [1, >= padded_numel]`` as in
    ``quant.stage1_reference`` / ``stage2_reference``.

    Every rank must call it with the same layout, options and plan (the
    barriers pair program p of every rank), and ``gathered_offset >= P *
    layout.chunk_bytes``. ``phase`` 1, 2 or 3 runs that phase alone, without
    barriers, and returns ``out`` (filled only by phase 3). Checks shapes,
    dtypes and devices on the host; does not check that the buffers hold
    ``gathered_offset * 2`` bytes (the caller sized them)."""
    p = layout.world_size
    launch.check_rows("x", x, 1, layout.numel, launch.INPUT_DTYPES)
    if x.shape[1] != layout.numel:
        raise ValueError(f"x: {x.shape[1]} values, layout says {layout.numel}")
    if feedback is not None:
        launch.check_rows("feedback", feedback, 1, layout.padded_numel, launch.FEEDBACK_DTYPES)
    if tuple(table.shape) != (2, p) or table.dtype != torch.int64 or not table.is_contiguous():
        raise ValueError(f"table: expected contiguous int64 [2, {p}], got {table.dtype} {tuple(table.shape)}")
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank}: not in [0, {p})")
    if gathered_offset < p * layout.chunk_bytes or gathered_offset % 16:
        raise ValueError(f"gathered_offset={gathered_offset}: must be a multiple of 16 and hold "
                         f"{p} chunks of {layout.chunk_bytes} bytes")
    if phase not in PHASES:
        raise ValueError(f"phase={phase}: one of {PHASES}")
    if out is None:
        out = torch.empty(layout.numel, dtype=x.dtype, device=x.device)
    elif out.dtype != x.dtype or out.numel() != layout.numel or not out.is_contiguous():
        raise ValueError(f"out: expected {layout.numel} contiguous {x.dtype} values, got {out.dtype} "
                         f"{tuple(out.shape)}")
    launch.check_device(x, feedback, table, out)
    lp = _launch_plan(layout, plan, gathered_offset, qmax, bool(hadamard), feedback is not None,
                      bool(has_incoming), bool(spread), phase)
    fb = feedback if feedback is not None else x
    lp.launcher(lp.grid, (x, fb, out, table), (rank, timeout_ns, *lp.ints), lp.constexprs)
    return out.view(layout.numel)


__all__ = [
    "ALL_PHASES", "FusedPlan", "PHASES", "TILE_TABLE", "TileRow", "buffer_bytes", "fused_all_reduce", "plan_for",
    "signal_slots",
]
