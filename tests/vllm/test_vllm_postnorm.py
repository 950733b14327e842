"""Post-norm models through the real hook: a Gemma-3 config keeps the 16-bit
all-reduce (logged, with the reason on the session), a Qwen3 config runs
Echo as configured, ``tp_comm_postnorm`` overrides, and a Gemma-3 under an
out-of-tree name no list knows is recognised by its structure. Real vLLM 0.26 ``ModelConfig``
/ ``VllmConfig`` objects (config.json only: no weights are loaded), in a
child process because the emulation patches vLLM's layer classes."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

#: An out-of-tree model's name: Gemma-3's layers registered under it.
RENAMED = "SandwichLMForCausalLM"

#: A Gemma-3 text config small enough to parse fast (no weights needed).
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "bfloat16",
}


def _worker(rank, world):
    from support.vllm_cpu import use_cpu_platform

    use_cpu_platform()
    from vllm import ModelRegistry
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM

    from echo_vllm.testing_models import make_tiny_qwen3
    from echo_vllm.vllm_glue import compat, startup
    from echo_vllm.vllm_glue.emulation import current_session

    root = Path(tempfile.mkdtemp())
    qwen = make_tiny_qwen3(root / "qwen3")
    gemma = root / "gemma3"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps(GEMMA3_CONFIG))
    models = {"qwen3": ModelConfig(model=str(qwen)), "gemma3": ModelConfig(model=str(gemma), tokenizer=str(qwen))}
    # an out-of-tree plugin's model: vLLM's Gemma-3 class under a new name
    ModelRegistry.register_model(RENAMED, type("SandwichLM", (Gemma3ForCausalLM,), {}))
    renamed = root / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text(json.dumps({**GEMMA3_CONFIG, "architectures": [RENAMED]}))
    models["renamed-gemma3"] = ModelConfig(model=str(renamed), tokenizer=str(qwen))
    # openPangu: post-norm only when its config turns the sandwich norm on
    for sandwich in (True, False):
        pangu = root / f"pangu-{sandwich}"
        pangu.mkdir()
        cfg = json.loads((qwen / "config.json").read_text())
        cfg.update(architectures=["PanguEmbeddedForCausalLM"], sandwich_norm=sandwich)
        (pangu / "config.json").write_text(json.dumps(cfg))
        models[f"pangu-sandwich={sandwich}"] = ModelConfig(model=str(pangu), tokenizer=str(qwen))

    out = {}
    for name, extra in (("qwen3", {}), ("gemma3", {}), ("gemma3", {"tp_comm_postnorm": "no-feedback"}),
                        ("gemma3", {"tp_comm_postnorm": "feedback"}), ("pangu-sandwich=True", {}),
                        ("pangu-sandwich=False", {}), ("renamed-gemma3", {})):
        cfg = VllmConfig(model_config=models[name],
                         additional_config={"tp_comm": "echo", "tp_comm_emulate": 2, **extra})
        with set_current_vllm_config(cfg):
            startup.on_group_created(SimpleNamespace(unique_name="tp:0", world_size=1, rank_in_group=0), None)
        s = current_session()
        key = name + ("/" + extra["tp_comm_postnorm"] if extra else "")
        out[key] = dict(archs=compat.model_architectures(cfg), tp_comm=s.settings.tp_comm,
                        feedback=s.settings.echo.feedback, note=s.model_note)
    return out


# a model session per architecture: CI's second tier
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sessions():
    pytest.importorskip("vllm")
    from support.vllm_cpu import run_vllm_processes

    return run_vllm_processes(_worker, 1)[0]


@pytest.mark.vllm
def test_pre_norm_model_keeps_feedback(sessions):
    s = sessions["qwen3"]
    assert s["archs"] == ["Qwen3ForCausalLM"]
    assert (s["tp_comm"], s["feedback"], s["note"]) == ("echo", True, None)


@pytest.mark.vllm
def test_post_norm_model_keeps_16_bit_by_default(sessions):
    s = sessions["gemma3"]
    assert s["archs"] == ["Gemma3ForCausalLM"]
    assert s["tp_comm"] == "nccl" and "Echo is off" in s["note"]  # the emulation's exact 16-bit sum


@pytest.mark.vllm
def test_post_norm_overrides(sessions):
    nofb, kept = sessions["gemma3/no-feedback"], sessions["gemma3/feedback"]
    assert (nofb["tp_comm"], nofb["feedback"]) == ("echo", False) and "feedback off" in nofb["note"]
    assert (kept["tp_comm"], kept["feedback"]) == ("echo", True) and "measurement only" in kept["note"]


@pytest.mark.vllm
def test_openpangu_follows_its_sandwich_norm_flag(sessions):
    on, off = sessions["pangu-sandwich=True"], sessions["pangu-sandwich=False"]
    assert on["archs"] == off["archs"] == ["PanguEmbeddedForCausalLM"]
    assert on["tp_comm"] == "nccl" and "Echo is off" in on["note"]
    assert (off["tp_comm"], off["feedback"], off["note"]) == ("echo", True, None)


@pytest.mark.vllm
def test_renamed_post_norm_model_is_recognised_by_structure(sessions):
    s = sessions["renamed-gemma3"]
    assert s["archs"] == [RENAMED]
    assert s["tp_comm"] == "nccl" and "Echo is off" in s["note"]
    assert "by structure: layers.0.post_feedforward_layernorm (Gemma3RMSNorm)" in s["note"]
