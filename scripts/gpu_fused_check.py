#!/usr/bin/env python3
"""The fused backend on a GPU host: P processes, bits against the references.

    python scripts/gpu_fused_check.py [--worlds 2,4] [--sweep-worlds 2,3,4,8] [--gpus 1] [--json OUT]
                                      [--bench] [--soak CALLS]

Runs from the repository root (it puts it on ``sys.path``); needs torch with
CUDA and Triton, nothing else, no network. For each P in ``--worlds`` it
spawns P processes joined in a gloo group (``file://`` rendezvous), on
``--gpus`` GPUs (rank r on GPU r % gpus: by default every rank on GPU 0,
with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` -- NCCL refuses two ranks
on one GPU, symmetric memory over gloo does not), and checks:

* ``eager``: several layouts (rows x cols, cols not a multiple of the group,
  fp16/bf16/fp32, feedback fp32/bf16/none, with and without rotation), each
  a chain of calls with feedback carried, NaN/Inf/huge/zero groups in one
  call, and one message large enough that programs loop over tiles: every
  rank's output and feedback buffer equal the composed references' bits
  (computed here, on the CPU, from every rank's inputs), outputs identical
  across ranks;
* ``graph``: a call captured in a CUDA graph after a warm-up, replayed with
  fresh inputs copied into the static input and the feedback reset: the
  references' bits on every replay;
* ``auto``: ``EchoCommunicator`` with ``backend="auto"`` picks ``fused`` here
  and returns the references' bits;
* ``soak`` (``--soak CALLS``): CALLS chained calls of random row counts,
  eager and replays of three captured graphs interleaved; every output
  equal across ranks, every 97th call (started from a zero feedback
  buffer) equal to the references, every flag back at 0 at the end;
* ``sweep`` (``--sweep-worlds 2,3,4,8``, the P values side by side): the
  ``fused`` cases of ``echo_vllm.shape_sweep`` for that P (widths 1, 2, 33,
  129, 5123 and every 9th up to 70, rows 1-33, bf16/fp16/fp32 inputs,
  bf16/int8/no feedback, every group size, random/zero/huge/tiny/non-finite
  values, chains of 3 calls) through Echo's 4-bit path on the fused backend
  (one backend per configuration): every rank's outputs equal the reference
  backend's bits;
* ``too_large``: a message larger than the buffers raises ``MessageTooLarge``
  (no fallback given);
* ``absent_peer`` / ``killed_peer``: rank 1 never calls (waits elsewhere, or
  exits): rank 0's call fails with a CUDA error within the timeout instead
  of hanging, and its backend's status word says rank 0 waited at barrier 1
  for rank 1 (the logged error names Echo, the phase and the peer).

Processes sharing one GPU are time-sliced, so nothing here is timed except
the timeout. ``--bench`` adds a single-process timing of each phase alone
(``phase=`` 1, 2, 3, every peer's buffer local to the GPU: no NVLink), next
to the composed Triton stage kernels on the same layouts.

Prints one JSON summary (also written to ``--json``); exits 1 if any check
failed.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

QMAX = 7
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FB_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}

# name, rows, cols, group, dtype, feedback dtype (None: no buffer), hadamard, calls, call with special values
CASES = [
    ("decode", 1, 8192, 32, "bf16", "bf16", True, 3, 1),
    ("ragged", 5, 333, 16, "fp16", "fp32", True, 2, 0),
    ("no-rotation", 7, 1000, 64, "fp32", "fp32", False, 2, 1),
    ("no-feedback", 3, 4096, 128, "bf16", None, True, 1, 0),
    ("prefill", 512, 4096, 32, "bf16", "fp32", True, 2, 1),  # programs loop over tiles
    ("int8-feedback", 64, 2880, 32, "bf16", "int8", True, 3, 1),  # codes + a bf16 scale per group
]
TIMEOUT_S = 30.0  # time-sliced ranks on one GPU wait long for each other: generous
ABSENT_TIMEOUT_S = 3.0


# -- inputs and comparison ---------------------------------------------------------------


def inputs(shape, seed: int, special: bool) -> torch.Tensor:
    """fp32 values of wide dynamic range; ``special`` plants groups with NaN,
    +-Inf, near-fp32-max, subnormal and all-zero values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))
    if special:
        flat = x.view(-1)
        for i, v in {0: float("nan"), 70: float("inf"), 150: float("-inf"), 230: 3e38, 300: 1e-40}.items():
            flat[i % flat.numel()] = v
        flat[400:528] = 0.0
    return x


