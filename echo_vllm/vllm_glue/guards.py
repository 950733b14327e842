"""The rule book of ``tp_comm``: what Echo's settings cannot run with.

:func:`conflicts` is one pure function: the conflicts of a configuration
(Echo's settings, :class:`~.settings.TpCommSettings`, and the few engine
facts that matter, :class:`EngineFacts`), each with the flag to change.
Both sides call it: the plugin when vLLM creates the tensor-parallel group
(:func:`check_engine_config`, on the finalized ``VllmConfig``), and
``echo-vllm serve`` before it starts vLLM (``echo_vllm.server.rewrite``,
from its command line), which turns every conflict into an argument error.
What a single setting may hold (``tp_comm`` values, P >= 2, ...) is
:class:`~.settings.TpCommSettings`' own validation, which both sides parse
through as well.

Why each rule:

* ``pass_config.fuse_allreduce_rms`` (FlashInfer all-reduce + RMSNorm fusion,
  on by default on sm90/sm100 with TP > 1) replaces the all-reduce node of
  the compiled graph with a fused kernel: the hook would never see those
  calls and Echo would silently not run.
* ``pass_config.enable_sp`` / ``fuse_gemm_comms`` (vLLM 0.26; gone in 0.33)
  turn all-reduces into reduce-scatter + all-gather pairs: same problem.
* dual-batch overlap (``enable_dbo``, ``ubatch_size > 1``) interleaves two
  micro-batches' all-reduces, which would mix two residual streams in one
  feedback chain.
* stochastic rounding under CUDA graphs: a replay repeats the captured
  noise draw.
* the emulation computes TP=P's partials on one device: it needs TP=1.
* Echo at TP=1 without the emulation has no all-reduce to replace, and
  ``tp_comm_postnorm`` without Echo has nothing to decide: the engine runs
  (vLLM's own all-reduce, logged), ``echo-vllm serve`` refuses them.

One more refusal needs no hook: when the plugin could not install its hook
(:mod:`echo_vllm.vllm_glue.plugin`), an engine that asks for Echo must not start at
all -- vLLM would run its own all-reduce under an Echo label
(:func:`check_hook_installed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import EchoConfigError
from . import compat
from .settings import EMULATE_KEY, POSTNORM_KEY, TpCommSettings


class EchoEngineConfigError(EchoConfigError):
    """The vLLM engine configuration conflicts with Echo."""


#: vLLM 0.26 compilation passes (pass_config fields) that remove or replace
#: the all-reduce Echo hooks, and what each does instead. ``echo-vllm serve``
#: turns them off (server/rewrite.py); here the engine refuses them.
BYPASS_PASSES = {
    "fuse_allreduce_rms": "replaces all-reduce + RMSNorm with FlashInfer's fused kernel",
    "enable_sp": "replaces the all-reduce with reduce-scatter + all-gather (sequence parallelism)",
    "fuse_gemm_comms": "fuses GEMMs with reduce-scatter/all-gather (async TP)",
}


@dataclass(frozen=True)
class EngineFacts:
    """What the rules read of an engine: its finalized ``VllmConfig``
    (:meth:`from_vllm_config`), or what ``echo-vllm serve``'s command line
    says it will be."""

    tensor_parallel_size: int = 1
    enable_dbo: bool = False
    ubatch_size: int = 0
    passes_on: tuple[str, ...] = ()
    """The :data:`BYPASS_PASSES` that are on."""
    cudagraphs: bool = False
    """The engine may replay CUDA graphs (``echo-vllm serve`` reads it from
    its command line: on unless ``--enforce-eager``, ``-O0`` or
    ``cudagraph_mode`` NONE, so the refusal comes before vLLM starts)."""

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "EngineFacts":
        parallel = getattr(vllm_config, "parallel_config", None)
        pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
        return cls(
            tensor_parallel_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
            enable_dbo=bool(getattr(parallel, "enable_dbo", False)),
            ubatch_size=int(getattr(parallel, "ubatch_size", 0) or 0),
            # getattr: vLLM 0.33 has no enable_sp / fuse_gemm_comms
            passes_on=tuple(name for name in BYPASS_PASSES if getattr(pass_config, name, None)),
            cudagraphs=compat.cudagraphs_enabled(vllm_config),
        )


@dataclass(frozen=True)
class Conflict:
    """One thing a configuration cannot do, and what to change."""

    message: str
    refused: bool = True
    """False: the engine still starts, with vLLM's own all-reduce (logged);
    ``echo-vllm serve`` refuses every conflict."""


def conflicts(settings: TpCommSettings, engine: EngineFacts) -> list[Conflict]:
    """Every conflict of ``settings`` with ``engine`` (empty: fine)."""
    out: list[Conflict] = []
    tp = engine.tensor_parallel_size
    if settings.emulated and tp != 1:
        out.append(Conflict(
            f"{EMULATE_KEY}={settings.emulate_world_size} emulates tensor parallelism on one "
            f"device and needs --tensor-parallel-size 1 (got {tp}); drop {EMULATE_KEY} "
            "to run Echo on the real group"))
    if settings.tp_comm == "echo" and not settings.emulated and tp == 1:
        out.append(Conflict(
            "tp_comm=echo needs --tensor-parallel-size > 1 (or tp_comm_emulate=P to emulate TP=P on one "
            "device): at TP=1 there is no all-reduce to replace, and vLLM runs unchanged", refused=False))
    if settings.active and not settings.emulated and tp > 1:
        for name in engine.passes_on:
            out.append(Conflict(
                f"compilation pass {name} is on; it {BYPASS_PASSES[name]}, removing the all-reduce Echo "
                f"replaces. Turn it off: vllm serve ... -cc.pass_config.{name}=false "
                f"(Python: compilation_config={{'pass_config': {{'{name}': False}}}})"))
    if settings.tp_comm == "echo" and settings.echo.rounding == "stochastic" and engine.cudagraphs:
        out.append(Conflict(
            "echo_rounding=stochastic draws its noise from a torch generator; a CUDA-graph replay would "
            "repeat the captured draw every step. Run eager (--enforce-eager) or use echo_rounding=nearest"))
    if settings.active and (engine.enable_dbo or engine.ubatch_size > 1):
        who = "tp_comm=echo" if settings.tp_comm == "echo" else f"{EMULATE_KEY}={settings.emulate_world_size}"
        given = "--enable-dbo" if engine.enable_dbo else f"--ubatch-size {engine.ubatch_size}"
        out.append(Conflict(
            f"{who} cannot run with {given}: dual-batch overlap interleaves two micro-batches' all-reduces "
            "in one feedback chain. Turn it off: drop --enable-dbo / --ubatch-size "
            "(Python: enable_dbo=False, ubatch_size=0)"))
    if settings.postnorm is not None and settings.tp_comm != "echo":
        out.append(Conflict(
            f"{POSTNORM_KEY}={settings.postnorm} needs tp_comm=echo (it decides what Echo does on "
            "post-norm models)", refused=False))
    return out


def check_engine_config(vllm_config: Any, settings: TpCommSettings) -> list[str]:
    """Raise :class:`EchoEngineConfigError` naming every refused conflict of
    the engine; returns the others' messages (to log)."""
    found = conflicts(settings, EngineFacts.from_vllm_config(vllm_config))
    refused = [c.message for c in found if c.refused]
    if refused:
        raise EchoEngineConfigError(
            "echo-vllm cannot run with this vLLM configuration "
            f"(tp_comm={settings.tp_comm!r}):\n  - " + "\n  - ".join(refused)
        )
    return [c.message for c in found if not c.refused]


def check_hook_installed(vllm_config: Any, problem: str | None) -> None:
    """Raise :class:`EchoEngineConfigError` if the engine asks for Echo (or
    the emulation) while the hook is not installed; ``problem`` says why it
    is not (None: it is). Engines that do not ask for Echo pass untouched."""
    if problem is None:
        return
    settings = TpCommSettings.from_vllm_config(vllm_config)
    if not settings.active:
        return
    asked = f"tp_comm={settings.tp_comm!r}" + (
        f", tp_comm_emulate={settings.emulate_world_size}" if settings.emulated else ""
    )
    raise EchoEngineConfigError(
        f"this engine asks for echo-vllm ({asked}) but echo-vllm's vLLM plugin could not "
        f"install its hook: {problem}. vLLM would run its own all-reduce instead. Fix the installation, "
        "or drop tp_comm / tp_comm_emulate from --additional-config to run stock vLLM."
    )
