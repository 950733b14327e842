"""Fused Triton kernels of Echo's stages, bit-exact twins of ``echo_vllm.quant``.

``stage1``, ``stage2``, ``output`` and ``consume`` take the same arguments as
the references (plus optional ``out`` buffers, so a CUDA graph can capture a
call without allocations) and return the same bits; ``output_norm`` is
``output`` followed by the norm of ``echo_vllm.rmsnorm`` (``norm_into``). ``echo_vllm.backends`` picks
them for CUDA tensors. ``AVAILABLE`` is False when Triton cannot be imported;
the references then serve every device.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels
on CPU tensors (slow; that is how CI checks them against the references).
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except Exception:  # pragma: no cover - depends on the installation
    AVAILABLE = False
else:
    AVAILABLE = True

if AVAILABLE:
    from .consume_kernel import consume
    from .output_kernel import output
    from .output_norm_kernel import output_norm
    from .stage1_kernel import stage1
    from .stage2_kernel import stage2

__all__ = ["AVAILABLE", "consume", "output", "output_norm", "stage1", "stage2"]
