"""The Echo communicator of one vLLM tensor-parallel group.

:func:`tp_communicator` builds the group's
:class:`~echo_vllm.communicator.EchoCommunicator` (vLLM's communicator
shape: ``disabled``, ``should_echo``, ``all_reduce(inp, out=)``,
``close()``) with what only vLLM knows: the group's transport (pynccl on
CUDA), vLLM's own all-reduce as the exact path, the session's tracker as the
calls' numbering and sink, and the model's width and largest batch. The
hook's patch of ``GroupCoordinator._all_reduce_out_place`` calls its
``all_reduce`` directly.

The group's topology is decided here once, when the TP group is made
(:func:`echo_vllm.hosts.choose_topology` inside ``make_backend``): the host
of each rank is ``EchoConfig.host_map`` where set, else vLLM's own node test
(:func:`node_map`: ``in_the_same_node_as``, shared memory, as vLLM's custom
all-reduce asks). A two-level group's sub-groups are made then too, on
every rank of the group in the same order (members-only
``torch.distributed.new_group`` over the group's device group). The choice
and its reason are logged and exported (``echo:topology``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import envs
from ..backends import make_backend
from ..communicator import EchoCommunicator
from ..config import EchoConfig
from ..envs import EchoEnv
from ..health import HealthCounters
from ..hosts import HostMap, check_host_map
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
    check_host_map(config.host_map, world_size)  # before any collective
    transport = make_transport(coordinator)
    env = env if env is not None else envs.read()
    hosts = HostMap.of(config.host_map) if config.host_map is not None else node_map(coordinator)
    max_numel = None  # the largest message: rows of the model's width, padded to whole groups per rank
    if hidden_size and max_num_tokens:
        max_numel = max_num_tokens * WireLayout(hidden_size, world_size, config.group_size).padded_cols
    backend, reason = make_backend(config, transport, device_type=getattr(coordinator.device, "type", "cpu"),
                                   env=env, peers=_peers(coordinator, transport), max_numel=max_numel, hosts=hosts)
    logger.info("echo: %s backend on %s (%s)", backend.name, coordinator.unique_name, reason)
    logger.info("echo: %s topology on %s (%s)", backend.topology, coordinator.unique_name, backend.topology_reason)
    tracker.stats.topology = (backend.topology, backend.topology_reason)
    # sampled NaN/Inf checks count on the device (allocated with the feedback buffer)
    health = HealthCounters(coordinator.device) if config.health_every else None
    tracker.stats.health = health
    tracker.stats.set_thresholds(config.effective_min_bytes, config.max_bytes)

    return EchoCommunicator(config, transport, device=coordinator.device, backend=backend, env=env,
                            exact_all_reduce=vllm_all_reduce, numbering=tracker.number, hidden_size=hidden_size, residual_ndim=2,
                            max_num_tokens=max_num_tokens, fixed_capacity=True, stats=tracker.stats,
                            sink=tracker.on_record, health=health)


def node_map(coordinator: Any) -> HostMap:
    """The host of each rank of ``coordinator``'s group by vLLM's own node
    test (``in_the_same_node_as`` over its gloo group: can the rank open a
    shared-memory segment the first rank of a host made), one test per
    host, as vLLM's ``_node_count`` runs it. A collective on the group.
    Ranks that share ``/dev/shm`` read as one host (containers with a
    shared ``/dev/shm``, network namespaces): set ``host_map`` there."""
    from vllm.distributed.parallel_state import in_the_same_node_as

    world = int(coordinator.world_size)
    host: list[int | None] = [None] * world
    hosts = 0
    for first in range(world):
        if host[first] is not None:
            continue
        host[first] = hosts
        for rank, same in enumerate(in_the_same_node_as(coordinator.cpu_group, source_rank=first)):
            if same and host[rank] is None:
                host[rank] = hosts
        hosts += 1
    return HostMap(tuple(host))  # type: ignore[arg-type]: every rank has one now


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


__all__ = ["make_transport", "node_map", "tp_communicator"]
