"""Error-vs-depth probe on a real model: the real-model counterpart of the demo.

For real prompts (windows of Shakespeare, LAMBADA passages), run the model
with the exact 16-bit sum of the P partials and with each variant, and
measure the residual stream after the embedding and after every decoder
layer: relative error ``|h_variant - h_exact| / |h_exact|`` per token,
averaged over tokens (and the Frobenius ratio over all tokens). Naive 4-bit
should grow with depth (independent errors add up); Echo should stay flat
at about one call's error (the carried errors telescope), and drop to the
nonlinear residue at the end with the exact last call.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..cli_args import device, file_stem, out_dir
from ..postnorm_policy import POSTNORM_POLICIES
from ..corpora import text_file
from .hf_emulation import HFEmulation, find_backbone
from .models import default_emulate_tp, model_arg, require_device, resolve_model, tp_size_arg
from .perplexity import (DTYPES, LAMBADA, SEQ_LEN, TOKENS, comm_dtype_for, lambada_set, load_hf_model, missing_text,
                         text_windows)
from .report import check_outputs, markdown_table, pyplot, save_figure, write_outputs
from .variants import parse_variant, parse_variants, variant_arg


@torch.no_grad()
def residual_streams(model, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Residual stream [B, T, H] (fp32) after the embedding and after each layer."""
    backbone = find_backbone(model)
    taps: list[torch.Tensor] = []

    def grab(_m, _a, out):
        h = out[0] if isinstance(out, tuple) else out
        taps.append(h.detach().float().clone())

    handles = [backbone.embed_tokens.register_forward_hook(grab)]
    handles += [layer.register_forward_hook(grab) for layer in backbone.layers]
    try:
        model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return taps


def relative_errors(ref: list[torch.Tensor], got: list[torch.Tensor], mask: torch.Tensor) -> tuple[list, list]:
    """Per depth: mean over real tokens of |d|/|h| per token, and the
    Frobenius ratio over all real tokens."""
    m = mask.bool()
    per_token, frob = [], []
    for a, b in zip(ref, got):
        a, b = a[m], b[m]
        d = (b - a).norm(dim=-1)
        n = a.norm(dim=-1).clamp_min(1e-30)
        per_token.append((d / n).mean().item())
        frob.append((d.square().sum().sqrt() / n.square().sum().sqrt()).item())
    return per_token, frob


def run(args) -> dict:
    path = resolve_model(args.model)
    world = args.tp or default_emulate_tp(args.model)
    model, tok = load_hf_model(path, args.dtype, args.device)
    ts = text_windows(tok, args.text, args.tokens, args.seq_len) if args.text else lambada_set(tok, args.lambada)
    seqs = ts.sequences
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, s in enumerate(seqs):
        ids[k, : len(s)] = torch.tensor(s)
        mask[k, : len(s)] = 1
    exact = parse_variant("exact")
    with HFEmulation(model, world, exact.mode, exact.config, comm_dtype=comm_dtype_for(model)):
        ref = residual_streams(model, ids, mask)
    curves = {}
    for v in parse_variants(args.variants):
        with HFEmulation(model, world, v.mode, v.config, comm_dtype=comm_dtype_for(model),
                          postnorm_policy=args.postnorm):
            got = residual_streams(model, ids, mask)
        per_token, frob = relative_errors(ref, got, mask)
        curves[v.name] = {"per_token": per_token, "frobenius": frob}
        print(f"[depth] {v.name}: final-layer rel err {per_token[-1]:.4g}", file=sys.stderr)
    result = {
        "model": str(args.model), "world_size": world, "dtype": args.dtype, "text": ts.name,
        "tokens": int(mask.sum()), "depths": ["embed"] + [f"layer {i}" for i in range(len(ref) - 1)],
        "curves": curves,
    }
    rows = []
    for i, d in enumerate(result["depths"]):
        rows.append({"depth": d, **{n: c["per_token"][i] for n, c in curves.items()}})
    md = (f"### Residual-stream relative error vs depth: {args.model}, emulated TP={world}, "
          f"{result['tokens']} tokens of {ts.name}\n\n"
          + markdown_table(rows, [("depth", "after")] + [(n, n) for n in curves]))
    paths = write_outputs(args.out, args.stem, result, md)
    plot(result, paths["json"].with_suffix(".png"))
    print(md)
    return result


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    x = list(range(len(result["depths"])))
    for name, c in result["curves"].items():
        ax.plot(x, c["per_token"], marker=".", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("residual stream after (0 = embedding, k = layer k-1)")
    ax.set_ylabel("relative error vs exact (mean over tokens)")
    ax.set_title(f"{result['model']}, emulated TP={result['world_size']}, {result['tokens']} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="echo-vllm eval depth", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=model_arg, default="smollm2-135m")
    p.add_argument("--tp", type=tp_size_arg, default=0)
    p.add_argument("--variants", nargs="+", type=variant_arg, default=["naive", "echo", "echo+hadamard+last"])
    p.add_argument("--text", default="hamlet", help="play name or path ('' to use --lambada)")
    p.add_argument("--tokens", type=TOKENS, default=2048)
    p.add_argument("--seq-len", type=SEQ_LEN, default=512)
    p.add_argument("--lambada", type=LAMBADA, default=None, help="with --text '': passages to measure (default 32)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--device", type=device(), default="cpu", help="torch device (cuda on a GPU host)")
    p.add_argument("--postnorm", default="no-feedback", choices=POSTNORM_POLICIES)
    p.add_argument("--out", type=out_dir, default="eval_results")
    p.add_argument("--stem", type=file_stem, default="depth")
    args = p.parse_args(argv)
    if args.text and args.lambada is not None:  # one set is measured: the text, the passages dropped without a word
        p.error(f"--lambada {args.lambada}: read only with --text '' (--text {args.text} is measured instead)")
    args.lambada = 32 if args.lambada is None else args.lambada
    if not args.text and not args.lambada:
        p.error("nothing to measure: --text '' needs --lambada N (N >= 1)")
    if args.text and missing_text(args.text):
        p.error(missing_text(args.text))
    parse_variants(args.variants)  # duplicates: one line, before any model loads
    require_device(args.device)
    check_outputs(args)
    if args.text:  # an unknown play: refused before the model loads
        text_file(args.text)
    run(args)
    return 0
