"""User input as text: the parsers and argparse types every tool shares.

One place for each check, so ``echo-vllm demo``, ``bench``, ``eval``,
``train-demo`` and ``serve`` (through :class:`~echo_vllm.config.EchoConfig`)
refuse the same input the same way: one line naming the value and what is
allowed (argparse exits 2), never a traceback, never a silent stand-in.

* text parsers: :func:`parse_bytes` (``256k``, ``4MiB``), :func:`parse_int`
  (plain integers, no suffix), :func:`parse_bool` (pydantic's spellings),
  :func:`parse_bit_rate` (tc's ``50mbit``), :func:`parse_duration` (``5ms``);
* :func:`did_you_mean`: the close-match suggestion of every "unknown" error;
* argparse types: :func:`count` (an integer in a range whose upper bound
  says why), :func:`byte_size`, :func:`counts` / :func:`byte_sizes` (comma
  lists), :func:`bit_rates`, :func:`duration`, :func:`factor`, :func:`real`,
  :func:`out_dir`, :func:`out_file`, :func:`existing_file`,
  :func:`existing_dir`, :func:`device`, :func:`file_stem`, :func:`http_url`;
* the command line as typed: :func:`check_argv` (an option spelled with a
  look-alike dash is refused, a negative-looking value is kept with its
  option); :func:`parse_json` (bounded: depth, digits, one value per key);
  :func:`path_problem` / :func:`env_path_problem` (what the file system
  would refuse, found before the work);
* :class:`UsageError`: bad input found after parsing (a combination of
  options, a missing input); :func:`report_errors` prints it in one line,
  exit 2 (the ``echo-vllm`` router does, for every subcommand).
  ``EchoConfigError`` and ``EchoEnvError`` are UsageErrors.

Nothing here imports torch or the rest of the package.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import sys
import tempfile
import unicodedata
from fractions import Fraction
from typing import Any, Callable, Iterable, Sequence

#: Boolean spellings: pydantic's (what vLLM accepts for its own flags), so a
#: value reads the same in ``--echo-*`` flags and in ``--additional-config``.
TRUE_TEXT = frozenset({"1", "true", "t", "yes", "y", "on"})
FALSE_TEXT = frozenset({"0", "false", "f", "no", "n", "off"})

#: Longer number texts are refused before parsing: no real count or size
#: needs more digits, and Python's int() of thousands of digits is slow.
MAX_NUMBER_TEXT = 40

#: Most ranks any tool runs or emulates: no tensor-parallel group is larger
#: (8 GPUs per host, a few hosts), and every rank costs a process or a
#: partial matmul on this machine.
MAX_RANKS = 64
RANKS_WHY = "no tensor-parallel group is larger"


#: Largest ``--seed`` of the demos: the seeds they derive from it
#: (``seed * 1000003 + k``) must stay within torch's 64-bit seeds.
MAX_TOOL_SEED = (1 << 32) - 1
SEED_WHY = "the seeds derived from it stay within torch's 64 bits"


class UsageError(ValueError):
    """Bad user input found after argument parsing (a combination of
    options, a file's content); a CLI prints it as an argparse error."""


def did_you_mean(word: str, known: Iterable[object], *, common: str = "") -> str:
    """``"; did you mean 'group_size'?"`` for the closest of ``known``, or
    ``""`` when nothing is close. ``common``: a prefix every name shares
    (``--echo-``), left out of the comparison so it does not make every
    name look close."""
    def trim(text: str) -> str:
        return text[len(common):] if common and text.startswith(common) else text

    by_trimmed = {trim(str(k)): str(k) for k in known}
    match = difflib.get_close_matches(trim(str(word)), list(by_trimmed), n=1, cutoff=0.6)
    return f"; did you mean {by_trimmed[match[0]]!r}?" if match else ""


def _short(text: object, limit: int = 60) -> str:
    """``repr`` of a value, cut to ``limit`` characters (errors stay one line)."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def _shown(text: object) -> str:
    """User text as typed when that prints on one line, else its ``repr``."""
    t = str(text)
    return t if t.isprintable() and t.strip() == t and len(t) <= 60 else _short(t)


# -- text parsers ------------------------------------------------------------------

#: Binary size suffixes (``k`` = KiB, ...); a trailing ``b`` / ``ib`` is optional.
_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt])(?:i?b)?|(\d+)\s*b?|(0x[0-9a-f]+)")


def parse_bytes(text: str) -> int:
    """A byte count: ``262144``, ``256k``, ``4MiB``, ``1.5G``, ``64MB`` (suffixes
    binary), ``0x40000``. A fraction of a byte (``1.1k``) is refused, not
    rounded. Raises ``ValueError("not a byte count: ...")``."""
    t = str(text).strip().lower().replace("_", "")
    m = _SIZE.fullmatch(t) if len(t) <= MAX_NUMBER_TEXT else None
    if m is None:
        raise ValueError(f"not a byte count: {_short(text)}")
    number, suffix, plain, hexa = m.groups()
    if hexa:
        return int(hexa, 16)
    if plain:
        return int(plain)
    exact = Fraction(number) * _SUFFIXES[suffix]
    if exact.denominator != 1:
        raise ValueError(f"not a byte count: {_short(text)} is {float(exact):g} bytes, not a whole number")
    return int(exact)


#: Bit-rate suffixes, decimal as tc's (``mbit`` = 10**6 bit/s).
_RATE_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bit|bps|bit/s)")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(us|ms|s)?")
_DURATION_UNITS = {"us": Fraction(1, 10**6), "ms": Fraction(1, 1000), "s": Fraction(1), None: Fraction(1)}


def parse_bit_rate(text: str) -> int:
    """A link rate in bits per second, with tc's decimal suffixes:
    ``50mbit``, ``1gbit``, ``200Mbit/s``, ``800kbps`` (``bps`` is bits here,
    as in tc), ``1000000bit``. A fraction of a bit per second is refused.
    Raises ``ValueError("not a bit rate: ...")``."""
    t = str(text).strip().lower().replace("_", "")
    m = _RATE.fullmatch(t) if len(t) <= MAX_NUMBER_TEXT else None
    if m is None:
        raise ValueError(f"not a bit rate: {_short(text)} (e.g. 50mbit, 1gbit)")
    exact = Fraction(m.group(1)) * _RATE_SUFFIXES[m.group(2)]
    if exact.denominator != 1:
        raise ValueError(f"not a bit rate: {_short(text)} is {float(exact):g} bit/s, not a whole number")
    return int(exact)


def parse_duration(text: str) -> float:
    """Seconds: ``5ms``, ``250us``, ``0.5s``, ``2`` (seconds). Raises
    ``ValueError("not a duration: ...")``."""
    t = str(text).strip().lower()
    m = _DURATION.fullmatch(t) if len(t) <= MAX_NUMBER_TEXT else None
    if m is None:
        raise ValueError(f"not a duration: {_short(text)} (e.g. 5ms, 250us, 0.5s)")
    return float(Fraction(m.group(1)) * _DURATION_UNITS[m.group(2)])


def parse_int(text: str) -> int:
    """A plain decimal integer (``" 7 "``, ``-3``, ``1_000``): no size suffix,
    no fraction, no exponent. Raises ``ValueError``."""
    t = str(text).strip()
    if len(t) > MAX_NUMBER_TEXT or not re.fullmatch(r"[+-]?\d+(_\d+)*", t):
        raise ValueError(f"not an integer: {_short(text)}")
    return int(t)


def parse_bool(text: str) -> bool:
    """True for :data:`TRUE_TEXT`, False for :data:`FALSE_TEXT` (any case);
    raises ``ValueError`` otherwise."""
    low = str(text).strip().lower()
    if low in TRUE_TEXT:
        return True
    if low in FALSE_TEXT:
        return False
    raise ValueError(f"not a boolean: {_short(text)} (true/false, yes/no, on/off, 1/0)")


# -- the command line as typed ------------------------------------------------------

#: Characters that look like ``-`` but are not (Unicode's dash punctuation,
#: the minus signs, the soft hyphen): a word processor's or a web page's
#: ``--api-key`` arrives as ``–api-key``. argparse reads such a token as a
#: positional value, so the option is lost and the tools' errors (vLLM's
#: "unrecognized arguments") print it together with the value after it.
#: Listed, not derived at import (a scan of every code point costs a third
#: of a second per process); tests/core/test_cli_args.py derives the Pd
#: set from ``unicodedata`` and checks this one holds it.
LOOKALIKE_DASHES = frozenset(
    "\u058a\u05be\u1400\u1806\u2010\u2011\u2012\u2013\u2014\u2015\u2e17\u2e1a\u2e3a\u2e3b\u2e40\u2e5d"
    "\u301c\u3030\u30a0\ufe31\ufe32\ufe58\ufe63\uff0d\U00010ead"  # Pd (dash punctuation) but ASCII '-'
    "\u00ad\u02d7\u207b\u208b\u2212\u2796")  # soft hyphen, the minus signs
#: An option's name as shown in an error: up to ``=`` (or a look-alike of
#: it) or a space, never the value glued to it.
_OPTION_NAME = re.compile(r"[^=\uff1d\ufe66\u207c\u208c\s]{0,40}")
#: A value argparse would take for an option (``-1M``, ``-.5``): argparse
#: itself keeps only plain negative numbers (``-1``, ``-2.5``) as values.
_NEGATIVE_LOOKING = re.compile(r"-\.?\d")


def _described(char: str) -> str:
    return f"{char!r} (U+{ord(char):04X} {unicodedata.name(char, 'unnamed')})"


def check_argv(argv: Sequence[str]) -> list[str]:
    """The command line as the tools' parsers should see it.

    Refused (:class:`UsageError`, one line naming the option, never what
    follows it): a token that begins with a look-alike of ``-``
    (:data:`LOOKALIKE_DASHES`: ``–api-key``, ``—out``, full-width
    ``－－seed``), and an option whose name holds one or any other
    character outside ASCII (``--api‐key``, a zero-width space): no tool's
    option has one, and guessing whether ``–`` meant ``-`` or ``--`` could
    run another option. A value that looks negative but is no plain number
    (``--sizes -1M``) is joined to the option before it (``--sizes=-1M``),
    so that the option's own parser judges it instead of argparse saying
    "expected one argument". Tokens after ``--`` are values: left as they
    are, but checked for look-alike dashes too."""
    out: list[str] = []
    options = True
    for token in map(str, argv):
        lead = token[:1]
        name = _OPTION_NAME.match(token).group(0)
        odd = next((c for c in name if not c.isascii()), None) if lead == "-" and len(token) > 1 else None
        if lead in LOOKALIKE_DASHES or (odd is not None and not _NEGATIVE_LOOKING.match(token)):
            char = lead if lead in LOOKALIKE_DASHES else odd
            bare = "".join("-" if c in LOOKALIKE_DASHES else c for c in name).lstrip("-")
            typed = ("--" if len(bare) > 1 else "-") + bare
            what = (f"begins with {_described(char)}, which only looks like '-' (pasted from a document or a web "
                    "page?)" if char == lead else f"holds {_described(char)}: option names are plain ASCII")
            hint = f"; type {typed}" if typed.isascii() and typed.isprintable() else ""
            raise UsageError(f"{_short(name, 48)} {what}{hint}")
        if token == "--":
            options = False
        elif (options and _NEGATIVE_LOOKING.match(token) and out and out[-1].startswith("--")
              and len(out[-1]) > 2 and "=" not in out[-1]):
            out[-1] = f"{out[-1]}={token}"
            continue
        out.append(token)
    return out


#: Deepest JSON a tool reads (``--additional-config``, a dotted value): no
#: vLLM or Echo setting nests deeper than a few levels, and Python's parser
#: and every walk over the result recurse once per level.
MAX_JSON_DEPTH = 64


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_TEXT:  # int() of 4300+ digits raises, of fewer is slow
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits: at most {MAX_NUMBER_TEXT}")
    return int(text)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object; a key given twice with different values is refused (the
    last would win silently). The same value twice is one setting and passes."""
    obj: dict = {}
    for key, value in pairs:
        if key in obj and obj[key] != value:
            raise ValueError(f"the key {_short(key, 40)} is given twice, with different values")
        obj[key] = value
    return obj


def json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``[``/``{`` nest in the JSON text ``text`` (strings skipped),
    counted up to ``limit + 1``: linear, no recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif char in "]}":
            depth -= 1
    return deepest


def parse_json(text: str) -> Any:
    """JSON text as a tool reads it: at most :data:`MAX_JSON_DEPTH` levels,
    integers of at most :data:`MAX_NUMBER_TEXT` digits, each key of an
    object once (or twice with one value). Raises ``ValueError`` with one
    line, never showing a value (it may be a secret); ``json.JSONDecodeError``
    (a ``ValueError``) for text that is no JSON."""
    depth = json_depth(str(text))
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
    return json.loads(text, parse_int=_json_int, object_pairs_hook=_json_pairs)


# -- argparse types ------------------------------------------------------------------


def _type(name: str, parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` with its ValueErrors as argparse's one-line errors; ``name``
    is what argparse's usage calls the value."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = name
    return convert


def check_range(value: int | float, low: int | float, high: int | float | None, why: str = "",
                shown: str | None = None) -> None:
    """Raise ``ValueError`` naming ``value`` unless ``low <= value <= high``
    (``high=None``: no upper bound); ``why`` says where the bound comes from."""
    if low <= value and (high is None or value <= high):
        return
    allowed = f"at least {low}" if high is None else f"from {low} to {high}"
    raise ValueError(f"{shown if shown is not None else value}: must be {allowed}" + (f" ({why})" if why else ""))


def count(low: int = 1, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """argparse type: a plain integer in ``low..high``; ``why`` (shown when
    the value is out of range) names the reason of the bounds."""

    def parse(text: str) -> int:
        value = parse_int(text)
        check_range(value, low, high, why)
        return value

    return _type("count", parse)


def counts(low: int = 1, high: int | None = None, why: str = "") -> Callable[[str], list[int]]:
    """argparse type: a comma list of :func:`count` values (at least one, each once)."""
    one = count(low, high, why)
    return _type("counts", lambda text: _list(text, one))


def byte_size(low: int = 1, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """argparse type: a :func:`parse_bytes` size in ``low..high`` bytes."""

    def parse(text: str) -> int:
        value = parse_bytes(text)
        check_range(value, low, high, why, shown=f"{_shown(text)} ({value} bytes)" if str(value) != text else None)
        return value

    return _type("size", parse)


def byte_sizes(low: int = 1, high: int | None = None, why: str = "") -> Callable[[str], list[int]]:
    """argparse type: a comma list of :func:`byte_size` values (at least one, each once)."""
    one = byte_size(low, high, why)
    return _type("sizes", lambda text: _list(text, one))


def _list(text: str, one: Callable[[str], object]) -> list:
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{_short(text)}: expected a comma list of values")
    try:
        values = [one(t.strip()) for t in items]
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None
    seen: dict[object, str] = {}
    for typed, value in zip(items, values):  # a repeat would be run twice and reported twice (or merged)
        if value in seen:
            same = "" if seen[value] == typed.strip() else f" ({seen[value]} is the same: {value})"
            raise ValueError(f"{_short(text)}: {typed.strip()} is given twice{same}")
        seen[value] = typed.strip()
    return values


def bit_rates(low: int, high: int, why: str = "") -> Callable[[str], list[int]]:
    """argparse type: a comma list of :func:`parse_bit_rate` rates in
    ``low..high`` bit/s (at least one, each once)."""

    def one(text: str) -> int:
        value = parse_bit_rate(text)
        check_range(value, low, high, why, shown=f"{_shown(text)} ({value} bit/s)")
        return value

    return _type("rates", lambda text: _list(text, one))


def duration(low: float, high: float, why: str = "") -> Callable[[str], float]:
    """argparse type: a :func:`parse_duration` in ``low..high`` seconds."""

    def parse(text: str) -> float:
        value = parse_duration(text)
        check_range(value, low, high, why, shown=f"{_shown(text)} ({value:g} s)")
        return value

    return _type("duration", parse)


def factor(high: int = 1024) -> Callable[[str], int]:
    """argparse type: a ladder's step factor, an integer from 2 to ``high``
    (1 would never reach the top: the ladder would not end)."""
    return count(2, high, "a factor of 1 or less never reaches the largest size")


def real(low: float, high: float, *, low_open: bool = False, why: str = "") -> Callable[[str], float]:
    """argparse type: a finite number in ``[low, high]`` (``(low, high]``
    with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise ValueError(f"not a number: {_short(text)}") from None
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
            side = "above" if low_open else "from"
            raise ValueError(f"{_shown(text)}: must be a finite number {side} {low:g} to {high:g}"
                             + (f" ({why})" if why else ""))
        return value

    return _type("number", parse)


#: Linux's limits (``<linux/limits.h>``): a path the kernel takes is at most
#: ``PATH_MAX - 1`` bytes, each of its names at most ``NAME_MAX`` (the file
#: system's own, read by ``pathconf``, where it says).
PATH_MAX = 4096
NAME_MAX = 255
#: Deepest folder a tool makes or writes into: ``os.makedirs`` and pathlib's
#: ``mkdir`` recurse once per folder they make, and Python stops at 1000
#: frames (a ``RecursionError``); no real layout comes near.
MAX_PATH_DEPTH = 256


def path_problem(text: str, *, room_bytes: int = 0) -> str | None:
    """Why the file system would refuse the path ``text`` (``None``: it
    would not): a name longer than ``NAME_MAX`` bytes, more than
    :data:`MAX_PATH_DEPTH` levels, or, with ``room_bytes`` left for what
    goes inside it (``NAME_MAX + 1`` for a folder's files), a path longer
    than ``PATH_MAX - 1`` bytes. Checked on the absolute path, as the
    kernel sees it; nothing is touched."""
    path = os.path.abspath(os.path.expanduser(str(text)))
    names = [n for n in path.split(os.sep) if n]
    if len(names) > MAX_PATH_DEPTH:
        return f"{len(names)} levels deep: at most {MAX_PATH_DEPTH} (a folder is made per level, recursively)"
    limit = _name_max(path)
    long = next((n for n in names if len(os.fsencode(n)) > limit), None)
    if long is not None:
        return f"the name {_short(long, 40)} is {len(os.fsencode(long))} bytes: the file system takes at most {limit}"
    size = len(os.fsencode(path)) + room_bytes
    if size > PATH_MAX - 1:
        room = f" with room for a file name in it ({room_bytes} bytes)" if room_bytes else ""
        return f"the path is {len(os.fsencode(path))} bytes{room}: the kernel takes at most {PATH_MAX - 1}"
    return None


def _name_max(path: str) -> int:
    """``NAME_MAX`` of the file system ``path`` is (or would be made) on."""
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        return int(os.pathconf(path or os.sep, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX


def folder_problem(text: str) -> str | None:
    """Why a folder cannot be made or written at ``text`` (``None``: it can).
    First :func:`path_problem` (with room for a file name in it); then
    checked by making (and removing) a folder where it goes: permission
    bits say nothing for root, nor of /proc or a read-only mount."""
    problem = path_problem(text, room_bytes=NAME_MAX + 1)
    if problem:
        return problem
    path = os.path.abspath(os.path.expanduser(str(text)))
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a folder"
    parent = path
    while not os.path.exists(parent):
        if os.path.islink(parent):  # makedirs cannot make a folder where a dangling link stands
            target = os.readlink(parent)
            there = os.path.lexists(os.path.join(os.path.dirname(parent), target))
            return f"{parent} is a link to {target}, which " + ("leads round in a loop of links" if there
                                                                  else "does not exist")
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be made, {parent} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".echo-vllm-write-check-", dir=parent))
    except OSError as e:
        where = "the folder" if parent == path else f"{parent}, where it would be made,"
        return f"{where} is not writable ({e.strerror})"
    return None


def path_text_problem(text: str) -> str | None:
    """Why the path ``text`` is not what it shows (``None``: it is): it
    begins or ends with a space (an env file's ``= /data/c`` is a relative
    path, made as a new folder in the current one; ``"out "`` a folder that
    looks like ``out``), or it holds a character that does not print
    (a zero-width space, a control character): the folder made would look
    like another one."""
    text = str(text)
    if text.strip() != text:
        return "begins or ends with a space (a relative path, made in the current folder)"
    odd = next((c for c in text if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if odd is not None:
        return f"holds {_described(odd)}, which does not print: the folder made would look like another one"
    return None


def env_path_problem(text: str) -> str | None:
    """Why a path-valued environment variable's value is refused (``None``:
    it is not): :func:`path_text_problem`, or one the file system refuses
    (:func:`path_problem`)."""
    return path_text_problem(text) or path_problem(text, room_bytes=NAME_MAX + 1)


def out_dir(text: str) -> str:
    """argparse type: a folder the tool can write into, existing or to be
    made (:func:`folder_problem`), with ``~`` expanded."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("'': expected a folder")
    problem = path_text_problem(text) or folder_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{_shown(text)}: {problem}")
    # the folder checked: a quoted ~ (``--out=~/x``) would else make a folder named ~ here
    return os.path.expanduser(str(text))


def out_file(text: str) -> str:
    """argparse type: a file the tool will write whole (``echo_vllm.outputs``):
    not a folder, and in a folder that exists or can be made and written
    (:func:`folder_problem`); ``~`` expanded."""
    path = os.path.expanduser(str(text))
    if not str(text).strip() or path.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: expected a file name")
    if os.path.isdir(path) and not os.path.islink(path):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: is a folder (the result would replace it)")
    problem = path_text_problem(text) or path_problem(path) or folder_problem(os.path.dirname(os.path.abspath(path)))
    if problem:
        raise argparse.ArgumentTypeError(f"{_shown(text)}: {problem}")
    return path


def existing_file(text: str) -> str:
    """argparse type: a readable regular file (a FIFO or a device would block
    the read, or never end it)."""
    if not os.path.isfile(text):
        what = "not a regular file" if os.path.exists(text) else "no such file"
        raise argparse.ArgumentTypeError(f"{_shown(text)}: {what}")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: the file is not readable")
    return text


def existing_dir(text: str) -> str:
    """argparse type: a folder that exists."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: no such folder")
    return text


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma list of ``choices`` (at least one, each once)."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
        if not items:
            raise ValueError(f"{_short(text)}: expected a comma list of {','.join(choices)}")
        for item in items:
            if item not in choices:
                raise ValueError(f"{_short(item)}: choose from {','.join(choices)}{did_you_mean(item, choices)}")
        if len(set(items)) != len(items):
            raise ValueError(f"{_short(text)}: a value is given twice")
        return items

    return _type("list", parse)


_DEVICE = re.compile(r"cpu|cuda(?::\d{1,2})?")


def device(allow_auto: bool = False) -> Callable[[str], str]:
    """argparse type: a torch device name, ``cpu``, ``cuda`` or ``cuda:N``
    (and ``auto`` where the tool picks)."""

    def parse(text: str) -> str:
        t = str(text).strip().lower()
        if (allow_auto and t == "auto") or _DEVICE.fullmatch(t):
            return t
        known = "auto, cpu, cuda, cuda:N" if allow_auto else "cpu, cuda, cuda:N"
        raise ValueError(f"{_short(text)}: not a device ({known})")

    return _type("device", parse)


def file_stem(text: str) -> str:
    """argparse type: a file name stem (letters, digits, ``._+-``): output
    files are named after it, inside the output folder."""
    if not re.fullmatch(r"[\w.+-]{1,100}", str(text)) or str(text) in (".", ".."):
        raise argparse.ArgumentTypeError(f"{_short(text)}: not a file name stem (letters, digits, . _ + -)")
    return str(text)


#: ``scheme://user:password@``: the password of a URL, never printed.
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/?#@\s:]*):[^/?#@\s]*@", re.IGNORECASE)


def hide_url_password(text: str) -> str:
    """``text`` with the password of every URL in it shown as ``***``."""
    return _URL_PASSWORD.sub(r"\1:***@", str(text))


def http_url(text: str) -> str:
    """argparse type: an ``http://`` or ``https://`` URL with a host (and,
    if given, a port in 1..65535), without ``user:password@``: the clients
    that read it (urllib, ``vllm bench serve``) would take that for part of
    the host name, and it would be printed. No error shows the password."""
    from urllib.parse import urlsplit

    shown = _short(hide_url_password(text))
    try:
        parts = urlsplit(str(text).strip())
        port = parts.port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{shown}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise argparse.ArgumentTypeError(f"{shown}: expected http://HOST[:PORT] or https://...")
    if "@" in parts.netloc:
        raise argparse.ArgumentTypeError(f"{shown}: a user or password in the URL is not supported (the "
                                         "clients would read it as part of the host name); give http://HOST[:PORT]")
    return str(text).strip()


def report_errors(prog: str, run: Callable[[], int | None], errors: tuple[type[BaseException], ...] = (UsageError,)) -> int:
    """``run()``'s exit code; one of ``errors`` it raises is printed as
    ``prog: error: <message>`` on one line instead (exit 2)."""
    try:
        return int(run() or 0)
    except errors as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


__all__ = [
    "LOOKALIKE_DASHES", "MAX_JSON_DEPTH", "MAX_PATH_DEPTH", "NAME_MAX", "PATH_MAX", "check_argv", "env_path_problem",
    "json_depth", "parse_json", "path_problem", "path_text_problem",
    "FALSE_TEXT", "MAX_RANKS", "MAX_TOOL_SEED", "RANKS_WHY", "SEED_WHY", "TRUE_TEXT", "UsageError", "bit_rates", "byte_size",
    "byte_sizes", "check_range", "choice_list", "count", "counts", "device", "did_you_mean", "duration", "existing_dir",
    "existing_file", "factor", "file_stem", "folder_problem", "hide_url_password", "http_url", "out_dir", "out_file",
    "parse_bit_rate", "parse_bool", "parse_bytes", "parse_duration", "parse_int", "real", "report_errors",
]
