"""Echo's backends: one interface, a registry, and the choice between them.

=============  =================================================================
``reference``  composed: the torch references (the specification) + transport
``triton``     composed: the fused Triton stage kernels + transport
``numba``      composed: the fused numba CPU loops + transport
``fused``      one Triton kernel over symmetric (peer-mapped) memory
=============  =================================================================

``EchoConfig.backend`` names one, or ``auto``: :func:`choose_backend` (one
pure function, returning its reason) picks from the device, the rounding
mode, ``ECHO_KERNELS`` (:mod:`echo_vllm.envs`), whether the group's GPUs
can run the fused kernel (:func:`.fused.fused_support`) and, for CPU
tensors, whether the caller wants the fastest CPU backend installed
(:func:`fastest_cpu_backend`: the evaluation and training tools do).
:func:`make_backend` asks it and builds the answer: every backend Echo runs
is made there (``EchoCommunicator`` on first use, the vLLM glue once per
tensor-parallel group, with the group's facts). A new backend registers a
:class:`BackendSpec`.

The group's topology is decided there too (:func:`echo_vllm.hosts.choose_topology`,
from ``EchoConfig.topology`` and the host of each rank: ``host_map``, or
asked from the group): where it is two-level, the chosen backend's stages
run as :class:`~.two_level.TwoLevelBackend` over the group's sub-groups
(``fused`` as the Triton stages: peer memory stays inside one host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import BACKEND_CHOICES, EchoConfig, EchoConfigError
from ..envs import EchoEnv
from ..hosts import TWO_LEVEL, HostMap, check_host_map, choose_topology, transport_hosts
from ..transport import Transport
from .base import EchoBackend
from .composed import ComposedBackend
from .fused import FusedSymmMemBackend, fused_support
from .stages import KernelStages, NumbaStages, ReferenceStages, StageOps, TritonStages
from .two_level import TwoLevelBackend


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend."""

    name: str
    build: Callable[..., EchoBackend]
    """``build(config, transport, env, *, peers, max_numel)``: the backend for
    one configuration and transport (``peers``, ``max_numel``: see
    :func:`make_backend`; backends that need neither ignore them)."""
    devices: tuple[str, ...]
    """Device types (``torch.device.type``) whose tensors it reduces."""
    doc: str
    """One line for ``--help`` and the README."""


BACKENDS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> None:
    BACKENDS[spec.name] = spec


register_backend(BackendSpec(
    "reference", lambda cfg, tr, env, **group: ComposedBackend(cfg, tr, ReferenceStages()), ("cpu", "cuda"),
    "torch references of every stage (the specification) around the transport",
))
register_backend(BackendSpec(
    "triton", lambda cfg, tr, env, **group: ComposedBackend(cfg, tr, TritonStages()), ("cuda", "cpu"),
    "fused Triton stage kernels around the transport (CPU only under TRITON_INTERPRET=1)",
))
register_backend(BackendSpec(
    "numba", lambda cfg, tr, env, **group: ComposedBackend(cfg, tr, NumbaStages()), ("cpu",),
    "fused numba CPU loops around the transport",
))


def _build_fused(cfg: EchoConfig, tr: Transport, env: EchoEnv, *, peers: Transport,
                 max_numel: int | None) -> EchoBackend:
    # messages larger than its buffers take the composed Triton path over the transport: same bits
    fallback = ComposedBackend(cfg, tr, TritonStages())
    return FusedSymmMemBackend(cfg, peers, max_numel=max_numel, fallback=fallback)


register_backend(BackendSpec(
    "fused", _build_fused, ("cuda",),
    "one Triton kernel over symmetric memory (P2P GPUs of one host; larger messages: the triton backend)",
))


assert set(BACKEND_CHOICES) == {"auto", *BACKENDS}, "config.BACKEND_CHOICES and the registry disagree"

