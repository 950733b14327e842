"""Result files a tool writes into its output folder: whole, or not at all.

Every result (a JSON record, a Markdown table, a PNG, a training record) is
written to a temporary file in the folder it goes to and then renamed over
its name (``os.replace``, atomic on one file system): a reader sees the old
file or the new one, never half of one; a crash leaves the old one; and a
symbolic link standing at the name is replaced by the file, never followed,
so whatever it pointed to is left as it was. A name that is a folder (which
the rename cannot replace) is refused before the work starts
(:func:`check_names`), not after it.

Nothing here imports torch; matplotlib only when a figure is saved.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable

from .cli_args import NAME_MAX, UsageError, path_problem


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: The permissions a plain ``open(path, "w")`` gives a new file (the
#: temporary file is made private; the result must not be).
_FILE_MODE = 0o666 & ~_umask()


def check_names(folder: str | os.PathLike, names: Iterable[str], *, option: str = "--out") -> None:
    """Refuse (:class:`UsageError`, one line) before any work: a result name
    in ``folder`` that is a folder (a link to one is fine: the result
    replaces the link), or longer than the file system takes."""
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            raise UsageError(f"{option} {folder}: {name} is a folder, where the tool writes its result file "
                             f"{name}; move it or give another {option}")
        problem = path_problem(path) or (
            f"the name is {len(os.fsencode(name))} bytes: at most {NAME_MAX}" if len(os.fsencode(name)) > NAME_MAX
            else None)
        if problem:
            raise UsageError(f"{option} {folder}: cannot hold the result file {name[:60]}: {problem}")


def write_file(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """``path`` holds what ``write(file)`` writes into a binary file: first
    a temporary file beside it, then renamed over ``path`` (see the module);
    the temporary file never outlives a failure."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".echo-vllm-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def open_fresh(path: str | os.PathLike) -> IO[str]:
    """A new, empty text file at ``path``, open for writing: a log that is
    written as it grows, so not whole. Made beside it and renamed over
    ``path`` first, so a link standing there is replaced, not followed."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".echo-vllm-", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, target)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return os.fdopen(fd, "w")


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """``path`` holds ``data``, written whole."""
    return write_file(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``path`` holds ``text`` (UTF-8), written whole."""
    return write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, value: Any, **dumps: Any) -> Path:
    """``path`` holds ``json.dumps(value, **dumps)`` and a newline, written
    whole; nothing is written when ``value`` does not serialise."""
    return write_text(path, json.dumps(value, **dumps) + "\n")


def save_figure(fig: Any, path: str | os.PathLike, **savefig: Any) -> Path:
    """``fig.savefig`` into ``path``, written whole; the format is the
    name's suffix (``.png``), as matplotlib reads it from a name."""
    fmt = Path(path).suffix.lstrip(".") or None
    return write_file(path, lambda f: fig.savefig(f, format=fmt, **savefig))


__all__ = ["check_names", "open_fresh", "save_figure", "write_bytes", "write_file", "write_json", "write_text"]
