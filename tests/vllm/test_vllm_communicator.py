"""``vllm_glue.communicator``: the TP group's ``EchoCommunicator``, its
backend chosen once from the group's facts (a stand-in CUDA group: no vLLM,
no GPU). (Named ``test_vllm_*``: tests/core/test_communicator.py is the core
communicator's, and pytest needs distinct file names.)"""

import pytest
import torch

from echo_vllm import EchoConfig
from echo_vllm.quant import WireLayout
from echo_vllm.vllm_glue.tracking import ForwardTracker, StepStats
from support.fake_group import ProcessGroupStandIn, cuda_tp_group


@pytest.fixture
def tp_group(monkeypatch):
    return cuda_tp_group(monkeypatch)


def _communicator(group, **echo):
    from echo_vllm.vllm_glue.communicator import tp_communicator

    return tp_communicator(group, EchoConfig(**echo), ForwardTracker(StepStats()), lambda x: x,
                           hidden_size=256, max_num_tokens=512)


def test_the_tp_group_gets_the_backend_make_backend_picks_from_its_facts(tp_group, monkeypatch):
    comm = _communicator(tp_group)
    (peers,) = tp_group.probed  # probed over the NCCL process group (pynccl maps no peer memory)
    assert isinstance(peers, ProcessGroupStandIn) and peers.name == "nccl-group"
    (transport, facts, built), = tp_group.built
    # the communicator reduces with the one backend built for the group
    assert comm.backend(torch.device("cuda")) is built and built.name == "fused"
    assert transport.name == "pynccl" and facts["peers"] is peers
    assert facts["max_numel"] == 512 * WireLayout(256, 2, 32).padded_cols  # the largest batch's rows
    # ECHO_KERNELS overrides the choice in vLLM too: the group is not even probed
    monkeypatch.setenv("ECHO_KERNELS", "triton")
    assert _communicator(tp_group).backend(tp_group.device).name == "triton"
    assert len(tp_group.probed) == 1 and len(tp_group.built) == 1
