"""``echo-vllm eval ttft``: time to first token and inter-token latency.

Measures a running OpenAI-compatible server (``echo-vllm serve``) with vLLM's
own serving benchmark (``vllm bench serve``, random prompts of a set length,
``--max-concurrency`` clients) over a grid of prompt lengths x concurrency,
and records TTFT / ITL / TPOT percentiles per cell under a label (the
server's comm mode). Two ways to compare exact and Echo:

* run the command once per server with ``--label exact`` / ``--label echo``
  into the same ``--out``, then ``--report`` merges every label there;
* or give ``--launch 'echo-vllm serve MODEL --tp-comm {mode} ...'`` and
  ``--labels exact echo``: the harness starts the server per label
  (``{mode}`` replaced; ``{mode_args}`` by that label's ``--mode-args``),
  waits for ``/health``, measures, and stops it.

``--background-traffic DUTY`` keeps the same GPUs' interconnect busy with
NCCL all-reduces at that duty cycle while measuring (``echo_vllm.eval.background``).

On one GPU the server can only *emulate* TP: every all-reduce is an
in-process sum plus Echo's extra kernels, with no link to save time on. The
harness still runs there (it tests the pipeline and shows the emulation's
overhead) and says that its times show no communication savings.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..cli_args import UsageError, count, counts, did_you_mean, file_stem, http_url, out_dir, real
from ..outputs import check_names, write_json
from ..server.credentials import scrub
from .background import BackgroundTraffic, TrafficSpec
from .report import markdown_table, output_names, pyplot, read_json, save_figure, write_outputs

ONE_GPU_NOTE = (
    "ONE GPU: tensor parallelism is emulated in-process; these times include the emulation's "
    "extra work and show NO communication savings. Echo's TTFT gain needs >= 2 GPUs and real links."
)

#: Prompts per cell when ``--num-prompts`` is not given (more where the concurrency is higher).
DEFAULT_PROMPTS = 16

METRICS = ["mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p50_itl_ms", "p99_itl_ms",
           "mean_tpot_ms", "request_throughput", "output_throughput", "completed"]


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def served_model(base_url: str) -> str:
    """The first model ``base_url``'s ``/v1/models`` lists; a server that does
    not answer it, or answers something else, raises :class:`UsageError`."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return str(json.loads(r.read())["data"][0]["id"])
    except urllib.error.HTTPError as e:
        problem = f"HTTP {e.code}"
    except (OSError, ValueError) as e:  # no answer in 10 s, a reset connection, not JSON
        problem = str(getattr(e, "reason", "")) or type(e).__name__
    except (KeyError, IndexError, TypeError):
        problem = "no model listed"
    raise UsageError(f"{url}: {problem} (give the served name with --model)")


#: Seconds between "still waiting" lines while a server starts.
PROGRESS_EVERY_S = 30.0


