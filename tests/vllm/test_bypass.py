"""Model code that goes around Echo's hook (echo_vllm.vllm_glue.bypass):
the pure decision, the facts read from real vLLM 0.26 objects (its model
registry, a real ModelConfig), and the list of such models checked against
vLLM 0.26's source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from echo_vllm.vllm_glue.bypass import (FLASHINFER_NORM, FLASHINFER_NORM_MODULES, REDUCE_SCATTER,
                                        REDUCE_SCATTER_MODULES, ModelFacts, model_bypasses)

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

M3 = ("MiniMaxM3SparseForCausalLM", "vllm.models.minimax_m3")
V32 = ("GlmMoeDsaForCausalLM", "vllm.models.deepseek_v32.nvidia.model")  # a model_class_overrides target
INKLING = ("InklingForCausalLM", "vllm.models.inkling")
QWEN = ("Qwen3ForCausalLM", "vllm.model_executor.models.qwen3")


def _facts(*modules, platform="cuda", flashinfer=True, tp=4):
    return ModelFacts(modules=modules, platform=platform, flashinfer=flashinfer, tensor_parallel_size=tp)


def test_fused_allreduce_norm_models_are_reported_where_flashinfer_can_run():
    (m3,) = model_bypasses(_facts(M3))
    assert m3.path == FLASHINFER_NORM and not m3.refused
    assert "MiniMaxM3SparseForCausalLM" in m3.message and "no switch" in m3.message
    assert [b.path for b in model_bypasses(_facts(V32, QWEN))] == [FLASHINFER_NORM]
    # where FlashInfer's path cannot be taken: nothing to report
    assert model_bypasses(_facts(M3, platform="rocm")) == ()
    assert model_bypasses(_facts(M3, flashinfer=False)) == ()
    assert model_bypasses(_facts(M3, tp=1)) == ()
    assert model_bypasses(_facts(QWEN)) == ()


def test_a_model_whose_stream_never_all_reduces_is_refused():
    (b,) = model_bypasses(_facts(INKLING, platform="cpu", flashinfer=False))
    assert b.path == REDUCE_SCATTER and b.refused and "tp_comm=nccl" in b.message


def _worker(rank, world):
    """In a fresh process (vLLM's CPU platform): facts read from the real
    registry and a real ModelConfig, and start-up refusing a model."""
    import sys
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    from support.vllm_cpu import use_cpu_platform

    use_cpu_platform()
    from vllm import ModelRegistry
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    from echo_vllm.testing_models import make_tiny_qwen3
    from echo_vllm.vllm_glue import EchoEngineConfigError, compat, session, startup

    out = {}
    # the registry's lazy entries: module names, nothing imported
    model = SimpleNamespace(registry=ModelRegistry, architectures=[M3[0], INKLING[0], "NoSuchArch"])
    out["lazy"] = compat.model_modules(SimpleNamespace(model_config=model))
    # what vLLM's model_class_overrides registers ("module:class"), as a drafter
    ModelRegistry.register_model(V32[0], "vllm.models.deepseek_v32.nvidia.model:DeepseekV32ForCausalLM")
    draft = SimpleNamespace(registry=ModelRegistry, architectures=[V32[0]])
    out["draft"] = compat.model_modules(SimpleNamespace(
        model_config=model, speculative_config=SimpleNamespace(draft_model_config=draft)))
    out["imported"] = sorted(m for m in ("vllm.models.minimax_m3", "vllm.models.deepseek_v32", "vllm.models.inkling")
                             if m in sys.modules)
    # a real ModelConfig: the tiny Qwen3
    root = Path(tempfile.mkdtemp())
    qwen = make_tiny_qwen3(root / "qwen3")
    cfg = VllmConfig(model_config=ModelConfig(model=str(qwen)), parallel_config=ParallelConfig(tensor_parallel_size=2))
    out["qwen_facts"] = ModelFacts.from_vllm_config(cfg)
    # an out-of-tree class living in Inkling's package: start-up refuses Echo for it
    ModelRegistry.register_model("InklingLike", type("InklingLike", (Qwen3ForCausalLM,),
                                                     {"__module__": "vllm.models.inkling.nvidia.model"}))
    like = root / "inkling-like"
    like.mkdir()
    (like / "config.json").write_text((qwen / "config.json").read_text().replace("Qwen3ForCausalLM", "InklingLike"))
    cfg = VllmConfig(model_config=ModelConfig(model=str(like), tokenizer=str(qwen)),
                     parallel_config=ParallelConfig(tensor_parallel_size=2), additional_config={"tp_comm": "echo"})
    with set_current_vllm_config(cfg):
        try:
            startup.on_group_created(SimpleNamespace(unique_name="tp:0", world_size=2, rank_in_group=0), None)
            out["refused"] = None
        except EchoEngineConfigError as e:
            out["refused"] = str(e)
    out["session"] = session.current()
    return out


@pytest.fixture(scope="module")
def real():
    from support.vllm_cpu import run_vllm_processes

    return run_vllm_processes(_worker, 1)[0]


def test_facts_come_from_vllms_registry_without_importing_the_model(real):
    assert real["lazy"] == (M3, INKLING)  # an architecture vLLM does not know is left out
    assert real["draft"] == (M3, INKLING, V32)  # the drafter's architectures count too
    assert real["imported"] == []


def test_facts_of_a_real_model_config(real):
    facts = real["qwen_facts"]
    assert facts.modules == (QWEN,) and facts.tensor_parallel_size == 2 and facts.platform == "cpu"
    assert model_bypasses(facts) == ()


def test_start_up_refuses_a_model_that_never_all_reduces(real):
    assert "InklingLike (vllm.models.inkling.nvidia.model)" in real["refused"]
    assert "tp_comm=nccl" in real["refused"] and real["session"] is None


def _vllm_users(pattern: str) -> set[str]:
    """Modules under vLLM's model packages whose source matches ``pattern``."""
    root = Path(vllm.__file__).parent
    found = set()
    for base in ("models", "model_executor/models"):
        for path in (root / base).rglob("*.py"):
            if re.search(pattern, path.read_text(errors="replace")):
                found.add("vllm." + ".".join(path.relative_to(root).with_suffix("").parts))
    return found


@pytest.mark.parametrize("pattern,prefixes", [
    (r"fused_allreduce_gemma_rms_norm|flashinfer_trtllm_fused_allreduce_norm", FLASHINFER_NORM_MODULES),
    (r"lamport_rs_conv", REDUCE_SCATTER_MODULES),
])
def test_every_vllm_model_that_fuses_its_all_reduce_is_known(pattern, prefixes):
    """Scanned from the installed vLLM's model code: every module that calls
    the fused path belongs to a listed package, and every listed package has
    one (a new vLLM that adds or drops one fails here)."""
    users = _vllm_users(pattern)
    assert users, pattern
    for module in users:
        assert any(module == p or module.startswith(p + ".") for p in prefixes), module
    for p in prefixes:
        assert any(m.startswith(p + ".") for m in users), p