#: The stages each backend runs as two-level Echo (the fused kernel's peer memory stays inside one host).
TWO_LEVEL_STAGES: dict[str, Callable[[], StageOps]] = {
    "reference": ReferenceStages, "triton": TritonStages, "numba": NumbaStages, "fused": TritonStages,
}
assert set(TWO_LEVEL_STAGES) == set(BACKENDS), "every backend needs its two-level stages"

#: ``fused_support``'s answer on a two-level group: the sub-groups run composed stages.
_TWO_LEVEL_NOT_FUSED = (False, "two-level topology: the composed stages run on the in-host and cross-host groups")


def choose_backend(requested: str, *, device_type: str, stochastic: bool, env_kernels: str = "auto",
                   p2p: bool = False, p2p_reason: str = "", interpreted: bool = False,
                   probe: Callable[[], tuple[bool, str]] | None = None,
                   fastest_cpu: Callable[[], str] | None = None) -> tuple[str, str]:
    """``(backend name, reason)`` for tensors on ``device_type``.

    An explicit ``requested`` name wins (stochastic rounding needs
    ``reference``: its noise comes from torch). ``auto``: stochastic ->
    ``reference``; else ``ECHO_KERNELS`` if set (``numba`` for CPU tensors
    only); else, for CUDA tensors, ``fused`` if ``p2p`` (the group can run
    it: :func:`.fused.fused_support`) and ``triton`` if not; for CPU
    tensors ``reference`` (the specification), or where ``fastest_cpu`` is
    given the backend it names (:func:`fastest_cpu_backend`: the same bits,
    faster), asked only there; ``reference`` elsewhere. ``p2p_reason``:
    what probing the group said (empty: not
    probed); an explicit ``fused`` on a group probed unable to run it is
    refused with it. ``probe``: instead of ``p2p`` / ``p2p_reason``, the
    probe that gives them, called once and only where the answer depends
    on the group (:func:`make_backend`: it is a collective). ``triton`` on
    CPU tensors needs Triton's interpreter (``interpreted``:
    ``TRITON_INTERPRET=1``). Raises :class:`EchoConfigError` for a request
    that cannot run.
    """
    group = probe if probe is not None else (lambda: (p2p, p2p_reason))
    name, reason = _choose(requested, device_type=device_type, stochastic=stochastic, env_kernels=env_kernels,
                           group=group, fastest_cpu=fastest_cpu)
    if name == "triton" and device_type == "cpu" and not interpreted:
        raise EchoConfigError(f"backend 'triton' ({reason}) takes CPU tensors only in Triton's interpreter: set "
                              "TRITON_INTERPRET=1 before Triton is imported, or use 'numba' or 'reference' on CPU")
    return name, reason


def _choose(requested: str, *, device_type: str, stochastic: bool, env_kernels: str,
            group: Callable[[], tuple[bool, str]], fastest_cpu: Callable[[], str] | None) -> tuple[str, str]:
    if requested != "auto":
        if requested not in BACKENDS:
            raise EchoConfigError(f"backend={requested!r}: choose one of {('auto', *BACKENDS)}")
        if stochastic and requested != "reference":
            raise EchoConfigError(f"rounding='stochastic' runs on the reference backend, not {requested!r}")
        if device_type not in BACKENDS[requested].devices:
            raise EchoConfigError(f"backend={requested!r} does not run on {device_type} tensors")
        if requested == "fused":
            p2p, p2p_reason = group()
            if not p2p and p2p_reason:
                raise EchoConfigError(f"backend='fused' cannot run on this group: {p2p_reason}")
        return requested, "configured"
    if stochastic:
        return "reference", "stochastic rounding (torch noise)"
    if env_kernels == "numba" and device_type == "cpu":
        return "numba", "ECHO_KERNELS=numba"
    if env_kernels in ("reference", "triton"):
        return env_kernels, f"ECHO_KERNELS={env_kernels}"
    if device_type == "cuda":
        p2p, p2p_reason = group()
        if p2p:
            return "fused", f"CUDA tensors, peer-to-peer GPUs{f' ({p2p_reason})' if p2p_reason else ''}"
        return "triton", f"CUDA tensors{f' (fused unavailable: {p2p_reason})' if p2p_reason else ''}"
    if device_type == "cpu":
        fastest = fastest_cpu() if fastest_cpu is not None else "reference"
        if fastest != "reference":
            return fastest, f"cpu tensors, the fastest CPU backend installed ({fastest}: the references' bits)"
        return "reference", "cpu tensors"
    return "reference", f"{device_type} tensors"


