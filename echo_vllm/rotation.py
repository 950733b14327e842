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

Sign flips (``EchoConfig.rotation_seed``)
-----------------------------------------
The rotation Echo applies is ``W D``: ``D`` flips the signs of some of a
group's values before the butterflies, the same positions in every group
(a pattern of period ``g`` along the row), and flips them back after the
inverse. Any ``D`` gives an orthogonal rotation, so each seed is one draw
of "a random rotation" and one evaluation measures the quality of many
(EVAL.md). The pattern is :func:`sign_flips`' integer, bit ``i`` set where
value ``i`` of a group is flipped: seed 0 flips nothing (the plain
Walsh-Hadamard transform, Echo's rotation before seeds existed), seed
``s >= 1`` draws every bit from a counter-based hash of ``(s, i)``. A
function of the configuration alone, it is the same on every rank, and a
value's sign depends on its column only, never on the batch; it reaches
the kernels as that one integer (the Triton kernels: a compile-time
constant; ``flips = 0`` compiles to the kernels without flips).
"""

from __future__ import annotations

import torch

#: splitmix64's increment and output multipliers (Steele, Lea, Flood,
#: "Fast splittable pseudorandom number generators", OOPSLA 2014).
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


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


def _splitmix64(z: int) -> int:
    """splitmix64's output function of the 64-bit state ``z``."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def sign_flips(seed: int, group_size: int) -> int:
    """The sign pattern of rotation seed ``seed`` for groups of ``group_size``
    values: an integer whose bit ``i`` is set where value ``i`` of every
    group is flipped (module docstring). 0 for seed 0 (no value flipped);
    for ``seed >= 1`` bit ``i`` is bit ``i % 64`` of splitmix64's output
    ``i // 64 + 1`` from state ``seed``: every one of the ``2**g`` patterns
    equally likely, the no-flip one included. Plain integer arithmetic:
    the same on every rank, platform and backend."""
    if seed == 0:
        return 0
    bits = 0
    for word in range(-(-group_size // 64)):
        bits |= _splitmix64((seed + (word + 1) * _GOLDEN_GAMMA) & _MASK64) << (64 * word)
    return bits & ((1 << group_size) - 1)


def sign_vector(flips: int, group_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[group_size]``: -1 where ``flips`` has bit ``i`` set, else +1
    (multiplying by it is exact, and by all ones the identity)."""
    bits = torch.tensor([(flips >> i) & 1 for i in range(group_size)], dtype=torch.float32, device=device)
    return 1.0 - 2.0 * bits
