"""``echo-vllm bench <kernels|fused|norm|allreduce> [options]``.

* ``kernels``: one GPU; every stage kernel for P virtual ranks at sizes up
  to 1 GiB, achieved bytes/s against a measured copy, and a labelled
  projection of the all-reduce speedup on stated links.
* ``fused``: one GPU; the fused kernel's phases, its P ranks emulated in
  one launch, and the stage kernels against their memory roofline and a
  speed-of-light kernel of the same byte mix.
* ``norm``: one GPU; Echo with the residual add and RMSNorm fused into
  its output phase against Echo then the norm, each phase against its
  roofline, and a labelled projection of the time to first token.
* ``allreduce``: 16-bit vs naive 4-bit vs Echo; NCCL under torchrun on N
  GPUs, gloo processes on CPU (``--backend gloo --world-size 4``); on one
  GPU without torchrun it prints the kernel table.
* ``link``: 16-bit vs Echo over a real, shaped link on one machine (root):
  hosts as network namespaces, tc shaping, background flows, the TP model's
  prefill and training step, faults.

Each prints its tables and, with ``--out DIR``, writes a JSON file (and,
except ``fused``, PNG plots).
"""

from __future__ import annotations

import argparse
import sys

from . import allreduce_bench, fused_bench, kernels_bench, link_bench, norm_bench


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="echo-vllm bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    kernels_bench.add_arguments(sub.add_parser("kernels", help="per-kernel times on one GPU + projection"))
    fused_bench.add_arguments(sub.add_parser("fused", help="the fused kernel vs its roofline on one GPU",
                                             description=fused_bench.__doc__,
                                             formatter_class=argparse.RawDescriptionHelpFormatter))
    norm_bench.add_arguments(sub.add_parser("norm", help="Echo + add + RMSNorm fused vs unfused on one GPU",
                                            description=norm_bench.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    allreduce_bench.add_arguments(sub.add_parser("allreduce", help="all-reduce: NCCL (torchrun) or gloo (CPU)"))
    link_bench.add_arguments(sub.add_parser("link", help="16-bit vs Echo over a shaped link between network namespaces",
                                            description=link_bench.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.what == "kernels":
        return kernels_bench.run(args)
    if args.what == "fused":
        return fused_bench.run(args)
    if args.what == "norm":
        return norm_bench.run(args)
    if args.what == "link":
        args.argv = argv[1:]  # the command as given, printed and kept in the JSON
        return link_bench.run(args)
    return allreduce_bench.run(args)
