"""Echo's collectives over vLLM's own pynccl communicator.

vLLM already holds one NCCL communicator per tensor-parallel group
(``device_communicator.pynccl_comm``), issues its calls on the current
stream and records them into CUDA graphs. Echo reuses it instead of opening
another communicator:

* all-to-all: one ``ncclSend`` + ``ncclRecv`` per peer inside an NCCL group
  (NCCL has no all-to-all primitive; grouped point-to-point is how
  ``all_to_all_single`` is built too);
* all-gather: ``ncclAllGather``;
* exact 16-bit fallback: ``ncclAllReduce`` (the hook passes vLLM's full
  all-reduce instead, which may pick its custom kernels).

Ranks are ranks *in the group*, which is what pynccl's ``send``/``recv`` take.
The shape agreement check travels on the group's gloo CPU group, off the GPU
stream, and never under graph capture.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..transport import ProcessGroupTransport, Transport


class PyncclTransport(Transport):
    """One rank of a vLLM ``PyNcclCommunicator``."""

    capturable = True

    def __init__(self, pynccl_comm: Any, cpu_group: Any):
        if pynccl_comm is None or getattr(pynccl_comm, "disabled", True):
            raise ValueError("vLLM's pynccl communicator is missing or disabled for this group")
        self.comm = pynccl_comm
        self.world_size = int(pynccl_comm.world_size)
        self.rank = int(pynccl_comm.rank)
        self.local_ranks = (self.rank,)
        self._cpu = ProcessGroupTransport(cpu_group)

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """send [1, P, B] -> recv [1, P, B]; recv[0, i] is what rank i sent us."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        me = self.rank
        recv[0, me].copy_(send[0, me])
        self.comm.group_start()
        try:
            for peer in range(self.world_size):
                if peer != me:
                    self.comm.send(send[0, peer], peer)
                    self.comm.recv(recv[0, peer], peer)
        finally:
            self.comm.group_end()
        return recv

    def all_gather(self, chunks: torch.Tensor) -> torch.Tensor:
        chunks = chunks.contiguous()
        out = torch.empty(
            (self.world_size,) + tuple(chunks.shape[1:]), dtype=chunks.dtype, device=chunks.device
        )
        self.comm.all_gather(out, chunks)
        return out

    def exact_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x[0].contiguous())

    def check_same(self, values: Sequence[int]) -> None:
        self._cpu.check_same(values)

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        return self._cpu.max_over_ranks(values)
