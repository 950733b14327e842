"""Transports refuse bad arguments by name, and ProcessGroupTransport's
exchanges over gloo give the torch collectives' bits (the all-reduce on
top of them: tests/core/test_allreduce.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from echo_vllm.spawn import run_processes
from echo_vllm.transport import ProcessGroupTransport, VirtualTransport


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


# (shape of one rank's chunk, dtype): Echo's wire bytes, odd and multi-dim rows, an empty call
_EXCHANGES = [((37,), torch.uint8), ((5, 3), torch.bfloat16), ((1,), torch.float32), ((0,), torch.uint8)]


def _exchange_worker(rank, world):
    transport = ProcessGroupTransport()
    out = []
    for case, (shape, dtype) in enumerate(_EXCHANGES):
        send = _rank_data(rank, case, (1, world) + shape, dtype)
        chunk = _rank_data(rank, case + 100, (1,) + shape, dtype)
        torch_recv = torch.empty_like(send)
        dist.all_to_all_single(torch_recv.view(-1), send.view(-1))
        torch_gathered = torch.empty((world,) + shape, dtype=dtype)
        dist.all_gather_into_tensor(torch_gathered.view(-1), chunk.view(-1))
        out.append((transport.all_to_all(send), torch_recv, transport.all_gather(chunk), torch_gathered))
    return out


def _rank_data(rank: int, case: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_process_group_exchanges_give_the_torch_collectives_bits(world):
    """Over gloo the transport posts its own point-to-point exchanges
    (receives before sends); every rank gets exactly what
    ``all_to_all_single`` / ``all_gather_into_tensor`` give, and what the
    definitions say: ``recv[0, i]`` is rank i's chunk for this rank, row i
    of the gather rank i's chunk."""
    results = run_processes(_exchange_worker, world)
    for case, (shape, dtype) in enumerate(_EXCHANGES):
        sends = [_rank_data(r, case, (1, world) + shape, dtype) for r in range(world)]
        chunks = torch.cat([_rank_data(r, case + 100, (1,) + shape, dtype) for r in range(world)])
        for rank, per_case in enumerate(results):
            recv, torch_recv, gathered, torch_gathered = per_case[case]
            assert torch.equal(recv, torch_recv) and torch.equal(gathered, torch_gathered)
            assert torch.equal(recv[0], torch.stack([s[0, rank] for s in sends]))
            assert torch.equal(gathered, chunks)
