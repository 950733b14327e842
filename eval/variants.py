"""The communication variants every evaluation compares, by name.

A variant is a mode (:data:`echo_vllm.policy.MODES`: "exact", the 16-bit sum
of the same P partials; "naive", Echo's 4-bit path without error feedback;
"echo", the Echo all-reduce; or "unsplit", the model as loaded, no emulation)
plus the :class:`EchoConfig` of the 4-bit modes. Specs on the
command line are ``NAME`` or ``NAME:field=value,...`` (``default:group_size=16``,
``echo+hadamard+last:first_exact_calls=2``), fields as in EchoConfig.

Every preset sets ``min_bytes=0``: evaluation measures the quality of the
quantized path on every call, whatever the message size. (With the serving
default of 256 KiB, short lm-eval requests would take the exact path and
flatter Echo.)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from ..cli_args import did_you_mean
from ..config import EchoConfig, EchoConfigError
from ..policy import mode_config

#: The ladder variants pin every field that defines them, so that they mean
#: the same thing whatever EchoConfig's defaults become (the defaults moved
#: to first_exact_calls=5 and a bf16 feedback buffer after this evaluation):
#: the 4-bit path on every call but the ones named, fp32 feedback, g=32.
_LADDER = dict(group_size=32, first_exact_calls=0, feedback_dtype="float32", rounding="nearest")
_ECHO_ONLY = dict(_LADDER, feedback=True, hadamard=False, exact_last_call=False)

#: name -> (mode, EchoConfig kwargs, description)
PRESETS: dict[str, tuple[str, dict, str]] = {
    "unsplit": ("unsplit", {}, "the model as loaded: no TP emulation, no all-reduce"),
    "exact": ("exact", {}, "16-bit sum of the P partials (baseline)"),
    "naive": ("naive", dict(_LADDER, feedback=False, hadamard=False, exact_last_call=False),
              "plain 4-bit two-shot, no feedback"),
    "naive+hadamard": ("naive", dict(_LADDER, feedback=False, hadamard=True, exact_last_call=False),
                       "4-bit with Hadamard rotation, no feedback"),
    "echo": ("echo", dict(_ECHO_ONLY), "error feedback only"),
    "echo+last": ("echo", dict(_ECHO_ONLY, exact_last_call=True),
                  "feedback + 16-bit last call"),
    "echo+hadamard": ("echo", dict(_ECHO_ONLY, hadamard=True),
                      "feedback + Hadamard"),
    "echo+hadamard+last": ("echo", dict(_ECHO_ONLY, hadamard=True, exact_last_call=True),
                           "feedback + Hadamard + 16-bit last call (every other call 4-bit)"),
    "default": ("echo", {}, "EchoConfig() as shipped (with min_bytes=0)"),
}

#: The ladder, in order, then Echo as shipped (the row README quotes).
STANDARD = ["exact", "naive", "echo", "echo+last", "echo+hadamard", "echo+hadamard+last", "default"]


@dataclass(frozen=True)
class Variant:
    name: str
    mode: str
    config: EchoConfig
    description: str = ""
    pinned_rotation: bool = False
    """The spec sets ``rotation_seed``: rotation draws (``eval perplexity
    --draws``) leave it at that seed."""

    @property
    def drawn(self) -> bool:
        """Whether rotation draws apply: an Echo variant with the Hadamard
        rotation whose seed the spec does not pin."""
        return self.mode == "echo" and self.config.hadamard and not self.pinned_rotation

    def at_draw(self, seed: int) -> "Variant":
        """This variant under rotation seed ``seed`` (itself when not :attr:`drawn`)."""
        return replace(self, config=self.config.replace(rotation_seed=seed)) if self.drawn else self

    @property
    def quantized(self) -> bool:
        """Its calls take Echo's 4-bit path (naive or Echo)."""
        return self.mode in ("naive", "echo")

    @property
    def bits_per_value(self) -> float:
        """Wire bits per value: 16 for exact (and unsplit), 4 + 16/g for the 4-bit modes."""
        return self.config.wire_bits_per_value if self.quantized else 16.0

    def vllm_additional_config(self, emulate: int = 0) -> dict:
        """``--additional-config`` for the echo-vllm plugin. ``emulate`` > 1
        asks for one-GPU emulation of TP=emulate (tensor_parallel_size 1);
        0 means real TP. The exact variant is vLLM's own all-reduce
        (``tp_comm`` nccl): with the emulation, the 16-bit sum of the same
        partials (same rounding)."""
        if self.mode == "unsplit" or (self.mode == "exact" and emulate <= 1):
            return {}
        out = {"tp_comm": "nccl"} if self.mode == "exact" else {
            "tp_comm": "echo", **{f"echo_{k}": v for k, v in mode_config(self.mode, self.config).to_dict().items()}}
        if emulate > 1:
            out["tp_comm_emulate"] = emulate
        return out

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "mode": self.mode,
            "description": self.description,
            "bits_per_value": self.bits_per_value,
            "config": self.config.to_dict(),
            "pinned_rotation": self.pinned_rotation,
        }


def parse_variant(spec: str) -> Variant:
    """``NAME`` or ``NAME:field=value,...`` -> :class:`Variant`. A list
    value keeps its commas: an item without ``=`` continues the value
    before it (``default:topology=two_level,host_map=0,0,1,1``)."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in PRESETS:
        raise EchoConfigError(f"unknown variant {name!r}" + (did_you_mean(name, PRESETS) or "; known: " + ", ".join(PRESETS)))
    mode, kwargs, text = PRESETS[name]
    raw: dict = {"min_bytes": 0, **kwargs}
    last, given = None, set()
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            if last is None:
                raise EchoConfigError(f"variant {spec!r}: expected field=value, got {item!r}")
            raw[last] += "," + item
            continue
        last = key.strip()
        raw[last] = value.strip()
        given.add(last.replace("-", "_"))
    try:
        config = EchoConfig.from_mapping(raw)
    except EchoConfigError as e:
        raise EchoConfigError(f"variant {spec!r}: {e}") from None
    return Variant(spec.strip(), mode, config, text + (f" ({rest})" if rest else ""), "rotation_seed" in given)


def variant_arg(spec: str) -> str:
    """argparse type of the tools' ``--variants``: a spec :func:`parse_variant`
    reads (kept as text; duplicates are :func:`parse_variants`' to refuse)."""
    try:
        parse_variant(spec)
    except EchoConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def parse_variants(specs: list[str]) -> list[Variant]:
    """The variants ``specs`` name; a spec given twice, or two specs of one
    setting (``naive`` and ``naive:``, or specs that differ in spaces only,
    which would also share one results file), raise :class:`EchoConfigError`."""
    variants = [parse_variant(s) for s in specs]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise EchoConfigError(f"duplicate variants in {names}")
    seen: dict[tuple, str] = {}
    for v in variants:
        key = (v.mode, tuple(sorted(v.config.to_dict().items())), v.pinned_rotation)
        if key in seen:
            raise EchoConfigError(f"variants {seen[key]!r} and {v.name!r} are one setting: give one of them")
        seen[key] = v.name
    return variants
