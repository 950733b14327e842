"""Model code that sums over the TP group without the all-reduce Echo hooks.

Echo sees a tensor-parallel sum only where it reaches
``GroupCoordinator._all_reduce_out_place``. The compilation passes that
replace that call are the rule book's business (:mod:`.guards`); this
module is about vLLM 0.26 models whose *own code* goes around it:

* FlashInfer's fused all-reduce + residual add + RMSNorm, called directly
  (``vllm.model_executor.layers.fused_allreduce_gemma_rms_norm``, the
  "Gemma fused norm", and DeepSeek-V3.2's copy of it in
  ``vllm.models.deepseek_v32.nvidia.fused_ops``): MiniMax-M3 on NVIDIA
  (attention output, and the FFN output its next norm absorbs) and
  DeepSeek-V3.2's ``vllm.models.deepseek_v32`` classes (NVIDIA only,
  reached through ``model_class_overrides``, e.g. for GLM-5.2). Where
  FlashInfer's workspace exists (NVSwitch or trtllm IPC) and the batch fits
  its budget (decode sizes), those sums run in 16-bit inside FlashInfer;
  larger batches fall back to ``tensor_model_parallel_all_reduce``, which
  Echo hooks.
* Inkling: every sublayer output is reduce-scattered, short-convolved on
  its shard and all-gathered (Lamport P2P kernels, else NCCL): its residual
  stream never goes through an all-reduce at all.

:func:`model_bypasses` decides, from :class:`ModelFacts` alone, what each
means for Echo: a path that leaves Echo nothing to do is *refused* (the
engine would run vLLM's own reductions under an Echo label); one that
takes only some calls away is *reported* (logged at start, exported as
``echo:model_bypass{path}``). vLLM 0.26 has no switch that turns either
path off: ``pass_config.fuse_allreduce_rms`` and
``fi_allreduce_fusion_max_size_mb`` govern only the compilation pass
(``_can_use_flashinfer`` reads FlashInfer's default budget), and Inkling's
``LAMPORT_RS_SCONV=0`` only swaps its kernels for NCCL's reduce-scatter +
all-gather. So nothing is switched off here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import compat

#: Model packages (vLLM registry module names, prefix match) whose decoder
#: calls FlashInfer's fused all-reduce + RMSNorm itself on NVIDIA.
FLASHINFER_NORM_MODULES = ("vllm.models.minimax_m3", "vllm.models.deepseek_v32")
#: Model packages whose residual stream is reduce-scattered and all-gathered
#: instead of all-reduced.
REDUCE_SCATTER_MODULES = ("vllm.models.inkling",)

FLASHINFER_NORM = "flashinfer_allreduce_rmsnorm"
REDUCE_SCATTER = "reduce_scatter_all_gather"


@dataclass(frozen=True)
class ModelFacts:
    """What the decision reads of an engine (:func:`.compat.model_facts`)."""

    modules: tuple[tuple[str, str], ...] = ()
    """``(architecture, module)`` of the served model and of its drafter:
    the Python module vLLM's registry resolves each architecture to."""
    platform: str = "cpu"
    """``cuda`` (NVIDIA), ``rocm``, ``cpu``, ...: vLLM's current platform."""
    flashinfer: bool = False
    """The ``flashinfer`` package is installed."""
    tensor_parallel_size: int = 1

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "ModelFacts":
        parallel = getattr(vllm_config, "parallel_config", None)
        tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        modules = compat.model_modules(vllm_config)
        if not modules:  # a model-less config: nothing to look up
            return cls(tensor_parallel_size=tp)
        return cls(modules=modules, platform=compat.platform_name(), flashinfer=compat.flashinfer_installed(),
                   tensor_parallel_size=tp)


@dataclass(frozen=True)
class Bypass:
    """One way the model sums over the TP group that Echo does not see."""

    path: str
    """:data:`FLASHINFER_NORM` or :data:`REDUCE_SCATTER` (the metric's label)."""
    refused: bool
    """The engine must not start with Echo (nothing would reach it)."""
    message: str
    """What happens and what to do (logged, or the refusal's text)."""


def _owner(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def model_bypasses(facts: ModelFacts) -> tuple[Bypass, ...]:
    """The model-code paths of ``facts`` that go around Echo's hook, one
    :class:`Bypass` per path and model class (empty: every TP sum reaches
    Echo). Pure: the caller logs, exports and refuses."""
    if facts.tensor_parallel_size < 2:
        return ()
    out = []
    for arch, module in facts.modules:
        if _owner(module, FLASHINFER_NORM_MODULES) and facts.platform == "cuda" and facts.flashinfer:
            out.append(Bypass(FLASHINFER_NORM, False, (
                f"{arch} ({module}) calls FlashInfer's fused all-reduce + residual add + RMSNorm from its own "
                "code: where FlashInfer's workspace exists, batches within its budget (decode sizes) sum those "
                "layers' outputs in 16-bit inside FlashInfer, unseen by Echo (no bandwidth saved there; such "
                "passes make fewer all-reduces than Echo learned, counted in "
                "echo:forwards_total{kind=\"mismatched\"}); larger batches reach Echo. vLLM 0.26 has no switch "
                "for this path (pass_config.fuse_allreduce_rms governs only the compilation pass)")))
        if _owner(module, REDUCE_SCATTER_MODULES):
            out.append(Bypass(REDUCE_SCATTER, True, (
                f"{arch} ({module}) reduces every sublayer output with reduce-scatter + short convolution + "
                "all-gather (Lamport P2P kernels, else NCCL), never an all-reduce: Echo would replace none of "
                "its residual stream's sums. Run it with tp_comm=nccl")))
    return tuple(out)


__all__ = ["Bypass", "FLASHINFER_NORM", "FLASHINFER_NORM_MODULES", "ModelFacts", "REDUCE_SCATTER",
           "REDUCE_SCATTER_MODULES", "model_bypasses"]
