"""Every vLLM symbol the glue touches, looked up in one place.

Supported: vLLM 0.26 to 0.33 (the hooked method and ``additional_kwargs``
are the same in both; ``enable_sp`` / ``fuse_gemm_comms`` exist only up to
0.32, and the guards read them with ``getattr``). Older versions are refused;
newer ones are tried with a warning when the hooked method still exists.
Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any, Callable

import torch

#: Oldest vLLM the glue runs on, and the first version not yet read.
MIN_VERSION = (0, 26)
UNTESTED_FROM = (0, 34)


class VllmCompatError(RuntimeError):
    """This vLLM lacks something the Echo hook needs."""


def vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            import vllm  # a source tree or bundle on PYTHONPATH has no metadata

            return getattr(vllm, "__version__", None)
        except ImportError:
            return None


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of '0.26.0', '0.27.1.dev12+gabc', ..."""
    m = re.match(r"\s*v?(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    return int(m.group(1)), int(m.group(2) or 0)


def check_version(version: str | None) -> str | None:
    """None if supported; else why not (too old) -- raise-free so the plugin
    can log it. Newer-than-tested versions pass (with a note from caller)."""
    if version is None:
        return "vLLM is not installed"
    if version_tuple(version) < MIN_VERSION:
        return f"vLLM {version} is older than {MIN_VERSION[0]}.{MIN_VERSION[1]}"
    return None


def is_untested(version: str) -> bool:
    return version_tuple(version) >= UNTESTED_FROM


def group_coordinator_cls() -> type:
    from vllm.distributed import parallel_state

    cls = getattr(parallel_state, "GroupCoordinator", None)
    if cls is None or not callable(getattr(cls, "_all_reduce_out_place", None)):
        raise VllmCompatError(
            "vllm.distributed.parallel_state.GroupCoordinator._all_reduce_out_place not found"
        )
    return cls


def engine_args_cls() -> type:
    """``EngineArgs``, whose ``create_engine_config`` builds every engine's
    ``VllmConfig`` (``LLM``, ``vllm serve``, ``AsyncLLM``) in the process that
    starts the engine, before any worker exists."""
    from vllm.engine.arg_utils import EngineArgs

    if not callable(getattr(EngineArgs, "create_engine_config", None)):
        raise VllmCompatError("vllm.engine.arg_utils.EngineArgs.create_engine_config not found")
    return EngineArgs


def current_vllm_config() -> Any:
    """The config of the engine being built (set around worker start-up)."""
    from vllm import config

    getter = getattr(config, "get_current_vllm_config_or_none", None)
    if getter is not None:
        return getter()
    try:
        return config.get_current_vllm_config()
    except AssertionError:
        return None


@functools.lru_cache(maxsize=1)
def _forward_context_fns() -> tuple[Callable[[], bool], Callable[[], Any]]:
    from vllm import forward_context as fc

    return fc.is_forward_context_available, fc.get_forward_context


def forward_kwargs() -> dict | None:
    """``additional_kwargs`` of the current forward context, or None when no
    forward pass is running (e.g. multimodal encoders, weight sync)."""
    available, get = _forward_context_fns()
    if not available():
        return None
    kwargs = getattr(get(), "additional_kwargs", None)
    return kwargs if isinstance(kwargs, dict) else None


def forward_context_platform() -> Any:
    """The platform object ``set_forward_context`` calls."""
    from vllm import forward_context as fc

    return fc.current_platform


def fullgraph_replay_cls() -> type | None:
    """The class whose ``run_fullgraph`` replays the model's FULL CUDA graphs
    outside any forward context: Model Runner V2's ``ModelCudaGraphManager``
    (0.26; its base ``CudaGraphManager`` also serves drafters), or, where a
    vLLM has only the base class, that one. None without Model Runner V2."""
    try:
        from vllm.v1.worker.gpu import cudagraph_utils
    except ImportError:
        return None
    for name in ("ModelCudaGraphManager", "CudaGraphManager"):
        cls = getattr(cudagraph_utils, name, None)
        if cls is not None and callable(getattr(cls, "run_fullgraph", None)):
            return cls
    return None


def graph_num_tokens(desc: Any) -> int | None:
    """Padded token count of the graph ``run_fullgraph`` replays: a
    ``BatchExecutionDescriptor`` (0.26) or the count itself (older V2)."""
    if isinstance(desc, int):
        return desc
    tokens = getattr(desc, "num_tokens", None)
    return int(tokens) if tokens is not None else None


def hidden_size(vllm_config: Any) -> int | None:
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return None
    try:
        return int(model.get_hidden_size())
    except Exception:
        return None


def model_architectures(vllm_config: Any) -> list[str]:
    """The served model's ``architectures`` (from its HF config)."""
    model = getattr(vllm_config, "model_config", None)
    archs = getattr(model, "architectures", None)
    if not archs:
        archs = getattr(getattr(model, "hf_config", None), "architectures", None)
    return [str(a) for a in (archs or ())]


def model_modules(vllm_config: Any) -> tuple[tuple[str, str], ...]:
    """``(architecture, module)`` for the served model's architectures and
    its drafter's (speculative decoding): the module vLLM's model registry
    resolves each to, without importing it (``model_class_overrides``
    included: reading ``ModelConfig.registry`` registers them). Architectures
    the registry does not know are left out."""
    configs = [getattr(vllm_config, "model_config", None)]
    spec = getattr(vllm_config, "speculative_config", None)
    configs.append(getattr(spec, "draft_model_config", None))
    out: list[tuple[str, str]] = []
    for model in configs:
        if model is None:
            continue
        try:
            registry = model.registry
        except Exception:  # a config without a registry property (older vLLM, a stand-in)
            from vllm.model_executor.models.registry import ModelRegistry as registry
        archs = getattr(model, "architectures", None) or getattr(getattr(model, "hf_config", None),
                                                                 "architectures", None) or ()
        for arch in archs:
            entry = registry.models.get(arch)
            module = getattr(entry, "module_name", None) or getattr(getattr(entry, "model_cls", None),
                                                                    "__module__", None)
            if module and (arch, module) not in out:
                out.append((str(arch), str(module)))
    return tuple(out)


def platform_name() -> str:
    """vLLM's current platform: ``cuda`` (NVIDIA), ``rocm``, ``cpu``, ..."""
    from vllm.platforms import current_platform

    for name in ("cuda", "rocm", "xpu", "cpu", "tpu"):
        probe = getattr(current_platform, f"is_{name}", None)
        if probe is not None and probe():
            return name
    return str(getattr(current_platform, "device_type", "unknown") or "unknown")


def flashinfer_installed() -> bool:
    """The ``flashinfer`` package is importable (looked up, not imported)."""
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def model_hf_config(vllm_config: Any) -> Any:
    """The served model's HF config (None when there is no model config)."""
    return getattr(getattr(vllm_config, "model_config", None), "hf_config", None)


def model_dtype(vllm_config: Any) -> Any:
    """The model's activation dtype (a ``torch.dtype``), or None."""
    return getattr(getattr(vllm_config, "model_config", None), "dtype", None)


def max_num_batched_tokens(vllm_config: Any) -> int | None:
    sched = getattr(vllm_config, "scheduler_config", None)
    value = getattr(sched, "max_num_batched_tokens", None)
    return int(value) if value else None


def cudagraphs_enabled(vllm_config: Any) -> bool:
    """Whether the engine may replay CUDA graphs (``cudagraph_mode`` other
    than NONE and no ``enforce_eager``), by the mode's name (the Enum's
    truthiness is vLLM's own convention)."""
    if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is None:
        return False
    return str(getattr(mode, "name", mode)).upper() != "NONE"


def linear_classes() -> tuple[type, type]:
    """``(RowParallelLinear, UnquantizedLinearMethod)``: the layer the
    emulation splits, and the weights it can split."""
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod

    return RowParallelLinear, UnquantizedLinearMethod


def vocab_embedding_classes() -> tuple[type, type, type]:
    """``(VocabParallelEmbedding, ParallelLMHead, UnquantizedEmbeddingMethod)``."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    return VocabParallelEmbedding, ParallelLMHead, UnquantizedEmbeddingMethod


def custom_op_registrar() -> Callable | None:
    """vLLM's ``direct_register_custom_op`` (registers under the current
    platform's dispatch key), or None where this vLLM has none."""
    try:
        from vllm.utils.torch_utils import direct_register_custom_op
    except ImportError:
        return None
    return direct_register_custom_op


def group_by_name(name: str) -> Any:
    """The live ``GroupCoordinator`` vLLM registered as ``name`` (what its
    ``all_reduce`` op looks up)."""
    from vllm.distributed import parallel_state

    ref = parallel_state._groups.get(name)
    group = ref() if ref is not None else None
    if group is None:
        raise ValueError(f"echo: no live vLLM group named {name!r}")
    return group


def register_custom_op(lib: Any, name: str, impl: Any, fake: Any) -> None:
    """Define op ``name`` of ``lib``: vLLM's helper (dispatch key of the current
    platform); plain torch.library where a vLLM version lacks it."""
    registrar = custom_op_registrar()
    if registrar is None:
        lib.define(name + torch.library.infer_schema(impl, mutates_args=()))
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{lib.ns}::{name}", fake, lib=lib)
        return
    registrar(name, impl, mutates_args=[], fake_impl=fake, target_lib=lib)


def inductor_compile_config(vllm_config: Any) -> dict | None:
    """The engine's ``compilation_config.inductor_compile_config`` (where
    ``post_grad_custom_post_pass`` goes), or None where it has none."""
    config = getattr(getattr(vllm_config, "compilation_config", None), "inductor_compile_config", None)
    return config if isinstance(config, dict) else None


def ir_norm_ops() -> dict:
    """vLLM's IR norm ops as a compiled graph holds them before its IR
    lowering -> their names (``vllm/ir/ops/layernorm.py``)."""
    import vllm.ir  # noqa: F401  (defines torch.ops.vllm_ir.*)

    return {torch.ops.vllm_ir.fused_add_rms_norm.default: "fused_add_rms_norm",
            torch.ops.vllm_ir.rms_norm.default: "rms_norm"}


def inductor_pass_base() -> type:
    """vLLM's ``InductorPass``: what ``post_grad_custom_post_pass`` must be
    (its backend adds it to the post-grad pass manager)."""
    from vllm.compilation.passes.inductor_pass import InductorPass

    return InductorPass


def batch_invariant_enabled() -> bool:
    """vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT``, read through
    ``vllm.envs`` as vLLM reads it); False where this vLLM has no such mode."""
    import vllm.envs as envs

    return bool(getattr(envs, "VLLM_BATCH_INVARIANT", False))
