"""Launch each phase of the fused kernel once (one rank, P = 8, 64 MiB of
rows of 8192, every peer's buffer local), and each composed stage kernel
(stage 1, stage 2, output) on the same layout, for a profiler to read:

    ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats -k regex:'_fused|stage|output' python scripts/experiments/fused_profile.py

An experiment (BENCHMARKS.md, "Kernels against the memory roofline", reports what it showed), not a tool.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--size", default="64M", help="message bytes per rank (bf16)")
    ap.add_argument("--feedback-dtype", default="bfloat16", help="bfloat16 or int8 (where the kernels support it)")
    args = ap.parse_args(argv)
    import torch

    from echo_vllm import quant
    from echo_vllm.backends.fused import local_buffers
    from echo_vllm.backends.stages import TritonStages
    from echo_vllm.bench.report import parse_size
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.quant import WireLayout

    p = args.world_size
    lay = WireLayout(parse_size(args.size) // 2, p, 32, 8192)
    x = torch.randn(1, lay.numel, device="cuda").to(torch.bfloat16)
    fb_dtype = quant.FEEDBACK_STORAGE[args.feedback_dtype]
    fb = torch.zeros(1, quant.feedback_row_len(lay.padded_numel, fb_dtype, lay.group_size), dtype=fb_dtype,
                     device="cuda")
    y = torch.empty(1, lay.numel, dtype=torch.bfloat16, device="cuda")
    tiling = fk.tiling_for(lay, torch.cuda.get_device_properties(0).multi_processor_count)
    table, _, _ = local_buffers(p, lay.chunk_bytes, fk.signal_slots(tiling.programs, p), "cuda")
    for phase in (1, 2, 3, 1, 2, 3):  # the second round is the one to read (warm caches, compiled)
        fk.fused_all_reduce(x, fb, table, lay, rank=0, gathered_offset=p * lay.chunk_bytes, qmax=7, hadamard=True,
                            has_incoming=True, tiling=tiling, timeout_ns=10**10, out=y, phase=phase)
    st = TritonStages()
    wire = torch.empty(1, p, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
    q2 = torch.empty(1, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        st.stage1(x, fb, lay, qmax=7, hadamard=True, has_incoming=True, out=wire)
        st.stage2(wire, fb, [0], lay, qmax=7, out=q2)
        st.output(wire[0], lay, torch.bfloat16, hadamard=True, out=y[0])
    torch.cuda.synchronize()
    print("tiling", tiling)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
