"""Transports refuse bad arguments by name (the collectives themselves are
tested through the all-reduce, tests/core/test_allreduce.py)."""

from __future__ import annotations

import pytest
import torch

from echo_vllm.transport import VirtualTransport


@pytest.mark.parametrize("world_size", [2.5, True, 1, 0, -3, "4", None, 65, 10**6])
def test_virtual_transport_needs_an_integer_world_size_of_two_or_more(world_size):
    with pytest.raises(ValueError, match=f"VirtualTransport needs an integer world_size >= 2, got {world_size!r}"):
        VirtualTransport(world_size)


def test_virtual_transport_holds_its_ranks():
    assert VirtualTransport(3).local_ranks == (0, 1, 2)


@pytest.mark.parametrize("dtype, value", [(torch.int64, 2**40 + 1), (torch.int32, 2**24 + 1),
                                          (torch.float64, 1 + 2**-40)])
def test_virtual_exact_all_reduce_sums_wide_dtypes_in_their_own_dtype(dtype, value):
    """What ``torch.distributed`` gives: fp32 rounded these sums (2^40 + 1
    summed 4 times came back as 2^42)."""
    x = torch.full((4, 3), value, dtype=dtype)
    assert torch.equal(VirtualTransport(4).exact_all_reduce(x), torch.full((3,), 4 * value, dtype=dtype))


def test_virtual_exact_all_reduce_keeps_the_imaginary_part():
    x = torch.complex(torch.zeros(2, 3), torch.arange(6.0).view(2, 3))
    assert torch.equal(VirtualTransport(2).exact_all_reduce(x), x[0] + x[1])
