"""The four stage functions of Echo, and the three implementations of them.

A :class:`StageOps` runs the stages of one Echo call on local data, with no
communication: ``stage1`` (rotate, add the carried error, quantize, write
the wire), ``stage2`` (decode P chunks, sum in rank order, requantize),
``output`` (decode, unrotate, cast), ``output_norm`` (the same, then the
residual add and RMSNorm that follow the all-reduce in a transformer) and
``consume`` (the input of an exact call absorbing the carried error). Every implementation returns the bits of
the torch references in :mod:`echo_vllm.quant`, which are the specification:

* :class:`ReferenceStages` -- the references themselves (any device; the
  only one with stochastic rounding, whose noise comes from torch);
* :class:`TritonStages` -- the fused Triton kernels (CUDA; CPU tensors under
  ``TRITON_INTERPRET=1``, which is how CI checks them);
* :class:`NumbaStages` -- the fused numba loops (CPU).

The last two are one forwarder, :class:`KernelStages`, over two kernel
modules.

A composed backend (:mod:`echo_vllm.backends.composed`) puts one of them
around a transport's all-to-all and all-gather.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from .. import quant
from ..norm import norm_into
from ..quant import WireLayout


class StageOps(Protocol):
    """What a stage implementation provides (signatures of the references)."""

    name: str
    stochastic: bool
    """Whether ``noise`` (stochastic rounding) is supported."""

    def stage1(self, x: torch.Tensor, feedback: torch.Tensor | None, layout: WireLayout, *, qmax: int,
               hadamard: bool, has_incoming: bool, noise: torch.Tensor | None = None, encoder: str = "absmax",
               out: torch.Tensor | None = None) -> torch.Tensor: ...

    def stage2(self, recv: torch.Tensor, feedback: torch.Tensor | None, own_chunks: list[int],
               layout: WireLayout, *, qmax: int, noise: torch.Tensor | None = None, encoder: str = "absmax",
               out: torch.Tensor | None = None) -> torch.Tensor: ...

    def output(self, gathered: torch.Tensor, layout: WireLayout, out_dtype: torch.dtype, *, hadamard: bool,
               out: torch.Tensor | None = None) -> torch.Tensor: ...

    def consume(self, x: torch.Tensor, feedback: torch.Tensor, layout: WireLayout, *,
                hadamard: bool, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def output_norm(self, gathered: torch.Tensor, layout: WireLayout, out_dtype: torch.dtype,
                    weight: torch.Tensor, eps: float, *, hadamard: bool, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``output``, then the residual add and RMSNorm of
        ``norm.norm_into`` (signature of ``kernels.output_norm``)."""


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value.view(out.shape))
    return out


def _output_then_norm(stages, gathered, layout, out_dtype, weight, eps, *, hadamard, residual=None, out=None,
                      residual_out=None):
    """``output_norm`` as the stages' ``output`` followed by ``norm.norm_into``
    (the same bits as the fused kernel, by its specification)."""
    y = stages.output(gathered, layout, out_dtype, hadamard=hadamard).view(layout.rows, layout.cols)
    o, r = norm_into(y, weight, eps, residual=residual, out=out, residual_out=residual_out)
    return o.view(layout.numel), r.view(layout.numel) if r is not None else None


def _no_noise(name: str, noise: torch.Tensor | None) -> None:
    if noise is not None:
        raise ValueError(f"{name} stages round to nearest only; stochastic rounding runs on 'reference'")


class ReferenceStages:
    """The torch references of :mod:`echo_vllm.quant`."""

    name = "reference"
    stochastic = True

    def stage1(self, x, feedback, layout, *, qmax, hadamard, has_incoming, noise=None, encoder="absmax", out=None):
        wire = quant.stage1_reference(x, feedback, layout, qmax=qmax, hadamard=hadamard,
                                      has_incoming=has_incoming, noise=noise, encoder=encoder)
        return _into(out, wire)

    def stage2(self, recv, feedback, own_chunks, layout, *, qmax, noise=None, encoder="absmax", out=None):
        return _into(out, quant.stage2_reference(recv, feedback, own_chunks, layout, qmax=qmax, noise=noise,
                                                 encoder=encoder))

    def output(self, gathered, layout, out_dtype, *, hadamard, out=None):
        return _into(out, quant.output_reference(gathered, layout, out_dtype, hadamard=hadamard))

    def consume(self, x, feedback, layout, *, hadamard, out=None):
        return _into(out, quant.consume_reference(x, feedback, layout, hadamard=hadamard))

    output_norm = _output_then_norm


class KernelStages:
    """Each stage forwarded to the function of the same name in a kernel
    module (parametrised by the subclass: ``name``, ``module``, relative to
    this package, and ``needs``, what it imports). ``output_norm`` is the
    module's when it has one, else ``output`` then ``norm.norm_into``. No
    stochastic rounding: the kernels round to nearest."""

    name: str
    module: str
    needs: str
    stochastic = False

    def __init__(self):
        kernels = importlib.import_module(self.module, __package__)  # imports Triton / numba: only when built
        if not kernels.AVAILABLE:
            raise RuntimeError(f"the {self.needs} stages need {self.needs} (pip install {self.needs.lower()})")
        self._k = kernels
        self._fused_norm = getattr(kernels, "output_norm", None)

    def stage1(self, x, feedback, layout, *, qmax, hadamard, has_incoming, noise=None, encoder="absmax", out=None):
        _no_noise(self.name, noise)
        return self._k.stage1(x, feedback, layout, qmax=qmax, hadamard=hadamard, has_incoming=has_incoming,
                              encoder=encoder, out=out)

    def stage2(self, recv, feedback, own_chunks, layout, *, qmax, noise=None, encoder="absmax", out=None):
        _no_noise(self.name, noise)
        return self._k.stage2(recv, feedback, own_chunks, layout, qmax=qmax, encoder=encoder, out=out)

    def output(self, gathered, layout, out_dtype, *, hadamard, out=None):
        return self._k.output(gathered, layout, out_dtype, hadamard=hadamard, out=out)

    def consume(self, x, feedback, layout, *, hadamard, out=None):
        return self._k.consume(x, feedback, layout, hadamard=hadamard, out=out)

    def output_norm(self, gathered, layout, out_dtype, weight, eps, *, hadamard, residual=None, out=None,
                    residual_out=None):
        norm = self._fused_norm if self._fused_norm is not None else self._output_then_norm
        return norm(gathered, layout, out_dtype, weight, eps, hadamard=hadamard, residual=residual, out=out,
                    residual_out=residual_out)

    _output_then_norm = _output_then_norm


class TritonStages(KernelStages):
    """The fused Triton kernels of :mod:`echo_vllm.kernels` (every feedback
    format, int8 included; ``output_norm`` fused too)."""

    name, module, needs = "triton", "..kernels", "Triton"


class NumbaStages(KernelStages):
    """The fused numba CPU loops of :mod:`echo_vllm.kernels.cpu_loops`
    (``output_norm``: their ``output``, then ``norm.norm_into``)."""

    name, module, needs = "numba", "..kernels.cpu_loops", "numba"


__all__ = ["KernelStages", "NumbaStages", "ReferenceStages", "StageOps", "TritonStages"]
