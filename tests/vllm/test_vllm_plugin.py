"""A plugin that cannot install its hook must not let an Echo run start as
stock vLLM. One spawned process (vLLM patches classes; the pytest process
stays clean): the version check is made to fail, vLLM loads the plugin
through its entry point (``EngineArgs`` does), and real engine configs are
built from a tiny local model folder -- those asking for Echo fail there,
the others build as usual. ~25 s on 2 cores, most of it vLLM's import.
"""

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REASON = "vLLM 0.25.0 is older than 0.26 (simulated)"


def _worker(rank, world, model_dir):
    from support.vllm_cpu import use_cpu_platform

    use_cpu_platform()
    from echo_vllm.vllm_glue import compat

    compat.check_version = lambda version: REASON  # what an out-of-range vLLM gets
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.engine.arg_utils import EngineArgs

    import echo_vllm.vllm_glue.plugin as plugin

    def build(additional_config):
        args = EngineArgs(model=model_dir, max_model_len=128, additional_config=additional_config)
        try:
            cfg = args.create_engine_config()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return cfg.additional_config

    out = {"before": plugin._status}  # not registered yet: EngineArgs loads the plugin
    out["echo"] = build({"tp_comm": "echo"})
    out["status"] = plugin._status
    out["hooked"] = "_echo_originals" in GroupCoordinator.__dict__
    out["emulation"] = build({"tp_comm": "nccl", "tp_comm_emulate": 4})
    out["stock"] = build({})
    out["nccl"] = build({"tp_comm": "nccl", "other": 1})
    return out


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    pytest.importorskip("vllm")
    from support.vllm_cpu import run_vllm_processes
    from echo_vllm.testing_models import make_tiny_qwen3

    model_dir = make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "qwen3", num_layers=1, vocab_size=512)
    return run_vllm_processes(_worker, 1, str(model_dir))[0]


def test_the_failed_install_is_reported_and_nothing_is_hooked(proc):
    assert proc["before"] is None
    assert proc["status"].startswith(f"not installed: {REASON}")
    assert "engines that ask for tp_comm=echo fail at start-up" in proc["status"]
    assert not proc["hooked"]


def test_engines_asking_for_echo_fail_where_their_config_is_built(proc):
    for key, asked in (("echo", "tp_comm='echo'"), ("emulation", "tp_comm_emulate=4")):
        text = proc[key]
        assert isinstance(text, str) and text.startswith("EchoEngineConfigError: "), text
        assert asked in text and REASON in text


def test_engines_not_asking_for_echo_start_as_usual(proc):
    assert proc["stock"] == {}
    assert proc["nccl"] == {"tp_comm": "nccl", "other": 1}
