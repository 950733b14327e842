"""``echo-vllm demo``: why Echo's error does not grow with depth.

P gloo processes play the tensor-parallel ranks of an L-layer model whose
per-rank partial outputs are random but seeded (Gaussian, plus a few
outlier channels as real activations have). Each layer's partials are
all-reduced three ways -- exact 16-bit, naive 4-bit, Echo -- and added to
a residual stream. Rank 0 rebuilds every rank's partials to keep an fp64
reference, and prints the residual's error at each depth: naive 4-bit
errors add up (about sqrt(depth)), Echo's telescope (one call's worth at
any depth; the exact last call removes even that).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from ..cli_args import MAX_RANKS, MAX_TOOL_SEED, RANKS_WHY, SEED_WHY, count, out_dir
from ..communicator import EchoCommunicator
from ..config import EchoConfig
from ..numbering import CallSlot
from ..outputs import check_names, save_figure, write_json
from ..policy import Path
from ..quant import WireLayout
from ..spawn import run_processes
from ..transport import ProcessGroupTransport

#: Largest message the demo reduces (tokens x hidden): rank 0 rebuilds every
#: rank's partials in fp64, P x 8 bytes per value per layer.
MAX_DEMO_VALUES = 1 << 22

#: The files the demo writes into ``--out``.
OUTPUTS = ("demo.json", "demo.png")

MODES = {
    "exact 16-bit": None,
    "naive 4-bit": EchoConfig.naive(min_bytes=0),
    # first_exact_calls=0: every call quantized, to show the telescoping
    # itself (the serving default keeps the first 5 calls in 16-bit).
    "Echo": EchoConfig(min_bytes=0, first_exact_calls=0),
}


def _partial(layer: int, rank: int, tokens: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 1009 + rank)
    x = torch.randn(tokens, hidden, generator=g)
    x[:, :: max(1, hidden // 8)] *= 16.0  # a few outlier channels
    return x.to(torch.bfloat16)


def _rank_main(rank: int, world: int, layers: int, tokens: int, hidden: int, seed: int) -> dict:
    transport = ProcessGroupTransport()
    out: dict = {}
    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm  # the [eval] extra; the table prints without it
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=layers * len(MODES), desc=f"demo P={world} L={layers}", unit="call")
    for name, cfg in MODES.items():
        comm = EchoCommunicator(cfg or EchoConfig(), transport)
        residual = torch.zeros(tokens, hidden, dtype=torch.float64)
        reference = torch.zeros_like(residual)
        errors, update_rms = [], []
        for t in range(layers):
            x = _partial(t, rank, tokens, hidden, seed)
            y = comm.all_reduce(x, slot=CallSlot(t, last_call=(t == layers - 1)),
                                path=Path.EXACT if cfg is None else None)
            residual += y.double()
            if rank == 0:
                exact = sum(_partial(t, r, tokens, hidden, seed).double() for r in range(world))
                reference += exact
                errors.append(((residual - reference).norm() / math.sqrt(residual.numel())).item())
                update_rms.append((exact.norm() / math.sqrt(exact.numel())).item())
            if bar is not None:
                bar.update()
        out[name] = {"rms_error": errors, "update_rms": update_rms}
    if bar is not None:
        bar.close()
    return out


def _depths(layers: int) -> list[int]:
    d, out = 1, []
    while d < layers:
        out.append(d)
        d *= 2
    return out + [layers]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="echo-vllm demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", "-p", type=count(2, MAX_RANKS, RANKS_WHY + "; each is a process here"),
                    default=4, help=f"gloo processes (TP ranks), 2..{MAX_RANKS}")
    ap.add_argument("--layers", "-l", type=count(1, 128, "the depths shown double up to 128"), default=64,
                    help="all-reduce calls (1..128)")
    ap.add_argument("--tokens", type=count(1, 1 << 16), default=64, help="rows per call (tokens x hidden <= 2^22)")
    ap.add_argument("--hidden", type=count(1, 1 << 16), default=1024, help="values per row")
    ap.add_argument("--seed", type=count(0, MAX_TOOL_SEED, SEED_WHY), default=0)
    ap.add_argument("--out", type=out_dir, default="out/demo", help="folder for demo.json and demo.png")
    args = ap.parse_args(argv)
    if args.tokens * args.hidden > MAX_DEMO_VALUES:
        ap.error(f"--tokens {args.tokens} x --hidden {args.hidden} = {args.tokens * args.hidden} values per call: "
                 f"at most {MAX_DEMO_VALUES} (rank 0 keeps an fp64 copy of every rank's partials per layer)")
    check_names(args.out, OUTPUTS)

    t0 = time.time()
    results = run_processes(
        _rank_main, args.world_size, args.layers, args.tokens, args.hidden, args.seed
    )[0]
    elapsed = time.time() - t0

    cfg = MODES["Echo"]
    lay = WireLayout(args.tokens * args.hidden, args.world_size, cfg.group_size, args.hidden)
    unit = sum(results["exact 16-bit"]["update_rms"]) / args.layers
    print(f"\nresidual-stream error after each all-reduce, P={args.world_size}, "
          f"{args.tokens}x{args.hidden} bf16 per call")
    print("error = RMS(residual - fp64 reference) / RMS(one layer's exact output)\n")
    names = list(MODES)
    print(f"{'depth':>6} " + " ".join(f"{n:>14}" for n in names))
    for d in _depths(args.layers):
        row = [results[n]["rms_error"][d - 1] / unit for n in names]
        note = "  <- exact last call" if d == args.layers else ""
        print(f"{d:>6} " + " ".join(f"{v:>14.5f}" for v in row) + note)
    naive, echo = results["naive 4-bit"]["rms_error"], results["Echo"]["rms_error"]
    last_q = args.layers - 2 if args.layers > 1 else 0
    print(f"\ngrowth from depth 1 to {last_q + 1}: naive 4-bit x{naive[last_q] / naive[0]:.2f}, "
          f"Echo x{max(echo[: last_q + 1]) / echo[0]:.2f} (max over depths)")
    print(f"wire bytes per call and rank: 16-bit ring {lay.ring_bytes_per_rank(2):,}, "
          f"Echo {lay.wire_bytes_per_rank:,} ({cfg.wire_bits_per_value:g} bit/value, "
          f"{lay.wire_bytes_per_rank / lay.ring_bytes_per_rank(2):.3f}x)")

    os.makedirs(args.out, exist_ok=True)
    summary = {
        "world_size": args.world_size, "layers": args.layers, "tokens": args.tokens,
        "hidden": args.hidden, "seed": args.seed, "seconds": elapsed,
        "wire_bytes_per_call": {"16bit": lay.ring_bytes_per_rank(2), "echo": lay.wire_bytes_per_rank},
        "bits_per_value": {"16bit": 16, "echo": cfg.wire_bits_per_value},
        "relative_error": {n: [e / unit for e in results[n]["rms_error"]] for n in names},
    }
    write_json(os.path.join(args.out, "demo.json"), summary, indent=1)
    png = os.path.join(args.out, "demo.png")
    if _plot(summary, png):
        print(f"wrote {args.out}/demo.json and {png} ({elapsed:.1f} s)")
    else:
        print(f"wrote {args.out}/demo.json ({elapsed:.1f} s); no PNG: matplotlib is not installed "
              "(pip install 'echo-vllm[eval]')")
    return 0


def _plot(summary: dict, path: str) -> bool:
    """Write the PNG; False if matplotlib (the [eval] extra) is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, errs in summary["relative_error"].items():
        ax.plot(range(1, len(errs) + 1), errs, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("depth (all-reduce calls into the residual stream)")
    ax.set_ylabel("residual error / one layer's output (RMS)")
    ax.set_title(f"P={summary['world_size']} ranks, {summary['tokens']}x{summary['hidden']} per call")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
