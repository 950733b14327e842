"""``echo-vllm eval accuracy``: lm-eval on the seven benchmarks, per variant.

Runs ``lm_eval.simple_evaluate`` once per communication variant on the local
task configs (``echo_vllm.eval.tasks``: lm-eval's own prompts and metrics)
through one of two backends:

* ``--backend vllm`` (GPU): lm-eval's vLLM backend; the variant reaches the
  echo-vllm plugin as ``additional_config`` (``tp_comm: echo``,
  ``tp_comm_emulate: P`` on one GPU, ``echo_<field>`` options). Each variant
  runs in its own subprocess so GPU memory and compile caches start clean.
* ``--backend hf`` (CPU or GPU): lm-eval's HF backend on a transformers
  model patched by :class:`~echo_vllm.eval.hf_emulation.HFEmulation`.

Writes per task acc / acc_norm with stderr, the average, the delta to exact,
and a paired comparison on the same documents (delta with its paired stderr
and the share of documents whose answer changed) -- the honest error bar for
"within x points of exact", much tighter than the unpaired stderrs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cli_args import MAX_RANKS, RANKS_WHY, UsageError, count, device, file_stem, out_dir, parse_int, real
from ..outputs import open_fresh, write_json
from ..postnorm_policy import POSTNORM_POLICIES
from .models import default_emulate_tp, model_arg, require_device, resolve_model, tp_size_arg
from .perplexity import DTYPES, comm_dtype_for, load_hf_model
from .report import check_outputs, markdown_table, pyplot, read_json, save_figure, write_outputs
from .tasks import SEVEN, local_name, task_manager
from .variants import Variant, parse_variants, variant_arg


def batch_size_arg(text: str) -> int | str:
    """argparse type of ``--batch-size``: lm-eval's ``auto`` or 1..4096."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        value = parse_int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'auto' or an integer from 1 to 4096")
    return value


_LIMIT = real(0, 1e9, low_open=True)


def limit_arg(text: str) -> float | int:
    """argparse type of ``--limit``: a fraction of each task below 1, else a
    whole number of documents (lm-eval would cut 2.5 to 2 silently)."""
    value = _LIMIT(text)
    if value >= 1 and value != int(value):
        raise argparse.ArgumentTypeError(f"{text}: a fraction of each task is below 1; from 1 up, a whole number "
                                         "of documents")
    return int(value) if value >= 1 else value


METRICS = ("acc", "acc_norm")


def primary_metric(task_result: dict) -> str:
    """acc_norm where the task defines it (length-normalised choice scores:
    ARC, HellaSwag, PIQA, OpenBookQA), acc otherwise (WinoGrande, BoolQ)."""
    return "acc_norm" if "acc_norm,none" in task_result else "acc"


def _evaluate(lm, tasks: list[str], limit, batch_size, bootstrap_iters: int) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=[local_name(t) for t in tasks],
        task_manager=task_manager(tasks),
        num_fewshot=0,
        limit=limit,
        batch_size=batch_size,
        log_samples=True,
        bootstrap_iters=bootstrap_iters,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def summarize(raw: dict, tasks: list[str]) -> dict:
    """Per task: metrics with stderr and per-document scores (for pairing)."""
    out = {}
    for t in tasks:
        res = raw["results"][local_name(t)]
        entry = {"primary": primary_metric(res)}
        for m in METRICS:
            if f"{m},none" in res:
                entry[m] = res[f"{m},none"]
                se = res.get(f"{m}_stderr,none")
                entry[f"{m}_stderr"] = se if isinstance(se, (int, float)) else None
        samples = sorted(raw.get("samples", {}).get(local_name(t), []), key=lambda s: s["doc_id"])
        entry["docs"] = {m: [float(s[m]) for s in samples if m in s] for m in METRICS}
        # log-likelihood of every answer choice (nats), for a paired
        # sensitivity measure that does not wait for an answer to flip
        entry["docs"]["loglik"] = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        entry["n"] = len(samples)
        out[t] = entry
    return out


def variant_file(args, name: str) -> Path:
    # letters, digits and "+-_." only: a spec's ":" "=" "," would make names
    # that shells need quoted and that the GPU host's file return refuses
    safe = "".join(c if c.isalnum() or c in "+-_." else "_" for c in name)
    return Path(args.out) / f"{args.stem}.variant.{safe}.json"


def log_files(args, n: int) -> list[str]:
    """The logs of ``--parallel``'s ``n`` engines in ``--out``."""
    return [f"{args.stem}.log.{k}.txt" for k in range(n)] if args.parallel else []


