r"""Time the fused Echo + add + RMSNorm under tile plans other than
``rmsnorm_plan.norm_tiling``'s: rows per tile and the output phase's second
pass (Echo's output read back, or decoded again, or none: ``--once one``,
every chunk of a step's rows in one pass), every rank of P emulated
in one launch (time over P, as ``bench norm``'s (b)), and phase 3 alone
(one rank). Each plan's output and new residual are first compared bit for
bit with the plan's own (the tiling must not change the numerics).

    python scripts/experiments/norm_tiles.py --world-sizes 8,4 --tokens 8192 --rows 1,2,4 --jobs 12

``--grids plan,full,few`` also tries a persistent grid with a program in
every slot of every SM (:func:`full_grid`) and one with as few programs as
share the tiles evenly (:func:`fewest_grid`, the plan's until now, whatever
the checked-out plan is), and ``--echo-phases`` times Echo's
own phases alone (one rank on every SM, as a rank on its own GPU runs
them) under each grid:

    python scripts/experiments/norm_tiles.py --echo-phases --world-sizes 8,4,2 --tokens 1024,8192 --grids plan,full

A plan's phase 3 alone, for a profiler (``--compile-only P:T:H:rows:once:step:warps_per_sm:one_pass_values``, once
0 decode again, 1 read back, 2 one pass, launches every rank's phases, then phase 3 alone):

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats -k regex:_fused_norm --launch-skip 1 --launch-count 1 \
        python scripts/experiments/norm_tiles.py --compile-only 8:8192:4096:4:0:4:24

Compilation is the slow part: ``--jobs`` processes compile the plans first
(each runs its plan once, which fills Triton's cache), then this process
times them one after another. An experiment (BENCHMARKS.md, "Dropped ideas
worth knowing", reports what it showed), not a tool.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

EPS = 1e-6


#: ``--once`` values: the output phase's second pass (read back, decode again) or none (one pass).
SECOND_PASS = {"on": 1, "off": 0, "one": 2}


def _tiling(lay, rows: int, once: int, step: int, warps_per_sm: int, one_pass_values: int = 16):
    """``(the plan's tiling, a variant)``: ``rows`` rows per tile (warps and values per thread to
    match), in two passes whose second reads Echo's output back (``once`` 1) or decodes again (0), or
    in one pass (2: as many rows a step as ``rmsnorm_plan.one_pass_rows`` allows; None if not one), and
    ``warps_per_sm`` in place of ``rmsnorm_plan.NORM_WARPS_PER_SM`` (programs per SM, and so registers),
    ``one_pass_values`` of ``rmsnorm_plan.ONE_PASS_MAX_VALUES`` (the most values a thread holds in one pass)."""
    from echo_vllm import rmsnorm_plan
    from echo_vllm.rmsnorm_plan import MAX_WARPS, WARP_VALUES, norm_tiling, one_pass_rows

    rmsnorm_plan.NORM_WARPS_PER_SM = warps_per_sm  # read by NormTiling.per_sm()
    rmsnorm_plan.ONE_PASS_MAX_VALUES = one_pass_values  # read by one_pass_rows()

    plan, reason = norm_tiling(lay)
    if plan is None:
        raise SystemExit(f"no fused norm: {reason}")
    two, _ = norm_tiling(lay, one_pass=False)
    chunk_row = two.padded_row_groups * lay.group_size
    warps = max(1, min(MAX_WARPS, rows * chunk_row // WARP_VALUES))
    if once == 2:
        one = one_pass_rows(lay.world_size, chunk_row, rows, warps)
        held = one * (1 << (lay.world_size - 1).bit_length()) * chunk_row // (32 * warps)
        return plan, two._replace(rows=rows, num_warps=warps, values_per_thread=held, chunks_per_step=1,
                                  decode_once=False, one_pass_rows=one) if one else None
    return plan, two._replace(rows=rows, num_warps=warps, values_per_thread=rows * chunk_row // (32 * warps),
                              chunks_per_step=min(step, lay.world_size), decode_once=bool(once))


def _case(world: int, tokens: int, hidden: int, dev: str = "cuda"):
    import torch

    from echo_vllm.backends.fused import local_buffers
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.quant import WireLayout

    lay = WireLayout(tokens * hidden, world, 32, hidden)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else world
    table, _, _ = local_buffers(world, lay.chunk_bytes, fk.signal_slots(sms * 32, world), dev)  # 32: the most programs an SM holds
    torch.manual_seed(world * 7919 + tokens)  # (a torch.Generator object crashes Triton's interpreter)
    x = torch.randn(world, lay.numel, device=dev).to(torch.bfloat16)
    res = torch.randn(lay.numel, device=dev).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device=dev)).to(torch.bfloat16)
    return lay, sms, table, x, res, w


def full_grid(tiling, layout, sms: int):
    """``tiling`` with a program in every slot of the ``sms`` SMs (``per_sm`` each, as many as the tiles):
    the plan's persistent grid takes as few programs as give each the same number of tiles, which
    leaves some SMs a program short."""
    from echo_vllm.kernels.fused_kernel import TILE_TABLE

    per_sm = tiling.norm.per_sm() if tiling.norm is not None else next(
        r.per_sm for r in TILE_TABLE if layout.chunk_numel <= r.max_chunk_numel)
    return tiling._replace(programs=min(tiling.tiles(layout), sms * per_sm))


def fewest_grid(tiling, layout, sms: int):
    """``tiling`` with as few programs as give each the same number of tiles, give or take one, in as
    few rounds as a full grid (the plan's persistent grid until a full one replaces it)."""
    full = full_grid(tiling, layout, sms)
    rounds = -(-tiling.tiles(layout) // full.programs)
    return tiling._replace(programs=-(-tiling.tiles(layout) // rounds))


def with_grid(grid: str, tiling, layout, sms: int):
    """``tiling`` with the persistent grid ``grid`` names: plan (its own), full or few."""
    return {"full": full_grid, "few": fewest_grid}.get(grid, lambda t, *_: t)(tiling, layout, sms)


def _run(lay, sms, table, x, res, w, norm, *, ranks: int | None = None, phase: int = 0, out=None, fb=None,
         ress=None, grid: str = "plan"):
    """One call of the fused norm kernel with ``norm``'s tiles on the persistent grid ``grid``
    (:func:`with_grid`): ``(out, new residual)``."""
    import torch

    from echo_vllm.kernels import fused_kernel as fk

    p = lay.world_size
    ranks = p if ranks is None else ranks
    used = sms // p if ranks == p else sms
    tiling = with_grid(grid, fk.tiling_for_norm(lay, norm, used), lay, used)
    if fb is None:
        fb = torch.zeros(ranks, lay.padded_numel, dtype=torch.bfloat16, device=x.device)
    if ress is None:
        ress = res.repeat(ranks, 1)
    kw = dict(gathered_offset=p * lay.chunk_bytes, qmax=7, hadamard=True, has_incoming=True, tiling=tiling)
    if x.device.type == "cpu":  # the interpreter runs programs one by one: the phases, and the ranks, one at a time
        if out is None:
            out = torch.empty_like(x[:ranks])
        for ph in (1, 2, 3) if phase == 0 else (phase,):
            for r in range(ranks):
                fk.fused_all_reduce_norm(x[r:r + 1], fb[r:r + 1], table, lay, w, EPS, residual=ress[r], rank=r,
                                         timeout_ns=0, out=out[r], phase=ph, **kw)
        return out, ress
    out, _ = fk.fused_all_reduce_norm(x[:ranks], fb, table, lay, w, EPS, residual=ress, rank=0,
                                      timeout_ns=10 * 10**9, out=out, phase=phase, **kw)
    return out, ress


def _compile(spec: str) -> int:
    """``P:T:H:rows:once:step:warps_per_sm:one_pass_values``: run that plan once, then its phase 3 alone (fills Triton's cache)."""
    import torch

    world, tokens, hidden, rows, once, step, wps, opv = (int(v) for v in spec.split(":"))
    lay, sms, table, x, res, w = _case(world, tokens, hidden)
    _, norm = _tiling(lay, rows, once, step, wps, opv)
    if norm is None:
        return 0
    _run(lay, sms, table, x, res, w, norm)  # launch 1: every rank, all phases
    _run(lay, sms, table, x, res, w, norm, ranks=1, phase=3)  # launch 2: phase 3 alone (for a profiler)
    torch.cuda.synchronize()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="8,4")
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,2,4", help="rows per tile to try (beside the plan's own)")
    ap.add_argument("--once", default="on,off,one", help="second passes to try: on (read back), off (decode "
                    "again), one (none: one pass)")
    ap.add_argument("--steps", default="4", help="chunks per step of the first pass to try")
    ap.add_argument("--warps-per-sm", default="24", help="rmsnorm_plan.NORM_WARPS_PER_SM values to try")
    ap.add_argument("--one-pass-values", default="16", help="rmsnorm_plan.ONE_PASS_MAX_VALUES values to try (one pass: the most values a thread holds; 32 gives P = 8 at hidden 4096 steps of 2 rows on 8 warps)")
    ap.add_argument("--grids", default="plan", help="persistent grids to try: plan (the plan's), full "
                    "(a program in every slot of every SM), few (as few programs as share the tiles evenly)")
    ap.add_argument("--echo-phases", action="store_true",
                    help="instead: Echo's own phases alone (one rank, every SM; no norm) under --grids")
    ap.add_argument("--jobs", type=int, default=1, help="processes compiling the plans first")
    ap.add_argument("--compile-only", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the timings here")
    ap.add_argument("--device", default="cuda", help="cpu: the bit comparison only, under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    if args.compile_only:
        return _compile(args.compile_only)
    import torch

    from echo_vllm.bench import timing
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.rmsnorm_plan import NORM_WARPS_PER_SM as PLAN_WPS
    from echo_vllm.rmsnorm_plan import ONE_PASS_MAX_VALUES as PLAN_OPV
    from echo_vllm.rmsnorm_plan import WARP_VALUES

    if args.echo_phases:
        return _echo_phases(args, timing)
    grids = args.grids.split(",")
    cases = []
    for world in (int(v) for v in args.world_sizes.split(",")):
        for tokens in (int(v) for v in args.tokens.split(",")):
            for rows in (int(v) for v in args.rows.split(",")):
                for once in args.once.split(","):
                    for step in (int(v) for v in args.steps.split(",")):
                        for wps in (int(v) for v in args.warps_per_sm.split(",")):
                            for opv in (int(v) for v in args.one_pass_values.split(",")):
                                cases.append((world, tokens, args.hidden, rows, SECOND_PASS[once], step, wps, opv))
    if args.jobs > 1:
        def compile_one(c):
            spec = ":".join(map(str, c))
            r = subprocess.run([sys.executable, __file__, "--compile-only", spec], capture_output=True, text=True)
            return spec, r.returncode, r.stderr[-400:]
        with ThreadPoolExecutor(args.jobs) as pool:
            for spec, rc, err in pool.map(compile_one, cases):  # the grid is no constant: compiled once
                print(f"compiled {spec}: rc={rc}" + (f" {err}" if rc else ""), flush=True)
    results, last = [], None
    for world, tokens, hidden, rows, once, step, wps, opv, grid in ((*c, g) for c in cases for g in grids):
        if last != (world, tokens):
            setup = _case(world, tokens, hidden, args.device)
            lay = setup[0]
            base, first = _tiling(lay, 1, 1, 4, PLAN_WPS, PLAN_OPV)
            want, want_res = (t.clone() for t in _run(*setup, first))  # every variant's bits against these
            last = (world, tokens)
        _, norm = _tiling(lay, rows, once, step, wps, opv)
        if norm is None or norm.rows * norm.padded_row_groups * lay.group_size < WARP_VALUES:
            continue  # a row too many values for one pass; a warp's 32 lanes of 8 values is the smallest tile
        got, got_res = _run(*setup, norm, grid=grid)
        same = (torch.equal(got.view(torch.int16), want.view(torch.int16))
                and torch.equal(got_res.view(torch.int16), want_res.view(torch.int16)))
        row = dict(world=world, tokens=tokens, hidden=hidden, rows=rows, second_pass={1: "read back", 0: "decode",
                   2: "none"}[once], one_pass_rows=norm.one_pass_rows, step=step, grid=grid, warps=norm.num_warps,
                   per_sm=norm.per_sm(),
                   one_pass_values=opv, plan=norm == base and wps == PLAN_WPS and opv == PLAN_OPV and grid == "plan",
                   registers=fk.tiling_for_norm(lay, norm, setup[1] // world).registers, same_bits=same)
        results.append(row)
        if args.device != "cuda":
            print(json.dumps(row), flush=True)
            continue
        out = torch.empty_like(setup[3])
        fb = torch.zeros(world, lay.padded_numel, dtype=torch.bfloat16, device="cuda")
        ress = setup[4].repeat(world, 1)
        whole = timing.cuda_graph_time(lambda i: _run(*setup, norm, out=out, fb=fb, ress=ress, grid=grid), iters=5,
                                       calls_per_graph=2).median_s * 1e6 / world
        ph3 = timing.cuda_graph_time(lambda i: _run(*setup, norm, ranks=1, phase=3, out=out[:1], fb=fb[:1],
                                                    ress=ress[:1], grid=grid), iters=10, calls_per_graph=2).median_s * 1e6
        row.update(echo_norm_us=round(whole, 2), phase3_norm_us=round(ph3, 2))
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["same_bits"] for r in results) else 1


def _echo_phases(args, timing) -> int:
    """Echo's phases alone (no norm), one rank on every SM, under each of ``--grids``; the
    output after phase 3 compared bit for bit across the grids."""
    import torch

    from echo_vllm.backends.fused import local_buffers
    from echo_vllm.quant import WireLayout

    from echo_vllm.kernels import fused_kernel as fk

    dev = args.device
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 2
    results, ok = [], True
    for world in (int(v) for v in args.world_sizes.split(",")):
        for tokens in (int(v) for v in args.tokens.split(",")):
            lay = WireLayout(tokens * args.hidden, world, 32, args.hidden)
            table, _, _ = local_buffers(world, lay.chunk_bytes, fk.signal_slots(sms * 32, world), dev)
            torch.manual_seed(world + tokens)
            x = torch.randn(1, lay.numel, device=dev).to(torch.bfloat16)
            ys = {}
            for grid in args.grids.split(","):
                plan = fk.tiling_for(lay, sms)
                tiling = with_grid(grid, plan, lay, sms)
                fb = torch.zeros(1, lay.padded_numel, dtype=torch.bfloat16, device=dev)
                y = torch.empty(1, lay.numel, dtype=torch.bfloat16, device=dev)
                kw = dict(rank=0, gathered_offset=world * lay.chunk_bytes, qmax=7, hadamard=True, has_incoming=True,
                          tiling=tiling, timeout_ns=0 if dev == "cpu" else 10**10, out=y)
                for ph in (1, 2, 3):
                    fk.fused_all_reduce(x, fb, table, lay, phase=ph, **kw)
                ys[grid] = y.clone()
                row = dict(world=world, tokens=tokens, hidden=args.hidden, grid=grid, programs=tiling.programs,
                           same_bits=torch.equal(y.view(torch.int16), next(iter(ys.values())).view(torch.int16)))
                ok &= row["same_bits"]
                if dev == "cuda":
                    for ph in (1, 2, 3):
                        row[f"phase{ph}_us"] = round(timing.cuda_graph_time(
                            lambda i, ph=ph: fk.fused_all_reduce(x, fb, table, lay, phase=ph, **kw), iters=10,
                            calls_per_graph=4).median_s * 1e6, 2)
                results.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
