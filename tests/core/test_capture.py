"""Work that a CUDA graph cannot replay faithfully refuses to be captured,
through the one capture check (``echo_vllm.capture.capturing``) that the CPU
stand-in for a capture reaches."""

from __future__ import annotations

import pytest
import torch

from echo_vllm import EchoConfig, FeedbackChain, Path, StackedCommunicator, VirtualTransport
from echo_vllm.capture import capturing, cuda_available
from support.vllm_graphs import capture


def test_the_stand_in_reaches_the_check():
    assert not capturing()
    with capture():
        assert capturing()


def test_cuda_is_asked_once_per_process(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or False)
    cuda_available.cache_clear()
    try:
        assert [capturing() for _ in range(3)] == [False] * 3
    finally:
        cuda_available.cache_clear()  # the next caller asks the real torch
    assert asked == [1]


def test_stochastic_rounding_refuses_capture_nearest_runs():
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    stochastic = StackedCommunicator(EchoConfig(rounding="stochastic", min_bytes=0), VirtualTransport(4))
    stochastic.all_reduce(x, path=Path.ECHO)  # eager: fine
    with capture(), pytest.raises(RuntimeError, match="cannot run inside a CUDA graph"):
        stochastic.all_reduce(x, path=Path.ECHO)
    nearest = StackedCommunicator(EchoConfig(min_bytes=0), VirtualTransport(4))
    with capture():
        captured = nearest.all_reduce(x, path=Path.ECHO)
    eager = StackedCommunicator(EchoConfig(min_bytes=0), VirtualTransport(4)).all_reduce(x, path=Path.ECHO)
    assert torch.equal(captured, eager)


def test_feedback_buffer_cannot_grow_during_capture():
    chain = FeedbackChain(4)
    with capture(), pytest.raises(RuntimeError, match="reserve it before capture"):
        chain.reserve(1024)
