"""Echo's configuration: one dataclass, validated once, parsed from one place.

Every knob a user can set lives here. The vLLM plugin reads it from
``--additional-config`` (``echo_<field>`` keys; ``echo-<field>``, the CLI's
spelling, reads the same), ``echo-vllm serve`` and the tools from their
``--echo-<field>`` flags. Bad values and unknown ``echo_*`` keys raise
:class:`EchoConfigError` with the offending key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .cli_args import FALSE_TEXT, TRUE_TEXT, UsageError, did_you_mean, parse_bool, parse_bytes, parse_int

#: Group sizes the wire format supports. Smaller groups quantize more finely
#: (a 16-bit scale per group) at the cost of more scale bytes on the wire:
#: g=32 -> 4.5 bit/value, g=64 -> 4.25, g=128 -> 4.125.
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128)

#: Bits per value of Echo's payload: codes in [-7, 7]. The wire format, the
#: kernels and the layout are built for it, so it is not an option.
BITS = 4

#: Options that no longer exist, refused by name with the reason (a config
#: that sets one was written for something Echo does not do).
REMOVED_OPTIONS = {
    "bits": f"Echo's payload is {BITS}-bit only (its wire format, kernels and layout are built for it); "
            "drop the option",
}

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
#: ``DEFAULT_MIN_BYTES``. Held as the word itself, so that it survives
#: ``replace`` and JSON unchanged, and no number (``-1``) means it.
AUTO_BYTES = "auto"

#: Largest ``min_bytes`` / ``max_bytes``: 2^62, so byte counts stay int64
#: wherever they flow (``crossover.NEVER``, "Echo never runs", is this value).
#: Far above any message: a min_bytes above :data:`LARGE_MIN_BYTES` warns.
MAX_MESSAGE_BYTES = 1 << 62
#: ``min_bytes`` above this gets a warning: a prefill of 16k tokens of an
#: 8192-wide model is 256 MiB, so most or every call would take the exact path.
LARGE_MIN_BYTES = 1 << 30
#: Most all-reduce calls a forward pass makes (1 + 2 x layers) for any model
#: served today, with room: the bound of ``first_exact_calls`` and
#: ``health_every``; ``first_exact_calls`` above :data:`MANY_CALLS` warns.
MAX_CALLS = 1 << 16
MANY_CALLS = 1 + 2 * 128
#: Seeds are int64 (torch's generators take no more).
MAX_SEED = (1 << 63) - 1
#: Longest fused-kernel barrier wait: a day. Longer is a hang, not a wait.
MAX_TIMEOUT_S = 24 * 3600.0
#: The fused kernel counts a barrier wait in whole nanoseconds of
#: ``%globaltimer`` (:attr:`EchoConfig.timeout_ns`); a ``timeout_s`` below one
#: is 0 ns there, a trap at the first spin of every wait.
NS_PER_S = 10**9

ROUNDING_MODES = ("nearest", "stochastic")
#: Values of ``EchoConfig.backend`` (``echo_vllm.backends`` registers each).
BACKEND_CHOICES = ("auto", "reference", "triton", "numba", "fused")
#: Values of ``EchoConfig.feedback_dtype`` (formats: ``echo_vllm.quant``'s docstring).
FEEDBACK_DTYPES = ("float32", "bfloat16", "int8")
#: Values of ``EchoConfig.topology`` (``echo_vllm.hosts.choose_topology`` decides ``auto``).
TOPOLOGY_CHOICES = ("auto", "flat", "two_level")
#: Most ranks a ``host_map`` names: far more than any tensor-parallel group.
MAX_HOST_MAP_RANKS = 1024
#: Values of ``EchoConfig.encoder`` (``echo_vllm.quant``'s docstring, Encoders).
ENCODERS = ("absmax", "signed_mse")


class EchoConfigError(UsageError):
    """A configuration value Echo cannot run with (a ``ValueError``; the
    tools print it as a one-line usage error)."""


@dataclass(frozen=True)
class EchoConfig:
    """How one Echo all-reduce quantizes, and what it carries between calls."""

    group_size: int = 32
    """Values per quantization group (one bf16 scale each), one of
    ``SUPPORTED_GROUP_SIZES``; also the Hadamard block size."""

    feedback: bool = True
    """Carry each call's quantization error into the next call of the same
    forward pass (Echo). False gives naive 4-bit, the baseline Echo beats."""

    hadamard: bool = True
    """Rotate every group with a Walsh-Hadamard transform before quantizing
    (undone after the final dequantization). Spreads outlier channels over the
    group so the shared scale fits the rest; costs a few adds per value."""

    rotation_seed: int = 0
    """Which rotation (0 to 2^63 - 1): the signs of a seed-drawn pattern of
    each group's values are flipped before the Hadamard transform and back
    after its inverse (``echo_vllm.rotation``; the same on every rank,
    per column, so batch-invariant). 0, the default, flips none: the plain
    Walsh-Hadamard rotation. Every seed is an orthogonal rotation of the
    same kind, so one accuracy measurement is one draw among them: the
    evaluation runs several seeds to put error bars on its numbers
    (``echo-vllm eval perplexity --draws``). Needs ``hadamard``."""

    exact_last_call: bool = True
    """Run the last all-reduce of a forward pass in 16-bit, consuming the
    carried error so the residual stream enters the final norm / LM head with
    no quantization error left in it."""

    min_bytes: int = AUTO_BYTES
    """Messages smaller than this (in input bytes) take the exact 16-bit path:
    latency-bound sizes gain nothing from a 4x smaller payload. ``"auto"``
    (the default; only the word, no number, means it): the vLLM glue
    measures where Echo beats vLLM's
    all-reduce on this machine at engine start and uses that
    (``echo_vllm.crossover``); elsewhere 256 KiB. Above 1 GiB it warns:
    hardly any message is that large."""

    max_bytes: int = 0
    """Messages larger than this take the exact path (0 = no upper limit).
    Bounds the feedback buffer a deployment must reserve."""

    rounding: str = "nearest"
    """"nearest" (round half to even, deterministic) or "stochastic"
    (unbiased, uses ``seed``)."""

    seed: int = 0
    """Seed of the stochastic-rounding generator (0 to 2^63 - 1); ignored
    for "nearest"."""

    feedback_dtype: str = "bfloat16"
    """Storage dtype of the feedback buffer. bfloat16 (default) halves the
    buffer's memory traffic (stage 1 reads and rewrites it: 8 -> 4 bytes per
    value) and rounds each carried error to 8 significant bits, at most a 2^-8
    relative change of an already small term (no measured accuracy cost:
    EVAL.md, "Why the defaults are what they are"). float32 keeps the
    telescoping exact to fp32 rounding. int8 stores each group's error as int8 codes with one bf16
    scale per group (1 + 2/g bytes per value: 1.06 at g=32), moving each
    value by at most half a step of 1/127 of its group's largest error
    (``echo_vllm.quant``; EVAL.md, "Feedback storage"). Every backend implements
    all three, bit for bit."""

    encoder: str = "absmax"
    """How each quantization group picks its scale and 4-bit codes, on the
    same wire (4 + 16/g bit/value) and with the same decoder, ``(code - 8)
    * scale``. ``absmax`` (the default): the scale is the group's largest
    magnitude over 7, codes in [-7, 7] (zero exact, rounding unbiased).
    ``signed_mse``: the scale carries the sign of the group's largest-
    magnitude value, which lands on code -8, so all 16 codes are used, and
    three ratios of that scale are tried (``quant.SIGNED_MSE_CLIPS``: 8/7,
    absmax's step; 1; 0.95, a clip), keeping the one with the least squared
    error of the group: 27% less one-shot error than absmax on SmolLM2's
    partials, for more arithmetic in the quantizing kernels (stage 1:
    ~1.5x the instructions; ``echo_vllm.quant``, Encoders). Stages 1 and 2
    use it; the int8 feedback format keeps its own quantizer. Every backend
    implements both, bit for bit. The default stays absmax until paired
    perplexity runs with error bars show signed_mse better and its GPU
    kernels run within 5% of absmax's stage-1 time."""

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
    that the early MLPs amplify (the measured effect: EVAL.md, "Why the
    defaults are what they are"). 0 quantizes every call."""

    health_every: int = 16
    """Check every k-th call of a forward pass (call indices k-1, 2k-1, ...)
    that takes Echo for NaN/Inf in its input and output: a few tiny device
    ops added into a counter, no sync, captured into CUDA graphs
    (``echo:nonfinite_total`` on /metrics; ``echo_vllm.health``). 0 turns
    the checks off."""

    fuse_norm: bool = False
    """Off by default: it saves little of a whole layer's time (BENCHMARKS.md,
    "Echo + residual add + RMSNorm in one kernel"), and its
    variance rounds in another order than Inductor's, which can move
    tokens as much as compilation itself does. When on, under
    vLLM's compilation (not ``--enforce-eager``), fold the residual
    add and RMSNorm that follow each residual all-reduce into Echo's output
    phase (a compilation pass on pre-norm models, ``vllm_glue.rmsnorm_fusion``):
    the output is not written and read again, ~2 x tokens x hidden x 2
    bytes less HBM traffic per call. The bits are Echo's output followed by
    vLLM's norm with the variance of Echo's kernels (``echo_vllm.rmsnorm``),
    which rounds its sum in another order than Inductor's kernel. False
    (the default) keeps vLLM's norm after the all-reduce."""

    topology: str = "auto"
    """How Echo crosses hosts (``echo_vllm.hosts``): ``two_level`` reduces
    inside each host first (an exact 16-bit reduce-scatter), runs Echo
    across hosts on each rank's shard (the ranks with the same local index),
    and gathers inside the host: 2(H-1)/H x 4.5 bits per value leave a host
    whatever its number of GPUs. ``flat`` is the one two-shot over all ranks
    (its all-to-all sends every rank's chunks to every remote rank).
    ``auto``: two-level where the group spans 2 or more hosts of equal size
    with 2 or more ranks each, flat otherwise (the reason is logged and on
    /metrics). An explicit ``two_level`` the group cannot run is refused.
    Two-level rounds to nearest (stochastic rounding runs flat)."""

    host_map: tuple[int, ...] | None = None
    """The host of each rank of the group, in group-rank order (``0,0,1,1``:
    ranks 0-1 on one host, 2-3 on another; labels are any integers from 0,
    hosts are numbered by their first rank). None: asked from the group
    once (vLLM: its own node test; elsewhere the ranks' host names). Set it
    where every host reports the same name (containers, network namespaces)
    or to emulate hosts on one machine. Its length must be the group's size
    (checked when the group is known)."""

    timeout_s: float = 60.0
    """Seconds a fused-backend kernel waits for a peer at a barrier before it
    traps instead of hanging: the error names the barrier and the late peer,
    and the process's CUDA context is lost. Generous by default: ranks
    legitimately drift apart by a first-call compilation or a host stall. At
    most a day; at least a nanosecond, the kernel's unit (:attr:`timeout_ns`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "EchoConfig":
        # the generated __init__ would raise a bare TypeError: name the option and why
        for key in kwargs:
            if key not in cls.__dataclass_fields__:
                raise EchoConfigError(_unknown_option(key))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_choice("group_size", self.group_size, SUPPORTED_GROUP_SIZES)
        _check_choice("rounding", self.rounding, ROUNDING_MODES)
        _check_choice("backend", self.backend, BACKEND_CHOICES)
        _check_choice("feedback_dtype", self.feedback_dtype, FEEDBACK_DTYPES)
        _check_choice("topology", self.topology, TOPOLOGY_CHOICES)
        object.__setattr__(self, "host_map", _host_map(self.host_map))
        _check_choice("encoder", self.encoder, ENCODERS)
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise EchoConfigError(f"{name}={value!r:.60}: must be True or False")
        for name, (high, why) in INT_BOUNDS.items():
            value = getattr(self, name)
            if name == "min_bytes" and value == AUTO_BYTES:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
                raise EchoConfigError(f"{name}={value!r:.60}: must be an integer from 0 to {high} ({why})"
                                      + (", or 'auto' (the word: no number means it)" if name == "min_bytes" else ""))
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_TIMEOUT_S:  # NaN fails too
            raise EchoConfigError(f"timeout_s={t!r:.60}: must be a number of seconds above 0, at most "
                                  f"{MAX_TIMEOUT_S:g} (a day: a longer wait at a barrier is a hang)")
        if self.timeout_ns < 1:
            raise EchoConfigError(f"timeout_s={t!r:.60}: must be at least {1 / NS_PER_S:g} s (the fused kernel "
                                  "counts the wait in whole nanoseconds: less is 0 ns, a trap at the first spin)")
        if self.topology == "two_level" and self.rounding == "stochastic":
            raise EchoConfigError("topology='two_level' with rounding='stochastic': two-level Echo rounds to "
                                  "nearest; use rounding='nearest' or topology='flat'")
        if self.rotation_seed and not self.hadamard:
            raise EchoConfigError(
                f"rotation_seed={self.rotation_seed} with hadamard=False: the seed picks the signs flipped "
                "before the Hadamard rotation, and without one it changes nothing; set hadamard=True or drop it")
        if self.batch_invariant and self.rounding == "stochastic":
            raise EchoConfigError(
                "batch_invariant with rounding='stochastic': a value's noise draw depends on its "
                "position in the message, so its bits would depend on the batch; use rounding='nearest'")
        if self.max_bytes and self.effective_min_bytes > self.max_bytes:
            # no message could satisfy both: Echo would never run
            raise EchoConfigError(
                f"min_bytes={self.effective_min_bytes} > max_bytes={self.max_bytes}: no message would take Echo"
            )

    def warnings(self) -> list[str]:
        """Settings that run but leave Echo idle for most or every call, each
        saying why (the tools print them; a refusal would forbid a measurement)."""
        out = []
        if not self.batch_invariant and self.effective_min_bytes > LARGE_MIN_BYTES:
            out.append(
                f"min_bytes={self.effective_min_bytes} ({self.effective_min_bytes / (1 << 30):.4g} GiB): only "
                "messages at least this large take Echo, and a prefill of 16k tokens of an 8192-wide bf16 "
                "model is 0.25 GiB, so most or every all-reduce takes the exact 16-bit path")
        if self.first_exact_calls > MANY_CALLS:
            out.append(
                f"first_exact_calls={self.first_exact_calls}: a forward pass of a 128-layer model makes "
                f"{MANY_CALLS} all-reduce calls, so every call of most models takes the exact 16-bit path")
        return out

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
    def timeout_ns(self) -> int:
        """``timeout_s`` in the fused kernel's unit: whole nanoseconds of
        ``%globaltimer`` (rounded down)."""
        return int(self.timeout_s * NS_PER_S)

    @property
    def qmax(self) -> int:
        """Largest quantized magnitude: symmetric [-7, 7] keeps zero exact and
        the rounding error unbiased (the 16th code, -8, is left unused)."""
        return (1 << (BITS - 1)) - 1

    @property
    def wire_bits_per_value(self) -> float:
        """Payload bits plus the amortised 16-bit scale."""
        return BITS + 16.0 / self.group_size

    # -- parsing ---------------------------------------------------------------

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, prefix: str = "") -> "EchoConfig":
        """Build from a dict such as vLLM's ``additional_config``.

        Keys are field names, with ``-`` read as ``_``. With a ``prefix``
        (e.g. ``echo_``) only keys that carry it are Echo's and others are
        ignored (the rest of vLLM's additional_config); without one every
        key must be a field. An unknown key of Echo's is an error with the
        closest field's name (a typo must not silently run a different
        experiment), and so is a nested dict under the bare prefix
        (``{"echo": {...}}``), which would otherwise be ignored. One field
        in two spellings (``group_size`` and ``group-size``) is refused
        unless both give the same value.
        """
        if not isinstance(raw, Mapping):
            raise EchoConfigError(f"expected a mapping of option: value, got {type(raw).__name__} {raw!r:.60}")
        if not isinstance(prefix, str):
            raise EchoConfigError(f"prefix={prefix!r}: must be text (\"\" for bare field names)")
        names = {f.name: f for f in fields(cls)}
        prefix = prefix.replace("-", "_")
        kwargs: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        for given, value in raw.items():
            if not isinstance(given, str):
                if prefix:
                    continue  # not Echo's: vLLM's additional_config holds other keys too
                raise EchoConfigError(f"option name {given!r}: must be text")
            key = given.replace("-", "_")
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
                raise EchoConfigError(_unknown_option(key, prefix))
            value = _coerce(key, value, names[key].type)
            if key in kwargs and kwargs[key] != value:  # one option in two spellings: neither may win silently
                raise EchoConfigError(f"{spelled[key]!r} and {given!r} are one option, given twice with different "
                                      f"values ({kwargs[key]!r:.30} and {value!r:.30})")
            kwargs[key], spelled[key] = value, given
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_BOOL_FIELDS = tuple(f.name for f in fields(EchoConfig) if f.type in ("bool", bool))

#: Integer fields: (largest value, why); each is at least 0 (``min_bytes``
#: may also be ``AUTO_BYTES``).
INT_BOUNDS = {
    "min_bytes": (MAX_MESSAGE_BYTES, "2^62: byte counts stay int64; no message comes near it"),
    "max_bytes": (MAX_MESSAGE_BYTES, "2^62: byte counts stay int64; 0 means no limit"),
    "first_exact_calls": (MAX_CALLS, "no model's forward pass makes more all-reduce calls"),
    "health_every": (MAX_CALLS, "no model's forward pass makes more all-reduce calls; 0 turns the checks off"),
    "seed": (MAX_SEED, "seeds are int64"),
    "rotation_seed": (MAX_SEED, "seeds are int64"),
}

#: Integer fields that are byte counts: only these take size suffixes
#: (``256k``, ``4MiB``, :func:`parse_bytes`); every other integer is plain
#: (``first_exact_calls=5k`` is an error, not 5120).
BYTE_SIZE_FIELDS = frozenset({"min_bytes", "max_bytes"})


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    # type first: True == 1 and 64.0 == 64 would pass a plain membership test
    if type(value) is not type(choices[0]) or value not in choices:
        shown = ", ".join(map(str, choices))
        hint = ""
        if isinstance(value, str):
            hint = " (a number, not text)" if value in map(str, choices) else did_you_mean(value, choices)
        raise EchoConfigError(f"{name}={value!r:.60}: choose one of {shown}{hint}")


def _host_map(value: Any) -> tuple[int, ...] | None:
    """``host_map`` as a tuple of host labels (integers from 0), or None; a
    list reads as its tuple (JSON has no tuples)."""
    if value is None:
        return None
    if isinstance(value, list):
        value = tuple(value)
    if (not isinstance(value, tuple) or not 1 <= len(value) <= MAX_HOST_MAP_RANKS
            or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in value)):
        raise EchoConfigError(f"host_map={value!r:.80}: must be the host of each rank in group-rank order, "
                              f"integers from 0 (e.g. 0,0,1,1), at most {MAX_HOST_MAP_RANKS} ranks")
    return value


def _parse_host_map(key: str, value: Any) -> Any:
    """``host_map`` from text (``"0,0,1,1"``; ``""`` or ``none``: None), a
    JSON list, or as given (:func:`_host_map` checks it)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("", "none"):
        return None
    try:
        return tuple(parse_int(part) for part in text.split(","))
    except ValueError:
        raise EchoConfigError(f"{key}={value!r:.80}: expected the host of each rank as integers separated by "
                              "commas (e.g. 0,0,1,1)") from None


def _unknown_option(key: str, prefix: str = "") -> str:
    """The error for an option ``prefix + key`` EchoConfig does not have."""
    if key in REMOVED_OPTIONS:
        return f"{prefix + key}: {REMOVED_OPTIONS[key]}"
    known = [prefix + f.name for f in fields(EchoConfig)]
    hint = did_you_mean(prefix + key, known, common=prefix)
    return f"unknown option {prefix + key!r}" + (hint or "; known: " + ", ".join(known))


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Turn strings from the environment or a CLI into the field's type:
    a byte count for :data:`BYTE_SIZE_FIELDS`, a plain integer for other
    int fields, a boolean from :data:`TRUE_TEXT` / :data:`FALSE_TEXT`.
    A value of another type is refused (``3.7`` is not an integer, ``None``
    not a boolean); ranges are the dataclass's."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if key == "host_map":
        return _parse_host_map(key, value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, (str, int)):
            try:
                return parse_bool(str(value))
            except ValueError:
                pass
        raise EchoConfigError(f"{key}={value!r:.60}: expected a boolean (true/false, yes/no, on/off, 1/0)")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if not isinstance(value, str):
            raise EchoConfigError(f"{key}={value!r:.60}: expected an integer")
        if key == "min_bytes" and value.strip().lower() == "auto":
            return AUTO_BYTES
        if key in BYTE_SIZE_FIELDS:
            try:
                nbytes = parse_bytes(value)
            except ValueError as e:
                raise EchoConfigError(f"{key}={value!r:.60}: expected an integer byte count (262144, 256k, 4MiB)"
                                      + (f"; {e}" if "whole number" in str(e) else "")) from None
            if nbytes > MAX_MESSAGE_BYTES:  # named as typed: the parsed number can have 30 digits
                raise EchoConfigError(f"{key}={value!r:.60} ({nbytes:.3g} bytes): must be at most "
                                      f"{MAX_MESSAGE_BYTES} ({INT_BOUNDS[key][1]})")
            return nbytes
        try:
            return parse_int(value)
        except ValueError:
            # a count, not a size: a size suffix here is a mistake, never 1024x
            suffixed = re.fullmatch(r"\s*[\d.]+\s*[kmgt](i?b)?\s*", value, re.IGNORECASE)
            raise EchoConfigError(f"{key}={value!r:.60}: expected an integer" + (
                f" (size suffixes such as k are for {' and '.join(sorted(BYTE_SIZE_FIELDS))} only)"
                if suffixed else "")) from None
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise EchoConfigError(f"{key}={value!r:.60}: too large") from None
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise EchoConfigError(f"{key}={value!r:.60}: expected a number")
    if not isinstance(value, str):
        raise EchoConfigError(f"{key}={value!r:.60}: expected text")
    return value


__all__ = [
    "AUTO_BYTES",
    "BITS",
    "BYTE_SIZE_FIELDS",
    "DEFAULT_MIN_BYTES",
    "ENCODERS",
    "EchoConfig",
    "EchoConfigError",
    "FALSE_TEXT",
    "SUPPORTED_GROUP_SIZES",
    "TOPOLOGY_CHOICES",
    "TRUE_TEXT",
    "parse_bytes",
]
