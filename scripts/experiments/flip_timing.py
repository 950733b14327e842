r"""The stage kernels with and without a rotation seed's sign flips, on one GPU:

    python scripts/experiments/flip_timing.py --rotation-seed 1

Times stage 1, output and consume (``triton.testing.do_bench``, the best of
``--repeats`` alternating rounds of each) on rows of ``--hidden`` at P =
``--world-size``, with seed 0 (no flips: today's kernels) and the seed's
flips, and prints each kernel's time and the difference. Stage 2 does not
flip. An experiment (the rotation seed's cost, issue 47), not a tool.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rotation-seed", type=int, default=1, help="the seed whose flips are timed beside seed 0")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096, help="values per row")
    ap.add_argument("--tokens", type=int, default=8192, help="rows")
    ap.add_argument("--feedback-dtype", default="bfloat16", choices=("float32", "bfloat16", "int8"))
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds; each kernel's best is kept")
    args = ap.parse_args(argv)
    import torch
    from triton.testing import do_bench

    from echo_vllm import kernels
    from echo_vllm.quant import FEEDBACK_STORAGE, WireLayout, feedback_row_len
    from echo_vllm.rotation import sign_flips

    fb_dtype = FEEDBACK_STORAGE[args.feedback_dtype]
    lay = WireLayout(args.tokens * args.hidden, args.world_size, 32, args.hidden)
    x = torch.randn(1, lay.numel, device="cuda").bfloat16()
    fb = torch.zeros(1, feedback_row_len(lay.padded_numel, fb_dtype, 32), device="cuda", dtype=fb_dtype)
    wire = torch.empty(1, args.world_size, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
    y, xo = torch.empty(lay.numel, dtype=torch.bfloat16, device="cuda"), torch.empty_like(x)
    seeds = (0, args.rotation_seed)
    best: dict[tuple[int, str], float] = {}
    for _ in range(args.repeats):
        for seed in seeds:
            f = sign_flips(seed, 32)
            calls = {
                "stage1": lambda: kernels.stage1(x, fb, lay, qmax=7, hadamard=True, has_incoming=True, flips=f,
                                                 out=wire),
                "output": lambda: kernels.output(wire[0], lay, torch.bfloat16, hadamard=True, flips=f, out=y),
                "consume": lambda: kernels.consume(x, fb, lay, hadamard=True, flips=f, out=xo),
            }
            for name, fn in calls.items():
                t = do_bench(fn, warmup=25, rep=200)
                best[seed, name] = min(best.get((seed, name), float("inf")), t)
    print(f"{torch.cuda.get_device_name()}: {args.tokens} x {args.hidden} bf16, P={args.world_size}, "
          f"feedback {args.feedback_dtype}, rotation seed {args.rotation_seed} (flips {sign_flips(seeds[1], 32):#010x})")
    for name in ("stage1", "output", "consume"):
        t0, t1 = best[0, name] * 1e3, best[seeds[1], name] * 1e3
        print(f"  {name:8s} seed 0 {t0:8.1f} us   seed {seeds[1]} {t1:8.1f} us   {100 * (t1 / t0 - 1):+5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
