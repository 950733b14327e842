#!/usr/bin/env python3
"""Experiment: the one-shot error of each 4-bit encoder, and of signed_mse's clip sets.

Quantizes, once and without carried error, what stage 1 and stage 2 of
Echo quantize -- each rank's rotated partial output (``u`` of
``quant.stage1_reference``) and the rotated exact sum of the P partials
(what stage 2 requantizes, without the stage-1 error) -- of every
all-reduce of one forward pass of a real model under emulated TP (the HF
emulation's recorded partials), and the same for Gaussian data. For
``absmax`` and for ``signed_mse`` with each clip set it prints the
relative MSE (sum of squared errors over sum of squares) and the
relative RMS error (its square root), pooled over the calls and as the
mean over calls, and the share of groups that keep each clip ratio.

    python scripts/experiments/encoder_clips.py --model smollm2-135m --tp 3 --tokens 512 \\
        --clips 1 8/7,1 8/7,1,0.95 8/7,1,0.95,0.9,0.85,0.8,0.75,0.7 --json /tmp/clips.json

Each set replaces ``quant.SIGNED_MSE_CLIPS`` for its run (the reference
quantizer, the specification of every backend).
"""

from __future__ import annotations

import argparse
import contextlib
import fractions
import json
import os
import sys

import torch

from echo_vllm import quant
from echo_vllm.quant import WireLayout, input_scale, to_wire_order
from echo_vllm.rotation import fwht


def _clip_set(text: str) -> tuple[float, ...]:
    try:
        clips = tuple(float(fractions.Fraction(c)) for c in text.split(","))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated ratios, e.g. 8/7,1,0.95") from None
    if not clips or any(not 0 < c <= 8 / 7 for c in clips):
        raise argparse.ArgumentTypeError(f"{text!r}: ratios in (0, 8/7]")
    return clips


def rotated(x: torch.Tensor, world_size: int, g: int) -> torch.Tensor:
    """``[R, rows, cols]`` -> the groups ``[R, G, g]`` stage 1 quantizes (no carried error)."""
    r, rows, cols = x.shape
    lay = WireLayout(rows * cols, world_size, g, cols)
    u = to_wire_order(x.reshape(r, -1).float(), lay) * input_scale(g, True)
    return fwht(u.reshape(r, -1, g))


@contextlib.contextmanager
def clip_set(clips: tuple[float, ...]):
    """``quant.SIGNED_MSE_CLIPS`` replaced by ``clips`` inside the block."""
    saved, quant.SIGNED_MSE_CLIPS = quant.SIGNED_MSE_CLIPS, clips
    try:
        yield
    finally:
        quant.SIGNED_MSE_CLIPS = saved


def errors(u: torch.Tensor, encoder: str, clips: tuple[float, ...] = (1.0,)) -> tuple[float, float, list[int]]:
    """``(sum of squared errors, sum of squares, groups keeping each clip)``
    of quantizing the groups ``u [..., G, g]`` once (a group counts for the
    first clip whose scale it has)."""
    with clip_set(clips):
        _, scales, err = quant.quantize_groups(u, 7, encoder=encoder)
        mults = quant.clip_multipliers()
    kept = [0] * len(clips)
    if encoder == "signed_mse":
        amax, chosen = u.abs().amax(-1), scales.float().abs()
        left = torch.ones_like(chosen, dtype=torch.bool)
        for k, m in enumerate(mults):
            hit = left & (chosen == quant._bf16_scale(amax * m).float())
            kept[k], left = int(hit.sum()), left & ~hit
    return float((err.double() ** 2).sum()), float((u.double() ** 2).sum()), kept


def model_partials(model: str, tp: int, tokens: int, text: str) -> list[torch.Tensor]:
    """The P partials ``[P, tokens, hidden]`` of every all-reduce of one
    forward pass over the first ``tokens`` tokens of ``text``."""
    from echo_vllm.corpora import load_text
    from echo_vllm.eval.hf_emulation import HFEmulation
    from echo_vllm.eval.models import resolve_model
    from echo_vllm.eval.perplexity import load_hf_model

    hf, tok = load_hf_model(resolve_model(model))
    ids = tok(load_text(text)).input_ids[:tokens]
    with torch.no_grad(), HFEmulation(hf, tp, mode="exact", record=True) as emu:
        hf(torch.tensor([ids]))
    return [r.partials.reshape(tp, len(ids), -1) for r in emu.records]


def study(sources: dict[str, list[torch.Tensor]], tp: int, g: int, sets: list[tuple[float, ...]]) -> list[dict]:
    rows = []
    for name, calls in sources.items():
        for stage in ("stage 1", "stage 2"):
            us = [rotated(x if stage == "stage 1" else x.float().sum(0, keepdim=True), tp, g) for x in calls]
            for encoder, clips in [("absmax", (1.0,))] + [("signed_mse", c) for c in sets]:
                per_call, num, den, kept = [], 0.0, 0.0, [0] * len(clips)
                for u in us:
                    e, s, k = errors(u, encoder, clips)
                    per_call.append(e / s)
                    num, den = num + e, den + s
                    kept = [a + b for a, b in zip(kept, k)]
                groups = sum(u.numel() // g for u in us)
                rows.append({"data": name, "stage": stage, "encoder": encoder,
                             "clips": list(clips) if encoder == "signed_mse" else None,
                             "rel_mse_pooled": num / den, "rel_mse_mean": sum(per_call) / len(per_call),
                             "rel_mse_per_call": per_call,
                             "kept_share": [k / groups for k in kept] if encoder == "signed_mse" else None})
                r = rows[-1]
                label = encoder if encoder == "absmax" else f"signed_mse {','.join(f'{c:.4g}' for c in clips)}"
                shares = "" if r["kept_share"] is None else " kept " + " ".join(f"{s:.2f}" for s in r["kept_share"])
                print(f"{name:<10} {stage:<8} {label:<40} rel MSE pooled {r['rel_mse_pooled']:.5f} "
                      f"(RMS {r['rel_mse_pooled'] ** 0.5:.4f})  mean over calls {r['rel_mse_mean']:.5f} "
                      f"(RMS {r['rel_mse_mean'] ** 0.5:.4f}){shares}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a model of `echo-vllm eval` (or a local HF folder)")
    ap.add_argument("--tp", type=int, default=3, help="emulated TP size (default 3)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens of the text in the forward pass (default 512)")
    ap.add_argument("--text", default="hamlet", help="held-out text (default hamlet)")
    ap.add_argument("--gaussian-groups", type=int, default=1 << 16, help="Gaussian groups per rank (default 65536)")
    ap.add_argument("--clips", type=_clip_set, nargs="+", default=[quant.SIGNED_MSE_CLIPS],
                    help="clip sets of signed_mse to compare, each comma-separated (default the shipped set)")
    ap.add_argument("--no-model", action="store_true", help="Gaussian data only")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--cache", help="keep the model's partials in this file (read back when it exists)")
    args = ap.parse_args(argv)
    g = 32
    gen = torch.Generator().manual_seed(0)
    cols = args.tp * g * 8
    sources = {"gaussian": [torch.randn(args.tp, args.gaussian_groups // 8, cols, generator=gen).to(torch.bfloat16)]}
    if not args.no_model:
        if args.cache and os.path.exists(args.cache):
            sources[args.model] = torch.load(args.cache)
        else:
            sources[args.model] = model_partials(args.model, args.tp, args.tokens, args.text)
            if args.cache:
                torch.save(sources[args.model], args.cache)
    rows = study(sources, args.tp, g, args.clips)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
