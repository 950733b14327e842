"""Engine settings Echo cannot run under, refused at start-up by name.

Why each one:

* ``pass_config.fuse_allreduce_rms`` (FlashInfer all-reduce + RMSNorm fusion,
  on by default on sm90/sm100 with TP > 1) replaces the all-reduce node of
  the compiled graph with a fused kernel: the hook would never see those
  calls and Echo would silently not run.
* ``pass_config.enable_sp`` / ``fuse_gemm_comms`` (vLLM 0.26; gone in 0.33)
  turn all-reduces into reduce-scatter + all-gather pairs: same problem.
* dual-batch overlap (``enable_dbo``, ``ubatch_size > 1``) interleaves two
  micro-batches' all-reduces, which would mix two residual streams in one
  feedback chain.

The checks read a finalized ``VllmConfig`` (defaults resolved), so they run
in the worker when the tensor-parallel group is created.

One more refusal needs no hook: when the plugin could not install its hook
(:mod:`echo_vllm.vllm_glue.plugin`), an engine that asks for Echo must not start at
all -- vLLM would run its own all-reduce under an Echo label
(:func:`check_hook_installed`).
"""

from __future__ import annotations

from typing import Any

from ..config import EchoConfigError
from . import compat
from .settings import TpCommSettings


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


def conflicts(vllm_config: Any, settings: TpCommSettings) -> list[str]:
    """Every reason the engine cannot run Echo as configured (empty: fine)."""
    if not settings.active:
        return []
    problems: list[str] = []
    parallel = getattr(vllm_config, "parallel_config", None)
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)

    if settings.emulated and tp_size != 1:
        problems.append(
            f"tp_comm_emulate={settings.emulate_world_size} emulates tensor parallelism on one "
            f"device and needs --tensor-parallel-size 1 (got {tp_size}); drop tp_comm_emulate "
            "to run Echo on the real group"
        )

    if not settings.emulated and tp_size > 1:
        pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
        for name in BYPASS_PASSES:
            if getattr(pass_config, name, None):
                problems.append(
                    f"compilation pass {name} is on; it removes the all-reduce Echo replaces. "
                    f"Turn it off: vllm serve ... -cc.pass_config.{name}=false "
                    f"(Python: compilation_config={{'pass_config': {{'{name}': False}}}})"
                )

    if settings.mode == "echo" and settings.echo.rounding == "stochastic" and compat.cudagraphs_enabled(vllm_config):
        problems.append(
            "echo_rounding=stochastic draws its noise from a torch generator; a CUDA-graph replay would "
            "repeat the captured draw every step. Run eager (--enforce-eager) or use echo_rounding=nearest"
        )

    if getattr(parallel, "enable_dbo", False) or int(getattr(parallel, "ubatch_size", 0) or 0) > 1:
        problems.append(
            "dual-batch overlap interleaves two micro-batches' all-reduces in one feedback chain. "
            "Turn it off: drop --enable-dbo / --ubatch-size (Python: enable_dbo=False, ubatch_size=0)"
        )
    return problems


def check_engine_config(vllm_config: Any, settings: TpCommSettings) -> None:
    """Raise :class:`EchoEngineConfigError` naming every flag to change."""
    problems = conflicts(vllm_config, settings)
    if problems:
        raise EchoEngineConfigError(
            "echo-vllm cannot run with this vLLM configuration "
            f"(tp_comm={settings.mode!r}):\n  - " + "\n  - ".join(problems)
        )


def check_hook_installed(vllm_config: Any, problem: str | None) -> None:
    """Raise :class:`EchoEngineConfigError` if the engine asks for Echo (or
    the emulation) while the hook is not installed; ``problem`` says why it
    is not (None: it is). Engines that do not ask for Echo pass untouched."""
    if problem is None:
        return
    settings = TpCommSettings.from_vllm_config(vllm_config)
    if not settings.active:
        return
    asked = f"tp_comm={settings.mode!r}" + (
        f", tp_comm_emulate={settings.emulate_world_size}" if settings.emulated else ""
    )
    raise EchoEngineConfigError(
        f"this engine asks for echo-vllm ({asked}) but echo-vllm's vLLM plugin could not "
        f"install its hook: {problem}. vLLM would run its own all-reduce instead. Fix the installation, "
        "or drop tp_comm / tp_comm_emulate from --additional-config to run stock vLLM."
    )
