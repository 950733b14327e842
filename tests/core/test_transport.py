"""Transports refuse bad arguments by name (the collectives themselves are
tested through the all-reduce, tests/core/test_allreduce.py)."""

from __future__ import annotations

import pytest

from echo_vllm.transport import VirtualTransport


@pytest.mark.parametrize("world_size", [2.5, True, 1, 0, -3, "4", None])
def test_virtual_transport_needs_an_integer_world_size_of_two_or_more(world_size):
    with pytest.raises(ValueError, match=f"VirtualTransport needs an integer world_size >= 2, got {world_size!r}"):
        VirtualTransport(world_size)


def test_virtual_transport_holds_its_ranks():
    assert VirtualTransport(3).local_ranks == (0, 1, 2)