def fastest_cpu_backend() -> str:
    """``numba`` when numba imports (the references' bits, much faster on
    CPU; it compiles on first use), else ``reference``. ``auto`` takes it
    for CPU tensors where the caller asks (``make_backend(fast_cpu=True)``:
    the evaluation and training tools); the library's ``auto`` stays
    ``reference``."""
    try:
        from ..kernels import cpu_loops
    except Exception:  # numba missing or broken: the references still work
        return "reference"
    return "numba" if cpu_loops.AVAILABLE else "reference"


def make_backend(config: EchoConfig, transport: Transport, *, device_type: str, env: EchoEnv,
                 peers: Transport | None = None, max_numel: int | None = None,
                 fast_cpu: bool = False, hosts: HostMap | None = None) -> tuple[EchoBackend, str]:
    """Build the backend :func:`choose_backend` picks for ``config``, in the
    topology :func:`~echo_vllm.hosts.choose_topology` picks; returns it
    (``topology``, ``topology_reason`` and ``hosts`` set) and the backend's
    reason.

    The host of each rank: ``hosts`` (the vLLM glue's node test), else
    ``config.host_map`` (its length checked against the group here, before
    anything runs), else asked from ``peers``
    (:func:`~echo_vllm.hosts.transport_hosts`: a collective). A two-level
    backend splits ``peers`` into its sub-groups (a collective too).

    When the answer depends on whether the group can run the fused kernel,
    ``peers`` is probed first (:func:`.fused.fused_support`: a collective on
    a process group, so every rank builds its backend at the same call).
    ``peers``: the ``torch.distributed`` transport of the same ranks that
    the fused backend maps peer memory over (default ``transport``; vLLM's
    TP group moves the composed path's bytes with pynccl, and maps peer
    memory over the group's NCCL process group). ``max_numel``: the largest
    message in values per rank, which sizes the fused backend's buffers
    (None: from ``max_bytes``, or its default). ``fast_cpu``: ``auto``
    takes the fastest CPU backend installed for CPU tensors
    (:func:`fastest_cpu_backend`) rather than the references.
    """
    peers = transport if peers is None else peers
    check_host_map(config.host_map, transport.world_size)
    if hosts is None:
        hosts = HostMap.of(config.host_map) if config.host_map is not None else transport_hosts(peers)
    stochastic = config.rounding == "stochastic"
    topology, topology_reason = choose_topology(hosts.host_of_rank, config.topology, stochastic=stochastic)
    two_level = topology == TWO_LEVEL
    name, reason = choose_backend(config.backend, device_type=device_type, stochastic=stochastic,
                                  env_kernels=env.kernels, interpreted=env.triton_interpret,
                                  probe=(lambda: _TWO_LEVEL_NOT_FUSED) if two_level else
                                  (lambda: fused_support(peers, device_type)),
                                  fastest_cpu=fastest_cpu_backend if fast_cpu else None)
    if two_level:
        backend: EchoBackend = TwoLevelBackend.over(config, transport, TWO_LEVEL_STAGES[name](), hosts, split=peers)
    else:
        backend = BACKENDS[name].build(config, transport, env, peers=peers, max_numel=max_numel)
    backend.hosts, backend.topology_reason = hosts, topology_reason
    return backend, reason


__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
    "BackendSpec",
    "ComposedBackend",
    "EchoBackend",
    "FusedSymmMemBackend",
    "KernelStages",
    "NumbaStages",
    "ReferenceStages",
    "StageOps",
    "TWO_LEVEL_STAGES",
    "TritonStages",
    "TwoLevelBackend",
    "choose_backend",
    "fastest_cpu_backend",
    "make_backend",
    "register_backend",
]
