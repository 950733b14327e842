"""What an engine asks of Echo, read from vLLM's ``additional_config``.

A plugin cannot add flags to ``vllm serve``; ``--additional-config`` reaches
every worker and is part of vLLM's compile hash, so that is where Echo's
switches live::

    --additional-config '{"tp_comm": "echo", "echo_group_size": 64}'
    --additional-config '{"tp_comm": "echo", "tp_comm_emulate": 4}'   # one GPU

Keys
----
``tp_comm``
    ``"nccl"`` (default: vLLM's own all-reduce, untouched) or ``"echo"``.
``tp_comm_emulate``
    P >= 2: emulate tensor parallelism of size P on one device
    (``--tensor-parallel-size 1``); ``tp_comm`` then picks Echo or the exact
    16-bit sum of the same P partials (the baseline).
``tp_comm_emulate_measure``
    With emulation, also track the residual stream's accumulated
    communication error per forward pass (eager mode only; costs an fp32
    sum per call).
``tp_comm_postnorm``
    What Echo does on a post-norm model (Gemma-2/3, OLMo-2, ...; see
    :mod:`echo_vllm.postnorm_policy`): ``"exact"`` (default: Echo off for that
    model), ``"no-feedback"`` (Echo without error feedback) or
    ``"feedback"`` (as configured, for measurement). Ignored for other models.
``echo_<field>``
    Any :class:`~echo_vllm.config.EchoConfig` field, e.g. ``echo_feedback``,
    ``echo_min_bytes``. Unknown ``echo_*`` or ``tp_comm*`` keys are errors: a
    typo must not silently run a different experiment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..cli_args import MAX_RANKS, RANKS_WHY, did_you_mean
from ..config import EchoConfig, EchoConfigError, _coerce
from ..postnorm_policy import (
    DEFAULT_POSTNORM_POLICY,
    POSTNORM_POLICIES,
    decide_postnorm,
    postnorm_config,
)

#: Values of ``tp_comm`` (vLLM users' words: ``nccl`` is vLLM's own all-reduce, the
#: 16-bit one; inside Echo the same all-reduce is ``exact``, ``policy.MODES``).
TP_COMM_CHOICES = ("nccl", "echo")

TP_COMM_KEY = "tp_comm"
"""additional_config key the plugin reads the all-reduce backend from."""
EMULATE_KEY = "tp_comm_emulate"
"""additional_config key of the one-GPU emulation's virtual TP size."""
MEASURE_KEY = "tp_comm_emulate_measure"
"""additional_config key: the emulation also measures the residual stream's
accumulated communication error (eager mode)."""
POSTNORM_KEY = "tp_comm_postnorm"
"""additional_config key: what Echo does on a post-norm model (Gemma-2/3, ...)."""
KNOWN_KEYS = (TP_COMM_KEY, EMULATE_KEY, MEASURE_KEY, POSTNORM_KEY)
"""Every ``tp_comm*`` key the plugin knows (others are refused)."""


def normalize_keys(raw: Mapping[str, Any]) -> dict:
    """Echo's keys in the CLI's dashed spelling (``tp-comm``, ``echo-group-size``)
    read as the underscored ones; other keys (a platform's own) stay as given.
    One key in both spellings with different values is refused
    (:class:`EchoConfigError`): neither may win silently."""
    def ours(key: Any) -> bool:
        return isinstance(key, str) and (key.startswith("tp-comm") or key.startswith("echo-"))

    out: dict = {}
    spelled: dict = {}
    for given, value in raw.items():
        key = given.replace("-", "_") if ours(given) else given
        if key in out and out[key] != value:
            raise EchoConfigError(f"{spelled[key]!r} and {given!r} are one option, given twice with different "
                                  f"values ({out[key]!r:.30} and {value!r:.30})")
        out[key], spelled[key] = value, given
    return out


