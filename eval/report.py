"""Writing results: one JSON, one Markdown table, one PNG per run.

Every evaluation command ends here so that its outputs look alike:
``<out>/<stem>.json`` (everything, machine-readable), ``<stem>.md`` (the
table a human reads, with the command line that made it) and ``<stem>.png``.
"""

from __future__ import annotations

import json
import lzma
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import outputs
from ..cli_args import UsageError
from ..outputs import check_names, write_json, write_text


def environment() -> dict[str, Any]:
    """What produced the numbers."""
    info = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "command": "echo-vllm eval " + recorded_command(sys.argv[2:] if sys.argv[1:2] == ["eval"] else sys.argv[1:]),
    }
    for mod in ("transformers", "vllm", "lm_eval"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            pass
    return info


def recorded_command(argv: list[str]) -> str:
    """``argv`` as the reports record it: no secret shows
    (``credentials.scrub``), also inside a word that is itself a command line
    (``eval ttft --launch 'echo-vllm serve M --api-key KEY'``), and no URL's
    password."""
    from ..server.credentials import scrub

    def word(text: str) -> str:
        if not any(c.isspace() for c in text):
            return text
        try:
            return shlex.join(scrub(shlex.split(text)))
        except ValueError:  # not a command line: nothing of it is shown
            return "***"

    return " ".join(word(w) for w in scrub(list(argv)))


def read_json(path: Path, required: Sequence[str] = ()) -> dict:
    """The JSON object in ``path`` (xz-compressed when it ends in ``.xz``), a
    results file of an earlier run. Raises :class:`UsageError` naming the file
    when it cannot be read, is not a JSON object or lacks a ``required`` key,
    and before reading when it is not a regular file (a FIFO would block)."""
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file (a results file of this tool is one)")
    try:
        data = path.read_bytes()
        value = json.loads(lzma.decompress(data) if path.suffix == ".xz" else data)
    except (OSError, lzma.LZMAError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a readable JSON results file ({e})") from None
    missing = [k for k in required if k not in value] if isinstance(value, dict) else None
    if missing is None or missing:
        what = "not a JSON object" if missing is None else f"no {', '.join(map(repr, missing))}"
        raise UsageError(f"{path}: {what} (not a results file of this tool, or cut short)")
    return value


def fmt(value: Any, digits: int = 4) -> str:
    """Numbers with ``digits`` significant digits; None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """``columns``: (key, header) pairs; values formatted with :func:`fmt`
    unless already strings."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(r.get(k) if isinstance(r.get(k), str) else fmt(r.get(k)) for k, _ in columns) + " |"
        for r in rows
    ]
    return "\n".join([head, sep, *body])


def output_names(stem: str) -> tuple[str, str, str]:
    """The files a run named ``stem`` writes into ``--out``: JSON, Markdown, PNG."""
    return f"{stem}.json", f"{stem}.md", f"{stem}.png"


def check_outputs(args: Any, *more: str) -> None:
    """Refuse, before any work, a run whose result files (``--stem``'s, and
    ``more``) cannot be written into ``--out`` (``outputs.check_names``)."""
    check_names(args.out, (*output_names(args.stem), *more))


def write_outputs(out_dir: str | Path, stem: str, payload: dict, markdown: str) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "environment": environment()}
    json_name, md_name, _ = output_names(stem)
    paths = {"json": out / json_name, "md": out / md_name}
    write_json(paths["json"], payload, indent=2, default=str)
    cmd = payload["environment"]["command"]
    write_text(paths["md"], markdown.rstrip() + f"\n\nCommand: `{cmd}`\n")
    return paths


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> None:
    fig.tight_layout()
    outputs.save_figure(fig, path, dpi=120)
    pyplot().close(fig)
