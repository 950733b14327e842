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
``echo_<field>``
    Any :class:`~echo_vllm.config.EchoConfig` field, e.g. ``echo_feedback``,
    ``echo_min_bytes``. Unknown ``echo_*`` or ``tp_comm*`` keys are errors: a
    typo must not silently run a different experiment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import EchoConfig, EchoConfigError, _coerce

#: Values of ``tp_comm``.
MODES = ("nccl", "echo")

_KNOWN_KEYS = ("tp_comm", "tp_comm_emulate", "tp_comm_emulate_measure")


@dataclass(frozen=True)
class TpCommSettings:
    """The engine's tensor-parallel communication choice."""

    mode: str = "nccl"
    """"echo" reduces residual-stream all-reduces with Echo; "nccl" leaves
    vLLM's all-reduce alone (or, with emulation, sums partials exactly)."""

    emulate_world_size: int = 0
    """P >= 2 emulates TP=P on one device; 0 means no emulation."""

    emulate_measure: bool = False
    """Track the residual stream's accumulated error (emulation, eager)."""

    echo: EchoConfig = field(default_factory=EchoConfig)
    """Echo's own options (the ``echo_*`` keys)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise EchoConfigError(f"tp_comm={self.mode!r}: choose one of {MODES}")
        p = self.emulate_world_size
        if p != 0 and p < 2:
            raise EchoConfigError(
                f"tp_comm_emulate={p!r}: must be at least 2 (or 0 / absent for no emulation)"
            )
        if self.emulate_measure and not p:
            raise EchoConfigError("tp_comm_emulate_measure needs tp_comm_emulate")

    @property
    def emulated(self) -> bool:
        return self.emulate_world_size >= 2

    @property
    def active(self) -> bool:
        """Echo's glue has something to do in this engine."""
        return self.mode == "echo" or self.emulated

    @classmethod
    def from_additional_config(cls, raw: Any) -> "TpCommSettings":
        """Parse vLLM's ``additional_config`` (a dict; anything else, e.g. a
        platform's own config object, means "not asked for")."""
        if not isinstance(raw, Mapping):
            return cls()
        unknown = [
            k for k in raw if isinstance(k, str) and k.startswith("tp_comm") and k not in _KNOWN_KEYS
        ]
        if unknown:
            raise EchoConfigError(
                f"unknown option(s) {unknown} in additional_config; known: {list(_KNOWN_KEYS)}"
            )
        mode = str(raw.get("tp_comm", "nccl")).strip().lower()
        emulate = _coerce("tp_comm_emulate", raw.get("tp_comm_emulate", 0), int)
        measure = _coerce("tp_comm_emulate_measure", raw.get("tp_comm_emulate_measure", False), bool)
        return cls(
            mode=mode,
            emulate_world_size=emulate,
            emulate_measure=measure,
            echo=EchoConfig.from_mapping(raw, prefix="echo_"),
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "TpCommSettings":
        return cls.from_additional_config(getattr(vllm_config, "additional_config", None))
