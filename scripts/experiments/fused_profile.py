"""Launch each phase of the fused kernel once (one rank, P = 8, 64 MiB of
rows of 8192, every peer's buffer local) for a profiler to read:

    ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats -k regex:_fused python scripts/experiments/fused_profile.py

An experiment (BENCHMARKS.md section 11 reports what it showed), not a tool.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--size", default="64M", help="message bytes per rank (bf16)")
    args = ap.parse_args(argv)
    import torch

    from echo_vllm.backends.fused import local_buffers
    from echo_vllm.bench.report import parse_size
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.quant import WireLayout

    p = args.world_size
    lay = WireLayout(parse_size(args.size) // 2, p, 32, 8192)
    x = torch.randn(1, lay.numel, device="cuda").to(torch.bfloat16)
    fb = torch.zeros(1, lay.padded_numel, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(1, lay.numel, dtype=torch.bfloat16, device="cuda")
    plan = fk.plan_for(lay, torch.cuda.get_device_properties(0).multi_processor_count)
    table, _, _ = local_buffers(p, lay.chunk_bytes, fk.signal_slots(plan.programs, p), "cuda")
    for phase in (1, 2, 3, 1, 2, 3):  # the second round is the one to read (warm caches, compiled)
        fk.fused_all_reduce(x, fb, table, lay, rank=0, gathered_offset=p * lay.chunk_bytes, qmax=7, hadamard=True,
                            has_incoming=True, plan=plan, timeout_ns=10**10, out=y, phase=phase)
    torch.cuda.synchronize()
    print("plan", plan)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
