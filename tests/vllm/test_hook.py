"""``vllm_glue.hook``: the patches, on stand-ins for vLLM's classes (no vLLM
import): ``GroupCoordinator.__init__`` reports every group to
``startup.on_group_created``, ``_all_reduce_out_place`` goes to the group's
Echo communicator only while it has a working one, the per-forward hook
and the FULL-graph replay wrapper tell the current session's tracker.
(The same patches on vLLM's real classes: tests/vllm/test_vllm_tp.py.)"""

from types import SimpleNamespace

import pytest

from echo_vllm.vllm_glue import compat, hook, session, startup


class _Coordinator:
    """vLLM's GroupCoordinator, as far as the hook touches it."""

    def __init__(self, name):
        self.unique_name = name

    def _all_reduce_out_place(self, x):
        return ("vllm", x)


class _Tracker:
    def __init__(self):
        self.forwards, self.replays = [], []

    def on_forward_start(self, out, num_tokens, cudagraph):
        self.forwards.append((dict(out), num_tokens, cudagraph))

    def on_graph_replay(self, tokens):
        self.replays.append(tokens)


@pytest.fixture
def coordinator(monkeypatch):
    """A fresh stand-in class for each test; groups reported to startup are recorded."""
    cls = type("GroupCoordinator", (_Coordinator,), {})
    monkeypatch.setattr(compat, "group_coordinator_cls", lambda: cls)
    monkeypatch.setattr(startup, "on_group_created", lambda group, original: cls.created.append((group, original)))
    monkeypatch.setattr(session, "current", lambda: None)
    cls.created = []
    return cls


def test_install_patches_once_and_keeps_the_originals(coordinator):
    original_init, original_ar = coordinator.__init__, coordinator._all_reduce_out_place
    assert hook.install() == "hooked GroupCoordinator._all_reduce_out_place and __init__"
    assert coordinator._echo_originals == (original_init, original_ar)
    patched = (coordinator.__init__, coordinator._all_reduce_out_place)
    assert patched[0] is not original_init and patched[1] is not original_ar
    assert hook.install() == "already installed"
    assert (coordinator.__init__, coordinator._all_reduce_out_place) == patched


def test_every_new_group_is_reported_with_vllms_all_reduce(coordinator):
    original_ar = coordinator._all_reduce_out_place
    hook.install()
    group = coordinator("tp:0")
    assert group.unique_name == "tp:0"  # vLLM's own __init__ ran first
    assert coordinator.created == [(group, original_ar)]


def test_the_all_reduce_goes_to_a_working_echo_communicator_only(coordinator):
    hook.install()
    group = coordinator("tp:0")
    assert group._all_reduce_out_place(1) == ("vllm", 1)  # no communicator: vLLM's
    group._echo_comm = SimpleNamespace(disabled=False, all_reduce=lambda x: ("echo", x))
    assert group._all_reduce_out_place(2) == ("echo", 2)
    group._echo_comm.disabled = True
    assert group._all_reduce_out_place(3) == ("vllm", 3)
    assert coordinator("other")._all_reduce_out_place(4) == ("vllm", 4)  # the communicator is per group


def test_the_forward_hook_tells_the_current_sessions_tracker(monkeypatch, caplog):
    class Platform:
        @classmethod
        def set_additional_forward_context(cls, **kwargs):
            return {"vllm": kwargs["num_tokens"]}

    platform, tracker = Platform(), _Tracker()
    monkeypatch.setattr(compat, "forward_context_platform", lambda: platform)
    monkeypatch.setattr(compat, "fullgraph_replay_cls", lambda: None)
    monkeypatch.setattr(session, "current", lambda: SimpleNamespace(tracker=tracker))
    assert hook.install_forward_hook() and hook.install_forward_hook()  # idempotent
    wrapped = platform.set_additional_forward_context
    assert wrapped._echo_wrapped and Platform.set_additional_forward_context.__name__ == wrapped.__name__
    out = wrapped(num_tokens=13, batch_descriptor=SimpleNamespace(num_tokens=16), cudagraph_runtime_mode=1)
    assert out == {"vllm": 13} and tracker.forwards == [({"vllm": 13}, 16, True)]
    monkeypatch.setattr(session, "current", lambda: None)  # Echo off: vLLM's context, untouched
    assert wrapped(num_tokens=5, batch_descriptor=None, cudagraph_runtime_mode=0) == {"vllm": 5}
    assert len(tracker.forwards) == 1
    monkeypatch.setattr(compat, "forward_context_platform", lambda: object())  # a vLLM without it
    with caplog.at_level("WARNING", logger="echo_vllm"):
        assert hook.install_forward_hook() is False
    assert "counters do not include CUDA-graph replays" in caplog.text


def test_full_graph_replays_are_counted_where_model_runner_v2_replays_them(monkeypatch):
    class Manager:
        def run_fullgraph(self, desc):
            return "replayed"

    tracker = _Tracker()
    monkeypatch.setattr(compat, "fullgraph_replay_cls", lambda: Manager)
    monkeypatch.setattr(session, "current", lambda: SimpleNamespace(tracker=tracker))
    assert hook._wrap_fullgraph_replay() and hook._wrap_fullgraph_replay()  # idempotent
    assert Manager().run_fullgraph(SimpleNamespace(num_tokens=32)) == "replayed"
    assert Manager().run_fullgraph(8) == "replayed"
    assert tracker.replays == [32, 8]
    monkeypatch.setattr(compat, "fullgraph_replay_cls", lambda: None)  # no Model Runner V2
    assert hook._wrap_fullgraph_replay() is False
