"""What the compiler makes of each Echo kernel, without a GPU.

``python -m echo_vllm.bench.sass_report [--layouts spread,thread]`` compiles
stage 1, stage 2, output and consume for sm_90 (bf16 input, fp32 feedback,
g = 32, Hadamard on, P = 8, sizes with the 1 GiB benchmark's
specialization) under ``host_overhead.compile_only`` and prints, per
kernel: registers and static shared memory (``cuobjdump
--dump-resource-usage``), the SASS instruction count of one thread (the
kernels have no loops, so that is what each thread executes, for
``GROUPS_PER_PROGRAM * G / (32 * NUM_WARPS)`` values), and its global and
shared memory instructions with their widths.

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
import os
import re
import subprocess
import tempfile

import torch

from .host_overhead import _calls, compile_only

#: SASS opcodes reported by name (others are summed as "other").
MEMORY_PREFIXES = ("LDG", "STG", "LDS", "STS", "LDSM", "STSM")


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
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and m.group(1) != "NOP":
            ops[m.group(1)] += 1
    regs = re.search(r"REG:(\d+)", usage)
    shared = re.search(r"SHARED:(\d+)", usage)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "shared_bytes": int(shared.group(1)) if shared else None,
        "sass": sum(ops.values()),
        "memory": {op: n for op, n in sorted(ops.items()) if op.startswith(MEMORY_PREFIXES)},
        "shuffles": sum(n for op, n in ops.items() if op.startswith("SHFL")),
        "barriers": sum(n for op, n in ops.items() if op.startswith("BAR")),
    }


def report(layouts=("spread", "thread")) -> list[dict]:
    from ..kernels import consume_kernel, launch, output_kernel, stage1_kernel, stage2_kernel

    modules = {"stage1": stage1_kernel, "stage2": stage2_kernel, "output": output_kernel, "consume": consume_kernel}
    values_per_thread = launch.GROUPS_PER_PROGRAM * 32 // (32 * launch.NUM_WARPS)
    rows = []
    with compile_only():
        for layout in layouts:
            for name, call in _calls(1 << 22, 8, launch.is_spread(layout)).items():
                call()
                compiled = list(modules[name]._LAUNCH.fn.device_caches[-1][0].values())[-1]
                r = kernel_report(compiled)
                rows.append({"layout": layout, "kernel": name, **r,
                             "sass_per_value": r["sass"] / values_per_thread})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_vllm.bench.sass_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="spread,thread")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'layout':<7} {'kernel':<8} {'regs':>4} {'shared':>6} {'SASS':>5} {'/value':>6} {'SHFL':>4} {'BAR':>3}  memory")
    for r in report(tuple(args.layouts.split(","))):
        mem = " ".join(f"{op}x{n}" for op, n in r["memory"].items())
        print(f"{r['layout']:<7} {r['kernel']:<8} {r['registers']:>4} {r['shared_bytes']:>6} {r['sass']:>5} "
              f"{r['sass_per_value']:>6.1f} {r['shuffles']:>4} {r['barriers']:>3}  {mem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
