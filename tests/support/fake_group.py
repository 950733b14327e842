"""A stand-in for one rank of a 2-rank process group, for tests of what is
decided when a group is created (nothing is ever sent through it), and a
stand-in for vLLM's TP group coordinator built on it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from echo_vllm.hosts import HostMap
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

    all_gather = exact_all_reduce = all_to_all

    def __repr__(self) -> str:
        return f"FakeRank({self.name!r})"


class ProcessGroupStandIn(FakeRank):
    """Stands in for ProcessGroupTransport(group) of the glue."""


def cuda_tp_group(monkeypatch) -> SimpleNamespace:
    """A CUDA TP group of 2 (a stand-in coordinator) whose bytes move over
    pynccl; the fused backend's probe and builder record what they get
    (``probed``, ``built``). ``monkeypatch``: pytest's, which undoes it all."""
    from echo_vllm import backends
    from echo_vllm.vllm_glue import communicator as glue

    group = SimpleNamespace(unique_name="tp:0", world_size=2, rank_in_group=0, device=torch.device("cuda", 0),
                            device_group="nccl-group", cpu_group="gloo-group", device_communicator=None,
                            probed=[], built=[])
    monkeypatch.setattr(glue, "make_transport", lambda coordinator: FakeRank("pynccl"))
    monkeypatch.setattr(glue, "node_map", lambda coordinator: HostMap((0, 0)))  # vLLM's node test: one host
    monkeypatch.setattr(glue, "ProcessGroupTransport", ProcessGroupStandIn)
    monkeypatch.setattr(backends, "fused_support", lambda peers, device: group.probed.append(peers) or (True, "P2P"))

    def build(cfg, transport, env, **facts):
        backend = SimpleNamespace(name="fused", topology="flat", close=lambda: None)
        group.built.append((transport, facts, backend))
        return backend

    monkeypatch.setitem(backends.BACKENDS, "fused", dataclasses.replace(backends.BACKENDS["fused"], build=build))
    monkeypatch.delenv("ECHO_KERNELS", raising=False)
    return group
