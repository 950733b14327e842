"""The stages as the fused Triton kernels of :mod:`echo_vllm.kernels`.

Imported where a backend that runs them is built (:mod:`echo_vllm.backends`):
Triton loads only then. The kernels round to nearest (no ``noise``);
``output_norm`` is fused too.
"""

from __future__ import annotations

from .. import kernels

if not kernels.AVAILABLE:  # the registry builds this module's stages only: one line, not a missing name
    raise ImportError("the triton stages need Triton (pip install triton)")


class TritonStages:
    """:class:`~echo_vllm.backends.stages.StageOps` of the Triton kernels
    (every feedback format, int8 included; CUDA, or CPU tensors under
    ``TRITON_INTERPRET=1``)."""

    name = "triton"
    stochastic = False
    stage1 = staticmethod(kernels.stage1)
    stage2 = staticmethod(kernels.stage2)
    output = staticmethod(kernels.output)
    output_norm = staticmethod(kernels.output_norm)
    consume = staticmethod(kernels.consume)


__all__ = ["TritonStages"]
