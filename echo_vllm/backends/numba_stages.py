"""The stages as the fused numba CPU loops of :mod:`echo_vllm.kernels.cpu_loops`.

Imported where a backend that runs them is built (:mod:`echo_vllm.backends`):
numba loads only then. The loops round to nearest (no ``noise``);
``output_norm`` is their ``output`` then ``rmsnorm.norm_into``.
"""

from __future__ import annotations

from ..kernels import cpu_loops
from .stages import output_then_norm


class NumbaStages:
    """:class:`~echo_vllm.backends.stages.StageOps` of the numba loops (CPU tensors)."""

    name = "numba"
    stochastic = False
    stage1 = staticmethod(cpu_loops.stage1)
    stage2 = staticmethod(cpu_loops.stage2)
    output = staticmethod(cpu_loops.output)
    consume = staticmethod(cpu_loops.consume)
    output_norm = output_then_norm

    def __init__(self):
        if not cpu_loops.AVAILABLE:
            raise RuntimeError("the numba stages need numba (pip install numba)")


__all__ = ["NumbaStages"]
