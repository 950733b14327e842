"""``vllm_glue.pynccl_transport``: Echo's collectives over vLLM's pynccl
API give the bits of ``ProcessGroupTransport``.

Two gloo processes (no vLLM needed: the transport only calls the
communicator's API); vLLM's ``PyNcclCommunicator`` is stood in for by the
same calls over gloo point-to-point, so that PyncclTransport's all-to-all
indexing runs on CPU. Each rank makes three chained Echo calls and one
exact all-reduce through each transport.
"""

import pytest
import torch

from echo_vllm import CallSlot, EchoCommunicator, EchoConfig, FeedbackChain, Path, ProcessGroupTransport
from echo_vllm.spawn import run_processes

HIDDEN = 128


class _GlooAsPynccl:
    """vLLM's PyNcclCommunicator API (group_start/send/recv/group_end,
    all_gather, all_reduce) over gloo point-to-point, to run PyncclTransport's
    all-to-all indexing on CPU."""

    disabled = False

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._ops = None

    def group_start(self):
        self._ops = []

    def send(self, t, dst):
        self._ops.append(self.dist.P2POp(self.dist.isend, t, dst, self.group))

    def recv(self, t, src):
        self._ops.append(self.dist.P2POp(self.dist.irecv, t, src, self.group))

    def group_end(self):
        for work in self.dist.batch_isend_irecv(self._ops):
            work.wait()
        self._ops = None

    def all_gather(self, out, inp):
        self.dist.all_gather_into_tensor(out.view(-1), inp.reshape(-1), group=self.group)

    def all_reduce(self, t):
        out = t.clone()
        self.dist.all_reduce(out, group=self.group)
        return out


def _worker(rank, world):
    import torch.distributed as dist

    from echo_vllm.vllm_glue.pynccl_transport import PyncclTransport

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(7 + rank)
    xs = [torch.randn(6, HIDDEN, generator=g).bfloat16() for _ in range(3)]
    by = {}
    for label, transport in (("pynccl", PyncclTransport(_GlooAsPynccl(group), group)),
                             ("gloo", ProcessGroupTransport(group))):
        comm, chain = EchoCommunicator(EchoConfig(min_bytes=0), transport), FeedbackChain(1)
        by[label] = [comm.all_reduce(x.clone(), slot=CallSlot(t), path=Path.ECHO, chain=chain)
                     for t, x in enumerate(xs)]
        by[label].append(transport.exact_all_reduce(xs[0].unsqueeze(0).clone()))
    return by


@pytest.fixture(scope="module")
def ranks():
    return run_processes(_worker, 2)


def test_pynccl_transport_matches_process_group_transport(ranks):
    for r in ranks:
        a, b = r["pynccl"], r["gloo"]
        assert len(a) == len(b) == 4
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(ranks[0]["pynccl"], ranks[1]["pynccl"]))


def test_a_missing_or_disabled_communicator_is_refused():
    from echo_vllm.vllm_glue.pynccl_transport import PyncclTransport

    for comm in (None, _Disabled()):
        with pytest.raises(ValueError, match="pynccl communicator is missing or disabled"):
            PyncclTransport(comm, None)


class _Disabled:
    disabled = True