def save_variant(args, name: str, result: dict) -> None:
    path = variant_file(args, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"variant": name, "tasks_run": list(args.tasks), "limit": args.limit, "model": args.model,
            "backend": args.backend, "world_size": args.world, "real_tp": args.real_tp}
    write_json(path, {**meta, **result})


def load_variants(args, names: list[str] | None) -> dict:
    """Per-variant results saved in --out (all of them when ``names`` is None),
    plain or xz-compressed (``.json.xz``: how the recorded runs are kept).
    A file that is not a variant file is refused (:class:`UsageError`)."""
    out = {}
    paths = [*Path(args.out).glob(f"{args.stem}.variant.*.json"), *Path(args.out).glob(f"{args.stem}.variant.*.json.xz")]
    for path in sorted(paths):
        r = read_json(path, ("variant", "tasks", *MERGE_KEYS))
        if names is None or r["variant"] in names:
            out[r["variant"]] = r
    if names is not None:
        out = {n: out[n] for n in names if n in out}
    return out


#: What must agree between variant files before their scores are compared
#: document by document (a different --limit pairs different documents).
MERGE_KEYS = ("model", "backend", "world_size", "real_tp", "limit", "tasks_run")


def check_mergeable(results: dict) -> None:
    """Refuse to merge variant files from runs that measured different things."""
    first_name, first = next(iter(results.items()))
    for name, r in results.items():
        diff = [f"{k}: {r.get(k)!r} vs {first.get(k)!r}" for k in MERGE_KEYS if r.get(k) != first.get(k)]
        if diff:
            raise UsageError(f"cannot merge variant {name!r} with {first_name!r}, the runs differ in "
                             + "; ".join(diff))


def run_hf(args, variants: list[Variant], tasks: list[str]) -> dict:
    import torch
    from lm_eval.models.huggingface import HFLM

    from .hf_emulation import HFEmulation

    path = resolve_model(args.model)
    model, tok = load_hf_model(path, args.dtype, args.device)
    torch.manual_seed(0)
    results = {}
    for k, v in enumerate(variants):
        print(f"[accuracy] ({k + 1}/{len(variants)}) {v.name}: hf backend, emulated TP={args.world}",
              file=sys.stderr)
        t0 = time.time()
        if v.mode == "unsplit":
            emu = None
        else:
            emu = HFEmulation(model, args.world, v.mode, v.config, comm_dtype=comm_dtype_for(model),
                              postnorm_policy=args.postnorm).install()
        try:
            lm = HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch_size, max_length=args.max_length)
            raw = _evaluate(lm, tasks, args.limit, args.batch_size, args.bootstrap_iters)
        finally:
            if emu is not None:
                emu.remove()
        results[v.name] = {
            "tasks": summarize(raw, tasks),
            "seconds": time.time() - t0,
            "calls": emu.tp.comm.stats.snapshot()["calls"] if emu else {},
        }
        save_variant(args, v.name, results[v.name])
    return results


