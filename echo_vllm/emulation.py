"""Emulate tensor parallelism of size P on one device.

Real TP=P splits a row-parallel linear's input dimension (and the embedding's
vocabulary) into P shards; rank r computes a partial output from its shard,
and the all-reduce sums the partials. Here one process computes all P
partials -- with one separate matmul per rank, exactly as each rank would --
and reduces them with Echo over :class:`~echo_vllm.transport.VirtualTransport`.
On the same inputs this gives the bits a real P-GPU run gives (up to the
matmul kernel the BLAS picks for a shape, which is the same on the same
GPU model).

Framework glue (vLLM layers, transformers modules) calls these functions;
nothing here imports either framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .communicator import EchoCommunicator
from .config import EchoConfig, EchoConfigError
from .numbering import CallCounter, CallSlot
from .policy import Path, mode_config
from .transport import VirtualTransport

#: vLLM pads the vocabulary to a multiple of this before sharding it.
VOCAB_PADDING = 64


def shard_bounds(size: int, world_size: int) -> list[tuple[int, int]]:
    """Even contiguous shards, as vLLM's ``divide`` requires."""
    if size % world_size:
        raise EchoConfigError(
            f"dimension {size} is not divisible by the emulated tensor-parallel size {world_size}"
        )
    per = size // world_size
    return [(r * per, (r + 1) * per) for r in range(world_size)]


def vocab_shard_bounds(vocab_size: int, world_size: int) -> list[tuple[int, int]]:
    """Token-id ranges of each rank's embedding shard: the vocabulary padded to
    a multiple of 64, then split evenly (``VocabParallelEmbedding``)."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return [(lo, min(hi, vocab_size)) for lo, hi in shard_bounds(padded, world_size)]


def row_parallel_partials(
    x: torch.Tensor, weight: torch.Tensor, world_size: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Partial outputs [P, ..., out] of ``F.linear(x, weight, bias)`` under
    row parallelism: rank r multiplies input features ``r``'s shard; rank 0
    alone adds the bias (vLLM's ``RowParallelLinear``)."""
    parts = []
    for r, (lo, hi) in enumerate(shard_bounds(weight.shape[1], world_size)):
        parts.append(F.linear(x[..., lo:hi], weight[:, lo:hi], bias if r == 0 else None))
    return torch.stack(parts)


def vocab_parallel_partials(
    ids: torch.Tensor, weight: torch.Tensor, world_size: int
) -> torch.Tensor:
    """Partial embeddings [P, ..., hidden]: rank r looks up the ids in its
    vocabulary shard and writes zeros for the others."""
    parts = []
    for lo, hi in vocab_shard_bounds(weight.shape[0], world_size):
        inside = (ids >= lo) & (ids < hi)
        local = torch.where(inside, ids - lo, torch.zeros_like(ids))
        emb = F.embedding(local, weight[lo:hi])
        parts.append(emb.masked_fill(~inside.unsqueeze(-1), 0))
    return torch.stack(parts)


class StackedCommunicator(EchoCommunicator):
    """:class:`~echo_vllm.communicator.EchoCommunicator` over this process's
    R ranks at once: every input is stacked ``[R, ...]`` (R = P over a
    :class:`~echo_vllm.transport.VirtualTransport`: the emulation of P GPUs
    on one; R = 1 for one rank of a real group, training's rank-stacked
    tensors). Outputs, the policy and the records are one rank's, as in
    real tensor parallelism; ``exact_all_reduce`` takes the stack."""

    stacked = True

    def _message(self, inp: torch.Tensor) -> torch.Tensor:
        return self._local(inp)[0]  # the stack checked first: an empty one has no rank 0

    def _local(self, inp: torch.Tensor) -> torch.Tensor:
        ranks = len(self.transport.local_ranks)
        if inp.dim() < 2 or inp.shape[0] != ranks:
            raise ValueError(f"{ranks} local ranks of a group of {self.world_size} expect inputs stacked as "
                             f"[{ranks}, ...], got shape {tuple(inp.shape)}")
        return inp

    def _unlocal(self, xs: torch.Tensor) -> torch.Tensor:
        return xs


@dataclass
class EmulatedTP:
    """P virtual ranks reduced by Echo, with the per-forward call counter.

    Call :meth:`begin_forward` at the start of every forward pass (the
    counter restarts and the chain starts clean) and :meth:`end_forward`
    at its end; :meth:`reduce` each partial stack in model order.
    ``calls_per_forward`` (declared; else the counter learns it from the
    first forward) marks the last call for ``exact_last_call``.
    ``mode`` (:data:`echo_vllm.policy.MODES`): ``"exact"`` forces every
    call onto the 16-bit path (the baseline), ``"naive"`` runs ``config``
    without error feedback, ``"echo"`` as given. With
    ``config.backend="auto"`` CPU tensors run the fastest CPU backend
    installed (:func:`echo_vllm.backends.fastest_cpu_backend`: same bits).
    """

    world_size: int
    config: EchoConfig = field(default_factory=EchoConfig)
    mode: str = "echo"
    calls_per_forward: int | None = None
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        config = mode_config(self.mode, self.config)
        self.comm = StackedCommunicator(config or self.config, VirtualTransport(self.world_size), device=self.device,
                                        fast_cpu=True)
        self.counter = CallCounter(self.calls_per_forward)
        """Numbers the calls of each forward pass (holds the learned count)."""

    def begin_forward(self) -> None:
        self.counter.start()

    def end_forward(self) -> None:
        self.counter.end()

    def next_call(self) -> CallSlot:
        """The next call's place in the forward pass (:meth:`reduce` takes it
        itself unless given one)."""
        return self.counter.next()

    def reduce(self, partials: torch.Tensor, slot: CallSlot | None = None, path: Path | None = None) -> torch.Tensor:
        """Sum partials [P, ...] as the configured all-reduce would, as the
        call at ``slot`` (default: the next one); ``path``: the path the
        caller forces (``mode="exact"`` forces the exact one on every call)."""
        slot = self.counter.next() if slot is None else slot
        return self.comm.all_reduce(partials, slot=slot, path=Path.EXACT if self.mode == "exact" else path)
