"""``vllm_glue.startup``: what happens when vLLM creates the TP group -- a
refused combination stops it before any backend is probed, a bypass the
model reports is logged and exported (a stand-in CUDA group and engine
config: no vLLM, no GPU)."""

from types import SimpleNamespace

import pytest

from echo_vllm import EchoConfigError
from echo_vllm.vllm_glue import compat
from support.fake_group import cuda_tp_group


@pytest.fixture
def tp_group(monkeypatch):
    return cuda_tp_group(monkeypatch)


def test_fused_with_stochastic_rounding_is_refused_when_the_tp_group_is_created(tp_group, monkeypatch):
    from echo_vllm.vllm_glue import session, startup

    engine = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2))
    monkeypatch.setattr(compat, "current_vllm_config", lambda: engine)
    monkeypatch.setattr(compat, "batch_invariant_enabled", lambda: False)
    engine.additional_config = {"tp_comm": "echo", "echo_rounding": "stochastic", "echo_backend": "fused"}
    with pytest.raises(EchoConfigError, match="rounding='stochastic' runs on the reference backend, not 'fused'"):
        startup.on_group_created(tp_group, lambda group, x: x)
    assert session.current() is None and not tp_group.probed
    # the control: stochastic rounding on the references starts, with its backend built
    engine.additional_config["echo_backend"] = "reference"
    startup.on_group_created(tp_group, lambda group, x: x)
    try:
        assert session.current().communicator.backend(tp_group.device).name == "reference"
        assert tp_group._echo_comm is session.current().communicator
    finally:
        session.deactivate()


def test_a_reported_bypass_is_logged_and_exported_at_start(tp_group, monkeypatch, caplog):
    """MiniMax-M3 on NVIDIA with FlashInfer: Echo starts, says why some
    calls will not reach it, and the session's stats carry the path (the
    ``echo:model_bypass`` gauge)."""
    from echo_vllm.vllm_glue import session, startup

    engine = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2),
                             additional_config={"tp_comm": "echo", "echo_min_bytes": 0})
    monkeypatch.setattr(compat, "current_vllm_config", lambda: engine)
    monkeypatch.setattr(compat, "batch_invariant_enabled", lambda: False)
    monkeypatch.setattr(compat, "model_modules",
                        lambda cfg: (("MiniMaxM3SparseForCausalLM", "vllm.models.minimax_m3"),))
    monkeypatch.setattr(compat, "platform_name", lambda: "cuda")
    monkeypatch.setattr(compat, "flashinfer_installed", lambda: True)
    with caplog.at_level("WARNING", logger="echo_vllm"):
        startup.on_group_created(tp_group, lambda group, x: x)
    try:
        assert session.current().stats.snapshot()["bypasses"] == ["flashinfer_allreduce_rmsnorm"]
        assert any("MiniMaxM3SparseForCausalLM" in r.message and "FlashInfer" in r.message for r in caplog.records)
    finally:
        session.deactivate()