def vllm_model_args(args, v: Variant, path: Path) -> dict:
    """lm-eval's vLLM ``model_args``: the plugin reads the variant from
    ``additional_config``; real TP>1 also needs the all-reduce+RMSNorm
    fusion off (it would bypass the hook)."""
    emulate = args.world if args.real_tp <= 1 else 0
    margs = {
        "pretrained": str(path),
        "dtype": "bfloat16",
        "tensor_parallel_size": max(args.real_tp, 1),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_length,
        "seed": 0,
        "enforce_eager": args.enforce_eager,
    }
    extra = v.vllm_additional_config(emulate=emulate)
    if extra.get("tp_comm") == "echo":  # the plugin applies it on post-norm models only
        extra["tp_comm_postnorm"] = args.postnorm
    if extra:
        margs["additional_config"] = extra
    if args.kv_cache_gib:
        margs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    elif args.parallel:
        margs["kv_cache_memory_bytes"] = parallel_kv_cache_bytes(args.gpu_memory_utilization, _gpu_total_bytes())
    if args.real_tp > 1:
        margs["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    return margs


def run_vllm_one(args, v: Variant, tasks: list[str]) -> dict:
    """One variant in this process (the subprocess side of run_vllm)."""
    from lm_eval.models.vllm_causallms import VLLM

    path = resolve_model(args.model)
    margs = vllm_model_args(args, v, path)
    print(f"[accuracy] {v.name}: vLLM model_args {json.dumps(margs)}", file=sys.stderr)
    t0 = time.time()
    lm = VLLM(**margs, batch_size=args.batch_size)
    raw = _evaluate(lm, tasks, args.limit, args.batch_size, args.bootstrap_iters)
    return {"tasks": summarize(raw, tasks), "seconds": time.time() - t0, "model_args": margs}


#: KV cache per engine (GiB) when variants run side by side. vLLM sizes the
#: cache as its memory share minus what it sees in use after profiling, and
#: that reading includes the other engines' transient allocations: engines
#: started together got any size, none at all included. A fixed size
#: makes each start-up independent of the others; 8 GiB holds > 100 k tokens
#: of KV for the models here, far above lm-eval's batches of <= 2048-token
#: requests.
PARALLEL_KV_CACHE_GIB = 8.0


def parallel_kv_cache_bytes(share: float, gpu_total_bytes: int | None) -> int:
    """KV cache of one side-by-side engine: :data:`PARALLEL_KV_CACHE_GIB`, or
    half the engine's memory share where that is smaller (a 24 GB GPU split
    three ways has 6.4 GB a share, weights included)."""
    cap = int(PARALLEL_KV_CACHE_GIB * 2**30)
    if gpu_total_bytes:
        cap = min(cap, int(share * gpu_total_bytes / 2))
    return cap


def _gpu_total_bytes() -> int | None:
    try:
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    except Exception:  # no usable CUDA here: vLLM will say so itself
        return None


#: vLLM's start-up error when the memory share left no room for KV blocks.
KV_CACHE_OOM = "No available memory for the cache blocks"


def run_vllm(args, variants: list[Variant], tasks: list[str]) -> dict:
    """Each variant in its own subprocess (a fresh engine per comm config);
    with ``--parallel`` all at once on the same GPU, each with an equal share
    of ``--gpu-memory-utilization`` (start-up, ~1.5 min per engine, overlaps)."""
    n = len(variants)
    share = args.gpu_memory_utilization / n if args.parallel else args.gpu_memory_utilization
    results, procs = {}, []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    logs = [Path(args.out) / name for name in log_files(args, n)]
    with tempfile.TemporaryDirectory() as tmp:
        for k, v in enumerate(variants):
            out = Path(tmp) / f"{k}.json"
            cmd = [sys.executable, "-m", "echo_vllm.eval.accuracy", *args._argv, "--_one", v.name,
                   "--_out", str(out), "--gpu-memory-utilization", str(share)]
            print(f"[accuracy] ({k + 1}/{n}) {v.name}: vLLM backend in a subprocess", file=sys.stderr)
            log = open_fresh(logs[k]) if args.parallel else None
            proc = subprocess.Popen(cmd, env=os.environ.copy(), stdout=log, stderr=subprocess.STDOUT if log else None)
            procs.append((v, proc, out, log))
            if not args.parallel:
                proc.wait()
        failed = []
        for v, proc, out, log in procs:
            proc.wait()
            if log:
                log.close()
            if proc.returncode != 0 or not out.is_file():
                failed.append(f"{v.name} (exit {proc.returncode})")
                continue
            results[v.name] = json.loads(out.read_text())  # the child saved its variant file too
    if failed and args.parallel and any(
            KV_CACHE_OOM in p.read_text(errors="replace") for p in logs if p.is_file()):
        failed.append("hint: engines started side by side ran out of KV-cache memory; run fewer "
                      "variants per command (3 fit on an H200) or without --parallel")
    if failed:
        raise RuntimeError("vLLM run(s) failed: " + ", ".join(failed) +
                           (f"; logs in {args.out}/{args.stem}.log.*.txt" if args.parallel else ""))
    return results


def paired(exact_docs: list[float], docs: list[float]) -> dict | None:
    """Mean paired difference (points) with its stderr, and the share of
    documents whose score changed."""
    n = min(len(exact_docs), len(docs))
    if n < 2:
        return None
    d = [docs[i] - exact_docs[i] for i in range(n)]
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return {"delta": 100 * mean, "stderr": 100 * math.sqrt(var / n),
            "changed": sum(1 for x in d if x != 0) / n, "n": n}


def mean_abs_dll(exact: list[list[float]], other: list[list[float]]) -> float | None:
    """Mean |loglik difference| over every (document, choice) pair."""
    diffs = [abs(a - b) for ea, eb in zip(exact, other) for a, b in zip(ea, eb)]
    return sum(diffs) / len(diffs) if diffs else None


def build_table(results: dict, tasks: list[str]) -> tuple[list[dict], dict]:
    names = list(results)
    base = next((n for n in names if n == "exact" or n.startswith("exact:")), names[0])
    rows, averages = [], {}
    for n in names:
        prim = []
        for t in tasks:
            e = results[n]["tasks"][t]
            b = results[base]["tasks"][t]
            m = e["primary"]
            pr = paired(b["docs"].get(m, []), e["docs"].get(m, []))
            rows.append({
                "task": t, "variant": n, "n": e["n"],
                "acc": _p(e.get("acc")), "acc_stderr": _p(e.get("acc_stderr")),
                "acc_norm": _p(e.get("acc_norm")), "acc_norm_stderr": _p(e.get("acc_norm_stderr")),
                "primary": m, "score": _p(e.get(m)),
                "delta": None if n == base else _p(e.get(m)) - _p(b.get(m)),
                "paired_stderr": None if (n == base or pr is None) else pr["stderr"],
                "changed": None if (n == base or pr is None) else pr["changed"],
                "dll": None if n == base else mean_abs_dll(b["docs"].get("loglik", []), e["docs"].get("loglik", [])),
            })
            prim.append(_p(e.get(m)))
        averages[n] = sum(prim) / len(prim)
    for n in names:
        # paired stderr of the average over tasks: per-task paired variances
        # combine as independent (different documents).
        ses = [r["paired_stderr"] for r in rows if r["variant"] == n and r["paired_stderr"] is not None]
        rows.append({"task": "AVERAGE", "variant": n, "score": averages[n],
                     "delta": None if n == base else averages[n] - averages[base],
                     "paired_stderr": math.sqrt(sum(s * s for s in ses)) / len(tasks) if ses else None})
    return rows, {"baseline": base, "averages": averages}


def _p(x):
    return None if x is None else 100.0 * x


def render(result: dict) -> str:
    rows = result["rows"]
    lines = [f"### Accuracy: {result['model']}, backend {result['backend']}, "
             f"{'real' if result['real_tp'] > 1 else 'emulated'} TP={result['world_size']}, "
             f"limit={result['limit']}", "",
             "Scores in points (%). `score` is acc_norm where the task defines it, else acc. "
             "`delta` is vs exact; `paired se` is the stderr of that delta over the same documents; "
             "`changed` is the share of documents whose score flipped; `|dLL|` the mean absolute change "
             "of a choice's log-likelihood (nats).", ""]
    cols = [("task", "task"), ("variant", "variant"), ("n", "docs"), ("acc", "acc"), ("acc_stderr", "± se"),
            ("acc_norm", "acc_norm"), ("acc_norm_stderr", "± se"), ("score", "score"), ("delta", "delta"),
            ("paired_stderr", "paired se"), ("changed", "changed"), ("dll", "|dLL|")]
    lines.append(markdown_table(rows, cols))
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    plt = pyplot()
    tasks = result["tasks"] + ["AVERAGE"]
    names = list(result["variants"])
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(tasks)), 4.5))
    w = 0.8 / len(names)
    for k, n in enumerate(names):
        vals = [next(r["score"] for r in result["rows"] if r["task"] == t and r["variant"] == n) for t in tasks]
        errs = [next((r.get("acc_norm_stderr") if r.get("primary") == "acc_norm" else r.get("acc_stderr"))
                     for r in result["rows"] if r["task"] == t and r["variant"] == n) or 0 for t in tasks]
        ax.bar([i + k * w for i in range(len(tasks))], vals, w, yerr=errs, capsize=2, label=n)
    ax.set_xticks([i + w * (len(names) - 1) / 2 for i in range(len(tasks))])
    ax.set_xticklabels(tasks, rotation=20, ha="right")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{result['model']}: {result['backend']} backend, TP={result['world_size']}, limit={result['limit']}")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="echo-vllm eval accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=model_arg, default="smollm2-135m", help="registered name or local HF folder")
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    p.add_argument("--tp", type=tp_size_arg, default=0, help="TP size to emulate (default: per model)")
    p.add_argument("--real-tp", type=count(1, MAX_RANKS, RANKS_WHY), default=1,
                   help="vLLM only: real tensor_parallel_size (>1 disables emulation; --tp ignored)")
    p.add_argument("--variants", nargs="+", type=variant_arg, default=["exact", "naive", "default"],
                   help="default = Echo as shipped (EchoConfig())")
    p.add_argument("--tasks", nargs="+", default=SEVEN, choices=SEVEN)
    p.add_argument("--limit", type=limit_arg, default=None,
                   help="documents per task (lm-eval --limit; below 1: a fraction of each task)")
    p.add_argument("--batch-size", type=batch_size_arg, default=16, help="lm-eval batch size (int or 'auto')")
    p.add_argument("--max-length", type=count(2, 1 << 17), default=2048)
    p.add_argument("--bootstrap-iters", type=count(0, 1 << 20), default=1000,
                   help="lm-eval bootstrap draws for non-mean metrics; acc/acc_norm stderr is analytic "
                        "(0 turns every stderr off)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="hf backend: model dtype")
    p.add_argument("--device", type=device(), default="cpu", help="hf backend: torch device")
    p.add_argument("--postnorm", default="no-feedback", choices=POSTNORM_POLICIES,
                   help="Echo on post-norm models (Gemma-2/3): feedback off (default), exact, or as configured")
    p.add_argument("--gpu-memory-utilization", type=real(0, 1, low_open=True), default=0.8,
                   help="vLLM: fraction of GPU memory (split between variants with --parallel)")
    p.add_argument("--kv-cache-gib", type=real(0, 1 << 14, low_open=True), default=None,
                   help=f"vLLM: fixed KV-cache size per engine (default with --parallel: "
                        f"{PARALLEL_KV_CACHE_GIB:g}, or half an engine's memory share if smaller; "
                        "otherwise vLLM sizes it from its memory share)")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM: no CUDA graphs / torch.compile")
    p.add_argument("--parallel", action="store_true",
                   help="vLLM: run all variants at once on the GPU (memory split between them)")
    p.add_argument("--merge", action="store_true",
                   help="only build the table from every variant saved in --out under --stem "
                        "(runs split over several commands)")
    p.add_argument("--out", type=out_dir, default="eval_results")
    p.add_argument("--stem", type=file_stem, default="accuracy")
    p.add_argument("--_one", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args._argv = list(argv)
    if args.real_tp > 1 and args.backend == "hf" and not args.merge:  # hf emulated it, the table said "real TP"
        raise UsageError(f"--real-tp {args.real_tp}: vLLM only (--backend vllm); the hf backend emulates TP (--tp)")
    args.world = args.real_tp if args.real_tp > 1 else (args.tp or default_emulate_tp(args.model))
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)
    variants = parse_variants(args.variants)
    if len(set(args.tasks)) != len(args.tasks):  # counted twice in the average
        raise UsageError(f"--tasks {' '.join(args.tasks)}: a task is given twice")
    if args.backend == "hf" and not args.merge:  # a device this host lacks: refused before the model loads
        require_device(args.device)
    if not args._one:  # the parent checked the names of its children's variant files
        check_outputs(args, *(() if args.merge else (*(variant_file(args, v.name).name for v in variants),
                                                     *log_files(args, len(variants)))))
    if args._one:
        v = next(v for v in variants if v.name == args._one)
        result = run_vllm_one(args, v, args.tasks)
        # Saved here as well as handed back: a parent stopped by a wall-clock
        # limit (the GPU host's 10-minute calls) still leaves every finished
        # variant in --out, ready for --merge.
        save_variant(args, v.name, result)
        write_json(args._out, result)
        # Leave without interpreter/vLLM teardown: on the GPU host the Echo
        # variants' processes aborted in teardown ("terminate called
        # without an active exception", exit -6) after lm-eval had finished,
        # which discarded finished results. The results are on disk now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.merge:
        results = load_variants(args, None)
        if not results:
            raise UsageError(f"--merge: no {args.stem}.variant.*.json in {args.out}: nothing to merge")
        check_mergeable(results)
        first = next(iter(results.values()))
        args.tasks, args.limit = first["tasks_run"], first["limit"]
        args.model, args.backend, args.world, args.real_tp = (
            first["model"], first["backend"], first["world_size"], first["real_tp"])
        # exact first (the table's baseline), then the rest in file order
        results = {n: results[n] for n in sorted(results, key=lambda n: n != "exact")}
        variants = parse_variants(list(results))
    else:
        (run_vllm if args.backend == "vllm" else run_hf)(args, variants, args.tasks)
        results = load_variants(args, [v.name for v in variants])
    rows, summary = build_table(results, args.tasks)
    result = {
        "model": args.model, "backend": args.backend, "world_size": args.world, "real_tp": args.real_tp,
        "limit": args.limit, "tasks": list(args.tasks), "variants": {v.name: v.to_dict() for v in variants},
        "rows": rows, **summary,
        "runs": {n: {k: v for k, v in r.items() if k != "tasks"} for n, r in results.items()},
        "per_task": {n: {t: {k: v for k, v in e.items() if k != "docs"} for t, e in r["tasks"].items()}
                     for n, r in results.items()},
        # per-document scores stay in the variant files (<stem>.variant.*.json):
        # copied here they made the merged file ~3x their size for nothing new
        "variant_files": {n: variant_file(args, n).name for n in results},
    }
    md = render(result)
    paths = write_outputs(args.out, args.stem, result, md)
    plot(result, paths["json"].with_suffix(".png"))
    print(md)
    print(f"\nwrote {paths['md']}, {paths['json']}, {paths['json'].with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
