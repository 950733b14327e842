"""A stand-in for one rank of a 2-rank process group, for tests of what is
decided when a group is created (nothing is ever sent through it)."""

from __future__ import annotations

import torch

from echo_vllm.transport import Transport


class FakeRank(Transport):
    """Rank 0 of 2 that moves no bytes: building backends and communicators
    on it works; running a collective raises."""

    capturable = True

    def __init__(self, name: str = "group"):
        self.name = name
        self.world_size = 2
        self.rank = 0
        self.local_ranks = (0,)

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        raise AssertionError(f"{self.name}: no collective may run here")

    all_gather = all_reduce_exact = all_to_all

    def __repr__(self) -> str:
        return f"FakeRank({self.name!r})"
