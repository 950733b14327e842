"""What happens when vLLM creates a tensor-parallel group: Echo starts, or not.

Called by the hook's ``GroupCoordinator.__init__`` patch for every group;
acts only on the group named ``tp`` (in the worker, inside
``set_current_vllm_config``): reads ``additional_config``
(:mod:`.settings`), adjusts for the model (post-norm models), refuses
conflicting engine settings (:mod:`.guards`) and model code that goes
around the hook (:mod:`.bypass`: refused, or logged and exported), and
activates the process's session (:mod:`.session`): real TP, or the
one-device emulation; then registers the compilation pass that folds the
norm after each all-reduce into Echo (:mod:`.rmsnorm_fusion`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from ..postnorm_policy import decide_postnorm, module_tree
from . import compat, emulation, session
from .bypass import ModelFacts, model_bypasses
from .guards import EchoEngineConfigError, check_engine_config
from .settings import TpCommSettings

logger = logging.getLogger("echo_vllm")

#: Name vLLM gives the tensor-parallel group ("tp:0", "tp:1", ...).
TP_GROUP_NAME = "tp"


def on_group_created(coordinator: Any, vllm_all_reduce: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
    """Set Echo up for ``coordinator`` if it is the TP group of an engine that
    asks for it. ``vllm_all_reduce``: vLLM's unpatched ``_all_reduce_out_place``."""
    if str(getattr(coordinator, "unique_name", "")).split(":")[0] != TP_GROUP_NAME:
        return
    # a new TP group starts a new engine in this process: forget the last one
    session.deactivate()
    emulation.stop()
    vllm_config = compat.current_vllm_config()
    if vllm_config is None:
        return
    settings = TpCommSettings.from_vllm_config(vllm_config)
    if not settings.active:
        return
    # the model first: a post-norm model that keeps vLLM's 16-bit all-reduce
    # needs none of Echo's guard rails. It is not loaded yet: its structure
    # is the decoder transformers builds from its config, on the meta device
    hf_config = compat.model_hf_config(vllm_config)
    trust = bool(getattr(getattr(vllm_config, "model_config", None), "trust_remote_code", False))
    modules = module_tree(hf_config, trust_remote_code=trust) if settings.tp_comm == "echo" else None
    architectures = compat.model_architectures(vllm_config)
    postnorm = settings.tp_comm == "echo" and decide_postnorm(architectures, hf_config, modules).postnorm
    settings, note = settings.for_model(architectures, hf_config, modules)
    if note:
        logger.warning("echo: %s", note)
    if not settings.active:
        return
    settings, invariance = settings.for_batch_invariance(compat.batch_invariant_enabled())
    if invariance:
        logger.warning("echo: %s", invariance)
    # refused conflicts raise here; the others leave vLLM's all-reduce in place, said loudly
    for problem in check_engine_config(vllm_config, settings):
        logger.warning("echo: %s", problem)
    bypasses = model_bypasses(ModelFacts.from_vllm_config(vllm_config)) if settings.tp_comm == "echo" else ()
    refused = [b.message for b in bypasses if b.refused]
    if refused:
        raise EchoEngineConfigError("echo-vllm cannot run this model with tp_comm=echo:\n  - " + "\n  - ".join(refused))
    for b in bypasses:
        logger.warning("echo: %s", b.message)
    world = int(coordinator.world_size)
    if settings.emulated:
        active = session.activate(emulation.start(settings, vllm_config))
        logger.info("echo: emulating tensor parallelism %d on one device (%s reduce) %s",
                    settings.emulate_world_size, settings.tp_comm, settings.echo)
    elif world > 1:
        active = session.activate(session.TpSession(coordinator, settings, vllm_config,
                                                    functools.partial(vllm_all_reduce, coordinator)))
        comm = active.communicator
        coordinator._echo_comm = comm
        logger.info("echo: Echo all-reduce on group %s (world size %d, transport %s) %s",
                    coordinator.unique_name, world, type(comm.transport).__name__, settings.echo)
        # every rank of the group is here, in the same order: the calibration's collectives are safe
        measured = comm.calibrate(active.dtype)
        if measured is not None:
            logger.info("echo: crossover measured on this group: min_bytes=%s max_bytes=%s (%s)",
                        measured.min_bytes, measured.max_bytes, measured.reason)
    else:
        # nothing to reduce (the rule book's warning above): vLLM runs unchanged
        return
    from . import rmsnorm_fusion  # vLLM's compilation modules: only in the engine that runs Echo

    logger.info("echo: %s", rmsnorm_fusion.install(vllm_config, settings.tp_comm, settings.echo.fuse_norm, postnorm,
                                                None if settings.emulated else coordinator.unique_name))
    active.model_note = note
    active.stats.bypasses = tuple(sorted({b.path for b in bypasses}))


__all__ = ["TP_GROUP_NAME", "on_group_created"]
