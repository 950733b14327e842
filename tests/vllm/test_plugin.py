"""``vllm_glue.plugin``: a plugin that cannot install its hook must not let
an Echo run start as stock vLLM.

* In a vLLM process (vLLM patches classes; the pytest process stays clean;
  forked from the vLLM tests' server, ``support.vllm_cpu``): the version
  check is made to fail, vLLM loads the plugin through its entry point
  (``EngineArgs`` does), and real engine configs are built from a tiny
  local model folder -- those asking for Echo fail there, the others build
  as usual.
* Without vLLM: a hook install that raises, and ``VLLM_PLUGINS`` leaving
  the plugin out.
"""

from types import SimpleNamespace

import pytest

from echo_vllm.vllm_glue.guards import EchoEngineConfigError

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


@pytest.mark.vllm
@pytest.mark.slow
def test_the_failed_install_is_reported_and_nothing_is_hooked(proc):
    assert proc["before"] is None
    assert proc["status"].startswith(f"not installed: {REASON}")
    assert "engines that ask for tp_comm=echo fail at start-up" in proc["status"]
    assert not proc["hooked"]


@pytest.mark.vllm
@pytest.mark.slow
def test_engines_asking_for_echo_fail_where_their_config_is_built(proc):
    for key, asked in (("echo", "tp_comm='echo'"), ("emulation", "tp_comm_emulate=4")):
        text = proc[key]
        assert isinstance(text, str) and text.startswith("EchoEngineConfigError: "), text
        assert asked in text and REASON in text


@pytest.mark.vllm
@pytest.mark.slow
def test_engines_not_asking_for_echo_start_as_usual(proc):
    assert proc["stock"] == {}
    assert proc["nccl"] == {"tp_comm": "nccl", "other": 1}


# -- without vLLM: a hook that cannot be installed, a plugin left out ---------------


class _EngineArgs:
    """Stands in for vLLM's EngineArgs (no vLLM import here)."""

    def __init__(self, additional_config=None):
        self.additional_config = additional_config

    def create_engine_config(self, usage_context=None):
        return SimpleNamespace(additional_config=self.additional_config, usage=usage_context)


@pytest.fixture
def failed_plugin(monkeypatch):
    """A fresh plugin state whose hook install raises."""
    import echo_vllm.vllm_glue.plugin as plugin
    from echo_vllm.vllm_glue import compat, hook

    def broken():
        raise RuntimeError("GroupCoordinator changed")

    monkeypatch.setattr(plugin, "_status", None)
    monkeypatch.setattr(plugin, "_problem", None)
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(hook, "install", broken)
    monkeypatch.setattr(compat, "engine_args_cls", lambda: _EngineArgs)
    monkeypatch.setattr(_EngineArgs, "create_engine_config", _EngineArgs.create_engine_config)
    return plugin


def test_a_failed_install_makes_echo_engines_fail_at_config_time(failed_plugin):
    plugin = failed_plugin
    status = plugin.register()
    assert status.startswith("not installed: RuntimeError: GroupCoordinator changed")
    assert "fail at start-up" in status
    assert plugin.problem() == "RuntimeError: GroupCoordinator changed"
    assert plugin.register() == status  # once per process
    with pytest.raises(EchoEngineConfigError, match="GroupCoordinator changed") as e:
        _EngineArgs({"tp_comm": "echo", "echo_group_size": 64}).create_engine_config()
    assert "tp_comm='echo'" in str(e.value) and "drop tp_comm" in str(e.value)
    # runs that do not ask for Echo are untouched
    cfg = _EngineArgs({"tp_comm": "nccl"}).create_engine_config(usage_context="llm")
    assert cfg.usage == "llm" and _EngineArgs().create_engine_config().additional_config is None
    assert "cannot install its hook: RuntimeError" in plugin.launch_problem()


def test_launch_problem_sees_vllm_plugins_leaving_the_plugin_out(monkeypatch):
    import echo_vllm.vllm_glue.plugin as plugin

    monkeypatch.setattr(plugin, "_status", "installed (test)")
    monkeypatch.setattr(plugin, "_problem", None)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert plugin.launch_problem() is None  # the package declares the entry point
    monkeypatch.setenv("VLLM_PLUGINS", "other,echo_vllm")
    assert plugin.launch_problem() is None
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert "VLLM_PLUGINS='other' does not list 'echo_vllm'" in plugin.launch_problem()
