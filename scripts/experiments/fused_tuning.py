"""Tile size, warps and programs of the fused kernel: each phase alone, one GPU.

    python scripts/experiments/fused_tuning.py [--out DIR]

Every peer's buffer is local (one process): this times the kernel's memory
work per phase, not a link. Prints one JSON line per (P, plan) and a table.
An experiment (BENCHMARKS.md section 9 reports its outcome), not a tool.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from echo_vllm.backends.fused import local_buffers
    from echo_vllm.bench.timing import cuda_mean_s
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.quant import WireLayout

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for world, tokens in ((2, 4096), (8, 4096), (8, 256)):
        lay = WireLayout(tokens * 8192, world, 32, 8192)
        x = torch.randn(1, lay.numel, device="cuda").to(torch.bfloat16)
        fb = torch.zeros(1, lay.padded_numel, dtype=torch.bfloat16, device="cuda")
        y = torch.empty(lay.numel, dtype=torch.bfloat16, device="cuda")
        for groups, warps, per_sm in itertools.product((32, 64, 128), (4, 8), (1, 2, 4)):
            tiles = -(-lay.chunk_groups // groups)
            plan = fk.FusedPlan(groups, warps, min(tiles, sms * per_sm))
            table, _, _ = local_buffers(world, lay.chunk_bytes, fk.signal_slots(plan.programs, world), "cuda")
            kw = dict(rank=0, gathered_offset=world * lay.chunk_bytes, qmax=7, hadamard=True, has_incoming=True,
                      plan=plan, timeout_ns=10**10, out=y)
            row = {"P": world, "tokens": tokens, "groups": groups, "warps": warps, "programs": plan.programs}
            for ph in (1, 2, 3):
                row[f"phase{ph}_us"] = round(cuda_mean_s(lambda: fk.fused_all_reduce(x, fb, table, lay, phase=ph, **kw)) * 1e6, 1)
            row["total_us"] = round(row["phase1_us"] + row["phase2_us"] + row["phase3_us"], 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fused_tuning.json").write_text(json.dumps(rows, indent=1))
    for key in {(r["P"], r["tokens"]) for r in rows}:
        best = min((r for r in rows if (r["P"], r["tokens"]) == key), key=lambda r: r["total_us"])
        print("best", key, best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
