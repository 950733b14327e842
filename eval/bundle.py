"""``echo-vllm eval bundle``: carry prepared models and data to an offline host.

The GPU host reaches no registry and takes files in transfers of limited
size. This packs cache entries (``models/<name>``, ``data/...``) into one
xz-compressed tar split into ``bundle.part.NN`` pieces of at most
``--part-mib`` MiB plus ``SHA256SUMS`` -- the same layout as the vLLM
wheelhouse, so the wheelhouse's ``install.py TARGET PARTS_DIR`` unpacks it
(``--unpack`` here does the same). Unpack into a folder and point
``ECHO_VLLM_CACHE`` at it: ``prepare-model`` then finds the converted model
(checksummed by its manifest) and never downloads.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import lzma
import os
import re
import sys
import tarfile
import time
from pathlib import Path

from ..cli_args import UsageError, count, existing_dir, out_dir
from ..outputs import write_text
from ..assets import cache_dir, sha256_file, verify_manifest
from ..corpora import prepare_benchmarks, prepare_texts
from .models import MODELS, prepare_model


class _SplitWriter(io.RawIOBase):
    """A write-only file that spills into numbered parts of ``part_bytes``."""

    def __init__(self, out: Path, part_bytes: int):
        self.out, self.part_bytes = out, part_bytes
        self.index, self.size, self.f = -1, 0, None
        self.paths: list[Path] = []

    def _next(self) -> None:
        if self.f:
            self.f.close()
        self.index += 1
        path = self.out / f"bundle.part.{self.index:02d}"
        self.paths.append(path)
        self.f, self.size = open(path, "wb"), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = memoryview(b)
        done = 0
        while done < len(b):
            if self.f is None or self.size >= self.part_bytes:
                self._next()
            n = min(len(b) - done, self.part_bytes - self.size)
            self.f.write(b[done : done + n])
            self.size += n
            done += n
        return done

    def close(self) -> None:
        if self.f:
            self.f.close()
            self.f = None
        super().close()


def check_no_bundle(out: Path) -> None:
    """Refuse (:class:`UsageError`) an ``out`` that already holds bundle parts
    or a SHA256SUMS: a new bundle would overwrite them, or mix with them."""
    there = sorted(p.name for p in out.glob("bundle.part.*"))
    if os.path.lexists(out / "SHA256SUMS"):  # a dangling link too: writing would create its target
        there.append("SHA256SUMS")
    if there:
        raise UsageError(f"--out {out} already holds {', '.join(there)}: move them away or give an empty folder "
                         "(a bundle never overwrites files)")


def make_bundle(entries: list[Path], out: Path, part_mib: int = 56, preset: int = 6) -> list[Path]:
    """Pack ``entries`` (paths under the cache) into ``out``; returns the parts.
    An ``out`` holding a bundle already is refused (:func:`check_no_bundle`)."""
    root = cache_dir()
    check_no_bundle(out)
    out.mkdir(parents=True, exist_ok=True)
    writer = _SplitWriter(out, part_mib * (1 << 20))
    with lzma.open(writer, "wb", preset=preset) as xz, tarfile.open(fileobj=xz, mode="w|") as tar:
        for entry in entries:
            tar.add(entry, arcname=entry.relative_to(root).as_posix())
    writer.close()
    sums = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in writer.paths]
    write_text(out / "SHA256SUMS", "\n".join(sums) + "\n")
    return writer.paths


class _PartReader(io.RawIOBase):
    """Read the parts named in SHA256SUMS as one stream, checking each part's
    checksum before any of its bytes are used. With ``wait_s`` > 0 a part not
    there yet is waited for (parts arriving one transfer at a time can be
    unpacked while the rest travel; they must appear atomically, by rename)."""

    def __init__(self, names: list[str], digests: dict[str, str], parts_dirs: list[Path], wait_s: float):
        self.names, self.digests, self.dirs, self.wait_s = list(names), digests, parts_dirs, wait_s
        self.buf, self.pos = b"", 0

    def _find(self, name: str) -> Path:
        deadline = time.monotonic() + self.wait_s
        while True:
            for d in self.dirs:
                if (d / name).is_file():
                    return d / name
            if time.monotonic() >= deadline:
                raise FileNotFoundError(f"missing part: {name}" +
                                        (f" (waited {self.wait_s:g} s)" if self.wait_s else ""))
            time.sleep(min(1.0, self.wait_s))

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self.pos >= len(self.buf):
            if not self.names:
                return 0
            name = self.names.pop(0)
            data = self._find(name).read_bytes()
            if hashlib.sha256(data).hexdigest() != self.digests[name]:
                raise ValueError(f"checksum mismatch: {name}")
            self.buf, self.pos = data, 0
        n = min(len(b), len(self.buf) - self.pos)
        b[:n] = self.buf[self.pos : self.pos + n]
        self.pos += n
        return n


def read_sums(parts_dirs: list[Path]) -> dict[str, str]:
    """{part name: sha256} of the first SHA256SUMS in ``parts_dirs``; a
    missing, unreadable or malformed one raises :class:`UsageError`."""
    sums_file = next((d / "SHA256SUMS" for d in parts_dirs if (d / "SHA256SUMS").is_file()), None)
    if sums_file is None:
        raise UsageError("no SHA256SUMS in " + ", ".join(map(str, parts_dirs)) + ": not a folder of bundle parts")
    try:
        lines = sums_file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{sums_file}: cannot be read ({e})") from None
    want = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if fields and (len(fields) != 2 or not re.fullmatch(r"[0-9a-f]{64}", fields[0])):
            raise UsageError(f"{sums_file} line {number}: {line[:60]!r} is not '<sha256> <part name>'")
        if fields:
            want[fields[1]] = fields[0]
    if not want:
        raise UsageError(f"{sums_file}: lists no parts")
    return want


#: The list, in an unpack's target, of the paths unpacks wrote there: the only files one may replace.
UNPACKED = ".echo-unpacked"


def unpack(target: Path, parts_dirs: list[Path], wait_s: float = 0.0) -> None:
    """Verify and unpack parts (possibly spread over several folders), part by
    part; ``wait_s`` > 0 waits that long for each part still in transit.
    Without waiting, every part is there and matches SHA256SUMS before
    ``target`` is made: else :class:`UsageError` naming the parts. A file
    already in ``target`` is replaced only if an earlier unpack wrote it
    (listed in :data:`UNPACKED`: so an interrupted unpack, or bundles
    sharing files, can unpack again); any other stops the unpack with a
    :class:`UsageError` naming it, before it is touched."""
    want = read_sums(parts_dirs)
    reader = _PartReader(sorted(want), want, parts_dirs, wait_s)
    if not wait_s:  # all must be here: say which are not, or do not match, before unpacking any
        # regular files only, as the reader takes them: a FIFO or folder of that name is missing
        missing = sorted(name for name in want if not any((d / name).is_file() for d in parts_dirs))
        if missing:
            raise UsageError(f"missing parts: {missing} (listed in SHA256SUMS, not in "
                             f"{', '.join(map(str, parts_dirs))})")
        bad = [name for name in sorted(want) if sha256_file(reader._find(name)) != want[name]]
        if bad:
            raise UsageError(f"checksum mismatch: {', '.join(bad)} (not as SHA256SUMS lists: damaged or from "
                             "another bundle)")
    target.mkdir(parents=True, exist_ok=True)
    written = target / UNPACKED
    mine = set(written.read_text().splitlines()) if written.is_file() else set()
    with lzma.open(io.BufferedReader(reader, 1 << 20)) as xz, tarfile.open(fileobj=xz, mode="r|") as tar, \
            open(written, "a") as log:
        for member in tar:  # in stream order: each member's bytes are read as it is extracted
            dest = target / member.name
            if not member.isdir() and (dest.exists() or dest.is_symlink()) and member.name not in mine:
                raise UsageError(f"{dest} exists and no earlier unpack wrote it: unpack never replaces "
                                 "files of yours; unpack into a new folder")
            if member.name not in mine:  # logged before it is written: an interrupted unpack may redo it
                log.write(member.name + "\n")
                log.flush()
                mine.add(member.name)
            tar.extract(member, target, filter="data")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="echo-vllm eval bundle", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=["smollm2-135m"], choices=list(MODELS))
    p.add_argument("--no-data", action="store_true", help="leave out the benchmark data and texts")
    p.add_argument("--part-mib", type=count(1, 1 << 14), default=56, help="size of each part (1..16384 MiB)")
    p.add_argument("--xz-preset", type=int, default=6, choices=range(10),
                   help="xz level. bf16 weights shrink ~40%% at any level (Gemma-3-270M 544 MB -> "
                        "315 MB at 6, Qwen2.5-1.5B 3.4 GB -> 2.1 GB at 0); 0 is the fast choice for "
                        "multi-GB models, 6 (default) packs the text and data tightest")
    p.add_argument("--out", type=out_dir, default=".gpu-bundle/echo", help="output folder (git-ignored by default)")
    p.add_argument("--unpack", nargs="+", metavar=("TARGET", "PARTS_DIR"),
                   help="instead: unpack parts from PARTS_DIR(s) into TARGET")
    a = p.parse_args(argv)
    if a.unpack:
        if len(a.unpack) < 2:
            p.error("--unpack TARGET PARTS_DIR [PARTS_DIR ...]")
        try:  # TARGET: a folder that can be made or written; PARTS_DIRs: folders
            target = out_dir(a.unpack[0])
            for d in a.unpack[1:]:
                existing_dir(d)
        except argparse.ArgumentTypeError as e:
            p.error(f"--unpack: {e}")
        unpack(Path(target), [Path(d) for d in a.unpack[1:]])
        print(f"unpacked into {target}; export ECHO_VLLM_CACHE={target}")
        return 0
    if not a.models and a.no_data:
        p.error("nothing to bundle: --models names none and --no-data leaves out the data")
    if len(set(a.models)) != len(a.models):  # packed twice
        p.error(f"--models {' '.join(a.models)}: a model is given twice")
    check_no_bundle(Path(a.out))  # before any model is prepared
    entries = [prepare_model(m) for m in a.models]
    if not a.no_data:
        entries += [prepare_benchmarks(), prepare_texts()]
    for e in entries:
        if verify_manifest(e, full=True) is None:
            raise RuntimeError(f"{e}: incomplete (no manifest)")
    parts = make_bundle(entries, Path(a.out), a.part_mib, a.xz_preset)
    for part in parts:
        print(f"{part}  {part.stat().st_size / (1 << 20):.1f} MiB")
    print(f"{len(parts)} part(s) + SHA256SUMS in {a.out}", file=sys.stderr)
    return 0