def differs(got: torch.Tensor, want: torch.Tensor, *, nan_any: bool = False) -> str | None:
    """None if the bits are equal (any NaN matching any NaN with ``nan_any``:
    the compiled output cast writes the hardware's NaN payload), else where not."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    bad = got.contiguous().view(ints) != want.contiguous().view(ints)
    if nan_any:
        bad &= ~(got.float().isnan() & want.float().isnan())
    if not bad.any():
        return None
    i = bad.nonzero()[0].tolist()
    return f"{int(bad.sum())}/{bad.numel()} differ, first at {i}: {got[tuple(i)].item()!r} vs {want[tuple(i)].item()!r}"


def reference(xs: torch.Tensor, fb: torch.Tensor | None, layout, *, hadamard: bool, incoming: bool) -> torch.Tensor:
    """The composed pipeline on every rank's inputs ``xs [P, numel]`` (``fb``
    ``[P, ...]`` updated in place): the output every rank must return."""
    from echo_vllm import quant

    wire = quant.stage1_reference(xs, fb, layout, qmax=QMAX, hadamard=hadamard, has_incoming=incoming)
    q2 = quant.stage2_reference(wire.transpose(0, 1).contiguous(), fb, list(range(layout.world_size)), layout,
                                qmax=QMAX)
    return quant.output_reference(q2, layout, xs.dtype, hadamard=hadamard)


def compare_calls(per_rank: list[list[dict]], layout, hadamard: bool) -> list[str]:
    """Problems in the calls the ranks recorded (``x``, ``fb_before``,
    ``fb_after``, ``y``, ``incoming`` per call), against the references."""
    problems = []
    for c in range(len(per_rank[0])):
        calls = [r[c] for r in per_rank]
        fb = None if calls[0]["fb_before"] is None else torch.cat([k["fb_before"] for k in calls])
        y = reference(torch.cat([k["x"] for k in calls]), fb, layout, hadamard=hadamard,
                      incoming=calls[0]["incoming"])
        for r, k in enumerate(calls):
            for what, got, want, nan_any in (("output", k["y"], y, True),
                                              ("same output as rank 0", k["y"], calls[0]["y"], False),
                                              ("feedback", k["fb_after"], None if fb is None else fb[r:r + 1], False)):
                if got is not None and (d := differs(got, want, nan_any=nan_any)):
                    problems.append(f"call {c}, rank {r}, {what}: {d}")
    return problems


# -- what each rank runs ----------------------------------------------------------------


def _backend(world: int, group: int, hadamard: bool, max_numel: int, timeout_s: float = TIMEOUT_S, **kw):
    from echo_vllm import EchoConfig, ProcessGroupTransport
    from echo_vllm.backends.fused import FusedSymmMemBackend

    cfg = EchoConfig(group_size=group, hadamard=hadamard, min_bytes=0)
    return FusedSymmMemBackend(cfg, ProcessGroupTransport(), max_numel=max_numel, timeout_s=timeout_s, **kw)


def _finish() -> None:
    """Every rank's GPU work is done before any rank goes on (or exits and
    unmaps its buffer)."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()