def _health_problem(url: str) -> tuple[bool, str]:
    """``(healthy, what went wrong)`` of one ``GET url``; the text names a
    refused connection, an unknown host or the HTTP status."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200, f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, ConnectionRefusedError):
            return False, "connection refused"
        if isinstance(reason, socket.gaierror):
            return False, f"unknown host ({reason.strerror})"
        return False, str(reason)
    except (OSError, ValueError) as e:  # a reset connection, a timeout, a malformed answer
        return False, type(e).__name__


def wait_for_server(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 log=lambda s: print(s, file=sys.stderr, flush=True)) -> float:
    """Wait until ``base_url``'s ``/health`` answers 200; returns the
    seconds waited. Without a server ``proc`` of ours (measuring one that
    should already run) a refused connection or an unknown host fails at
    once, naming it; while ours starts, a line every
    :data:`PROGRESS_EVERY_S` says how long and what the last answer was."""
    url = base_url.rstrip("/") + "/health"
    t0 = time.monotonic()
    next_line = t0 + PROGRESS_EVERY_S
    while True:
        if proc is not None and proc.poll() is not None:
            raise UsageError(f"the server (--launch) exited with {proc.returncode} before {url} answered")
        healthy, problem = _health_problem(url)
        waited = time.monotonic() - t0
        if healthy:
            return waited
        if proc is None and (problem == "connection refused" or problem.startswith("unknown host")):
            raise UsageError(f"{url}: {problem}: no server there (start it, or give --launch to start one)")
        if waited >= timeout_s:
            raise UsageError(f"{url} not healthy after {timeout_s:.0f} s (last answer: {problem})")
        if time.monotonic() >= next_line:
            log(f"[ttft] waiting for {url}: {waited:.0f} s of {timeout_s:.0f} (last answer: {problem})")
            next_line += PROGRESS_EVERY_S
        time.sleep(min(2.0, max(0.0, timeout_s - waited)))


def cell_seed(input_len: int, concurrency: int) -> int:
    """Prompt seed of one cell: the same in every label (paired comparison),
    different between cells, so that one cell's prompts are not already in
    the prefix cache from another's (start servers with
    ``--no-enable-prefix-caching`` as well: the warm-up requests repeat the
    measured prompts)."""
    return 1000 * input_len + concurrency


def bench_cell(args, model: str, tokenizer: str, input_len: int, concurrency: int, out_dir: Path) -> dict:
    """One ``vllm bench serve`` run; returns its metrics."""
    fname = f"raw_{args.label}_in{input_len}_c{concurrency}.json"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm", "--base-url", args.base_url, "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(args.num_prompts or max(DEFAULT_PROMPTS, concurrency)),
        "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--ignore-eos", "--seed", str(cell_seed(input_len, concurrency)),
        "--num-warmups", str(args.warmups),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", fname, "--disable-tqdm",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout)
    except subprocess.TimeoutExpired:  # a server that is healthy but stopped answering: vLLM's client waits hours
        raise UsageError(f"vllm bench serve at {input_len} prompt tokens, {concurrency} clients did not end within "
                         f"{args.cell_timeout:.0f} s (--cell-timeout): is {args.base_url} still answering?") from None
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    raw = json.loads((out_dir / fname).read_text())
    return {k: raw.get(k) for k in METRICS}


def measure(args, label: str) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or served_model(args.base_url)
    tokenizer = args.tokenizer or model
    cells = []
    from tqdm import tqdm

    grid = [(L, c) for L in args.input_lens for c in args.concurrency]
    for L, c in tqdm(grid, desc=f"ttft[{label}]", unit="cell", file=sys.stderr):
        cells.append({"label": label, "input_len": L, "concurrency": c,
                      **bench_cell(args, model, tokenizer, L, c, out_dir)})
    return {"label": label, "model": model, "cells": cells}


def parse_mode_args(items: list[str]) -> dict[str, str]:
    """``LABEL=ARGS`` items of ``--mode-args`` -> {label: args}."""
    out = {}
    for item in items:
        label, sep, rest = item.partition("=")
        if not sep or not label:
            raise ValueError(f"--mode-args wants LABEL=ARGS, got {item!r}")
        if label in out:  # the ARGS may hold a key: not shown
            raise ValueError(f"--mode-args: label {label!r} is given twice")
        out[label] = rest
    return out


def shown_command(words: list[str]) -> str:
    """Command line ``words`` as printed: no key shows (``credentials.scrub``)."""
    return shlex.join(scrub(words))


def launch_arg(text: str) -> str:
    """argparse type of ``--launch``: a command line shlex can split, whose
    program (first word) is on PATH or a path to an executable."""
    try:
        words = shlex.split(text)
    except ValueError as e:  # the text itself may hold a key: not shown
        raise argparse.ArgumentTypeError(f"not a command line ({e})") from None
    if not words:
        raise argparse.ArgumentTypeError("'': expected the server's command line")
    if shutil.which(words[0]) is None:
        raise argparse.ArgumentTypeError(f"{shown_command(words[:1])}: no such program (the first word of "
                                         "--launch: a command on PATH or the path of an executable)")
    return text


def launch_command(template: str, label: str, mode_args: dict[str, str]) -> str:
    """The server command for one label: ``{mode}`` becomes the label and
    ``{mode_args}`` the label's ``--mode-args`` (empty when it has none), so
    one template can start e.g. an emulated server whose exact label only
    differs by ``--echo-min-bytes``."""
    return template.replace("{mode_args}", mode_args.get(label, "")).replace("{mode}", label)


def run_label(args, label: str) -> dict:
    args.label = label
    server = None
    if args.launch:
        cmd = shlex.split(launch_command(args.launch, label, args.mode_args))
        print(f"[ttft] starting: {shown_command(cmd)}", file=sys.stderr)
        server = subprocess.Popen(cmd)
    try:
        wait_for_server(args.base_url, args.server_timeout, server)
        if args.background_traffic:
            gpus = tuple(args.bg_gpus) if args.bg_gpus else tuple(range(max(gpu_count(), 1)))
            spec = TrafficSpec(args.background_traffic, args.bg_period_ms, args.bg_mib, gpus)
            with BackgroundTraffic(spec):
                res = measure(args, label)
            res["background"] = spec.__dict__
        else:
            res = measure(args, label)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    res["gpus"] = gpu_count()
    write_json(Path(args.out, label_file(label)), res, indent=2)
    return res


def label_file(label: str) -> str:
    """The results of one label's server (``ttft_<label>.json``) in ``--out``."""
    return f"ttft_{label}.json"


