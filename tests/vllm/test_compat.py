"""``vllm_glue.compat``: the vLLM versions Echo runs on, and vLLM's own
CUDA-graph enum read as vLLM means it."""

from types import SimpleNamespace

import pytest

from echo_vllm.vllm_glue import compat
from echo_vllm.vllm_glue.compat import check_version, version_tuple


def test_version_checks():
    assert version_tuple("0.26.0") == (0, 26)
    assert version_tuple("0.33.1.dev12+gabc") == (0, 33)
    assert version_tuple("1.0rc1") == (1, 0)
    assert check_version("0.26.0") is None and check_version("0.33.0") is None
    assert "older" in check_version("0.25.2")
    assert check_version(None) == "vLLM is not installed"


@pytest.mark.vllm
@pytest.mark.parametrize("mode, eager, graphs", [
    ("NONE", False, False), ("PIECEWISE", False, True), ("FULL", False, True),
    ("FULL_DECODE_ONLY", False, True), ("FULL_AND_PIECEWISE", False, True), ("FULL", True, False),
])
def test_cudagraphs_enabled_reads_vllms_enum(mode, eager, graphs):
    config_mod = pytest.importorskip("vllm.config")
    cfg = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager),
                          compilation_config=SimpleNamespace(cudagraph_mode=config_mod.CUDAGraphMode[mode]))
    assert compat.cudagraphs_enabled(cfg) is graphs
