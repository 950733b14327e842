"""The post-norm list against vLLM's own model registry and model files:
every architecture whose decoder sets a post-norm attribute is recognised
(a new vLLM model would otherwise get Echo's feedback silently), and
openPangu counts only when its config turns the sandwich norm on."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from echo_vllm.postnorm_policy import (
    CONDITIONAL_POSTNORM_ARCHITECTURES,
    POSTNORM_ARCHITECTURES,
    POSTNORM_MARKERS,
    is_postnorm_architecture,
)


@pytest.mark.vllm
def test_every_vllm_architecture_with_a_post_norm_layer_is_listed():
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    models_dir = Path(registry.__file__).parent
    sets_marker = re.compile(r"self\.(%s)\s*=" % "|".join(POSTNORM_MARKERS))
    found = {arch for arch, (module, _cls) in registry._VLLM_MODELS.items()
             if (models_dir / f"{module}.py").is_file()
             and sets_marker.search((models_dir / f"{module}.py").read_text())}
    assert len(found) >= 10  # the scan sees the files (Gemma, OLMo, GLM-4, ...)
    assert found - POSTNORM_ARCHITECTURES - set(CONDITIONAL_POSTNORM_ARCHITECTURES) == set()


@pytest.mark.vllm
def test_conditional_architectures_exist_and_name_their_flag():
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    models_dir = Path(registry.__file__).parent
    for arch, flag in CONDITIONAL_POSTNORM_ARCHITECTURES.items():
        module, _cls = registry._VLLM_MODELS[arch]
        assert f'"{flag}"' in (models_dir / f"{module}.py").read_text()


def test_openpangu_is_post_norm_only_with_its_sandwich_norm():
    arch = ["PanguEmbeddedForCausalLM"]
    assert is_postnorm_architecture(arch, SimpleNamespace(sandwich_norm=True))
    assert not is_postnorm_architecture(arch, SimpleNamespace(sandwich_norm=False))
    assert not is_postnorm_architecture(arch, SimpleNamespace())  # the flag defaults to off
    assert not is_postnorm_architecture(arch)
    assert is_postnorm_architecture(["Gemma3ForCausalLM"])  # unconditional ones need no config
    assert not is_postnorm_architecture(["Qwen3ForCausalLM"], SimpleNamespace(sandwich_norm=True))
