"""The Echo communicator of one vLLM tensor-parallel group.

:func:`tp_communicator` builds the group's
:class:`~echo_vllm.communicator.EchoCommunicator` (vLLM's communicator
shape: ``disabled``, ``should_echo``, ``all_reduce(inp, out=)``,
``close()``) with what only vLLM knows: the group's transport (pynccl on
CUDA), vLLM's own all-reduce as the exact path, the session's tracker as the
calls' numbering and sink, and the model's width and largest batch. The
hook's patch of ``GroupCoordinator._all_reduce_out_place`` calls its
``all_reduce`` directly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import envs
from ..backends import make_backend
from ..communicator import EchoCommunicator, ResidualStream
from ..config import EchoConfig
from ..envs import EchoEnv
from ..health import HealthCounters
from ..quant import WireLayout
from ..transport import ProcessGroupTransport, Transport
from .tracking import ForwardTracker

logger = logging.getLogger("echo_vllm")


def tp_communicator(coordinator: Any, config: EchoConfig, tracker: ForwardTracker,
                    vllm_all_reduce: Callable[[torch.Tensor], torch.Tensor], *, hidden_size: int | None = None,
                    max_num_tokens: int | None = None, env: EchoEnv | None = None) -> EchoCommunicator:
    """The :class:`~echo_vllm.communicator.EchoCommunicator` of the TP group of
    ``coordinator`` (a vLLM ``GroupCoordinator`` of at least 2 ranks).

    ``tracker``: numbers the calls and receives their records (the session's).
    ``vllm_all_reduce``: the exact path, vLLM's own all-reduce of this group.
    ``hidden_size`` / ``max_num_tokens``: the model's width and largest batch
    (residual messages, the feedback buffer's and the fused backend's sizes).
    Collective: every rank of the group builds it at group creation (the
    backend may probe the group, :func:`echo_vllm.backends.make_backend`).
    """
    world_size = int(coordinator.world_size)
    transport = make_transport(coordinator)
    env = env if env is not None else envs.read()
    max_numel = None  # the largest message: rows of the model's width, padded to whole groups per rank
    if hidden_size and max_num_tokens:
        max_numel = max_num_tokens * WireLayout(hidden_size, world_size, config.group_size).padded_cols
    backend, reason = make_backend(config, transport, device_type=getattr(coordinator.device, "type", "cpu"),
                                   env=env, peers=_peers(coordinator, transport), max_numel=max_numel)
    logger.info("echo: %s backend on %s (%s)", backend.name, coordinator.unique_name, reason)
    # sampled NaN/Inf checks count on the device (allocated with the feedback buffer)
    tracker.stats.health = HealthCounters(coordinator.device) if config.health_every else None
    tracker.stats.set_thresholds(config.effective_min_bytes, config.max_bytes)
    stream = ResidualStream(hidden_size, ndim=2, max_num_tokens=max_num_tokens, fixed_capacity=True)
    return EchoCommunicator(config, transport, device=coordinator.device, stream=stream, backend=backend,
                            exact_all_reduce=vllm_all_reduce, numbering=tracker.number, stats=tracker.stats,
                            sink=tracker.on_record)


def make_transport(coordinator: Any) -> Transport:
    """vLLM's pynccl communicator on CUDA; the group's own process group
    (gloo on CPU) elsewhere."""
    device_comm = getattr(coordinator, "device_communicator", None)
    pynccl = getattr(device_comm, "pynccl_comm", None)
    if pynccl is not None and not getattr(pynccl, "disabled", True):
        from .pynccl_transport import PyncclTransport

        return PyncclTransport(pynccl, coordinator.cpu_group)
    return ProcessGroupTransport(coordinator.device_group)


def _peers(coordinator: Any, transport: Transport) -> Transport:
    """The group's ``torch.distributed`` transport: where the fused backend
    probes the GPUs and maps peer memory (NCCL on CUDA; pynccl cannot)."""
    return transport if isinstance(transport, ProcessGroupTransport) else ProcessGroupTransport(coordinator.device_group)


__all__ = ["make_transport", "tp_communicator"]
