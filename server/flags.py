"""Echo's own ``echo-vllm serve`` flags, derived from :class:`EchoConfig`.

Every EchoConfig field becomes one flag (``group_size`` -> ``--echo-group-size``;
booleans also get ``--no-echo-...``), with the field's default and its
docstring as help, so the command line can never drift from the config.
Four flags are not EchoConfig fields: ``--tp-comm`` (which all-reduce vLLM
uses), ``--echo-emulate-tp`` (one-GPU emulation of TP=P),
``--echo-emulate-measure`` and ``--echo-postnorm`` (what Echo does on a
post-norm model).

Each flag knows the vLLM ``additional_config`` key the plugin reads it from.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Any

from ..config import (AUTO_BYTES, BACKEND_CHOICES, BYTE_SIZE_FIELDS, ENCODERS, FEEDBACK_DTYPES, ROUNDING_MODES,
                      SUPPORTED_GROUP_SIZES, TOPOLOGY_CHOICES, EchoConfig)
from ..postnorm_policy import DEFAULT_POSTNORM_POLICY, POSTNORM_POLICIES
# the keys and modes are the plugin's (one list: the plugin refuses what it does not know)
from ..vllm_glue.settings import EMULATE_KEY, MEASURE_KEY, POSTNORM_KEY, TP_COMM_KEY
from ..vllm_glue.settings import TP_COMM_CHOICES


class ServeArgsError(ValueError):
    """A command line ``echo-vllm serve`` refuses; the message is one line."""


ECHO_KEY_PREFIX = "echo_"
"""additional_config keys ``echo_<EchoConfig field>`` carry Echo's options."""

#: Allowed values shown in --help (validation itself is EchoConfig's).
_CHOICES: dict[str, tuple] = {
    "group_size": SUPPORTED_GROUP_SIZES,
    "rounding": ROUNDING_MODES,
    "feedback_dtype": FEEDBACK_DTYPES,
    "encoder": ENCODERS,
    "backend": BACKEND_CHOICES,
    "topology": TOPOLOGY_CHOICES,
}

#: Fields whose value is a list, typed as text (``--echo-host-map 0,0,1,1``; EchoConfig parses it).
_LIST_FIELDS = {"host_map": "H0,H1,..."}


@dataclass(frozen=True)
class Flag:
    """One Echo command-line flag."""

    option: str
    """``--echo-group-size``; booleans also accept ``--no-`` + option[2:]."""
    key: str
    """additional_config key the value lands in."""
    kind: str
    """"bool", "int", "float", "str", "choice" or "list" (comma-separated text)."""
    default: Any
    help: str
    choices: tuple = ()

    @property
    def negative(self) -> str | None:
        return "--no-" + self.option[2:] if self.kind == "bool" else None

    @property
    def field(self) -> str | None:
        """The EchoConfig field, or None for the tp_comm* flags."""
        return self.key[len(ECHO_KEY_PREFIX):] if self.key.startswith(ECHO_KEY_PREFIX) else None


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (frozen app): flags without help text
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


#: Constants whose value is a sentinel: the help shows the spelling a user types.
_SHOWN_AS = {"AUTO_BYTES": "auto"}


def _with_values(text: str) -> str:
    """``text`` as a terminal shows it: each ````NAME```` of a constant of
    :mod:`echo_vllm.config` written as its value (the docstrings name the
    constant, one source; the help shows what it holds), and every other
    reStructuredText literal ````x```` as `x`."""
    from .. import config

    def value(match: re.Match) -> str:
        name = match.group(1)
        if name in _SHOWN_AS:
            return _SHOWN_AS[name]
        held = getattr(config, name, None) if name.isupper() else None
        if isinstance(held, tuple):
            return ", ".join(map(str, held))
        return f"`{name}`" if held is None else str(held)

    return re.sub(r"``([^`]+)``", value, text)


