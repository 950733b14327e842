"""The four stage functions of Echo, and their specification.

A :class:`StageOps` runs the stages of one Echo call on local data, with no
communication: ``stage1`` (rotate, add the carried error, quantize, write
the wire), ``stage2`` (decode P chunks, sum in rank order, requantize),
``output`` (decode, unrotate, cast), ``output_norm`` (the same, then the
residual add and RMSNorm that follow the all-reduce in a transformer) and
``consume`` (the input of an exact call absorbing the carried error). Every implementation returns the bits of
the torch references in :mod:`echo_vllm.quant`, which are the specification:

* :class:`ReferenceStages` -- the references themselves (any device; the
  only one with stochastic rounding, whose noise comes from torch);
* :class:`~echo_vllm.backends.triton_stages.TritonStages` -- the fused
  Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``, which is
  how CI checks them);
* :class:`~echo_vllm.backends.numba_stages.NumbaStages` -- the fused numba
  loops (CPU).

Those two are their kernel modules' functions themselves, each in a module
of its own, imported where a backend that runs them is built (Triton and
numba load only then).

A composed backend (:mod:`echo_vllm.backends.composed`) puts one of them
around a transport's all-to-all and all-gather.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .. import quant
from ..rmsnorm import norm_into
from ..quant import WireLayout


class StageOps(Protocol):
    """What a stage implementation provides (signatures of the references)."""

    name: str
    stochastic: bool
    """Whether ``stage1`` and ``stage2`` take ``noise`` (stochastic rounding;
    a composed backend passes it to such stages only)."""

    def stage1(self, x: torch.Tensor, feedback: torch.Tensor | None, layout: WireLayout, *, qmax: int,
               hadamard: bool, has_incoming: bool, noise: torch.Tensor | None = None, flips: int = 0,
               encoder: str = "absmax",
               out: torch.Tensor | None = None) -> torch.Tensor: ...

    def stage2(self, recv: torch.Tensor, feedback: torch.Tensor | None, own_chunks: list[int],
               layout: WireLayout, *, qmax: int, noise: torch.Tensor | None = None, encoder: str = "absmax",
               out: torch.Tensor | None = None) -> torch.Tensor: ...

    def output(self, gathered: torch.Tensor, layout: WireLayout, out_dtype: torch.dtype, *, hadamard: bool,
               flips: int = 0, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def consume(self, x: torch.Tensor, feedback: torch.Tensor, layout: WireLayout, *,
                hadamard: bool, flips: int = 0, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def output_norm(self, gathered: torch.Tensor, layout: WireLayout, out_dtype: torch.dtype,
                    weight: torch.Tensor, eps: float, *, hadamard: bool, flips: int = 0,
                    residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``output``, then the residual add and RMSNorm of
        ``rmsnorm.norm_into`` (signature of ``kernels.output_norm``)."""


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value.view(out.shape))
    return out


def output_then_norm(stages, gathered, layout, out_dtype, weight, eps, *, hadamard, flips=0, residual=None,
                     out=None, residual_out=None):
    """``output_norm`` as the stages' ``output`` followed by ``rmsnorm.norm_into``
    (the same bits as the fused kernel, by its specification)."""
    y = stages.output(gathered, layout, out_dtype, hadamard=hadamard, flips=flips).view(layout.rows, layout.cols)
    o, r = norm_into(y, weight, eps, residual=residual, out=out, residual_out=residual_out)
    return o.view(layout.numel), r.view(layout.numel) if r is not None else None


class ReferenceStages:
    """The torch references of :mod:`echo_vllm.quant`."""

    name = "reference"
    stochastic = True

    def stage1(self, x, feedback, layout, *, qmax, hadamard, has_incoming, noise=None, flips=0, encoder="absmax",
               out=None):
        wire = quant.stage1_reference(x, feedback, layout, qmax=qmax, hadamard=hadamard,
                                      has_incoming=has_incoming, noise=noise, flips=flips, encoder=encoder)
        return _into(out, wire)

    def stage2(self, recv, feedback, own_chunks, layout, *, qmax, noise=None, encoder="absmax", out=None):
        return _into(out, quant.stage2_reference(recv, feedback, own_chunks, layout, qmax=qmax, noise=noise,
                                                 encoder=encoder))

    def output(self, gathered, layout, out_dtype, *, hadamard, flips=0, out=None):
        return _into(out, quant.output_reference(gathered, layout, out_dtype, hadamard=hadamard, flips=flips))

    def consume(self, x, feedback, layout, *, hadamard, flips=0, out=None):
        return _into(out, quant.consume_reference(x, feedback, layout, hadamard=hadamard, flips=flips))

    output_norm = output_then_norm


__all__ = ["ReferenceStages", "StageOps", "output_then_norm"]
