r"""Launch each phase of the fused kernel once (one rank, P = 8, 64 MiB of
rows of 8192, every peer's buffer local), and each composed stage kernel
(stage 1, stage 2, output) on the same layout, for a profiler to read:

    ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats -k regex:'_fused|stage|output' python scripts/experiments/fused_profile.py

With ``--norm`` it launches instead the fused kernel's phase 3 with the
residual add and RMSNorm (rows of ``--hidden``, ``--tokens`` of them), twice,
with the output phase's second pass as ``--decode-once`` says (``auto``:
the plan's choice, ``rmsnorm_plan.norm_tiling``), for comparing the two
designs of the P = 8 output phase:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats -k regex:_fused_norm python scripts/experiments/fused_profile.py \
        --norm --decode-once off

An experiment (BENCHMARKS.md, "Kernels against the memory roofline", reports what it showed), not a tool.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--size", default="64M", help="message bytes per rank (bf16)")
    ap.add_argument("--feedback-dtype", default="bfloat16", help="bfloat16 or int8 (where the kernels support it)")
    ap.add_argument("--norm", action="store_true", help="phase 3 with the residual add and RMSNorm instead")
    ap.add_argument("--hidden", type=int, default=4096, help="--norm: values per row (Qwen3-8B: 4096)")
    ap.add_argument("--tokens", type=int, default=8192, help="--norm: rows")
    ap.add_argument("--decode-once", choices=("auto", "on", "off"), default="auto",
                    help="--norm: the second pass reads Echo's output back (on) or decodes again (off)")
    ap.add_argument("--device", default="cuda", help="--norm: cpu runs it under TRITON_INTERPRET=1 (a smoke test)")
    args = ap.parse_args(argv)
    if args.norm:
        return _norm_phase3(args)
    import torch

    from echo_vllm import quant
    from echo_vllm.backends.fused import local_buffers
    from echo_vllm.backends.triton_stages import TritonStages
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


def _norm_phase3(args) -> int:
    """Phase 3 with the norm, one rank (every peer's buffer local), twice."""
    import torch

    from echo_vllm.backends.fused import local_buffers
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.rmsnorm_plan import norm_tiling
    from echo_vllm.quant import WireLayout

    p = args.world_size
    lay = WireLayout(args.tokens * args.hidden, p, 32, args.hidden)
    norm, reason = norm_tiling(lay)
    if norm is None:
        print(f"no fused norm: {reason}")
        return 2
    if args.decode_once != "auto":
        norm = norm._replace(decode_once=args.decode_once == "on")
    dev = args.device
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 1
    tiling = fk.tiling_for_norm(lay, norm, sms)
    table, _, _ = local_buffers(p, lay.chunk_bytes, fk.signal_slots(tiling.programs, p), dev)
    x = torch.randn(1, lay.numel, device=dev).to(torch.bfloat16)
    fb = torch.zeros(1, lay.padded_numel, dtype=torch.bfloat16, device=dev)
    w = (1 + 0.1 * torch.randn(args.hidden, device=dev)).to(torch.bfloat16)
    res = torch.randn(lay.numel, device=dev).to(torch.bfloat16)
    out = torch.empty(lay.numel, dtype=torch.bfloat16, device=dev)
    for phase in (1, 2, 3, 3):  # phases 1-2 fill the gathered area; the second phase 3 is the one to read
        fk.fused_all_reduce_norm(x, fb, table, lay, w, 1e-6, residual=res, rank=0, gathered_offset=p * lay.chunk_bytes,
                                 qmax=7, hadamard=True, has_incoming=False, tiling=tiling, timeout_ns=10**10,
                                 out=out, phase=phase)
    if dev == "cuda":
        torch.cuda.synchronize()
    print("tiling", tiling)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
