"""``echo-vllm`` command: a thin router to each subcommand's own module.

Each subcommand lives in its own module with a ``main(argv) -> int``; this
file only maps names to modules and imports lazily, so ``echo-vllm demo``
never imports vLLM and ``echo-vllm serve`` never imports matplotlib.
"""

from __future__ import annotations

import importlib
import sys

from . import envs
from .cli_args import check_argv, report_errors

SUBCOMMANDS = {
    "demo": ("echo_vllm.eval.demo", "error vs depth of exact, naive 4-bit and Echo over gloo processes"),
    "bench": ("echo_vllm.bench.cli", "benchmarks: all-reduce (GPU/gloo) and kernels"),
    "serve": ("echo_vllm.server.cli", "vLLM's OpenAI-compatible server with --tp-comm echo"),
    "eval": ("echo_vllm.eval.cli", "accuracy, perplexity and TTFT: exact vs naive 4-bit vs Echo"),
    "train-demo": ("echo_vllm.training.demo", "train a small Qwen3 at emulated TP=4: exact vs naive 4-bit vs Echo"),
}


def _usage() -> str:
    lines = ["usage: echo-vllm <command> [args]", "", "commands:"]
    width = max(map(len, SUBCOMMANDS))
    lines += [f"  {name:<{width}} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "echo-vllm <command> --help for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "--version":
        from . import __version__

        print(__version__)
        return 0
    if name not in SUBCOMMANDS:
        print(f"echo-vllm: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])

    def run() -> int | None:
        if name == "serve":  # serve checks its command line and the variables itself (the latter where Echo runs)
            return module.main(rest)
        envs.read()  # workers and caches read them mid-run: refuse a bad value before any work
        return module.main(check_argv(rest))

    try:
        # bad input found after parsing: one line, exit 2, no traceback
        return report_errors(f"echo-vllm {name}", run)
    except SystemExit as e:  # argparse's errors and --help: the exit code, as a return value
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
