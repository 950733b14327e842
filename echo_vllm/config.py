"""Echo's configuration: one dataclass, validated once, parsed from one place.

Every knob a user can set lives here. The vLLM plugin reads it from
``--additional-config`` (``echo_<field>`` keys; ``echo-<field>``, the CLI's
spelling, reads the same), ``echo-vllm serve`` and the tools from their
``--echo-<field>`` flags. Bad values and unknown ``echo_*`` keys raise
:class:`EchoConfigError` with the offending key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

#: Group sizes the wire format supports. Smaller groups quantize more finely
#: (a 16-bit scale per group) at the cost of more scale bytes on the wire:
#: g=32 -> 4.5 bit/value, g=64 -> 4.25, g=128 -> 4.125.
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128)

#: Only 4-bit payloads exist today; the field is kept so configs say it.
SUPPORTED_BITS = (4,)

#: Below this a quantized two-shot all-reduce is not expected to beat a 16-bit
#: one-shot all-reduce on NVLink: its kernels have a latency floor above vLLM's
#: custom all-reduce at decode sizes. An estimate, not a measurement: where a
#: real link exists, ``min_bytes="auto"`` measures the crossover instead
#: (``echo_vllm.crossover``). Prefill messages (tokens x hidden x 2 bytes) are
#: far above it.
DEFAULT_MIN_BYTES = 256 * 1024

#: ``min_bytes="auto"``: the crossover is measured at engine start
#: (``echo_vllm.crossover``); until then, and where nothing is measured (no
#: real link: the emulation, plain ``EchoCommunicator`` use), it is
#: ``DEFAULT_MIN_BYTES``.
AUTO_BYTES = -1

ROUNDING_MODES = ("nearest", "stochastic")
#: Values of ``EchoConfig.backend`` (``echo_vllm.backends`` registers each).
BACKEND_CHOICES = ("auto", "reference", "triton", "numba", "fused")
#: Values of ``EchoConfig.feedback_dtype`` (formats: ``echo_vllm.quant``'s docstring).
FEEDBACK_DTYPES = ("float32", "bfloat16", "int8")


class EchoConfigError(ValueError):
    """A configuration value Echo cannot run with."""


@dataclass(frozen=True)
class EchoConfig:
    """How one Echo all-reduce quantizes, and what it carries between calls."""

    group_size: int = 32
    """Values per quantization group (one bf16 scale each). Power of two in
    SUPPORTED_GROUP_SIZES; also the Hadamard block size."""

    bits: int = 4
    """Bits per value on the wire. Only 4 is implemented."""

    feedback: bool = True
    """Carry each call's quantization error into the next call of the same
    forward pass (Echo). False gives naive 4-bit, the baseline Echo beats."""

    hadamard: bool = True
    """Rotate every group with a Walsh-Hadamard transform before quantizing
    (undone after the final dequantization). Spreads outlier channels over the
    group so the shared scale fits the rest; costs a few adds per value."""

    exact_last_call: bool = True
    """Run the last all-reduce of a forward pass in 16-bit, consuming the
    carried error so the residual stream enters the final norm / LM head with
    no quantization error left in it."""

    min_bytes: int = AUTO_BYTES
    """Messages smaller than this (in input bytes) take the exact 16-bit path:
    latency-bound sizes gain nothing from a 4x smaller payload. ``"auto"``
    (the default, stored as ``AUTO_BYTES``): the vLLM glue measures where
    Echo beats vLLM's all-reduce on this machine at engine start and uses
    that (``echo_vllm.crossover``); elsewhere ``DEFAULT_MIN_BYTES``."""

    max_bytes: int = 0
    """Messages larger than this take the exact path (0 = no upper limit).
    Bounds the feedback buffer a deployment must reserve."""

    rounding: str = "nearest"
    """"nearest" (round half to even, deterministic) or "stochastic"
    (unbiased, uses ``seed``)."""

    seed: int = 0
    """Seed of the stochastic-rounding generator; ignored for "nearest"."""

    feedback_dtype: str = "bfloat16"
    """Storage dtype of the feedback buffer. bfloat16 (default) halves the
    buffer's memory traffic (stage 1 reads and rewrites it: 8 -> 4 bytes per
    value) and rounds each carried error to 8 significant bits, at most a 2^-8
    relative change of an already small term (no measured accuracy cost:
    EVAL.md, section 1). float32 keeps the telescoping exact to fp32
    rounding. int8 stores each group's error as int8 codes with one bf16
    scale per group (1 + 2/g bytes per value: 1.06 at g=32), moving each
    value by at most half a step of 1/127 of its group's largest error
    (``echo_vllm.quant``; EVAL.md, section 9). Every backend implements
    all three, bit for bit."""

    batch_invariant: bool = False
    """Make every path choice independent of the batch: ``min_bytes`` and
    ``max_bytes`` are not applied (a message's size depends on what else is
    in its batch), so every residual call takes the path its call index
    gives, and the layout makes a token's bits independent of its batch.
    The vLLM glue sets it when vLLM's batch-invariant mode
    (``VLLM_BATCH_INVARIANT``) is on. Refuses stochastic rounding, whose
    noise draw depends on a value's position in the message."""

    backend: str = "auto"
    """Which implementation runs a call (``echo_vllm.backends``): ``auto``
    picks from the device, ``ECHO_KERNELS`` and the group (``fused``, one
    kernel over symmetric memory, where the group's GPUs are P2P on one
    host; else the Triton stage kernels for CUDA tensors, the references on
    CPU); ``fused``, ``triton``, ``reference`` or ``numba`` force one (same
    bits)."""

    first_exact_calls: int = 5
    """Run the first k calls of every forward pass in 16-bit. The default 5
    covers the embedding and the first two layers (o_proj, down_proj each)
    of a 1 + 2L-call transformer: there the residual stream is only one or
    two updates, so one call's 4-bit error is a large relative perturbation
    that the early MLPs amplify (the measured effect: EVAL.md, section 1).
    0 quantizes every call."""

    health_every: int = 16
    """Check every k-th call of a forward pass (call indices k-1, 2k-1, ...)
    that takes Echo for NaN/Inf in its input and output: a few tiny device
    ops added into a counter, no sync, captured into CUDA graphs
    (``echo:nonfinite_total`` on /metrics; ``echo_vllm.health``). 0 turns
    the checks off."""

    fuse_norm: bool = True
    """Under vLLM's compilation (not ``--enforce-eager``), fold the residual
    add and RMSNorm that follow each residual all-reduce into Echo's output
    phase (a compilation pass on pre-norm models, ``vllm_glue.norm_fusion``):
    the output is not written and read again, ~2 x tokens x hidden x 2
    bytes less HBM traffic per call. The bits are Echo's output followed by
    vLLM's norm with the variance of Echo's kernels (``echo_vllm.norm``),
    which rounds its sum in another order than Inductor's kernel. False
    keeps vLLM's norm after the all-reduce."""

    timeout_s: float = 60.0
    """Seconds a fused-backend kernel waits for a peer at a barrier before it
    traps (a CUDA error naming nothing, instead of a hang; the process's CUDA
    context is lost). Generous by default: ranks legitimately drift apart by
    a first-call compilation or a host stall."""

    def __post_init__(self) -> None:
        g = self.group_size
        if not isinstance(g, int) or g not in SUPPORTED_GROUP_SIZES:
            raise EchoConfigError(
                f"group_size={g!r}: must be a power of two in {SUPPORTED_GROUP_SIZES}"
            )
        if self.bits not in SUPPORTED_BITS:
            raise EchoConfigError(f"bits={self.bits!r}: only {SUPPORTED_BITS} is implemented")
        if self.rounding not in ROUNDING_MODES:
            raise EchoConfigError(f"rounding={self.rounding!r}: choose one of {ROUNDING_MODES}")
        if self.backend not in BACKEND_CHOICES:
            raise EchoConfigError(f"backend={self.backend!r}: choose one of {BACKEND_CHOICES}")
        if self.feedback_dtype not in FEEDBACK_DTYPES:
            raise EchoConfigError(
                f"feedback_dtype={self.feedback_dtype!r}: choose one of {FEEDBACK_DTYPES}"
            )
        for name in ("min_bytes", "max_bytes", "first_exact_calls", "seed", "health_every"):
            value = getattr(self, name)
            auto = name == "min_bytes" and value == AUTO_BYTES
            if not isinstance(value, int) or isinstance(value, bool) or (value < 0 and not auto):
                raise EchoConfigError(f"{name}={value!r}: must be a non-negative integer"
                                      + (" or 'auto'" if name == "min_bytes" else ""))
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise EchoConfigError(f"timeout_s={t!r}: must be a positive number of seconds")
        if self.batch_invariant and self.rounding == "stochastic":
            raise EchoConfigError(
                "batch_invariant with rounding='stochastic': a value's noise draw depends on its "
                "position in the message, so its bits would depend on the batch; use rounding='nearest'")
        if self.max_bytes and self.effective_min_bytes > self.max_bytes:
            # no message could satisfy both: Echo would never run
            raise EchoConfigError(
                f"min_bytes={self.effective_min_bytes} > max_bytes={self.max_bytes}: no message would take Echo"
            )

    # -- presets -------------------------------------------------------------

    @classmethod
    def naive(cls, **overrides: Any) -> "EchoConfig":
        """Plain 4-bit two-shot all-reduce: no feedback, no rotation, no exact
        first or last calls -- every call quantized. The baseline every Echo
        number is compared with."""
        base = dict(feedback=False, hadamard=False, exact_last_call=False, first_exact_calls=0)
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes: Any) -> "EchoConfig":
        return dataclasses.replace(self, **changes)

    @property
    def min_bytes_auto(self) -> bool:
        """``min_bytes="auto"``: to be measured (``echo_vllm.crossover``)."""
        return self.min_bytes == AUTO_BYTES

    @property
    def effective_min_bytes(self) -> int:
        """The threshold the policy applies: ``DEFAULT_MIN_BYTES`` while auto."""
        return DEFAULT_MIN_BYTES if self.min_bytes_auto else self.min_bytes

    @property
    def qmax(self) -> int:
        """Largest quantized magnitude: symmetric [-7, 7] keeps zero exact and
        the rounding error unbiased (the 16th code, -8, is left unused)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def wire_bits_per_value(self) -> float:
        """Payload bits plus the amortised 16-bit scale."""
        return self.bits + 16.0 / self.group_size

    # -- parsing ---------------------------------------------------------------

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, prefix: str = "") -> "EchoConfig":
        """Build from a dict such as vLLM's ``additional_config``.

        Keys are field names, optionally with ``prefix`` (e.g. ``echo_``),
        with ``-`` read as ``_``; unknown keys that carry the prefix are an
        error (a typo must not silently run a different experiment), and so
        is a nested dict under the bare prefix (``{"echo": {...}}``), which
        would otherwise be ignored; other keys are ignored.
        """
        names = {f.name: f for f in fields(cls)}
        prefix = prefix.replace("-", "_")
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            if not isinstance(key, str):
                continue
            key = key.replace("-", "_")
            if prefix and key == prefix.rstrip("_"):
                raise EchoConfigError(
                    f"{key!r}: nested options are not read; write them as {prefix}<field> keys, "
                    f"e.g. {prefix}group_size"
                )
            if prefix:
                if not key.startswith(prefix):
                    continue
                key = key[len(prefix):]
            if key not in names:
                if prefix:
                    raise EchoConfigError(
                        f"unknown option {prefix + key!r}; known: "
                        + ", ".join(prefix + n for n in names)
                    )
                continue
            kwargs[key] = _coerce(key, value, names[key].type)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Boolean spellings: pydantic's (what vLLM accepts for its own flags), so a
#: value reads the same in ``--echo-*`` flags and in ``--additional-config``.
TRUE_TEXT = frozenset({"1", "true", "t", "yes", "y", "on"})
FALSE_TEXT = frozenset({"0", "false", "f", "no", "n", "off"})


#: Integer fields that are byte counts: only these take size suffixes
#: (``256k``, ``4MiB``, :func:`parse_bytes`); every other integer is plain
#: (``first_exact_calls=5k`` is an error, not 5120).
BYTE_SIZE_FIELDS = frozenset({"min_bytes", "max_bytes"})


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Turn strings from the environment or a CLI into the field's type:
    a byte count for :data:`BYTE_SIZE_FIELDS`, a plain integer for other
    int fields, a boolean from :data:`TRUE_TEXT` / :data:`FALSE_TEXT`."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in TRUE_TEXT:
            return True
        if text in FALSE_TEXT:
            return False
        raise EchoConfigError(f"{key}={value!r}: expected a boolean")
    if kind == "int":
        if isinstance(value, bool):
            raise EchoConfigError(f"{key}={value!r}: expected an integer")
        if isinstance(value, int):
            return value
        if key == "min_bytes" and str(value).strip().lower() == "auto":
            return AUTO_BYTES
        if key in BYTE_SIZE_FIELDS:
            try:
                return parse_bytes(str(value))
            except ValueError:
                raise EchoConfigError(f"{key}={value!r}: expected an integer byte count (262144, 256k, 4MiB)") from None
        try:
            return int(str(value).strip())
        except ValueError:
            # a count, not a size: a size suffix here is a mistake, never 1024x
            raise EchoConfigError(f"{key}={value!r}: expected an integer (size suffixes such as k "
                                  f"are for {' and '.join(sorted(BYTE_SIZE_FIELDS))} only)") from None
    if kind == "float":
        if isinstance(value, bool):
            raise EchoConfigError(f"{key}={value!r}: expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return float(str(value).strip())
        except ValueError:
            raise EchoConfigError(f"{key}={value!r}: expected a number") from None
    return str(value) if not isinstance(value, str) else value


#: Binary size suffixes (``k`` = KiB, ...); a trailing ``b`` / ``ib`` is optional.
_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt])(?:i?b)?|(\d+)\s*b?|(0x[0-9a-f]+)")


def parse_bytes(text: str) -> int:
    """A byte count: ``262144``, ``256k``, ``4MiB``, ``1.5G``, ``64MB`` (suffixes
    binary), ``0x40000``. The config's and the benchmarks' one parser."""
    t = str(text).strip().lower().replace("_", "")
    m = _SIZE.fullmatch(t)
    if m is None:
        raise ValueError(f"not a byte count: {text!r}")
    number, suffix, plain, hexa = m.groups()
    if hexa:
        return int(hexa, 16)
    if plain:
        return int(plain)
    return int(float(number) * _SUFFIXES[suffix])


__all__ = [
    "AUTO_BYTES",
    "BYTE_SIZE_FIELDS",
    "DEFAULT_MIN_BYTES",
    "EchoConfig",
    "EchoConfigError",
    "SUPPORTED_GROUP_SIZES",
]