RAW_NAME = re.compile(r"raw_(?P<label>.+)_in(?P<input_len>\d+)_c(?P<concurrency>\d+)\.json$")


def runs_from_raw(out: Path, covered: set[tuple[str, int, int]]) -> list[dict]:
    """Runs rebuilt from ``vllm bench serve``'s own result files for cells no
    ``ttft_<label>.json`` holds: a measurement stopped midway (a wall-clock
    limit, a crashed server) still reports every cell it finished. The GPU
    count of such a run is unknown (0: reported as one GPU)."""
    by_label: dict[str, dict] = {}
    for path in sorted(out.glob("raw_*_in*_c*.json")):
        m = RAW_NAME.match(path.name)
        if not m:
            continue
        key = (m["label"], int(m["input_len"]), int(m["concurrency"]))
        if key in covered:
            continue
        raw = read_json(path)
        run = by_label.setdefault(key[0], {"label": key[0], "model": raw.get("model_id"), "cells": [],
                                           "gpus": 0, "from_raw": True})
        run["cells"].append({"label": key[0], "input_len": key[1], "concurrency": key[2],
                             **{k: raw.get(k) for k in METRICS}})
    return list(by_label.values())


#: What every cell of a ``ttft_<label>.json`` holds (the report's keys).
CELL_KEYS = ("label", "input_len", "concurrency", "mean_ttft_ms")


def read_run(path: Path) -> dict:
    """One label's run as :func:`run_label` wrote it; :class:`UsageError`
    naming the file when it is not one."""
    run = read_json(path, ("label", "model", "cells"))
    cells = run["cells"]
    if not isinstance(cells, list) or not all(isinstance(c, dict) and all(k in c for k in CELL_KEYS) for c in cells):
        raise UsageError(f"{path}: 'cells' is not a list of cells with {', '.join(CELL_KEYS)}")
    return run


def report(out: str, baseline: str = "exact") -> dict:
    runs = [read_run(p) for p in sorted(Path(out).glob("ttft_*.json"))]
    covered = {(c["label"], c["input_len"], c["concurrency"]) for r in runs for c in r["cells"]}
    runs += runs_from_raw(Path(out), covered)
    if not runs:
        raise UsageError(f"no ttft_*.json or raw_*.json in {out}")
    base = {(c["input_len"], c["concurrency"]): c for r in runs if r["label"] == baseline for c in r["cells"]}
    rows = []
    for r in runs:
        for c in r["cells"]:
            b = base.get((c["input_len"], c["concurrency"]))
            speed = (b["mean_ttft_ms"] / c["mean_ttft_ms"]) if b and c["label"] != baseline and c["mean_ttft_ms"] else None
            rows.append({**c, "ttft_speedup": speed})
    rows.sort(key=lambda x: (x["input_len"], x["concurrency"], x["label"]))
    gpus = max(r.get("gpus", 0) for r in runs)
    note = ONE_GPU_NOTE if gpus <= 1 else f"{gpus} GPUs."
    bg = next((r.get("background") for r in runs if r.get("background")), None)
    cols = [("input_len", "prompt tokens"), ("concurrency", "clients"), ("label", "mode"),
            ("mean_ttft_ms", "TTFT mean ms"), ("p50_ttft_ms", "p50"), ("p99_ttft_ms", "p99"),
            ("mean_itl_ms", "ITL mean ms"), ("p99_itl_ms", "ITL p99"), ("ttft_speedup", f"TTFT x vs {baseline}")]
    md = "\n".join([f"### TTFT / ITL: {runs[0]['model']}", "", f"**{note}**", "",
                    f"Background traffic: {bg}" if bg else "Background traffic: none", "",
                    markdown_table(rows, cols)])
    result = {"runs": runs, "rows": rows, "note": note}
    paths = write_outputs(out, "ttft", result, md)
    _plot(rows, paths["json"].with_suffix(".png"), note)
    print(md)
    return result


