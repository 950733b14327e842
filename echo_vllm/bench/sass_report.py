"""What the compiler makes of each Echo kernel, without a GPU.

``python -m echo_vllm.bench.sass_report [--feedback-dtype float32,int8] [--encoders absmax,signed_mse]``
compiles stage 1, stage 2, output and consume for sm_90 (bf16 input, g = 32,
Hadamard on, P = 8, sizes with the 1 GiB benchmark's specialization) and the
fused kernel's phases, once per feedback dtype (default bfloat16, the
library's) and encoder (``EchoConfig.encoder``, default absmax; the output
and consume kernels do not depend on it), under
``host_overhead.compile_only`` and prints, per
kernel: registers and static shared memory (``cuobjdump
--dump-resource-usage``), the SASS instruction count of one thread (the
kernels have no loops, so that is what each thread executes, for
``GROUPS_PER_PROGRAM * G / (32 * NUM_WARPS)`` values), and its global and
shared memory instructions with their widths. ``--norm`` adds the output
phase with the residual add + RMSNorm (``output_norm`` and the fused
kernel's phase 3 with the norm, 8192 x 4096 at P = 8 and 2).

Why it matters: on the H200 the Echo kernels are partly issue-bound. One
SM issues 4 warp-instructions per cycle: at 1.98 GHz, 253 G thread-
instructions/s per SM, against 32.3 GB/s per SM of copy bandwidth (4258 GB/s
over 132 SMs). A kernel moving B bytes per value can keep pace with the copy
only below ~7.8 x B SASS per value, and only at perfect issue (stage 1 with
fp32 feedback, B = 10.6: 83; output, B = 2.56: 20).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import torch

from ..cli_args import choice_list, count
from ..config import ENCODERS, MAX_SEED
from ..quant import FEEDBACK_STORAGE
from ..rotation import sign_flips
from .host_overhead import _calls, compile_only

#: SASS opcodes reported by name (others are summed as "other"; LDL/STL: spills).
MEMORY_PREFIXES = ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDL", "STL")


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def kernel_report(compiled) -> dict:
    """Registers, shared bytes, SASS count and memory instructions of one
    compiled kernel (a Triton ``CompiledKernel``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    try:
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    ops = collections.Counter()
    loaded, late_spills = False, 0  # spill stores after the first global load: inside the work, not the prologue
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and m.group(1) != "NOP":
            ops[m.group(1)] += 1
            loaded |= m.group(1).startswith("LDG")
            late_spills += loaded and m.group(1).startswith("STL")
    regs = re.search(r"REG:(\d+)", usage)
    shared = re.search(r"SHARED:(\d+)", usage)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "shared_bytes": int(shared.group(1)) if shared else None,
        "sass": sum(ops.values()),
        "memory": {op: n for op, n in sorted(ops.items()) if op.startswith(MEMORY_PREFIXES)},
        "late_spill_stores": late_spills,
        "shuffles": sum(n for op, n in ops.items() if op.startswith("SHFL")),
        "barriers": sum(n for op, n in ops.items() if op.startswith("BAR")),
    }


def _fused_phase(phase: int, world_size: int = 8, fb_dtype: torch.dtype = torch.bfloat16, rows: int = 4096,
                 cols: int = 8192, flips: int = 0, encoder: str = "absmax"):
    """The fused kernel compiled for one phase alone (``fused_kernel.ALL_PHASES``:
    the whole kernel; 64 MiB of rows of 8192 by default), the rotation's sign
    flips ``flips``."""
    from ..kernels import fused_kernel as fk
    from ..quant import WireLayout, feedback_row_len

    lay = WireLayout(rows * cols, world_size, 32, cols)
    x, y = torch.zeros(1, lay.numel, dtype=torch.bfloat16), torch.empty(1, lay.numel, dtype=torch.bfloat16)
    fb = torch.zeros(1, feedback_row_len(lay.padded_numel, fb_dtype, lay.group_size), dtype=fb_dtype)
    tiling = fk.tiling_for(lay, 132)
    lp = fk._launch_plan(lay, tiling, 1, world_size * lay.chunk_bytes, 7, True, True, True, phase,
                         fk.tiling_lanes(tiling, lay, x, y), flips, encoder)
    return lp.launcher.compile(lp.grid, (x, fb, y, torch.zeros(2, world_size, dtype=torch.int64)),
                               fk.launch_ints(lp, x, fb, lay, rank=0, timeout_ns=10**9), lp.constexprs)


