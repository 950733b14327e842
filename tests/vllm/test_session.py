"""``vllm_glue.session``: the process's one Echo session -- the registry
(current, activate, deactivate) and a session's counters (no vLLM import:
stand-in engine configs)."""

from types import SimpleNamespace

import pytest

from echo_vllm.vllm_glue import compat, session
from echo_vllm.vllm_glue.settings import TpCommSettings


@pytest.fixture(autouse=True)
def no_session(monkeypatch):
    """Each test starts without a session, and leaves the process as it was."""
    monkeypatch.setattr(session, "_CURRENT", None)
    monkeypatch.setattr(compat, "forward_kwargs", lambda: None)  # no forward pass running


def _engine(hidden=576, tokens=2048):
    return SimpleNamespace(model_config=SimpleNamespace(get_hidden_size=lambda: hidden),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=tokens))


class _Closing(session.EchoSession):
    def close(self):
        self.closed = True


def test_a_session_reads_the_models_width_and_largest_batch():
    s = session.EchoSession(TpCommSettings(tp_comm="echo"), _engine(576, 2048), rank=1)
    assert (s.hidden_size, s.max_num_tokens) == (576, 2048)
    assert s.tracker.stats is s.stats and s.tracker.rank == 1
    bare = session.EchoSession(TpCommSettings(tp_comm="echo"), SimpleNamespace(), rank=0)
    assert (bare.hidden_size, bare.max_num_tokens) == (None, None)


def test_one_current_session_and_the_one_it_replaces_is_closed():
    assert session.current() is None and session.current_stats() is None
    first = session.activate(_Closing(TpCommSettings(tp_comm="echo"), _engine(), rank=0))
    assert session.current() is first and session.current_stats() is first.stats
    second = session.activate(_Closing(TpCommSettings(tp_comm="echo"), _engine(), rank=0))
    assert session.current() is second and first.closed and not hasattr(second, "closed")
    session.deactivate()
    assert session.current() is None and session.current_stats() is None and second.closed
    session.deactivate()  # nothing to close: fine


def test_reset_stats_starts_fresh_counters_and_keeps_what_was_learned():
    s = session.EchoSession(TpCommSettings(tp_comm="echo"), _engine(), rank=0)
    health = SimpleNamespace(resets=0)
    health.reset = lambda: setattr(health, "resets", health.resets + 1)
    old = s.stats
    old.calls_per_forward, old.bypasses, old.health = 7, ("flashinfer_allreduce_rmsnorm",), health
    old.set_thresholds(4096, 1 << 20)
    old.forwards_observed = 3
    returned = s.reset_stats()
    assert returned is old and s.stats is not old and s.tracker.stats is s.stats
    new = s.stats
    assert (new.calls_per_forward, new.min_bytes, new.max_bytes, new.bypasses) == (
        7, 4096, 1 << 20, ("flashinfer_allreduce_rmsnorm",))
    assert new.forwards_observed == 0 and old.forwards_observed == 3
    # the device-side health counter now counts for the new counters, from zero
    assert new.health is health and old.health is None and health.resets == 1