@dataclass(frozen=True)
class TpCommSettings:
    """The engine's tensor-parallel communication choice."""

    tp_comm: str = "nccl"
    """"echo" reduces residual-stream all-reduces with Echo; "nccl" leaves
    vLLM's all-reduce alone (or, with emulation, sums partials exactly)."""

    emulate_world_size: int = 0
    """P >= 2 emulates TP=P on one device; 0 means no emulation."""

    emulate_measure: bool = False
    """Track the residual stream's accumulated error (emulation, eager)."""

    echo: EchoConfig = field(default_factory=EchoConfig)
    """Echo's own options (the ``echo_*`` keys)."""

    postnorm: str | None = None
    """Policy for post-norm models (``tp_comm_postnorm``); None: not given
    (:data:`~echo_vllm.postnorm_policy.DEFAULT_POSTNORM_POLICY` applies)."""

    def __post_init__(self) -> None:
        if self.tp_comm not in TP_COMM_CHOICES:
            raise EchoConfigError(f"tp_comm={self.tp_comm!r}: choose one of {TP_COMM_CHOICES}"
                                  f"{did_you_mean(self.tp_comm, TP_COMM_CHOICES)}")
        p = self.emulate_world_size
        if not isinstance(p, int) or isinstance(p, bool) or (p != 0 and not 2 <= p <= MAX_RANKS):
            raise EchoConfigError(
                f"tp_comm_emulate={p!r}: must be from 2 to {MAX_RANKS} ({RANKS_WHY}; each rank is a partial "
                "matmul per row-parallel layer), or 0 / absent for no emulation"
            )
        if not isinstance(self.emulate_measure, bool):
            raise EchoConfigError(f"tp_comm_emulate_measure={self.emulate_measure!r}: must be True or False")
        if self.postnorm is not None and self.postnorm not in POSTNORM_POLICIES:
            raise EchoConfigError(
                f"tp_comm_postnorm={self.postnorm!r}: choose one of {POSTNORM_POLICIES}"
                + did_you_mean(self.postnorm, POSTNORM_POLICIES)
            )
        if self.emulate_measure and not p:
            raise EchoConfigError("tp_comm_emulate_measure needs tp_comm_emulate")

    @property
    def emulated(self) -> bool:
        return self.emulate_world_size >= 2

    @property
    def active(self) -> bool:
        """Echo's glue has something to do in this engine."""
        return self.tp_comm == "echo" or self.emulated

    @classmethod
    def from_additional_config(cls, raw: Any) -> "TpCommSettings":
        """Parse vLLM's ``additional_config`` (a dict; anything else, e.g. a
        platform's own config object, means "not asked for")."""
        if not isinstance(raw, Mapping):
            return cls()
        raw = normalize_keys(raw)
        unknown = [
            k for k in raw if isinstance(k, str) and k.startswith(TP_COMM_KEY) and k not in KNOWN_KEYS
        ]
        if unknown:
            hint = did_you_mean(unknown[0], KNOWN_KEYS)
            raise EchoConfigError(
                f"unknown option(s) {unknown} in additional_config{hint or ';'} known: {list(KNOWN_KEYS)}"
            )
        tp_comm = str(raw.get(TP_COMM_KEY, "nccl")).strip().lower()
        emulate = _coerce(EMULATE_KEY, raw.get(EMULATE_KEY, 0), int)
        measure = _coerce(MEASURE_KEY, raw.get(MEASURE_KEY, False), bool)
        return cls(
            tp_comm=tp_comm,
            emulate_world_size=emulate,
            emulate_measure=measure,
            echo=EchoConfig.from_mapping(raw, prefix="echo_"),
            postnorm=str(raw[POSTNORM_KEY]).strip().lower() if POSTNORM_KEY in raw else None,
        )

    def for_model(self, architectures: list[str], hf_config: Any = None,
                  modules: Any = None) -> tuple["TpCommSettings", str | None]:
        """These settings adjusted for the served model, and why (None when
        unchanged): on a post-norm model Echo's feedback would add errors
        back at the wrong scale, so :attr:`postnorm` decides. Post-norm is
        :func:`~echo_vllm.postnorm_policy.decide_postnorm`'s answer for
        ``architectures``, ``hf_config`` and the module tree ``modules``."""
        if self.tp_comm != "echo":
            return self, None
        decision = decide_postnorm(architectures, hf_config, modules)
        if not decision.postnorm:
            return self, None
        mode, echo = postnorm_config(self.echo, self.postnorm or DEFAULT_POSTNORM_POLICY)
        model = f"{architectures} ({decision.reason})"
        if mode == "exact":
            # the policy is spent: Echo is off, nothing is left for it to decide
            return replace(self, tp_comm="nccl", postnorm=None), (
                f"post-norm model {model}: Echo is off, every all-reduce in 16-bit "
                "(tp_comm_postnorm=exact, the default: 4-bit costs such models accuracy even without "
                "error feedback; tp_comm_postnorm=no-feedback opts in)")
        if echo == self.echo:
            if self.echo.feedback:
                return self, (f"post-norm model {model}: tp_comm_postnorm=feedback, Echo keeps "
                              "its error feedback although it does not cancel here (measurement only)")
            return self, None
        return replace(self, echo=echo), (
            f"post-norm model {model}: Echo runs with feedback off (its carried error would "
            "be rescaled by each call's output norm instead of cancelling); tp_comm_postnorm=exact "
            "turns Echo off, =feedback keeps it")

    def for_batch_invariance(self, enabled: bool) -> tuple["TpCommSettings", str | None]:
        """These settings under vLLM's batch-invariant mode, and why they
        changed (None when unchanged): Echo's size thresholds go off
        (``EchoConfig.batch_invariant``), so every residual all-reduce takes
        the path its call index gives whatever the batch, and the layout
        keeps each token's bits to itself. Stochastic rounding is refused:
        a value's noise draw depends on its position in the message."""
        if not enabled or self.tp_comm != "echo":
            return self, None
        if self.echo.rounding == "stochastic":
            raise EchoConfigError(
                "VLLM_BATCH_INVARIANT with echo_rounding=stochastic: a token's noise draw depends on "
                "its position in the batch, so its bits would too; use echo_rounding=nearest")
        echo = self.echo.replace(batch_invariant=True)
        return replace(self, echo=echo), (
            "vLLM batch-invariant mode: Echo's size thresholds are off (min_bytes/max_bytes "
            f"{self.echo.min_bytes}/{self.echo.max_bytes} ignored): every residual all-reduce takes the "
            "path of its call index, whatever the batch, and a token's bits never depend on the others")

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "TpCommSettings":
        return cls.from_additional_config(getattr(vllm_config, "additional_config", None))
