"""How Echo's bytes move between ranks: one small interface, three backends.

Echo needs three collectives, all on a leading "local ranks" dimension R
(the ranks whose data this process holds: 1 in a real multi-process group,
P for in-process virtual ranks):

* ``all_to_all(send[R, P, B]) -> recv[R, P, B]``: ``recv[r, i]`` is what
  rank i sent to local rank r (its chunk ``r``'s index);
* ``all_gather(chunk[R, B]) -> [P, B]``: every rank's reduced chunk;
* ``exact_all_reduce(x[R, ...]) -> [...]``: the 16-bit fallback.

Two-level Echo (:mod:`echo_vllm.two_level`) also needs ``split(groups)``:
transports over sub-groups of the ranks (the ranks of each host, the
ranks with the same local index on every host).

Backends:

* :class:`ProcessGroupTransport` -- ``torch.distributed`` (gloo on CPU,
  NCCL on GPU): ``all_to_all_single`` + ``all_gather_into_tensor`` over
  NCCL; over gloo the same exchanges as point-to-point calls with every
  receive posted before its send (gloo's own post the send first). Over
  gloo, CUDA tensors are staged through host memory (gloo's collectives are
  CPU collectives): a GPU job over a TCP link, which is how the gloo
  benchmark measures a bandwidth-bound link with the kernels on the GPU.
* :class:`VirtualTransport` -- P ranks in one process (one-GPU emulation of
  TP=P, evaluation). A transpose and a no-op; Echo's numerics are
  bit-identical to the multi-process run on the same inputs because every
  stage is elementwise per rank and the stage-2 sum runs in rank order.
* vLLM's pynccl communicator of a tensor-parallel group, wrapped by the vLLM
  glue (:class:`echo_vllm.vllm_glue.pynccl_transport.PyncclTransport`).
"""

from __future__ import annotations

import abc
from typing import Sequence

import torch
import torch.distributed as dist

from .cli_args import MAX_RANKS, RANKS_WHY


class EchoShapeMismatch(RuntimeError):
    """Ranks entered the same Echo call with different message shapes."""


