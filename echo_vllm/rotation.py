"""Walsh-Hadamard rotation of quantization groups.

Echo rotates each group of ``g`` values before quantizing so that one outlier
channel is spread over the whole group instead of setting a scale that
crushes its neighbours to zero. The transform used on the wire is the
*unnormalized* fast Walsh-Hadamard transform ``W`` (entries +-1, ``W @ W =
g * I``): it needs only adds and subtracts, so the rotated values are exact
functions of the input, the same in torch and in the Triton kernels, and the
inverse is ``W / g`` with ``1/g`` a power of two (an exact multiply). Echo
rotates the input times ``1 / (2 g)`` (``quant.input_scale``), so no
butterfly exceeds half the input's largest value, and undoes both with ``W``
times 2 (``quant.OUTPUT_SCALE``). The orthonormal rotation is ``W /
sqrt(g)``; Echo never needs it because group quantization is
scale-invariant, but :func:`hadamard_orthonormal` is here for tests and
users.

The butterfly order (stride 1, 2, 4, ...; outputs ``(a + b, a - b)``) is part
of the kernel specification: the Triton kernels perform the same adds in the
same order.
"""

from __future__ import annotations

import torch


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform over the last dimension.

    The last dimension must be a power of two. Works in ``x``'s dtype; Echo
    calls it on fp32.
    """
    g = x.shape[-1]
    if g & (g - 1):
        raise ValueError(f"fwht: last dimension {g} is not a power of two")
    lead = x.shape[:-1]
    h = 1
    while h < g:
        v = x.reshape(*lead, g // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, g)
        h *= 2
    return x


def hadamard_matrix(g: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The +-1 matrix W with ``fwht(x) == x @ W`` (W is symmetric)."""
    return fwht(torch.eye(g, dtype=dtype))


def hadamard_orthonormal(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal rotation ``W x / sqrt(g)``; its own inverse."""
    g = x.shape[-1]
    return fwht(x) * (g**-0.5)