def rank_eager(rank: int, world: int) -> dict:
    from echo_vllm.quant import WireLayout, feedback_row_len, write_feedback

    out = {}
    for ci, (name, rows, cols, g, dt, fbdt, had, calls, special) in enumerate(CASES):
        lay = WireLayout(rows * cols, world, g, cols)
        b = _backend(world, g, had, lay.padded_numel)  # one row of padded_numel: chunks as large as lay's
        fb = None
        if fbdt:
            gen = torch.Generator().manual_seed(ci * 100 + rank)
            # longer than the message, as a chain's buffer
            fb = torch.zeros(1, feedback_row_len(lay.padded_numel, FB_DTYPES[fbdt], g) + 48, dtype=FB_DTYPES[fbdt])
            write_feedback(fb, 0, 1e-2 * torch.randn(1, lay.padded_numel, generator=gen), g)
            fb = fb.cuda()
        recs = []
        for c in range(calls):
            x = inputs((1, lay.numel), 1000 * ci + 10 * c + rank, special=c == special).to(DTYPES[dt]).cuda()
            before = None if fb is None else fb.cpu()
            y = b.all_reduce(x, lay, fb, has_incoming=c > 0)
            torch.cuda.synchronize()
            recs.append(dict(x=x.cpu(), fb_before=before, fb_after=None if fb is None else fb.cpu(), y=y.cpu(),
                             incoming=c > 0))
        out[name] = recs
    _finish()
    return out