class Transport(abc.ABC):
    """The collectives Echo needs."""

    world_size: int
    local_ranks: tuple[int, ...]
    capturable: bool = False
    """True if the collectives can be recorded into a CUDA graph."""

    @abc.abstractmethod
    def all_to_all(self, send: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def all_gather(self, chunks: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def exact_all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def check_same(self, values: Sequence[int]) -> None:
        """Raise :class:`EchoShapeMismatch` on every rank if ranks disagree on
        ``values``. Virtual ranks share one call, so they always agree."""

    def split(self, groups: Sequence[Sequence[int]]) -> list[tuple["Transport", tuple[int, ...]]]:
        """Transports over ``groups`` (disjoint lists of this transport's
        ranks, each in rank order): for each group holding ranks of this
        process, ``(its transport, the positions of those ranks in
        local_ranks)``, in the order of ``groups``. A collective where the
        ranks are processes: every rank calls it with the same ``groups``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be split into sub-groups (two-level Echo runs "
                                  "over a torch.distributed group or in-process virtual ranks)")

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """The element-wise maximum of ``values`` over the ranks (the same
        list on every rank). Virtual ranks share one call: ``values``."""
        return [float(v) for v in values]


class VirtualTransport(Transport):
    """P ranks held by one process; inputs are stacked on dim 0."""

    capturable = True

    def __init__(self, world_size: int):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or not 2 <= world_size <= MAX_RANKS:
            raise ValueError(f"VirtualTransport needs an integer world_size >= 2, got {world_size!r:.40}"
                             + (f" (at most {MAX_RANKS}: {RANKS_WHY})" if isinstance(world_size, int) else ""))
        self.world_size = world_size
        self.local_ranks = tuple(range(world_size))

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        # send[src, dst] -> recv[dst, src]
        return send.transpose(0, 1).contiguous()

    def all_gather(self, chunks: torch.Tensor) -> torch.Tensor:
        return chunks

    def split(self, groups: Sequence[Sequence[int]]) -> list[tuple[Transport, tuple[int, ...]]]:
        return [(VirtualTransport(len(members)), tuple(members)) for members in groups]

    def exact_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks in rank order: floats narrower than fp32 in
        fp32, one rounding (what vLLM's custom all-reduce and NCCL's one-shot
        kernels do for 16-bit inputs); every other dtype in its own, as
        ``torch.distributed`` sums it (fp32 would round int64 and fp64 and
        drop a complex value's imaginary part)."""
        wide = x.is_floating_point() and x.element_size() < 4
        acc = torch.zeros(x.shape[1:], dtype=torch.float32 if wide else x.dtype, device=x.device)
        for r in range(x.shape[0]):
            acc = acc + (x[r].float() if wide else x[r])
        return acc.to(x.dtype)


class ProcessGroupTransport(Transport):
    """One rank of a ``torch.distributed`` process group."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_ranks = (self.rank,)
        self.backend = dist.get_backend(group)
        # NCCL collectives issued on the current stream can be captured; gloo
        # runs on the host and cannot.
        self.capturable = self.backend == "nccl"
        self._staged = self.backend == "gloo"

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where this backend's collectives can read it."""
        return t.cpu() if self._staged and t.is_cuda else t

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        host = self._host(send.contiguous())
        recv = torch.empty_like(host)
        if self.backend == "gloo":
            recv[0, self.rank] = host[0, self.rank]
            p = self.world_size
            self._receive_then_send([(recv[0, (self.rank - i) % p], (self.rank - i) % p) for i in range(1, p)],
                                    [(host[0, (self.rank + i) % p], (self.rank + i) % p) for i in range(1, p)])
        else:
            dist.all_to_all_single(recv.view(-1), host.view(-1), group=self.group)
        return recv.to(send.device)

    def all_gather(self, chunks: torch.Tensor) -> torch.Tensor:
        # flat buffers: gloo wants the output to be the input's shape with
        # its first dimension multiplied by world_size
        host = self._host(chunks.reshape(-1))
        out = torch.empty(self.world_size * chunks.numel(), dtype=chunks.dtype, device=host.device)
        if self.backend == "gloo":
            # a ring in rank order (gloo's own all-gather's bytes): step k forwards
            # to the right what came from the left at step k - 1
            rows, p = out.view(self.world_size, -1), self.world_size
            rows[self.rank] = host
            for step in range(p - 1):
                self._receive_then_send([(rows[(self.rank - step - 1) % p], (self.rank - 1) % p)],
                                        [(rows[(self.rank - step) % p], (self.rank + 1) % p)])
        else:
            dist.all_gather_into_tensor(out, host, group=self.group)
        return out.view((self.world_size,) + tuple(chunks.shape[1:])).to(chunks.device)

    def _receive_then_send(self, recvs: list[tuple[torch.Tensor, int]], sends: list[tuple[torch.Tensor, int]]) -> None:
        """Receive into each ``(buffer, group rank)`` of ``recvs`` and send
        each of ``sends``, every receive posted before any send, then wait
        for all. Over gloo's TCP pairs a receive announces itself to the
        peer in the same ordered stream as our sends: gloo's own all-to-all
        and all-gather post a send first, so once the peer is ready our
        payload goes out ahead of our announcement, and the peer's transfer
        to us waits for all of it. On a link that made one call's exchange
        take twice its wire time about half the time (``bench link``).
        The sends are waited for first, as gloo's own do: a peer that died
        fails a send at once, naming its address, where a receive from it
        only times out."""
        receiving = [dist.irecv(t, group=self.group, group_src=peer) for t, peer in recvs]
        sending = [dist.isend(t, group=self.group, group_dst=peer) for t, peer in sends]
        for work in sending + receiving:
            work.wait()

    def exact_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = self._host(x[0]).clone()
        dist.all_reduce(out, group=self.group)
        return out.to(x.device)

    def split(self, groups: Sequence[Sequence[int]]) -> list[tuple[Transport, tuple[int, ...]]]:
        """One ``torch.distributed.new_group`` per group this rank is in, with
        this group's backend; only the members take part
        (``use_local_synchronization``), so other ranks of the job need not
        call it. Every rank calls its groups in the order of ``groups``."""
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else \
            list(range(dist.get_world_size()))
        out: list[tuple[Transport, tuple[int, ...]]] = []
        for members in groups:
            if self.rank not in members:
                continue
            global_ranks = [ranks[m] for m in members]
            if global_ranks != sorted(global_ranks):  # torch numbers a group's ranks in global order
                raise ValueError(f"sub-group {list(members)} (global ranks {global_ranks}) is not in rank order")
            # NCCL: the communicator made now, not at a first call that may come under graph capture
            device = {"device_id": torch.device("cuda", torch.cuda.current_device())} if self.backend == "nccl" else {}
            sub = dist.new_group(global_ranks, backend=self.backend, use_local_synchronization=True, **device)
            out.append((ProcessGroupTransport(sub), (0,)))
        return out

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        device = "cuda" if self.backend == "nccl" else "cpu"
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def check_same(self, values: Sequence[int]) -> None:
        device = "cuda" if self.backend == "nccl" else "cpu"
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        every = torch.empty(self.world_size * len(values), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        rows = every.view(self.world_size, -1).tolist()
        if any(row != rows[0] for row in rows):
            raise EchoShapeMismatch(
                f"ranks disagree on the all-reduce message (numel, dtype, ...): {rows}; "
                f"this is rank {self.rank}"
            )
