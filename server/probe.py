"""HTTP checks against a running ``echo-vllm serve`` (the GPU-host script).

Standard library only (plus ``prometheus_client``'s text parser, which vLLM
installs), so it runs wherever the server runs::

    python -m echo_vllm.server.probe wait    --base-url URL [--timeout 600] [--pid PID]
    python -m echo_vllm.server.probe probe   --base-url URL --model NAME --out DIR
    python -m echo_vllm.server.probe summary --base-url URL --out DIR [--bench bench.json]

``probe``: /v1/completions, /v1/chat/completions, malformed requests (bad
JSON, unknown model, negative max_tokens: each must get a 4xx), a valid
request afterwards (the server keeps serving), and /metrics before and after.
``summary``: scrapes /metrics again, reads the load test's result file
(``vllm bench serve --save-result``), prints one line per check, writes
summary.json, and exits 1 if any check failed. The load itself is vLLM's
``vllm bench serve`` (see server/gpu_serve_check.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..cli_args import UsageError, count, http_url, out_dir, real, report_errors
from ..outputs import check_names, write_json, write_text

#: Longest ``wait --timeout``: a day. NaN or inf would wait forever for a
#: server that never answers.
MAX_WAIT_S = 24 * 3600.0
WAIT_WHY = "a wait without an end is a hang"

#: Largest Linux pid (``/proc/sys/kernel/pid_max`` can be at most 2^22). 0
#: and -1 name process groups, which always answer: the early exit never came.
MAX_PID = 1 << 22

ECHO_PREFIX = "echo:"
CALLS = ECHO_PREFIX + "allreduce_calls_total"


def http(method: str, url: str, body: bytes | None = None, timeout_s: float = 60.0) -> tuple[int, str]:
    """(status, body text); HTTP errors are answers, not exceptions."""
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def post_json(url: str, payload: Any, timeout_s: float = 120.0) -> tuple[int, str]:
    return http("POST", url, json.dumps(payload).encode(), timeout_s)


def wait_healthy(base_url: str, timeout_s: float, pid: int | None = None, poll_s: float = 2.0) -> float:
    """Seconds until /health answers 200; raises if the server process died
    or the time ran out (never waits forever)."""
    start = time.monotonic()
    while True:
        if pid is not None and not _alive(pid):
            raise RuntimeError(f"server process {pid} exited before /health answered")
        try:
            if http("GET", base_url + "/health", timeout_s=5)[0] == 200:
                return time.monotonic() - start
        except OSError:
            pass  # not listening yet
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"/health did not answer 200 within {timeout_s:g} s")
        time.sleep(poll_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by the shell) still answers kill 0.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return True


def echo_samples(metrics_text: str) -> dict[str, float]:
    """``{'name{label="v",...}': value}`` for every Echo sample on /metrics.

    Parsing with prometheus_client's own parser doubles as the check that the
    exposition is valid Prometheus text.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name.startswith(ECHO_PREFIX):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of ``name`` samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for key, v in samples.items()
               if key.split("{", 1)[0] == name and all(w in key for w in want))


def _text_of(kind: str, body: str) -> str:
    choice = json.loads(body)["choices"][0]
    return choice["text"] if kind == "completions" else choice["message"]["content"] or ""


def check_generation(base_url: str, model: str) -> list[dict]:
    """One plain completion and one chat completion; both must return text."""
    requests = {
        "completions": ("/v1/completions", {"model": model, "prompt": "The capital of France is",
                                             "max_tokens": 16, "temperature": 0}),
        "chat": ("/v1/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                                          "messages": [{"role": "user", "content": "Say hello."}]}),
    }
    results = []
    for kind, (path, payload) in requests.items():
        status, body = post_json(base_url + path, payload)
        entry = {"check": kind, "status": status, "ok": False}
        if status == 200:
            try:
                entry["text"] = _text_of(kind, body)
                entry["ok"] = True  # a random-weight model may answer with an empty string
            except (ValueError, KeyError, IndexError) as e:
                entry["error"] = f"unexpected body: {e!r}: {body[:200]}"
        else:
            entry["error"] = body[:300]
        results.append(entry)
    return results


def check_malformed(base_url: str, model: str) -> list[dict]:
    """Each malformed request must get a 4xx; then a valid one must get 200."""
    url = base_url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ("bad_json", lambda: http("POST", url, b'{"model": "' + model.encode() + b'", "messages": [')),
        ("unknown_model", lambda: post_json(url, {"model": "no-such-model", "messages": messages,
                                                  "max_tokens": 4})),
        ("negative_max_tokens", lambda: post_json(url, {"model": model, "messages": messages,
                                                        "max_tokens": -5})),
    ]
    results = []
    for name, send in cases:
        status, body = send()
        results.append({"check": name, "status": status, "ok": 400 <= status < 500, "body": body[:200]})
    status, body = post_json(url, {"model": model, "messages": messages, "max_tokens": 4})
    results.append({"check": "serves_after_malformed", "status": status, "ok": status == 200,
                    "body": body[:200]})
    return results