def rank_graph(rank: int, world: int) -> dict:
    from echo_vllm.quant import WireLayout

    lay = WireLayout(64 * 4096, world, 32, 4096)
    b = _backend(world, 32, True, lay.padded_numel)
    gen = torch.Generator().manual_seed(7 + rank)
    fb0 = (1e-2 * torch.randn(1, lay.padded_numel, generator=gen)).cuda()
    fb = fb0.clone()
    static_x = inputs((1, lay.numel), 500 + rank, False).to(torch.bfloat16).cuda()
    static_y = torch.empty(lay.numel, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, every rank takes part
        b.all_reduce(static_x, lay, fb, has_incoming=True, out=static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b.all_reduce(static_x, lay, fb, has_incoming=True, out=static_y)
    recs = []
    for replay in range(3):
        static_x.copy_(inputs((1, lay.numel), 600 + 10 * replay + rank, replay == 1).to(torch.bfloat16))
        fb.copy_(fb0 * (replay + 1))
        torch.cuda.synchronize()
        before = fb.cpu()
        graph.replay()
        torch.cuda.synchronize()
        recs.append(dict(x=static_x.cpu(), fb_before=before, fb_after=fb.cpu(), y=static_y.cpu(), incoming=True))
    _finish()
    return {"graph": recs}


def rank_auto(rank: int, world: int) -> dict:
    from echo_vllm import EchoCommunicator, EchoConfig, ProcessGroupTransport, policy

    ar = EchoCommunicator(EchoConfig(min_bytes=0), ProcessGroupTransport(), device="cuda")
    name = ar.backend(torch.device("cuda")).name
    x = inputs((16, 2048), 900 + rank, False).to(torch.bfloat16).cuda()
    y = ar.all_reduce(x, path=policy.Path.ECHO)
    _finish()
    return {"backend": name, "x": x.cpu(), "y": y.cpu()}


def rank_too_large(rank: int, world: int) -> dict:
    from echo_vllm.backends.fused import MessageTooLarge
    from echo_vllm.quant import WireLayout

    b = _backend(world, 32, True, 4096)
    lay = WireLayout(8192, world, 32)
    try:
        b.all_reduce(torch.zeros(1, lay.numel, dtype=torch.bfloat16, device="cuda"), lay, None, has_incoming=False)
        result = "no error"
    except MessageTooLarge as e:
        result = f"MessageTooLarge: {e}"
    _finish()
    return {"result": result}


def rank_sweep(rank: int, world: int) -> dict:
    """The shape sweep's cases for this P through the fused backend: each
    case's outputs, by label."""
    import torch.distributed as dist

    from echo_vllm import EchoCommunicator, ProcessGroupTransport, shape_sweep
    from echo_vllm.feedback import FeedbackChain

    transport, echoes, out = ProcessGroupTransport(), {}, {}
    cases = [c for c in shape_sweep.cases("fused") if c.world_size == world]

    def echo_of(case):  # one backend (and its symmetric buffers) per configuration, built by every rank in order
        config = case.config("fused")
        if config not in echoes:
            echoes[config] = EchoCommunicator(config, transport, device="cuda")
        return echoes[config]

    t0 = time.monotonic()
    for case in cases:  # every backend built in the same order on every rank: building one is collective
        echo_of(case).backend(torch.device("cuda"))
    # compiling is most of the sweep's time (a new kernel per case, ~19 s at P = 8, every rank compiling the
    # same one at once): each rank compiles its share first, and the calls find the rest in Triton's disk cache
    for case in cases[rank::world]:
        chain = FeedbackChain.of(case.config("fused"), 1, "cuda")
        echo_of(case).compile(shape_sweep.inputs(case, 0, rank).cuda(), chain)
        chain.release()
    dist.barrier()
    if rank == 0:
        print(f"P={world} sweep: {len(cases)} cases compiled over {world} ranks at {time.monotonic() - t0:.1f} s",
              flush=True)
    for i, case in enumerate(cases, 1):
        out[case.label] = shape_sweep.run_case(case, "fused", device="cuda", transport=transport, rank=rank,
                                               echo=echo_of(case))
        if rank == 0:  # where the time goes, and how far a run cut at its limit got
            print(f"P={world} sweep: case {i}/{len(cases)} {case.label} done at {time.monotonic() - t0:.1f} s",
                  flush=True)
    _finish()
    for echo in echoes.values():
        echo.close()
    return out


SOAK_COLS = 2048
SOAK_GRAPH_ROWS = (1, 16, 64)  # captured sizes, replayed between eager calls of random sizes


def _soak_x(call: int, rank: int, rows: int) -> torch.Tensor:
    """Call ``call``'s input on ``rank``: a function of (call, rank) only, so
    every rank can rebuild every rank's input for a reference."""
    return inputs((1, rows * SOAK_COLS), 7919 * call + rank, False).to(torch.bfloat16)


def _soak_plan(calls: int, seed: int, check_every: int) -> list[tuple[str, int, bool]]:
    """``(kind, rows, fresh)`` per call, the same on every rank: ``graph``
    replays (rows from SOAK_GRAPH_ROWS) between ``eager`` calls of random
    rows; every ``check_every``-th call starts from a zero feedback buffer
    (``fresh``) so its output can be checked alone against the references."""
    gen = torch.Generator().manual_seed(seed)
    plan = []
    for c in range(calls):
        graph = int(torch.randint(0, 3, (1,), generator=gen)) == 0  # a third of the calls
        rows = (SOAK_GRAPH_ROWS[int(torch.randint(0, 3, (1,), generator=gen))] if graph
                else int(torch.randint(1, 65, (1,), generator=gen)))
        plan.append(("graph" if graph else "eager", rows, c % check_every == 0))
    return plan


def rank_soak(rank: int, world: int, calls: int, seed: int, check_every: int) -> dict:
    """``calls`` chained calls (feedback carried) of random sizes, eager and
    from three captured CUDA graphs interleaved, on one backend: every
    output's checksum (to compare across ranks), the outputs of the fresh
    calls (to compare with the references) and the flags at the end."""
    from echo_vllm.quant import WireLayout

    lays = {r: WireLayout(r * SOAK_COLS, world, 32, SOAK_COLS) for r in range(1, 65)}
    b = _backend(world, 32, True, lays[64].padded_numel)
    fb = torch.zeros(1, lays[64].padded_numel, dtype=torch.bfloat16, device="cuda")
    static = {r: (torch.empty(1, r * SOAK_COLS, dtype=torch.bfloat16, device="cuda"),
                  torch.empty(r * SOAK_COLS, dtype=torch.bfloat16, device="cuda")) for r in SOAK_GRAPH_ROWS}
    graphs = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile every plan the graphs use
        for r, (x, y) in static.items():
            x.copy_(_soak_x(-1, rank, r))
            b.all_reduce(x, lays[r], fb, has_incoming=True, out=y)
    torch.cuda.current_stream().wait_stream(side)
    for r, (x, y) in static.items():
        graphs[r] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[r]):
            b.all_reduce(x, lays[r], fb, has_incoming=True, out=y)
    weights = torch.arange(1, 64 * SOAK_COLS + 1, device="cuda", dtype=torch.int64) % 65521
    sums, fresh = [], {}
    for c, (kind, rows, is_fresh) in enumerate(_soak_plan(calls, seed, check_every)):
        if is_fresh:
            fb.zero_()
        if kind == "graph":
            x, y = static[rows]
            x.copy_(_soak_x(c, rank, rows))
            graphs[rows].replay()  # incoming error: the graph always adds it (zero when fresh)
        else:
            y = b.all_reduce(_soak_x(c, rank, rows).cuda(), lays[rows], fb, has_incoming=True)
        sums.append((y.view(torch.int16).to(torch.int64) * weights[:y.numel()]).sum())
        if is_fresh:
            fresh[c] = y.cpu()
    torch.cuda.synchronize()
    _finish()
    flags = b.buffers.buffer[-4 * b.buffers.signal_slots:].view(torch.int32)
    return {"sums": torch.stack(sums).cpu(), "fresh": fresh, "flags_nonzero": int((flags != 0).sum())}


def rank_lost_peer(rank: int, world: int, how: str) -> dict:
    """Rank 1 builds the backend, then never calls it: it waits on the gloo
    group (``absent``) or exits (``killed``). Rank 0 calls, and must get an
    error within the timeout."""
    import torch.distributed as dist
    from echo_vllm.quant import WireLayout

    lay = WireLayout(4 * 4096, world, 32, 4096)
    b = _backend(world, 32, True, lay.padded_numel, timeout_s=ABSENT_TIMEOUT_S)
    if rank != 0:
        if how == "killed":
            os._exit(0)
        dist.barrier()  # released by rank 0 once it has its error
        return {}
    x = torch.ones(1, lay.numel, dtype=torch.bfloat16, device="cuda")
    b.all_reduce(x, lay, None, has_incoming=False)  # compiles, then launches
    t0 = time.monotonic()
    try:
        torch.cuda.synchronize()
        error = None
    except Exception as e:  # the trapped kernel's CUDA error
        error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    waited = time.monotonic() - t0
    trap = b.trap()  # what the kernel left in pinned host memory before its trap
    if how == "absent":
        dist.barrier()
    return {"error": error, "waited_s": waited, "trap": trap._asdict() if trap else None,
            "report": b.trap_error()}


# -- processes ------------------------------------------------------------------------------


def _child(rank, world, init_file, gpus, fn, args, results):
    if world > gpus:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"  # this child's torch reads it
    import torch.distributed as dist

    torch.cuda.set_device(rank % gpus)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    # no teardown: a trapped kernel leaves a CUDA context whose destructors
    # may fail, and the peers are done with this rank's memory (_finish)
    os._exit(0)


def run_ranks(fn, world: int, gpus: int, *args, expect=None, deadline_s: float = 240.0) -> dict[int, object]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; the results
    of the ranks in ``expect`` (default: all). Raises with the tracebacks if
    a rank fails or the deadline passes (stragglers are killed)."""
    expect = set(range(world)) if expect is None else set(expect)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="echo-fused-") as tmp:
        procs = [ctx.Process(target=_child, args=(r, world, os.path.join(tmp, "store"), gpus, fn, args, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        out, errors, deadline = {}, [], time.monotonic() + deadline_s
        try:
            while not expect <= set(out) and not errors:
                if time.monotonic() > deadline:
                    errors.append(f"deadline of {deadline_s} s passed; results from ranks {sorted(out)}")
                    break
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    continue
                if status == "ok":
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=20 if not errors else 0)
                if p.is_alive():
                    p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return out


# -- checks -----------------------------------------------------------------------------------


def check_soak(world: int, gpus: int, calls: int, seed: int = 0, check_every: int = 97) -> dict:
    """The soak: :func:`rank_soak` on every rank; outputs equal
    across ranks call by call, every fresh call equal to the references,
    every flag back at 0."""
    from echo_vllm.quant import WireLayout

    t0 = time.monotonic()
    problems = []
    try:
        got = run_ranks(rank_soak, world, gpus, calls, seed, check_every, deadline_s=600)
        for r in range(1, world):
            bad = (got[r]["sums"] != got[0]["sums"]).nonzero().view(-1).tolist()
            if bad:
                problems.append(f"rank {r} differs from rank 0 in {len(bad)} calls, first {bad[0]}")
        plan = _soak_plan(calls, seed, check_every)
        for c, y0 in got[0]["fresh"].items():
            rows = plan[c][1]
            xs = torch.cat([_soak_x(c, r, rows) for r in range(world)])
            want = reference(xs, torch.zeros(world, WireLayout(rows * SOAK_COLS, world, 32, SOAK_COLS).padded_numel,
                                             dtype=torch.bfloat16), WireLayout(rows * SOAK_COLS, world, 32, SOAK_COLS),
                             hadamard=True, incoming=True)
            if d := differs(y0.view(-1), want, nan_any=True):
                problems.append(f"fresh call {c} ({plan[c][0]}, {rows} rows): {d}")
        problems += [f"rank {r}: {got[r]['flags_nonzero']} flags not back at 0" for r in range(world)
                     if got[r]["flags_nonzero"]]
    except Exception:
        problems = [traceback.format_exc()]
    res = {"check": "soak", "world": world, "calls": calls, "ok": not problems, "problems": problems[:8],
           "seconds": round(time.monotonic() - t0, 1)}
    print(f"P={world} soak ({calls} calls): {'ok' if not problems else 'FAILED'} ({res['seconds']} s)", flush=True)
    for p in problems[:8]:
        print("   ", p[:2000], flush=True)
    return res


def check_sweep(world: int, gpus: int) -> dict:
    """:func:`rank_sweep` on every rank, each rank's outputs against the reference backend's."""
    from echo_vllm import shape_sweep

    t0 = time.monotonic()
    cases = [c for c in shape_sweep.cases("fused") if c.world_size == world]
    try:
        got = run_ranks(rank_sweep, world, gpus, deadline_s=500)  # names the late ranks within gpu_accept.sh's 530 s
        problems = []
        for case in cases:
            want = shape_sweep.reference_outputs(case)
            problems += [f"{case.label} rank {r}: {d}" for r in range(world)
                         for d in shape_sweep.differences(got[r][case.label], want)]
    except Exception:
        problems = [traceback.format_exc()]
    res = {"check": "sweep", "world": world, "cases": len(cases), "ok": not problems, "problems": problems[:8],
           "failures": len(problems), "seconds": round(time.monotonic() - t0, 1)}
    print(f"P={world} sweep ({len(cases)} cases): {'ok' if not problems else f'FAILED ({len(problems)})'} "
          f"({res['seconds']} s)", flush=True)
    for p in problems[:8]:
        print("   ", p[:2000], flush=True)
    return res


def check_world(world: int, gpus: int) -> list[dict]:
    from echo_vllm.quant import WireLayout

    checks = []

    def record(name, fn):
        t0 = time.monotonic()
        try:
            problems = fn()
        except Exception:
            problems = [traceback.format_exc()]
        checks.append({"check": name, "world": world, "ok": not problems, "problems": problems[:8],
                       "seconds": round(time.monotonic() - t0, 1)})
        print(f"P={world} {name}: {'ok' if not problems else 'FAILED'} ({checks[-1]['seconds']} s)", flush=True)
        for p in problems[:8]:
            print("   ", p[:2000], flush=True)

    def eager():
        got = run_ranks(rank_eager, world, gpus)
        problems = []
        for name, rows, cols, g, *_rest in CASES:
            had = _rest[2]
            lay = WireLayout(rows * cols, world, g, cols)
            problems += [f"{name}: {p}" for p in compare_calls([got[r][name] for r in range(world)], lay, had)]
        return problems

    def graph():
        got = run_ranks(rank_graph, world, gpus)
        return compare_calls([got[r]["graph"] for r in range(world)], WireLayout(64 * 4096, world, 32, 4096), True)

    def auto():
        got = run_ranks(rank_auto, world, gpus)
        problems = [f"rank {r} picked {got[r]['backend']!r}" for r in range(world) if got[r]["backend"] != "fused"]
        xs = torch.stack([got[r]["x"].view(-1) for r in range(world)])
        y = reference(xs, None, WireLayout(xs.shape[1], world, 32, 2048), hadamard=True, incoming=False)
        problems += [f"rank {r}: {d}" for r in range(world)
                     if (d := differs(got[r]["y"].view(-1), y, nan_any=True))]
        return problems

    def too_large():
        got = run_ranks(rank_too_large, world, gpus)
        return [f"rank {r}: {got[r]['result']}" for r in range(world)
                if not got[r]["result"].startswith("MessageTooLarge")]

    record("eager", eager)
    record("graph", graph)
    record("auto", auto)
    record("too_large", too_large)
    return checks


def check_lost_peer(how: str, gpus: int) -> dict:
    t0 = time.monotonic()
    try:
        got = run_ranks(rank_lost_peer, 2, gpus, how, expect=[0], deadline_s=180)[0]
        # an error, after about the timeout (a live but absent peer can end
        # the wait no other way; the clock starts after the launch returned)
        lo = 0.5 * ABSENT_TIMEOUT_S if how == "absent" else 0.0
        ok = got["error"] is not None and lo <= got["waited_s"] < ABSENT_TIMEOUT_S + 20
        problems = [] if ok else [f"rank 0 after {got['waited_s']:.1f} s: {got['error']}"]
        # the status word: rank 0 waited at barrier 1 for rank 1's signal, and the error says so
        want = {"rank": 0, "peer": 1, "barrier": 1, "signalling": False}
        trap = got["trap"] or {}
        if {k: trap.get(k) for k in want} != want:
            problems.append(f"status word {trap}, expected {want}")
        if not (got["report"] or "").startswith("echo fused all-reduce timed out") or "rank 1" not in got["report"]:
            problems.append(f"trap report: {got['report']!r}")
        detail = got
    except Exception:
        problems, detail = [traceback.format_exc()], None
    res = {"check": f"{how}_peer", "world": 2, "ok": not problems, "problems": problems, "detail": detail,
           "seconds": round(time.monotonic() - t0, 1)}
    print(f"P=2 {how}_peer: {'ok' if not problems else 'FAILED'} {detail}", flush=True)
    return res


# -- per-phase timing (one process) ----------------------------------------------------------


def bench() -> list[dict]:
    """Each phase of rank 0 alone, every peer's buffer on this GPU, against
    the composed Triton stage kernels on the same layout (device time per
    call, CUDA events over repeated launches)."""
    from echo_vllm import kernels
    from echo_vllm.backends.fused import local_buffers
    from echo_vllm.bench.timing import cuda_mean_s
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.quant import WireLayout

    def timed(fn) -> float:
        return cuda_mean_s(fn, reps=50) * 1e6

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for world in (2, 4, 8):
        for tokens in (1, 16, 256, 4096):
            lay = WireLayout(tokens * 8192, world, 32, 8192)
            tiling = fk.tiling_for(lay, sms)
            table, _, _ = local_buffers(world, lay.chunk_bytes, fk.signal_slots(tiling.programs, world), "cuda")
            x = torch.randn(1, lay.numel, device="cuda").to(torch.bfloat16)
            fb = torch.zeros(1, lay.padded_numel, dtype=torch.bfloat16, device="cuda")
            y = torch.empty(lay.numel, dtype=torch.bfloat16, device="cuda")
            kw = dict(rank=0, gathered_offset=world * lay.chunk_bytes, qmax=QMAX, hadamard=True, has_incoming=True,
                      tiling=tiling, timeout_ns=10**10, out=y)
            row = {"P": world, "tokens": tokens, "hidden": 8192, "tiling": tiling._asdict()}
            for ph in (1, 2, 3):
                row[f"fused_phase{ph}_us"] = round(timed(lambda: fk.fused_all_reduce(x, fb, table, lay, phase=ph,
                                                                                     **kw)), 2)
            wire = torch.empty(1, world, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
            q2 = torch.empty(1, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
            gathered = torch.zeros(world, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
            row["triton_stage1_us"] = round(timed(lambda: kernels.stage1(
                x, fb, lay, qmax=QMAX, hadamard=True, has_incoming=True, out=wire)), 2)
            row["triton_stage2_us"] = round(timed(lambda: kernels.stage2(wire, fb, [0], lay, qmax=QMAX, out=q2)), 2)
            row["triton_output_us"] = round(timed(lambda: kernels.output(
                gathered, lay, torch.bfloat16, hadamard=True, out=y)), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated P values (default 2,4; '' for none: only the lost-peer checks)")
    ap.add_argument("--sweep-worlds", default="", help="comma-separated P values to run the shape sweep for "
                    "through the fused backend (e.g. 2,3,4,8; default none)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs to spread the ranks over (default 1: all share GPU 0)")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--bench", action="store_true", help="add per-phase kernel timings (one process)")
    ap.add_argument("--skip-lost-peer", action="store_true", help="skip the absent/killed peer checks")
    ap.add_argument("--soak", type=int, default=0, metavar="CALLS",
                    help="also chain CALLS calls of random sizes with CUDA-graph replays interleaved, per P "
                         "(10000 is the soak for several GPUs)")
    ap.add_argument("--only-soak", action="store_true", help="run the soak alone")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this checks the compiled kernel", file=sys.stderr)
        return 2
    gpus = max(1, min(args.gpus, torch.cuda.device_count()))
    import triton

    t0 = time.monotonic()
    summary = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(0),
               "gpus": gpus, "checks": []}
    sweep_worlds = [int(w) for w in args.sweep_worlds.split(",") if w]
    # the sweeps side by side with the other checks: every process compiles its own kernels, and
    # the checks of one P alone leave most of the host's cores idle
    with ThreadPoolExecutor(max(1, len(sweep_worlds))) as pool:
        sweeps = [pool.submit(check_sweep, w, gpus) for w in sweep_worlds]
        for world in (int(w) for w in args.worlds.split(",") if w):
            if not args.only_soak:
                summary["checks"] += check_world(world, gpus)
            if args.soak:
                summary["checks"].append(check_soak(world, gpus, args.soak))
        summary["checks"] += [s.result() for s in sweeps]
    if not args.skip_lost_peer and not args.only_soak:
        summary["checks"] += [check_lost_peer("absent", gpus), check_lost_peer("killed", gpus)]
    if args.bench:
        summary["bench"] = bench()
    summary["ok"] = all(c["ok"] for c in summary["checks"])
    summary["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(summary, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
