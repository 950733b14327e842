"""``EchoCommunicator``: what each call records about the path it took."""

from __future__ import annotations

import torch

from echo_vllm import EchoCommunicator, EchoConfig, VirtualTransport
from echo_vllm.backends.composed import ComposedBackend
from echo_vllm.backends.stages import ReferenceStages
from echo_vllm.policy import Reason

P = 4
CFG = EchoConfig(min_bytes=0, first_exact_calls=0, exact_last_call=False, backend="reference")


class _SmallBuffers(ComposedBackend):
    """The reference backend with the fused backend's limit: its own kernels
    take messages of up to ``max_numel`` values, its fallback the rest (the
    same references here, so the bits cannot tell the two apart)."""

    def __init__(self, transport, max_numel: int):
        super().__init__(CFG, transport, ReferenceStages())
        self.max_numel = max_numel

    def fits(self, layout) -> bool:
        return layout.numel <= self.max_numel


def test_a_message_beyond_the_fused_buffers_is_recorded_with_its_reason():
    transport = VirtualTransport(P)
    records = []
    comm = EchoCommunicator(CFG, transport, backend=_SmallBuffers(transport, 64 * 128), sink=records.append)
    plain = EchoCommunicator(CFG, VirtualTransport(P))
    small, big = torch.randn(P, 64, 128).bfloat16(), torch.randn(P, 128, 128).bfloat16()
    for i, x in enumerate((small, big)):
        assert torch.equal(comm.all_reduce(x, i), plain.all_reduce(x, i))
    assert [(r.path, r.reason) for r in records] == [("echo", Reason.ECHO.value),
                                                     ("echo", Reason.EXCEEDS_FUSED_BUFFERS.value)]