def _plot(rows, path, note) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (label, conc) in sorted({(r["label"], r["concurrency"]) for r in rows}):
        pts = sorted((r["input_len"], r["mean_ttft_ms"]) for r in rows if r["label"] == label and r["concurrency"] == conc)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{label}, {conc} clients")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title(note if len(note) < 60 else "one GPU: emulation overhead, not a speed-up", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="echo-vllm eval ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", type=http_url, default="http://127.0.0.1:8000")
    p.add_argument("--label", type=file_stem, default=None, help="comm mode of the running server (exact, echo, ...)")
    p.add_argument("--labels", type=file_stem, nargs="+", default=None, help="with --launch: one server per label")
    p.add_argument("--launch", type=launch_arg, default=None, help="server command with {mode}; started per label")
    p.add_argument("--mode-args", nargs="*", default=[], metavar="LABEL=ARGS",
                   help="with --launch: text put in place of {mode_args} for that label")
    p.add_argument("--server-timeout", type=real(0, 86400, low_open=True, why="seconds, at most a day"), default=900)
    p.add_argument("--cell-timeout", type=real(0, 86400, low_open=True, why="seconds, at most a day"), default=1800,
                   help="seconds one cell's vllm bench serve may take")
    p.add_argument("--model", default=None, help="served model name (default: asked from /v1/models)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer path (default: the served name)")
    p.add_argument("--input-lens", type=count(1, 1 << 20), nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--concurrency", type=count(1, 1 << 12), nargs="+", default=[1, 8])
    p.add_argument("--output-len", type=count(1, 1 << 16), default=32)
    p.add_argument("--num-prompts", type=count(1, 1 << 20), default=None,
                   help=f"prompts per cell, at least each --concurrency (default: {DEFAULT_PROMPTS}, or the "
                        "concurrency if larger)")
    p.add_argument("--warmups", type=count(0, 1 << 12), default=2)
    p.add_argument("--background-traffic", type=real(0, 1), default=0.0, metavar="DUTY",
                   help="NCCL all-reduce traffic on the same GPUs at this duty cycle (0-1)")
    p.add_argument("--bg-gpus", type=counts(0, 1023), default=None,
                   help="comma-separated GPU ids for the traffic (default: all)")
    p.add_argument("--bg-period-ms", type=real(0, 1e5, low_open=True), default=100.0)
    p.add_argument("--bg-mib", type=count(1, 1 << 16), default=256)
    p.add_argument("--report", action="store_true", help="only merge ttft_*.json in --out into a table")
    p.add_argument("--baseline", type=file_stem, default="exact")
    p.add_argument("--out", type=out_dir, default="eval_results/ttft")
    return p


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        args.mode_args = parse_mode_args(args.mode_args)
    except ValueError as e:
        p.error(str(e))
    if gpu_count() <= 1:
        print(f"[echo-vllm] {ONE_GPU_NOTE}", file=sys.stderr)
    if not args.report:
        labels = args.labels or [args.label or "server"]
        if len(labels) > 1 and not args.launch:
            p.error("several --labels need --launch (one server per label)")
        if len(labels) > 1 and "{mode" not in args.launch:
            p.error(f"--launch {shown_command(shlex.split(args.launch))} has no {{mode}} or {{mode_args}}: every "
                    "label would start the same server")
        if len(set(labels)) != len(labels):
            p.error(f"--labels {' '.join(labels)}: a label is given twice")
        for flag, values in (("--input-lens", args.input_lens), ("--concurrency", args.concurrency)):
            if len(set(values)) != len(values):  # its cells were measured twice, two table rows of one cell
                p.error(f"{flag} {' '.join(map(str, values))}: a value is given twice")
        if args.num_prompts is not None and args.num_prompts < max(args.concurrency):  # was raised without a word
            p.error(f"--num-prompts {args.num_prompts} is below --concurrency {max(args.concurrency)}: each client "
                    "needs a prompt (leave --num-prompts out to get the concurrency where it is higher)")
        for label in args.mode_args:  # a misspelt label would start its server without its ARGS
            if not args.launch or label not in labels:
                p.error(f"--mode-args {label}=...: " + (
                    "needs --launch (its text goes in place of {mode_args})" if not args.launch else
                    f"{label!r} is none of the labels ({', '.join(labels)}){did_you_mean(label, labels)}"))
    check_names(args.out, [*(() if args.report else map(label_file, labels)), *output_names("ttft")])
    if not args.report:
        for label in labels:
            run_label(args, label)
    report(args.out, args.baseline)
    return 0
