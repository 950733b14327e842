"""``echo-vllm serve ARGS`` -> ``vllm serve ARGS'``: one pure function.

:func:`rewrite_args` removes Echo's flags (``--tp-comm``, ``--echo-*``), puts
them into vLLM's ``--additional-config`` (merged with whatever the user gave
there, JSON or dotted, ``=`` or space form, or in a ``--config`` YAML file),
switches off the compilation passes that would replace the all-reduce Echo
hooks, rejects combinations that cannot work, and passes every other token to
vLLM unchanged and in order.

What Echo's settings may hold and what they cannot run with are the
plugin's rules, asked here before vLLM starts: the ``additional_config``
the rewrite hands vLLM is parsed by the plugin's own
:meth:`~echo_vllm.vllm_glue.settings.TpCommSettings.from_additional_config`,
and the rule book :func:`echo_vllm.vllm_glue.guards.conflicts` judges it
against what the command line says of the engine; their errors become
argument errors. Checked here alone is how the command line is written
(a flag and a key that contradict each other, an Echo flag without
``--tp-comm echo``, an explicit request for a pass the rewrite turns off).

Merging: vLLM itself keeps only the dotted form when a JSON and a dotted
``--additional-config`` are both given (the dotted dict is parsed last and
replaces the JSON one). With ``--tp-comm echo`` we merge them instead, in
command-line order (later keys win), and hand vLLM one JSON object per
option; with ``--tp-comm nccl`` (stock vLLM) the argv is left as vLLM sees it.
A dotted Echo key (``--additional-config.echo_min_bytes 256k``) is read by
its flag's parser, never by vLLM's "human integer" reading of dotted values.

It reads nothing but ``argv`` (and the ``--config`` file, through an
injectable reader; the installed vLLM's version, from its metadata, when
``bypass_passes`` is not given), imports neither vLLM nor torch's CUDA,
and raises :class:`ServeArgsError` with a one-line message on bad input.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..cli_args import MAX_RANKS, RANKS_WHY, TRUE_TEXT, did_you_mean, parse_bool, parse_int, parse_json
from ..config import REMOVED_OPTIONS, EchoConfig, EchoConfigError
from ..vllm_glue import compat
from ..vllm_glue.guards import BYPASS_PASSES, EngineFacts, conflicts, launch_tp_hosts
from ..vllm_glue.settings import TpCommSettings, normalize_keys
from .flags import (
    ECHO_KEY_PREFIX,
    EMULATE_KEY,
    MEASURE_KEY,
    POSTNORM_KEY,
    TP_COMM_KEY,
    Flag,
    ServeArgsError,
    flags_by_option,
)
from .credentials import misspelled_secret, secret_in, secret_option, secret_refusal

ADDITIONAL_CONFIG = "--additional-config"
COMPILATION_CONFIG = "--compilation-config"
_CONFIG_ALIASES = {ADDITIONAL_CONFIG: ADDITIONAL_CONFIG, COMPILATION_CONFIG: COMPILATION_CONFIG,
                   "-cc": COMPILATION_CONFIG}
_TP_OPTIONS = ("-tp", "--tensor-parallel-size")
_DBO_OPTIONS = {"--enable-dbo": True, "--no-enable-dbo": False}
_UBATCH_OPTION = "--ubatch-size"
_EAGER_OPTIONS = {"--enforce-eager": True, "--no-enforce-eager": False}
_LEVEL_OPTION = "--optimization-level"
#: What the launch says of where the workers run (``guards.launch_tp_hosts``):
#: option -> vLLM's dest. Other multi-node flags (--node-rank, --master-addr,
#: --master-port, --headless) pass through unread.
_LAUNCH_OPTIONS = {"--nnodes": "nnodes", "-n": "nnodes", "--pipeline-parallel-size": "pipeline_parallel_size",
                   "-pp": "pipeline_parallel_size", "--data-parallel-size": "data_parallel_size",
                   "-dp": "data_parallel_size", "--distributed-executor-backend": "distributed_executor_backend"}
#: Integer-valued ones among them (the executor is a name).
_LAUNCH_COUNTS = ("nnodes", "pipeline_parallel_size", "data_parallel_size")

#: The shortest abbreviation vLLM 0.26's ``serve`` parser expands to each
#: option the rewrite reads (argparse takes a prefix that only one of its
#: 372 options starts with: ``--tensor-parallel 2`` is ``-tp 2`` there);
#: ``--config`` and ``--model`` have none (``--config-format``,
#: ``--model-impl``). tests/server/test_server_vllm.py derives the table
#: from the installed parser and checks it.
SHORTEST_ABBREVIATION = {
    "-tp": "-t", "--tensor-parallel-size": "--te", "--enable-dbo": "--enable-d", "--no-enable-dbo": "--no-enable-d",
    "--enforce-eager": "--enf", "--no-enforce-eager": "--no-enf", "--optimization-level": "--op",
    "--ubatch-size": "--ub", "--additional-config": "--ad", "--compilation-config": "--com", "-cc": "-c",
}


def expand_abbreviation(option: str) -> str:
    """``option`` (no ``=value``, no dotted path) as vLLM's parser reads it:
    the full name of an option the rewrite reads when ``option`` abbreviates
    it (:data:`SHORTEST_ABBREVIATION`), else ``option`` as it is."""
    for full, shortest in SHORTEST_ABBREVIATION.items():
        if option.startswith(shortest) and full.startswith(option):
            return full
    return option

#: Compilation passes that remove or replace the all-reduce Echo hooks (the
#: guard rails' list): FlashInfer's fused all-reduce + RMSNorm, sequence
#: parallelism and async TP (GEMM fused with SP's collectives).
BYPASS_PASSES_0_26 = tuple(BYPASS_PASSES)
#: vLLM 0.33 removed enable_sp / fuse_gemm_comms (passing them errors there).
BYPASS_PASSES_0_33 = ("fuse_allreduce_rms",)
_SP_REMOVED_IN = (0, 33)


@dataclass(frozen=True)
class ServeSettings:
    """What the rewrite decided, for the caller, the metrics and the tests."""

    tp_comm: str
    """"echo" or "nccl"."""
    tensor_parallel_size: int
    """As vLLM will parse it (1 when not given)."""
    emulate_tp: int = 0
    """Virtual TP size of the one-GPU emulation; 0 = off."""
    echo: EchoConfig | None = None
    """The resolved Echo configuration (None with --tp-comm nccl)."""
    additional_config: dict = field(default_factory=dict)
    """additional_config handed to vLLM (echo mode) or found (nccl mode)."""
    compilation_config: dict | None = None
    """compilation_config handed to vLLM (echo mode only)."""
    bypass_passes: tuple[str, ...] = ()
    """Pass-config keys switched off because they would bypass Echo."""
    warnings: tuple[str, ...] = ()
    """Settings that run but leave Echo idle for most calls (printed at start)."""

    @property
    def echo_on(self) -> bool:
        return self.tp_comm == "echo"

    @property
    def glue_active(self) -> bool:
        """Echo's vLLM glue runs (Echo on, or the emulation's exact baseline)."""
        return self.echo_on or self.emulate_tp > 0


def bypass_passes_for(vllm_version: str | None) -> tuple[str, ...]:
    """Pass keys to switch off for the installed vLLM (0.26 spelling if unknown)."""
    try:
        removed = compat.version_tuple(vllm_version or "") >= _SP_REMOVED_IN
    except ValueError:
        removed = False
    return BYPASS_PASSES_0_33 if removed else BYPASS_PASSES_0_26


# -- values as vLLM parses them ------------------------------------------------

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_dotted_value(text: str) -> Any:
    """A dotted option's value the way vLLM reads it: JSON, else a
    human-readable integer (``80g`` decimal, ``2K`` binary), else the string.
    JSON is read bounded (:func:`~echo_vllm.cli_args.parse_json`): what it
    refuses raises ``ValueError`` (vLLM's own reading would end in a
    traceback, or keep the last of a key given twice)."""
    try:
        return parse_json(text)
    except json.JSONDecodeError:
        pass
    match = _HUMAN_INT.fullmatch(text.strip())
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." not in number:
            return int(number) * _BINARY[suffix]
    try:
        return int(text)
    except ValueError:
        return text


def _truthy(value: Any) -> bool:
    """Would pydantic read this pass-config value as True?"""
    if isinstance(value, str):
        return value.strip().lower() in TRUE_TEXT
    return bool(value)


# -- scanning ------------------------------------------------------------------


@dataclass
class _Scan:
    """Everything the token walk found, in command-line order."""

    segments: list[tuple[str | None, list[str]]] = field(default_factory=list)
    """Every token except Echo's flags, in order, tagged with the config
    option it belongs to (None for all others)."""
    echo_flags: dict[str, tuple[Flag, Any, str]] = field(default_factory=dict)
    """key -> (flag, raw value, spelling as given); last one wins."""
    configs: dict[str, list[tuple[list[str], Any, bool]]] = field(
        default_factory=lambda: {ADDITIONAL_CONFIG: [], COMPILATION_CONFIG: []}
    )
    """option -> [(dotted path or [], value, append)] in order."""
    tp: int | None = None
    dbo: bool | None = None
    file_tp: int | None = None
    """From a --config file: used only when the command line does not say."""
    file_dbo: bool | None = None
    ubatch: int | None = None
    file_ubatch: int | None = None
    eager: bool | None = None
    file_eager: bool | None = None
    level: str | None = None
    """``-O`` / ``--optimization-level`` as given (0: no CUDA graphs)."""
    file_level: str | None = None
    launch: dict[str, Any] = field(default_factory=dict)
    """:data:`_LAUNCH_OPTIONS`' values by dest, from the command line."""
    file_launch: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_parallel_size(self) -> int:
        return next((v for v in (self.tp, self.file_tp) if v is not None), 1)

    @property
    def enable_dbo(self) -> bool:
        return bool(next((v for v in (self.dbo, self.file_dbo) if v is not None), False))

    @property
    def ubatch_size(self) -> int:
        return next((v for v in (self.ubatch, self.file_ubatch) if v is not None), 0)

    @property
    def enforce_eager(self) -> bool:
        return bool(next((v for v in (self.eager, self.file_eager) if v is not None), False))

    @property
    def optimization_level(self) -> str | None:
        return next((v for v in (self.level, self.file_level) if v is not None), None)

    def launch_value(self, dest: str, default: Any) -> Any:
        return self.launch.get(dest, self.file_launch.get(dest, default))

    @property
    def tp_hosts(self) -> tuple[int, ...] | None:
        """The node of each TP rank where the launch fixes it."""
        return launch_tp_hosts(self.tensor_parallel_size, self.launch_value("pipeline_parallel_size", 1),
                               self.launch_value("data_parallel_size", 1), self.launch_value("nnodes", 1),
                               self.launch_value("distributed_executor_backend", None))


