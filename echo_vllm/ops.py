"""The one place that picks a Triton kernel or the torch reference per stage.

CUDA tensors use the fused kernels of ``echo_vllm.kernels``; everything else
(CPU, and stochastic rounding, whose noise comes from a torch generator) uses
the references of ``echo_vllm.quant``. ``ECHO_KERNELS`` overrides the choice:
``reference`` forces the references everywhere; ``triton`` forces the kernels
(with ``TRITON_INTERPRET=1`` this runs them on CPU, which is how CI tests
them); ``cpu`` runs CPU tensors through the fused numba loops of
``echo_vllm.kernels.cpu_loops`` (same bits, ~20x faster than the references;
opt-in because numba compiles on first use) and CUDA tensors as ``auto``.
"""

from __future__ import annotations

import functools
import os

import torch

from . import quant
from .quant import WireLayout


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        from . import kernels
    except Exception:  # triton missing or broken: the references still work
        return None
    return kernels if kernels.AVAILABLE else None


@functools.lru_cache(maxsize=1)
def _cpu_loops():
    try:
        from .kernels import cpu_loops
    except Exception:  # numba missing or broken: the references still work
        return None
    return cpu_loops if cpu_loops.AVAILABLE else None


def _fused(t: torch.Tensor, *, stochastic: bool = False):
    """The fused implementation (a module with stage1/stage2/output/consume)
    for tensors like ``t``, or None for the references."""
    mode = os.environ.get("ECHO_KERNELS", "auto").lower()
    if mode == "reference" or stochastic:
        return None
    if mode == "triton":
        if _kernels() is None:
            raise RuntimeError("ECHO_KERNELS=triton but the Triton kernels cannot be imported")
        return _kernels()
    if mode == "cpu" and not t.is_cuda:
        if _cpu_loops() is None:
            raise RuntimeError("ECHO_KERNELS=cpu but the CPU loops cannot be imported (numba)")
        return _cpu_loops()
    return _kernels() if t.is_cuda else None


def stage1(
    x: torch.Tensor,
    feedback: torch.Tensor | None,
    layout: WireLayout,
    *,
    qmax: int,
    hadamard: bool,
    has_incoming: bool,
    noise: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    impl = _fused(x, stochastic=noise is not None)
    if impl is not None:
        return impl.stage1(
            x, feedback, layout, qmax=qmax, hadamard=hadamard, has_incoming=has_incoming, out=out
        )
    wire = quant.stage1_reference(
        x, feedback, layout, qmax=qmax, hadamard=hadamard, has_incoming=has_incoming, noise=noise
    )
    return _into(out, wire)


def stage2(
    recv: torch.Tensor,
    feedback: torch.Tensor | None,
    own_chunks: list[int],
    layout: WireLayout,
    *,
    qmax: int,
    noise: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    impl = _fused(recv, stochastic=noise is not None)
    if impl is not None:
        return impl.stage2(recv, feedback, own_chunks, layout, qmax=qmax, out=out)
    wire = quant.stage2_reference(recv, feedback, own_chunks, layout, qmax=qmax, noise=noise)
    return _into(out, wire)


def output(
    gathered: torch.Tensor,
    layout: WireLayout,
    out_dtype: torch.dtype,
    *,
    hadamard: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    impl = _fused(gathered)
    if impl is not None:
        return impl.output(gathered, layout, out_dtype, hadamard=hadamard, out=out)
    return _into(out, quant.output_reference(gathered, layout, out_dtype, hadamard=hadamard))


def consume(
    x: torch.Tensor, feedback: torch.Tensor, layout: WireLayout, *, hadamard: bool
) -> torch.Tensor:
    impl = _fused(x)
    if impl is not None:
        return impl.consume(x, feedback, layout, hadamard=hadamard)
    return quant.consume_reference(x, feedback, layout, hadamard=hadamard)


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out
