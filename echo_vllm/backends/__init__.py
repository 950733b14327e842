"""Echo's backends: one interface, a registry, and the choice between them.

=============  =================================================================
``reference``  composed: the torch references (the specification) + transport
``triton``     composed: the fused Triton stage kernels + transport
``numba``      composed: the fused numba CPU loops + transport
``fused``      one Triton kernel over symmetric (peer-mapped) memory
=============  =================================================================

``EchoConfig.backend`` names one, or ``auto``: :func:`choose_backend` (one
pure function, returning its reason) picks from the device, the rounding
mode, ``ECHO_KERNELS`` (:mod:`echo_vllm.envs`) and whether the group's GPUs
can run the fused kernel (:func:`.fused.fused_support`). A new backend
registers a :class:`BackendSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import BACKEND_CHOICES, EchoConfig, EchoConfigError
from ..envs import EchoEnv
from ..transport import Transport
from .base import EchoBackend
from .composed import ComposedBackend
from .fused import FusedSymmMemBackend, fused_support
from .stages import NumbaStages, ReferenceStages, StageOps, TritonStages


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend."""

    name: str
    build: Callable[[EchoConfig, Transport, EchoEnv], EchoBackend]
    """Makes the backend for one configuration and transport."""
    devices: tuple[str, ...]
    """Device types (``torch.device.type``) whose tensors it reduces."""
    doc: str
    """One line for ``--help`` and the README."""


BACKENDS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> None:
    BACKENDS[spec.name] = spec


register_backend(BackendSpec(
    "reference", lambda cfg, tr, env: ComposedBackend(cfg, tr, ReferenceStages()), ("cpu", "cuda"),
    "torch references of every stage (the specification) around the transport",
))
register_backend(BackendSpec(
    "triton", lambda cfg, tr, env: ComposedBackend(cfg, tr, TritonStages()), ("cuda", "cpu"),
    "fused Triton stage kernels around the transport (CPU only under TRITON_INTERPRET=1)",
))
register_backend(BackendSpec(
    "numba", lambda cfg, tr, env: ComposedBackend(cfg, tr, NumbaStages()), ("cpu",),
    "fused numba CPU loops around the transport",
))


def _build_fused(cfg: EchoConfig, tr: Transport, env: EchoEnv) -> EchoBackend:
    # messages larger than its buffers take the composed Triton path: same bits
    fallback = ComposedBackend(cfg, tr, TritonStages())
    return FusedSymmMemBackend(cfg, tr, fallback=fallback)


register_backend(BackendSpec(
    "fused", _build_fused, ("cuda",),
    "one Triton kernel over symmetric memory (P2P GPUs of one host; larger messages: the triton backend)",
))


assert set(BACKEND_CHOICES) == {"auto", *BACKENDS}, "config.BACKEND_CHOICES and the registry disagree"


def choose_backend(requested: str, *, device_type: str, stochastic: bool, env_kernels: str = "auto",
                   p2p: bool = False) -> tuple[str, str]:
    """``(backend name, reason)`` for tensors on ``device_type``.

    An explicit ``requested`` name wins (stochastic rounding needs
    ``reference``: its noise comes from torch). ``auto``: stochastic ->
    ``reference``; else ``ECHO_KERNELS`` if set (``numba`` for CPU tensors
    only); else, for CUDA tensors, ``fused`` if ``p2p`` (the group can run
    it: :func:`.fused.fused_support`) and ``triton`` if not; ``reference``
    elsewhere.
    """
    if requested != "auto":
        if requested not in BACKENDS:
            raise EchoConfigError(f"backend={requested!r}: choose one of {('auto', *BACKENDS)}")
        if stochastic and requested != "reference":
            raise EchoConfigError(f"rounding='stochastic' runs on the reference backend, not {requested!r}")
        if device_type not in BACKENDS[requested].devices:
            raise EchoConfigError(f"backend={requested!r} does not run on {device_type} tensors")
        return requested, "configured"
    if stochastic:
        return "reference", "stochastic rounding (torch noise)"
    if env_kernels == "numba" and device_type == "cpu":
        return "numba", "ECHO_KERNELS=numba"
    if env_kernels in ("reference", "triton"):
        return env_kernels, f"ECHO_KERNELS={env_kernels}"
    if device_type == "cuda" and p2p:
        return "fused", "CUDA tensors, peer-to-peer GPUs"
    if device_type == "cuda":
        return "triton", "CUDA tensors"
    return "reference", f"{device_type} tensors"


def fastest_cpu_backend() -> str:
    """``numba`` when numba imports (the references' bits, much faster on
    CPU; it compiles on first use), else ``reference``. The evaluation and
    training tools use it for CPU tensors; the library's ``auto`` stays
    ``reference``."""
    try:
        from ..kernels import cpu_loops
    except Exception:  # numba missing or broken: the references still work
        return "reference"
    return "numba" if cpu_loops.AVAILABLE else "reference"


def fast_on_cpu(config: EchoConfig, device: torch.device | str) -> EchoConfig:
    """``config`` with ``backend="auto"`` resolved to :func:`fastest_cpu_backend`
    for CPU tensors (the same bits); unchanged otherwise."""
    if config.backend == "auto" and torch.device(device).type == "cpu":
        return config.replace(backend=fastest_cpu_backend())
    return config


def make_backend(config: EchoConfig, transport: Transport, *, device_type: str, env: EchoEnv) -> EchoBackend:
    """Build the backend :func:`choose_backend` picks for ``config``. When
    ``auto`` could pick ``fused``, the group is probed first (a collective on
    a process group: every rank builds its backend at the same call)."""
    stochastic = config.rounding == "stochastic"
    p2p = False
    if config.backend == "auto" and device_type == "cuda" and not stochastic and env.kernels == "auto":
        p2p, _ = fused_support(transport, device_type)
    name, _ = choose_backend(config.backend, device_type=device_type, stochastic=stochastic,
                             env_kernels=env.kernels, p2p=p2p)
    return BACKENDS[name].build(config, transport, env)


__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
    "BackendSpec",
    "ComposedBackend",
    "EchoBackend",
    "FusedSymmMemBackend",
    "NumbaStages",
    "ReferenceStages",
    "StageOps",
    "TritonStages",
    "choose_backend",
    "fast_on_cpu",
    "fastest_cpu_backend",
    "make_backend",
    "register_backend",
]