def _split(token: str) -> tuple[str, str | None]:
    """``--max_model_len.a_b=v`` -> (``--max-model-len.a_b``, ``v``): vLLM's spelling rules
    (underscores are dashes in the option name, not in the dotted path)."""
    name, eq, value = token.partition("=")
    if name.startswith("--"):
        head, dot, tail = name[2:].partition(".")
        name = "--" + head.replace("_", "-") + dot + tail
    return name, (value if eq else None)


def _take_value(argv: list[str], i: int, name: str, inline: str | None) -> tuple[str, int]:
    """The option's value (inline or the next token) and the next index."""
    if inline is not None:
        return inline, i + 1
    if i + 1 >= len(argv):
        raise ServeArgsError(f"{name} needs a value")
    return argv[i + 1], i + 2


def _parse_bool(name: str, text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError:
        raise ServeArgsError(f"{name}={text!r}: expected true or false") from None


def _unknown_echo_option(name: str, table: Mapping[str, Flag]) -> str:
    """The error for an ``--echo-*`` / ``--tp-comm*`` option that does not exist."""
    field = name.removeprefix("--no-").removeprefix("--").removeprefix("echo-").replace("-", "_")
    if name.startswith(("--echo-", "--no-echo-")) and field in REMOVED_OPTIONS:
        return f"{name}: {REMOVED_OPTIONS[field]}"
    hint = did_you_mean(name, table, common="--echo-")
    return f"unknown Echo option {name}" + (hint or "; known: " + " ".join(sorted(table)))


def _scan(argv: list[str], read_config: Callable[[str], Mapping[str, Any]]) -> _Scan:
    table = flags_by_option()
    scan = _Scan()
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":  # argparse: everything after is positional
            scan.segments.append((None, argv[i:]))
            break
        if not token.startswith("-") or token == "-":
            scan.segments.append((None, [token]))
            i += 1
            continue
        name, inline = _split(token)
        base, _, path = name.partition(".")
        if name not in table:  # the rewrite reads an abbreviation as vLLM's parser will
            base = expand_abbreviation(base)
            name = base + ("." + path if path else "")

        if name in table:
            flag = table[name]
            if flag.kind == "bool":
                value: Any = name == flag.option
                if inline is not None:
                    value = _parse_bool(name, inline) == value
                i += 1
            else:
                value, i = _take_value(argv, i, name, inline)
            scan.echo_flags[flag.key] = (flag, value, name)
            continue
        if name.startswith(("--echo-", "--no-echo-", "--tp-comm")):
            raise ServeArgsError(_unknown_echo_option(name, table))

        start = i
        if base in _CONFIG_ALIASES:
            option = _CONFIG_ALIASES[base]
            raw, i = _take_value(argv, i, name, inline)
            scan.configs[option].append(_config_entry(option, path, raw))
            scan.segments.append((option, argv[start:i]))
            continue
        if name in _TP_OPTIONS:
            raw, i = _take_value(argv, i, name, inline)
            scan.tp = _int(name, raw)
        elif name in _DBO_OPTIONS:
            scan.dbo = _DBO_OPTIONS[name]
            i += 1
        elif name in _EAGER_OPTIONS:
            scan.eager = _EAGER_OPTIONS[name]
            i += 1
        elif name == _LEVEL_OPTION or (token.startswith("-O") and not token.startswith("-O.")):
            if name == _LEVEL_OPTION:
                scan.level, i = _take_value(argv, i, name, inline)
            elif token == "-O":  # vLLM reads a following 0-3 as the level
                scan.level = argv[i + 1] if i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3") else None
                i += 2 if scan.level is not None else 1
            else:
                scan.level = token[3:] if token[2:3] == "=" else token[2:]
                i += 1
        elif name == _UBATCH_OPTION:
            raw, i = _take_value(argv, i, name, inline)
            scan.ubatch = _int(name, raw)
        elif name in _LAUNCH_OPTIONS:
            raw, i = _take_value(argv, i, name, inline)
            dest = _LAUNCH_OPTIONS[name]
            scan.launch[dest] = _int(name, raw) if dest in _LAUNCH_COUNTS else raw
        elif name == "--config":
            raw, i = _take_value(argv, i, name, inline)
            _scan_config_file(scan, raw, read_config)
        else:
            i += 1  # an option we do not inspect; its value (if any) follows as is
        scan.segments.append((None, argv[start:i]))
    return scan


def _echo_key(key: str) -> bool:
    """An additional_config key of Echo's (``echo_*``, ``tp_comm*``, in
    either spelling), read by Echo's own parsers, not vLLM's."""
    key = next(iter(normalize_keys({key: None})))
    return isinstance(key, str) and key.startswith((ECHO_KEY_PREFIX, TP_COMM_KEY))


def _config_entry(option: str, path: str, raw: str) -> tuple[list[str], Any, bool]:
    """One ``--additional-config`` / ``-cc`` occurrence: a JSON object, or a
    dotted ``.a.b value`` assignment (``.a.b+ x,y`` appends to a list).

    A dotted value is read as vLLM reads it (:func:`parse_dotted_value`),
    except an Echo key's (``--additional-config.echo_min_bytes 256k``): that
    text is kept as typed, for the same parser as its ``--echo-*`` flag
    (``256k`` is 262144 bytes there, not vLLM's 256000, and ``5k`` calls or
    ``1.1k`` bytes are refused, not read as 5000 and 1100)."""
    if not path:
        return [], _json_object(option, raw), False
    keys = path.split(".")
    keys[0] = next(iter(normalize_keys({keys[0]: None})))
    if keys[-1].endswith("+"):
        keys[-1] = keys[-1][:-1]
        return keys, list(raw.split(",")), True
    if option == ADDITIONAL_CONFIG and len(keys) == 1 and _echo_key(keys[0]):
        return keys, raw, False
    try:
        return keys, parse_dotted_value(raw), False
    except ValueError as e:
        raise ServeArgsError(f"{option}.{path}: {e}") from None


def _argv(scan: _Scan, *, drop: tuple[str, ...] = ()) -> list[str]:
    """The kept tokens in order, without the segments of the ``drop`` options."""
    return [token for option, tokens in scan.segments if option not in drop for token in tokens]


def _json_object(option: str, raw: Any) -> dict:
    """``option``'s value (JSON text, or a mapping a ``--config`` file
    held) as a dict, Echo's keys in one spelling (so that a later
    occurrence replaces an earlier one in either). The errors name the
    place, never the text: it may hold a secret."""
    if isinstance(raw, Mapping):
        value: Any = dict(raw)
    else:
        try:
            value = parse_json(raw)
        except json.JSONDecodeError as e:
            raise ServeArgsError(f"{option} is not valid JSON ({e.msg} at character {e.pos})") from None
        except (ValueError, TypeError) as e:
            raise ServeArgsError(f"{option}: {e}") from None
    if not isinstance(value, dict):
        raise ServeArgsError(f"{option} must be a JSON object, got a JSON {type(value).__name__}")
    try:
        return normalize_keys(value)
    except EchoConfigError as e:
        raise ServeArgsError(f"{option}: {e}") from None


def _int(name: str, raw: Any) -> int:
    """An integer as typed or as JSON gave it; ``3.7``, ``true`` and ``4k`` are not."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        try:
            return parse_int(raw)
        except ValueError:
            pass
    raise ServeArgsError(f"{name} {raw!r:.60} is not an integer")


def _scan_config_file(scan: _Scan, path: str, read_config: Callable) -> None:
    """Settings in a vLLM ``--config`` YAML file count as given before the
    command-line flags (vLLM's precedence: command line > config file)."""
    try:
        raw = read_config(path)
    except Exception as e:  # missing file, YAML syntax: the user's input, one line
        mark = getattr(e, "problem_mark", None)  # YAML's own message quotes the line, which may hold a secret
        why = f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else " ".join(str(e).split())
        raise ServeArgsError(f"--config {path}: {why}") from None
    if not isinstance(raw, Mapping):
        raise ServeArgsError(f"--config {path}: expected a mapping of option: value")

    table = flags_by_option()
    for key, value in raw.items():
        name = "--" + str(key).replace("_", "-")
        if name in table or name.startswith("--echo-"):
            raise ServeArgsError(
                f"--config {path}: put Echo's {name} on the command line (vLLM would reject it)")
        if secret_option(name):  # vLLM reads the file into its arguments
            raise ServeArgsError(
                f"--config {path}: holds {key}, which vLLM would print in its argument log; pass it as "
                f"{name} on the command line (handed to vLLM through its environment) instead")
        near = misspelled_secret(name)
        if near is not None:  # vLLM would refuse it, printing its value
            raise ServeArgsError(
                f"--config {path}: holds {key}, not an option of vllm serve; did you mean {near[2:]}? "
                f"(refused here: vLLM's error would print its value; pass {near} on the command line)")
        if name in _CONFIG_ALIASES:
            option = _CONFIG_ALIASES[name]
            # before every command-line entry, wherever --config stood
            scan.configs[option].insert(0, ([], _json_object(option, value), False))
        elif name == "--tensor-parallel-size":
            scan.file_tp = _int(name, value)
        elif name == "--enable-dbo":
            scan.file_dbo = bool(value)
        elif name == _UBATCH_OPTION:
            scan.file_ubatch = _int(name, value)
        elif name == "--enforce-eager":
            scan.file_eager = bool(value)
        elif name == _LEVEL_OPTION:
            scan.file_level = str(value)
        elif name in _LAUNCH_OPTIONS:
            dest = _LAUNCH_OPTIONS[name]
            scan.file_launch[dest] = _int(name, value) if dest in _LAUNCH_COUNTS else value
    found = secret_in(raw)
    if found:  # vLLM reads the file into its arguments, and prints them
        raise secret_refusal(f"--config {path}", found)


def _merge(occurrences: list[tuple[list[str], Any, bool]]) -> dict:
    """Deep-merge JSON objects and dotted assignments in order; ``key+``
    (vLLM's list append) extends a list, everything else replaces."""
    merged: dict = {}
    for keys, value, append in occurrences:
        if not keys:
            _deep_update(merged, value)
            continue
        node = merged
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        last = keys[-1]
        if append and isinstance(node.get(last), list):
            node[last] = node[last] + value
        else:
            node[last] = value
    return merged


def _deep_update(into: dict, update: Mapping) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_update(into[key], value)
        else:
            into[key] = value


def _read_yaml(path: str) -> Mapping[str, Any]:
    import yaml  # vLLM depends on PyYAML; only needed with --config

    if os.path.exists(path) and not os.path.isfile(path):
        # a FIFO (``<(...)``) or a device would block the read forever, and vLLM reads the file again
        raise ValueError("not a regular file (vLLM reads it a second time; a pipe or a device cannot be read twice)")
    with open(path) as f:
        return yaml.safe_load(f) or {}


# -- decisions -----------------------------------------------------------------


def _coerce_field(key: str, value: Any, source: str) -> Any:
    """Echo option ``echo_<field>`` in EchoConfig's type (``256k`` -> 262144);
    unknown fields and bad values are errors naming ``source``."""
    try:
        config = EchoConfig.from_mapping({key: value}, prefix=ECHO_KEY_PREFIX)
    except EchoConfigError as e:
        raise ServeArgsError(f"{source}: {e}") from None
    return getattr(config, key[len(ECHO_KEY_PREFIX):])


def _text(name: str, raw: Any) -> str:
    """A choice as the plugin reads it (validated by the plugin's settings)."""
    return str(raw).strip().lower()


def _bool_value(name: str, raw: Any) -> bool:
    return raw if isinstance(raw, bool) else _parse_bool(name, str(raw))


def _as_given(value: Any) -> str:
    """A user's additional_config value in an error: text as typed (a dotted
    value is kept as text), anything else as JSON wrote it."""
    return value if isinstance(value, str) and value.isprintable() and len(value) <= 60 else json.dumps(value)[:60]


def _flag_or_key(scan: _Scan, additional: dict, key: str, parse: Callable[[str, Any], Any]) -> Any:
    """One setting given as a flag, as an additional_config key, or both
    (then they must agree); None when neither."""
    flagged = scan.echo_flags.get(key)
    value = parse(flagged[2], flagged[1]) if flagged else None
    if key in additional:
        in_config = parse(f"--additional-config {key}", additional[key])
        if value is not None and value != in_config:
            raise ServeArgsError(
                f"{flagged[2]} {flagged[1]} contradicts --additional-config {key}={_as_given(additional[key])}")
        value = in_config if value is None else value
    return value


def _echo_values(scan: _Scan, additional: dict) -> dict[str, Any]:
    """Echo's additional_config entries (flags merged with the user's keys)."""
    values: dict[str, Any] = {}
    for key in additional:
        if key.startswith(ECHO_KEY_PREFIX):
            values[key] = _coerce_field(key, additional[key], f"--additional-config {key}")
    for key, (flag, raw, spelled) in scan.echo_flags.items():
        if flag.field is None:
            continue
        value = _coerce_field(key, raw, spelled)
        if key in values and values[key] != value:
            raise ServeArgsError(
                f"{spelled} {raw} contradicts --additional-config {key}={_as_given(additional[key])}")
        values[key] = value
    return values


def _plugin_settings(additional: dict) -> TpCommSettings:
    """``additional`` as the plugin will read it; its errors as argument errors."""
    try:
        return TpCommSettings.from_additional_config(additional)
    except EchoConfigError as e:
        raise ServeArgsError(str(e)) from None


def _cudagraphs(scan: _Scan) -> bool:
    """Whether vLLM may replay CUDA graphs, as the command line says: yes
    unless ``--enforce-eager``, ``cudagraph_mode`` NONE, or ``-O0`` without
    a ``cudagraph_mode`` (level 0's default is NONE)."""
    if scan.enforce_eager:
        return False
    mode = _merge(scan.configs[COMPILATION_CONFIG]).get("cudagraph_mode")
    if mode is not None:
        return str(mode).strip().upper() not in ("NONE", "0")
    return str(scan.optimization_level).strip() != "0"


def _echo_compilation_config(scan: _Scan, passes: tuple[str, ...]) -> dict:
    """The user's compilation config with the bypassing passes off; an
    explicit request for one of them is a contradiction."""
    compilation = _merge(scan.configs[COMPILATION_CONFIG])
    pass_config = compilation.setdefault("pass_config", {})
    if not isinstance(pass_config, dict):
        raise ServeArgsError(f"--compilation-config pass_config must be an object, got {pass_config!r}")
    for key in passes:
        if key in pass_config and _truthy(pass_config[key]):
            raise ServeArgsError(
                f"--tp-comm echo cannot run with -cc.pass_config.{key}={json.dumps(pass_config[key])}: "
                f"it {BYPASS_PASSES[key]}, bypassing Echo; drop it or use --tp-comm nccl")
        pass_config[key] = False
    return compilation


def rewrite_args(
    argv: list[str],
    *,
    bypass_passes: tuple[str, ...] | None = None,
    read_config: Callable[[str], Mapping[str, Any]] = _read_yaml,
) -> tuple[list[str], ServeSettings]:
    """``echo-vllm serve`` arguments -> (``vllm serve`` arguments, settings).

    ``bypass_passes`` defaults to the installed vLLM's spelling of the passes
    that bypass the all-reduce (see :func:`bypass_passes_for`).
    """
    argv = list(argv)
    scan = _scan(argv, read_config)
    additional = normalize_keys(_merge(scan.configs[ADDITIONAL_CONFIG]))
    if isinstance(additional.get("echo"), Mapping):
        raise ServeArgsError("--additional-config: a nested \"echo\" object is not read; write "
                             "echo_<field> keys (e.g. echo_group_size) or --echo-<field> flags")
    tp = scan.tensor_parallel_size
    if tp < 1:
        raise ServeArgsError(f"--tensor-parallel-size {tp}: must be >= 1")
    tp_comm = _flag_or_key(scan, additional, TP_COMM_KEY, _text)
    tp_comm = "nccl" if tp_comm is None else tp_comm  # "" is refused by the plugin's settings, not read as nccl
    emulate = _flag_or_key(scan, additional, EMULATE_KEY, _int) or 0
    measure = _flag_or_key(scan, additional, MEASURE_KEY, _bool_value)
    postnorm = _flag_or_key(scan, additional, POSTNORM_KEY, _text)
    given = {key: value for key, value in ((MEASURE_KEY, measure), (POSTNORM_KEY, postnorm)) if value is not None}
    echo_values = _echo_values(scan, additional) if tp_comm == "echo" else {}
    plugin = _plugin_settings({**additional, TP_COMM_KEY: tp_comm, EMULATE_KEY: emulate, **given, **echo_values})
    if plugin.active and tp > MAX_RANKS:
        raise ServeArgsError(f"--tensor-parallel-size {tp}: Echo runs on groups of at most {MAX_RANKS} ({RANKS_WHY})")
    if plugin.tp_comm == "nccl":
        echo_only = sorted(spelled for flag, _, spelled in scan.echo_flags.values() if flag.field is not None)
        if echo_only:
            raise ServeArgsError(f"{' '.join(echo_only)} needs --tp-comm echo (nccl is vLLM's own all-reduce)")
    # no bypassing pass is on: the rewrite turns them off, and refuses an explicit request for one
    engine = EngineFacts(tensor_parallel_size=tp, enable_dbo=scan.enable_dbo, ubatch_size=scan.ubatch_size,
                         cudagraphs=_cudagraphs(scan), tp_hosts=scan.tp_hosts)
    for problem in conflicts(plugin, engine):
        raise ServeArgsError(problem.message)
    emulation = {EMULATE_KEY: emulate, **({MEASURE_KEY: measure} if measure is not None else {})} if emulate else {}
    emulation.update({POSTNORM_KEY: postnorm} if postnorm is not None else {})

    if plugin.tp_comm == "nccl":
        if not emulate:  # stock vLLM: argv untouched
            return _argv(scan), ServeSettings("nccl", tp, additional_config=additional)
        # the emulation's exact baseline: the same P partials summed in 16-bit
        additional.update({TP_COMM_KEY: "nccl", **emulation})
        vllm_argv = _argv(scan, drop=(ADDITIONAL_CONFIG,)) + [ADDITIONAL_CONFIG, json.dumps(additional)]
        return vllm_argv, ServeSettings("nccl", tp, emulate, additional_config=additional)

    passes = bypass_passes_for(compat.vllm_version()) if bypass_passes is None else bypass_passes
    compilation = _echo_compilation_config(scan, passes)
    additional.update({TP_COMM_KEY: "echo", **echo_values, **emulation})
    vllm_argv = _argv(scan, drop=(ADDITIONAL_CONFIG, COMPILATION_CONFIG)) + [
        ADDITIONAL_CONFIG, json.dumps(additional),
        COMPILATION_CONFIG, json.dumps(compilation),
    ]
    return vllm_argv, ServeSettings("echo", tp, emulate, plugin.echo, additional, compilation, tuple(passes),
                                    tuple(plugin.echo.warnings()))


def verify_parsed(args: Any, settings: ServeSettings) -> list[str]:
    """Differences between what vLLM parsed and what the rewrite decided.

    Catches what an argv scan cannot see: abbreviated options (argparse
    accepts ``--enable-db``), values from sources we did not read. Empty
    list = consistent. ``args`` is vLLM's parsed namespace.
    """
    if not settings.glue_active:
        return []
    problems = []
    parsed_tp = getattr(args, "tensor_parallel_size", None)
    if parsed_tp != settings.tensor_parallel_size:
        problems.append(f"tensor_parallel_size={parsed_tp} where the rewrite read {settings.tensor_parallel_size}")
    if getattr(args, "enable_dbo", False):
        problems.append("enable_dbo is on")
    if (getattr(args, "ubatch_size", 0) or 0) > 1:
        problems.append(f"ubatch_size={args.ubatch_size}, expected <= 1")
    additional = getattr(args, "additional_config", None) or {}
    for key in (TP_COMM_KEY, EMULATE_KEY):
        if additional.get(key) != settings.additional_config.get(key):
            problems.append(f"additional_config {key}={additional.get(key)!r}, "
                            f"expected {settings.additional_config.get(key)!r}")
    pass_config = getattr(getattr(args, "compilation_config", None), "pass_config", None)
    for key in settings.bypass_passes:
        value = getattr(pass_config, key, None)
        if value is not False:
            problems.append(f"compilation_config.pass_config.{key}={value!r}, expected False")
    return problems