def scrape(base_url: str, out: Path, name: str) -> dict[str, float]:
    status, text = http("GET", base_url + "/metrics")
    write_text(out / f"{name}.txt", text)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return echo_samples(text)


def run_probe(base_url: str, model: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    before = scrape(base_url, out, "metrics_before")
    checks = check_generation(base_url, model) + check_malformed(base_url, model)
    after = scrape(base_url, out, "metrics_after_probe")
    result = {"checks": checks, "echo_before": before, "echo_after_probe": after}
    write_json(out / "probe.json", result, indent=2)
    return result


def _percentiles(bench: dict, metric: str) -> str:
    """``mean=.. p50=.. p99=..`` from vllm bench serve's result keys."""
    parts = [f"mean={bench[f'mean_{metric}_ms']:.2f}"] if f"mean_{metric}_ms" in bench else []
    tails = sorted((float(k[1:].split("_")[0]), k) for k in bench
                   if k[:2] in {f"p{d}" for d in "0123456789"} and k.endswith(f"_{metric}_ms"))
    parts += [f"{k.split('_')[0]}={bench[k]:.2f}" for _, k in tails]
    return " ".join(parts)


NORM_CALLS = ECHO_PREFIX + "norm_calls_total"
NORM_SITES = ECHO_PREFIX + "norm_fusion_sites"


def summarize(base_url: str, out: Path, bench_file: Path | None,
              expect_fused_norm: bool = False) -> tuple[bool, list[str]]:
    """All checks in one list of lines; True when every one passed.
    ``expect_fused_norm``: the norm fusion pass is on (compiled engine, the
    default ``--echo-fuse-norm``): calls must have run it fused."""
    probe = _probe_result(out / "probe.json")
    lines, ok = [], True

    def line(passed: bool, text: str) -> None:
        nonlocal ok
        ok &= passed
        lines.append(f"[{'PASS' if passed else 'FAIL'}] {text}")

    for c in probe["checks"]:
        line(c["ok"], f"{c['check']}: HTTP {c['status']}")
    bench = None if bench_file is None else _json_object(bench_file)
    if bench is not None:
        if isinstance(bench, dict):
            n, done, failed = bench.get("num_prompts"), bench.get("completed"), bench.get("failed", 0)
            line(failed == 0 and done == n,
                 f"load: {done}/{n} completed, {failed} failed, concurrency {bench.get('max_concurrency')}, "
                 f"{bench.get('output_throughput', 0):.0f} output tok/s")
            lines.append(f"       TTFT ms {_percentiles(bench, 'ttft')}; ITL ms {_percentiles(bench, 'itl')}")
        else:
            line(False, f"load: {bench}")
    final = scrape(base_url, out, "metrics_final")
    start = probe["echo_before"]
    moved = total(final, CALLS) - total(start, CALLS)
    echo_calls = total(final, CALLS, path="echo") - total(start, CALLS, path="echo")
    line(moved > 0, f"echo metrics moved: +{moved:.0f} all-reduce calls (+{echo_calls:.0f} on the echo path)")
    wire, equiv = total(final, ECHO_PREFIX + "wire_bytes_total"), total(final, ECHO_PREFIX + "equiv_16bit_bytes_total")
    n_err = total(final, ECHO_PREFIX + "rel_error_samples_total")
    err = total(final, ECHO_PREFIX + "rel_error_sum_total") / n_err if n_err else float("nan")
    lines.append(f"       wire {wire:.3g} B vs 16-bit {equiv:.3g} B (ratio {wire / equiv if equiv else float('nan'):.3f}); "
                 f"rel. error mean {err:.3g} over {n_err:.0f} samples")
    reasons = {k.split('reason="')[1].split('"')[0]: v for k, v in final.items()
               if k.startswith(CALLS) and 'reason="' in k}
    lines.append("       calls by reason: " + ", ".join(f"{r}={v:.0f}" for r, v in sorted(reasons.items())))
    norm = {k.split('how="')[1].split('"')[0]: v for k, v in final.items()
            if k.startswith(NORM_CALLS) and 'how="' in k}
    sites = {k.split('outcome="')[1].split('"')[0]: v for k, v in final.items()
             if k.startswith(NORM_SITES) and 'outcome="' in k}
    text = (f"norm after the all-reduce: calls by how it ran {dict(sorted(norm.items())) or '{}'}; compiled sites "
            f"{dict(sorted(sites.items())) or '{}'}")
    if expect_fused_norm:
        line(norm.get("fused", 0) > 0, "fused into Echo (" + text + ")")
    else:
        lines.append("       " + text)
    write_json(out / "summary.json", {"ok": ok, "lines": lines, "echo_final": final}, indent=2)
    return ok, lines


def _json_object(path: Path) -> dict | str:
    """The JSON object in ``path`` (``vllm bench serve``'s result), or why
    there is none (a FIFO is not opened: reading it would wait forever)."""
    if not path.is_file():
        return f"{path} is not a regular file" if path.exists() else f"no result file {path}"
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{path} is not a JSON result ({e})"
    return value if isinstance(value, dict) else f"{path} is not a JSON object"


def _probe_result(path: Path) -> dict:
    """What ``probe`` wrote in ``path``; :class:`UsageError` naming the file
    when it is missing or not ``probe``'s."""
    result = _json_object(path)
    if not isinstance(result, dict) or not isinstance(result.get("checks"), list) or "echo_before" not in result:
        raise UsageError(f"{path}: not what `probe --out {path.parent}` writes (run it first): "
                         + (result if isinstance(result, str) else "no 'checks' or 'echo_before'"))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo_vllm.server.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("wait", "probe", "summary"):
        p = sub.add_parser(name)
        p.add_argument("--base-url", type=http_url, default="http://127.0.0.1:8000")
        if name == "wait":
            p.add_argument("--timeout", type=real(0, MAX_WAIT_S, low_open=True, why=WAIT_WHY), default=600.0,
                           help="seconds (above 0, at most a day)")
            p.add_argument("--pid", type=count(1, MAX_PID, "a Linux pid"), default=None,
                           help="fail early if this process exits")
        else:
            p.add_argument("--out", type=out_dir, required=True)
        if name == "probe":
            p.add_argument("--model", required=True, help="served model name")
        if name == "summary":
            p.add_argument("--bench", type=Path, default=None, help="vllm bench serve result JSON")
            p.add_argument("--expect-fused-norm", action="store_true",
                           help="fail unless calls ran the norm fused into Echo (echo:norm_calls_total{how=fused})")
    args = parser.parse_args(argv)
    return report_errors(f"{parser.prog} {args.command}", lambda: _run(args))


#: The files each command writes into ``--out``.
OUTPUTS = {"probe": ("metrics_before.txt", "metrics_after_probe.txt", "probe.json"),
           "summary": ("metrics_final.txt", "summary.json")}


def _run(args) -> int:
    base = args.base_url.rstrip("/")
    if args.command in OUTPUTS:
        check_names(args.out, OUTPUTS[args.command])
    if args.command == "wait":
        try:
            print(f"healthy after {wait_healthy(base, args.timeout, args.pid):.1f} s")
        except (TimeoutError, RuntimeError) as e:  # the server's outcome, not a bug: one line, exit 1
            print(f"wait: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "probe":
        result = run_probe(base, args.model, Path(args.out))
        for c in result["checks"]:
            print(f"{c['check']}: HTTP {c['status']} {'ok' if c['ok'] else 'FAILED'}")
        return 0 if all(c["ok"] for c in result["checks"]) else 1
    ok, lines = summarize(base, Path(args.out), args.bench, args.expect_fused_norm)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