def _norm_kernels(world_size: int, rows: int = 8192, cols: int = 4096, keep_output: bool = False,
                  flips: int = 0) -> dict:
    """The output-norm kernel, the fused kernel's phase 3 with the norm, the
    whole fused norm kernel and, beside it, Echo's own whole fused kernel,
    compiled for ``rows x cols`` bf16 (Qwen3-8B's prefill by default), with
    the residual add (``keep_output``: without one, Echo's output kept)."""
    from ..kernels import fused_kernel as fk
    from ..kernels import contract
    from ..kernels import output_norm_kernel as onk
    from ..rmsnorm_plan import norm_tiling
    from ..quant import WireLayout

    lay = WireLayout(rows * cols, world_size, 32, cols)
    tiling, reason = norm_tiling(lay)
    if tiling is None:
        raise ValueError(reason)
    res, w = torch.empty(lay.numel, dtype=torch.bfloat16), torch.empty(cols, dtype=torch.bfloat16)
    out = torch.empty(lay.numel, dtype=torch.bfloat16)
    mode = onk.residual_mode(None if keep_output else res, res)
    plan = onk._plan(lay, tiling, True, mode, contract.lane_layout(lay.cols, tiling.groups_per_tile * lay.group_size,
                                                                     tiling.num_warps, res, w, out), flips)
    composed = plan.launcher.compile(plan.grid, (torch.empty(world_size, lay.chunk_bytes, dtype=torch.uint8), res, w, out, res),
                          (*plan.ints, 1e-6), plan.constexprs)
    fused_tiling = fk.tiling_for_norm(lay, tiling, 132)
    x, fb = torch.zeros(1, lay.numel, dtype=torch.bfloat16), torch.zeros(1, lay.padded_numel, dtype=torch.bfloat16)

    def fused(phase):
        lp = fk._norm_launch_plan(lay, fused_tiling, 1, world_size * lay.chunk_bytes, 7, True, True, True, phase,
                                  mode, fk.tiling_lanes(fused_tiling, lay, res, w, out), flips)
        ints = (0, 10**9, 0, x.stride(0), fb.stride(0), lay.numel, lay.numel, *lp.ints, 1e-6)
        return lp.launcher.compile(lp.grid, (x, fb, torch.zeros(2, world_size, dtype=torch.int64), res, w, out, res),
                                   ints, lp.constexprs)

    kept = " kept" if keep_output else ""
    return {"values_per_thread": tiling.values_per_thread, f"output_norm P={world_size}{kept}": composed,
            f"fused phase 3 norm P={world_size}{kept}": fused(3),
            f"fused norm whole P={world_size}{kept}": fused(fk.ALL_PHASES),
            f"fused whole P={world_size}": _fused_phase(fk.ALL_PHASES, world_size, rows=rows, cols=cols, flips=flips)}


def norm_report(world_sizes: tuple[int, ...] = (8, 2), keep_output: bool = False, flips: int = 0) -> list[dict]:
    """One row per norm kernel (:func:`_norm_kernels`) and P: SASS per row
    value a thread holds (``keep_output``: the kernels without a residual
    that keep Echo's output, named "... kept")."""
    rows = []
    with compile_only():
        for p in world_sizes:
            kernels = _norm_kernels(p, keep_output=keep_output, flips=flips)
            per_thread = kernels.pop("values_per_thread")
            for name, k in kernels.items():
                r = kernel_report(k)
                rows.append({"kernel": name, **r, "sass_per_value": r["sass"] / per_thread,
                             "maxnreg": k.metadata.maxnreg})
    return rows