@functools.lru_cache(maxsize=1)
def echo_flags() -> tuple[Flag, ...]:
    """All Echo flags: the four tp_comm* ones, then one per EchoConfig field."""
    docs = _field_docs(EchoConfig)
    flags = [
        Flag("--tp-comm", TP_COMM_KEY, "choice", "nccl",
             "Tensor-parallel all-reduce: 'echo' (4-bit, error feedback) or 'nccl' "
             "(stock vLLM, the default).", TP_COMM_CHOICES),
        Flag("--echo-emulate-tp", EMULATE_KEY, "int", 0,
             "Emulate TP=P on one GPU (needs --tensor-parallel-size 1): every "
             "row-parallel layer is split into P partial matmuls, reduced by Echo "
             "(--tp-comm echo) or summed exactly in 16-bit (--tp-comm nccl, the "
             "baseline). 0 = off."),
        Flag("--echo-emulate-measure", MEASURE_KEY, "bool", False,
             "With --echo-emulate-tp: also measure the residual stream's accumulated "
             "communication error per forward pass (eager mode; an fp32 sum per call)."),
        Flag("--echo-postnorm", POSTNORM_KEY, "choice", DEFAULT_POSTNORM_POLICY,
             "On a post-norm model (Gemma-2/3/4, OLMo-2/3, EXAONE-4), where the error "
             "feedback cannot cancel: 'exact' (default) keeps vLLM's 16-bit all-reduce, "
             "'no-feedback' runs Echo without feedback (costs accuracy), 'feedback' keeps it "
             "(measurement only). Other models ignore it.",
             POSTNORM_POLICIES),
    ]
    for f in dataclasses.fields(EchoConfig):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        choices = _CHOICES.get(f.name, ())
        if kind == "str" and choices:
            kind = "choice"
        if f.name in _LIST_FIELDS:
            kind = "list"
        flags.append(Flag("--echo-" + f.name.replace("_", "-"), ECHO_KEY_PREFIX + f.name,
                          kind, f.default, docs.get(f.name, ""), tuple(choices)))
    return tuple(flags)


def flags_by_option() -> dict[str, Flag]:
    """Every accepted spelling (``--x`` and ``--no-x``) -> its flag."""
    table: dict[str, Flag] = {}
    for flag in echo_flags():
        table[flag.option] = flag
        if flag.negative:
            table[flag.negative] = flag
    return table


def format_help(width: int = 100) -> str:
    """Echo's section of ``echo-vllm serve --help``."""
    lines = [
        "usage: echo-vllm serve MODEL [vllm serve options] [--tp-comm {nccl,echo}] [echo options]",
        "",
        "Runs vLLM's own OpenAI-compatible server (`vllm serve`). Echo's flags are",
        "rewritten into vLLM's --additional-config (keys tp_comm, tp_comm_emulate,",
        "echo_<option>), and with --tp-comm echo the compilation passes that would",
        "bypass the all-reduce are switched off. Every other flag goes to vLLM as is.",
        "",
        "Echo options:",
    ]
    for flag in echo_flags():
        spell = flag.option if flag.kind != "bool" else f"{flag.option}, {flag.negative}"
        if flag.kind == "int":
            # byte sizes take suffixes (256k); counts are plain integers
            spell += " SIZE" if flag.field in BYTE_SIZE_FIELDS else " N"
        elif flag.kind == "float":
            spell += " SECONDS" if flag.field and flag.field.endswith("_s") else " X"
        elif flag.kind == "choice":
            spell += " {" + ",".join(str(c) for c in flag.choices) + "}"
        elif flag.kind == "str":
            spell += " TEXT"
        elif flag.kind == "list":
            spell += " " + _LIST_FIELDS[flag.field]
        lines.append(f"  {spell}")
        text = _with_values(flag.help)
        default = "auto" if flag.field == "min_bytes" and flag.default == AUTO_BYTES else flag.default
        text += f" (default: {default})"
        lines += textwrap.wrap(text, width, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines)