def report(fb_dtype: torch.dtype = torch.bfloat16, flips: int = 0, encoder: str = "absmax") -> list[dict]:
    """One row per kernel, feedback in ``fb_dtype``, stages 1 and 2 with
    ``encoder``: the stage kernels (no loops: the SASS count is
    what a thread executes, for ``TILE_VALUES / threads`` values) and the
    fused kernel's three phases compiled alone (static counts of a loop
    over tiles: phases 1 and 3 handle a thread's 8 values of each of the
    P = 8 chunks per tile, 64 values; phase 2 its 8 values of the own chunk,
    each summed over 8 ranks and stored to 8 peers). ``flips``: the
    rotation's sign flips (``rotation.sign_flips``; 0 compiles none)."""
    from ..kernels import consume_kernel, contract, output_kernel, stage1_kernel, stage2_kernel

    modules = {"stage1": stage1_kernel, "stage2": stage2_kernel, "output": output_kernel, "consume": consume_kernel}
    values_per_thread = contract.TILE_VALUES // (32 * contract.NUM_WARPS)
    rows = []
    with compile_only():
        for name, call in _calls(1 << 22, 8, fb_dtype, flips, encoder).items():
            call()
            compiled = list(modules[name]._LAUNCH.fn.device_caches[-1][0].values())[-1]
            r = kernel_report(compiled)
            rows.append({"kernel": name, **r, "sass_per_value": r["sass"] / values_per_thread})
        for phase in (1, 2, 3):
            r = kernel_report(_fused_phase(phase, fb_dtype=fb_dtype, flips=flips, encoder=encoder))
            rows.append({"kernel": f"fused phase {phase}", **r, "sass_per_value": r["sass"] / (8 if phase == 2 else 64)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_vllm.bench.sass_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--feedback-dtype", type=choice_list(tuple(FEEDBACK_STORAGE)), default="bfloat16",
                    help="comma-separated feedback buffer formats to compile for (of " + ", ".join(FEEDBACK_STORAGE)
                         + "), one table each")
    ap.add_argument("--encoders", type=choice_list(ENCODERS), default="absmax",
                    help="comma-separated encoders to compile stages 1 and 2 for (of " + ", ".join(ENCODERS)
                         + "), one table each")
    ap.add_argument("--json", help="also write every table's rows to this file")
    ap.add_argument("--norm", action="store_true",
                    help="also the output phase with the residual add + RMSNorm (8192 x 4096, P = 8 and 2)")
    ap.add_argument("--rotation-seed", type=count(0, MAX_SEED, "seeds are int64"), default=0,
                    help="compile with this EchoConfig.rotation_seed's sign flips (0: none, the default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    flips = sign_flips(args.rotation_seed, 32)
    tables = {}
    for dt in args.feedback_dtype:
        for encoder in args.encoders:
            print(f"feedback {dt}, encoder {encoder}, rotation seed {args.rotation_seed} (sign flips {flips:#010x}):")
            print(f"{'kernel':<14} {'regs':>4} {'shared':>6} {'SASS':>5} {'/value':>6} {'SHFL':>4} {'BAR':>3}  memory")
            tables[f"{dt} {encoder}"] = rows = report(FEEDBACK_STORAGE[dt], flips, encoder)
            for r in rows:
                mem = " ".join(f"{op}x{n}" for op, n in r["memory"].items())
                print(f"{r['kernel']:<14} {r['registers']:>4} {r['shared_bytes']:>6} {r['sass']:>5} "
                      f"{r['sass_per_value']:>6.1f} {r['shuffles']:>4} {r['barriers']:>3}  {mem}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(tables, f, indent=1)
    if args.norm:
        print("with the residual add + RMSNorm (bf16 feedback):")
        for r in norm_report(flips=flips):
            mem = " ".join(f"{op}x{n}" for op, n in r["memory"].items())
            print(f"{r['kernel']:<24} {r['registers']:>4}/{r['maxnreg'] or '-'} {r['shared_bytes']:>6} {r['sass']:>5} "
                  f"{r['sass_per_value']:>6.1f} {r['shuffles']:>4} {r['barriers']:>3}  {mem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
