"""The vLLM glue's pure parts (no vLLM import): settings parsing, the guard
rules, call numbering and counters under (simulated) CUDA-graph replay."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from echo_vllm.quant import WireLayout
from echo_vllm.stats import CallRecord
from support.fake_group import FakeRank

from echo_vllm import EchoConfig, EchoConfigError
from echo_vllm.vllm_glue import EngineFacts, TpCommSettings, check_engine_config, conflicts
from echo_vllm.vllm_glue import compat, tracking
from echo_vllm.vllm_glue.compat import check_version, version_tuple
from echo_vllm.vllm_glue.guards import EchoEngineConfigError
from echo_vllm.vllm_glue.tracking import (
    CALL_INDEX_KEY,
    ForwardTracker,
    StepStats,
    tag_forward,
)

# -- settings ------------------------------------------------------------------


def test_settings_default_is_off():
    for raw in (None, {}, {"unrelated": 1}, SimpleNamespace(tp_comm="echo")):
        s = TpCommSettings.from_additional_config(raw)
        assert not s.active and s.mode == "nccl" and not s.emulated


def test_settings_parse_echo_options_and_emulation():
    s = TpCommSettings.from_additional_config(
        {"tp_comm": "Echo", "tp_comm_emulate": "4", "echo_group_size": "64", "echo_feedback": "off"}
    )
    assert s.active and s.mode == "echo" and s.emulate_world_size == 4
    assert s.echo == EchoConfig(group_size=64, feedback=False)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"tp_comm": "fp8"}, "tp_comm='fp8'"),
        ({"tp_comm": "echo", "tp_comm_emulate": 1}, "tp_comm_emulate=1"),
        ({"tp_comm": "echo", "tp_comm_emualte": 4}, "tp_comm_emualte"),
        ({"tp_comm": "echo", "echo_gruop_size": 64}, "echo_gruop_size"),
        ({"tp_comm": "echo", "echo_group_size": 48}, "group_size=48"),
        ({"tp_comm": "echo", "tp_comm_emulate_measure": True}, "needs tp_comm_emulate"),
        ({"tp_comm": "echo", "tp_comm_postnorm": "skip"}, "tp_comm_postnorm='skip'"),
    ],
)
def test_settings_reject_typos_and_bad_values(raw, needle):
    with pytest.raises(EchoConfigError, match=None) as e:
        TpCommSettings.from_additional_config(raw)
    assert needle in str(e.value)


# -- post-norm models ----------------------------------------------------------

GEMMA3 = ["Gemma3ForCausalLM"]


@pytest.mark.parametrize("arch", ["Gemma3ForCausalLM", "Olmo2ForCausalLM", "Glm4ForCausalLM", "Plamo2ForCausalLM"])
def test_post_norm_models_keep_16_bit_by_default(arch):
    exact, note = TpCommSettings.from_additional_config({"tp_comm": "echo"}).for_model([arch])
    assert exact.mode == "nccl" and not exact.active
    assert "Echo is off" in note and arch in note and "tp_comm_postnorm=no-feedback" in note


def test_post_norm_policies_no_feedback_and_feedback():
    s = TpCommSettings.from_additional_config(
        {"tp_comm": "echo", "echo_group_size": 64, "tp_comm_postnorm": "no-feedback"})
    adjusted, note = s.for_model(GEMMA3)
    assert adjusted.echo == EchoConfig(group_size=64, feedback=False) and adjusted.mode == "echo"
    assert "feedback off" in note
    # with emulation, "exact" keeps the emulation and sums the partials in 16-bit
    emu, _ = TpCommSettings.from_additional_config(
        {"tp_comm": "echo", "tp_comm_emulate": 4}).for_model(GEMMA3)
    assert emu.mode == "nccl" and emu.emulated and emu.active
    kept, note = TpCommSettings.from_additional_config(
        {"tp_comm": "echo", "tp_comm_postnorm": "feedback"}).for_model(GEMMA3)
    assert kept.echo.feedback and "measurement only" in note


@pytest.mark.parametrize("archs", [["Qwen3ForCausalLM"], ["LlamaForCausalLM"], []])
def test_pre_norm_models_and_echo_off_are_left_alone(archs):
    s = TpCommSettings.from_additional_config({"tp_comm": "echo"})
    assert s.for_model(archs) == (s, None)
    off = TpCommSettings.from_additional_config({"tp_comm": "nccl", "tp_comm_emulate": 2})
    assert off.for_model(GEMMA3) == (off, None)
    # feedback already off and Echo asked for without it: nothing to change, nothing to say
    nofb = TpCommSettings.from_additional_config(
        {"tp_comm": "echo", "echo_feedback": False, "tp_comm_postnorm": "no-feedback"})
    assert nofb.for_model(GEMMA3) == (nofb, None)


# -- the rule book (the same function runs on real VllmConfigs in test_vllm_emulation,
# and behind echo-vllm serve in tests/server)


def _config(tp=2, dbo=False, ubatch=0, **passes):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, enable_dbo=dbo, ubatch_size=ubatch),
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace(**passes)),
    )


def _problems(vllm_config, settings, refused=True):
    return [c.message for c in conflicts(settings, EngineFacts.from_vllm_config(vllm_config))
            if c.refused is refused]


ECHO = TpCommSettings(mode="echo")


def test_guards_pass_a_clean_config_and_ignore_echo_off():
    assert conflicts(ECHO, EngineFacts.from_vllm_config(_config(fuse_allreduce_rms=False, enable_sp=False))) == []
    assert conflicts(TpCommSettings(), EngineFacts.from_vllm_config(_config(fuse_allreduce_rms=True, dbo=True))) == []


def test_guards_name_every_flag():
    bad = _config(dbo=True, fuse_allreduce_rms=True, enable_sp=True, fuse_gemm_comms=True)
    with pytest.raises(EchoEngineConfigError) as e:
        check_engine_config(bad, ECHO)
    text = str(e.value)
    for flag in ("fuse_allreduce_rms", "enable_sp", "fuse_gemm_comms"):
        assert f"-cc.pass_config.{flag}=false" in text
    assert "--enable-dbo" in text and text.count("\n  - ") == 4


def test_guards_without_fields_of_newer_vllm():
    # vLLM 0.33 has no enable_sp / fuse_gemm_comms: absent fields are fine
    assert _problems(_config(fuse_allreduce_rms=False), ECHO) == []
    (msg,) = _problems(_config(ubatch=2), ECHO)
    assert "tp_comm=echo cannot run with --ubatch-size 2" in msg


def test_guards_for_emulation():
    emu = TpCommSettings(mode="echo", emulate_world_size=4)
    # fusion passes do not matter at TP=1 (no all-reduce node to remove)
    assert conflicts(emu, EngineFacts.from_vllm_config(_config(tp=1, fuse_allreduce_rms=True))) == []
    (msg,) = _problems(_config(tp=2), emu)
    assert "--tensor-parallel-size 1" in msg
    (msg,) = _problems(_config(tp=1, dbo=True), TpCommSettings(emulate_world_size=4))  # the exact baseline too
    assert msg.startswith("tp_comm_emulate=4 cannot run with --enable-dbo")


def test_what_the_engine_runs_through_is_a_warning_not_a_refusal():
    """Echo at TP=1 without the emulation, and a post-norm policy without
    Echo, leave vLLM's own all-reduce: the engine starts and says so
    (echo-vllm serve refuses both, tests/server)."""
    (msg,) = check_engine_config(_config(tp=1), ECHO)
    assert "needs --tensor-parallel-size > 1" in msg and "vLLM runs unchanged" in msg
    baseline = TpCommSettings(mode="nccl", emulate_world_size=2, postnorm="exact")
    assert check_engine_config(_config(tp=1), baseline) == [
        "tp_comm_postnorm=exact needs tp_comm=echo (it decides what Echo does on post-norm models)"]
    # a post-norm model whose policy turned Echo off has spent the policy: nothing to say
    spent, _ = TpCommSettings(mode="echo", emulate_world_size=2, postnorm="exact").for_model(GEMMA3)
    assert spent.mode == "nccl" and check_engine_config(_config(tp=1), spent) == []


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


def test_guards_refuse_stochastic_rounding_under_cuda_graphs():
    stochastic = TpCommSettings(mode="echo", echo=EchoConfig(rounding="stochastic"))
    graphs = _config()
    graphs.compilation_config.cudagraph_mode = SimpleNamespace(name="FULL_AND_PIECEWISE")
    (msg,) = _problems(graphs, stochastic)
    assert "--enforce-eager" in msg and "echo_rounding=nearest" in msg
    assert _problems(graphs, ECHO) == []  # nearest rounding replays fine
    graphs.compilation_config.cudagraph_mode = SimpleNamespace(name="NONE")
    assert _problems(graphs, stochastic) == []


# -- versions ------------------------------------------------------------------


def test_version_checks():
    assert version_tuple("0.26.0") == (0, 26)
    assert version_tuple("0.33.1.dev12+gabc") == (0, 33)
    assert version_tuple("1.0rc1") == (1, 0)
    assert check_version("0.26.0") is None and check_version("0.33.0") is None
    assert "older" in check_version("0.25.2")
    assert check_version(None) == "vLLM is not installed"


# -- call numbering and counters ------------------------------------------------


def _run_calls(tracker, stats, kwargs, n, tokens=8):
    slots = []
    for _ in range(n):
        slot = tracker.next_call(kwargs, tokens)
        tracker.on_record(CallRecord("echo", "echo", wire_bytes=10, equiv_bytes=40))
        slots.append(slot)
    return slots


def test_indices_restart_per_forward_and_the_count_is_learned():
    stats = StepStats()
    tr = ForwardTracker(stats)
    first = _run_calls(tr, stats, {}, 5)
    assert [s.index for s in first] == [0, 1, 2, 3, 4]
    assert not any(s.last_call for s in first)  # not known yet
    assert first[0].first_of_forward and not first[1].first_of_forward
    second = _run_calls(tr, stats, {}, 5)
    assert [s.index for s in second] == [0, 1, 2, 3, 4]
    assert [s.last_call for s in second] == [False] * 4 + [True]
    assert stats.calls_per_forward == 5
    assert tr.next_call(None, 8).index is None  # no forward context


def test_side_calls_are_not_numbered_but_join_the_pass_and_its_plan(monkeypatch):
    """A side call (``residual=False``) takes no index: the residual calls
    around it are numbered 0, 1, 2 ... as if it were absent, the learned
    count is the residual calls', and its record still joins the pass's
    plan, so a replay counts it."""
    stats = StepStats()
    tr = ForwardTracker(stats)
    for _ in range(2):
        kw = {}
        slots = []
        for residual in (True, False, True, False, True):
            slots.append(tr.next_call(kw, 8, residual=residual))
            tr.on_record(CallRecord("echo" if residual else "exact", "echo" if residual else "not_residual_shape"))
        assert [s.index for s in slots] == [0, 1, 1, 2, 2]
    assert stats.calls_per_forward == 3 and stats.forwards_mismatched == 0
    assert [s.last_call for s in slots] == [False, False, False, False, True]
    side_only = {}  # a graph-mode pass whose only call seen is a side call: observed, not a replay
    tr.on_forward_start(side_only, num_tokens=8, cudagraph=True)
    tr.next_call(side_only, 8, residual=False)
    tr.settle()
    assert stats.forwards_replayed == 0 and stats.calls_per_forward == 3
    _capture(tr, stats, monkeypatch, tokens=4, n=1)
    monkeypatch.setattr(tracking, "capturing", lambda: True)
    kw = {}
    tr.next_call(kw, 4, residual=False)
    tr.on_record(CallRecord("exact", "not_residual_shape"))
    monkeypatch.setattr(tracking, "capturing", lambda: False)
    before = stats.calls[("exact", "not_residual_shape")]
    tr.on_graph_replay(4)
    assert stats.calls[("exact", "not_residual_shape")] == before + 1


def test_a_pass_with_another_count_is_counted_not_learned():
    stats = StepStats()
    tr = ForwardTracker(stats)
    _run_calls(tr, stats, {}, 5)
    _run_calls(tr, stats, {}, 3)  # e.g. a drafter model's pass
    _run_calls(tr, stats, {}, 5)
    assert stats.calls_per_forward == 5 and stats.forwards_mismatched == 1
    assert stats.forwards_observed == 2  # the third pass closes with the next one


def test_counters_include_graph_replays_and_exclude_capture(monkeypatch):
    """Eager pass (counted), captured pass (plan only), two replays (no
    Python ran: counted from the plan when the next pass starts)."""
    stats = StepStats()
    tr = ForwardTracker(stats)
    eager = {}
    tr.on_forward_start(eager, num_tokens=8, cudagraph=False)
    _run_calls(tr, stats, eager, 3)
    assert stats.calls[("echo", "echo")] == 3

    monkeypatch.setattr(tracking, "capturing", lambda: True)
    capture = {}
    tr.on_forward_start(capture, num_tokens=16, cudagraph=True)
    _run_calls(tr, stats, capture, 3, tokens=16)
    monkeypatch.setattr(tracking, "capturing", lambda: False)
    assert stats.calls[("echo", "echo")] == 3  # capture executes nothing

    for _ in range(2):  # replays of the 16-token graph: the hook never runs
        tr.on_forward_start({}, num_tokens=16, cudagraph=True)
    tr.on_forward_start({}, num_tokens=8, cudagraph=False)  # accounts the last replay
    assert stats.forwards_replayed == 2
    assert stats.calls[("echo", "echo")] == 3 + 2 * 3
    assert stats.wire_bytes == 10 * 9 and stats.equiv_16bit_bytes == 40 * 9
    snap = stats.snapshot()
    assert snap["forwards_replayed"] == 2 and snap["calls_per_forward"] == 3


def test_replay_of_an_unknown_size_is_counted_as_unplanned():
    stats = StepStats()
    tr = ForwardTracker(stats)
    tr.on_forward_start({}, num_tokens=32, cudagraph=True)
    tr.on_forward_start({}, num_tokens=32, cudagraph=True)
    tr.on_graph_replay(16)  # settles the second pass first
    assert stats.forwards_replayed == 0 and not stats.calls
    assert stats.forwards_unplanned == 3 and stats.snapshot()["forwards_unplanned"] == 3


def _capture(tr, stats, monkeypatch, tokens, n=3, path=("echo", "echo")):
    """A pass captured into a graph of ``tokens`` (inside a NONE-mode
    context, as Model Runner V2 captures FULL graphs)."""
    monkeypatch.setattr(tracking, "capturing", lambda: True)
    kw = {}
    tr.on_forward_start(kw, num_tokens=tokens, cudagraph=False)
    for _ in range(n):
        tr.next_call(kw, tokens)
        tr.on_record(CallRecord(*path, nbytes=tokens, wire_bytes=10, equiv_bytes=40))
    monkeypatch.setattr(tracking, "capturing", lambda: False)


def test_full_graph_replays_without_a_context_count_at_once(monkeypatch):
    """Model Runner V2 replays FULL graphs with no forward context: the hook
    around run_fullgraph counts each, and first settles the pass before."""
    stats = StepStats()
    tr = ForwardTracker(stats)
    _capture(tr, stats, monkeypatch, tokens=4)
    eager = {}
    tr.on_forward_start(eager, num_tokens=8, cudagraph=False)  # prefill, observed
    _run_calls(tr, stats, eager, 3)
    for _ in range(5):
        tr.on_graph_replay(4)
    assert stats.forwards_replayed == 5 and stats.forwards_observed == 2  # capture + prefill
    assert stats.calls[("echo", "echo")] == 3 + 5 * 3


def test_settle_closes_the_last_pass_but_not_a_running_one(monkeypatch):
    stats = StepStats()
    tr = ForwardTracker(stats)
    _capture(tr, stats, monkeypatch, tokens=4)
    replay = {}
    tr.on_forward_start(replay, num_tokens=4, cudagraph=True)  # a PIECEWISE replay
    tr.settle(running=replay)  # still running: left open
    assert stats.forwards_replayed == 0
    tr.settle()
    assert stats.forwards_replayed == 1 and stats.calls[("echo", "echo")] == 3
    tr.settle()  # idempotent
    assert stats.forwards_replayed == 1
    eager = {}
    tr.on_forward_start(eager, num_tokens=8, cudagraph=False)
    _run_calls(tr, stats, eager, 2)
    tr.settle(running=eager)
    assert stats.forwards_observed == 1  # the capture; the eager pass is still open
    tr.settle()
    assert stats.forwards_observed == 2 and stats.forwards_mismatched == 1


def test_the_captured_plan_is_what_replays_count(monkeypatch):
    """An eager pass of a captured size (a fallback batch) must not replace
    the plan the graph was captured with: the graph replays the capture's
    decisions (here gloo cannot be captured: exact)."""
    stats = StepStats()
    tr = ForwardTracker(stats)
    _capture(tr, stats, monkeypatch, tokens=4, path=("exact", "capture_unsupported"))
    eager = {}
    tr.on_forward_start(eager, num_tokens=4, cudagraph=False)
    _run_calls(tr, stats, eager, 3, tokens=4)
    tr.on_graph_replay(4)
    assert stats.calls == {("echo", "echo"): 3, ("exact", "capture_unsupported"): 3}
    assert stats.exact_bytes == 3 * 4


def test_metrics_publish_at_most_once_a_second():
    seen = []
    tr = ForwardTracker(StepStats(), rank=3, publish=lambda snap, rank: seen.append(rank))
    assert tr.maybe_publish(now=100.0)
    assert not tr.maybe_publish(now=100.5)
    assert tr.maybe_publish(now=101.0)
    assert seen == [3, 3]


def test_a_failing_metrics_export_is_disabled_not_raised():
    def boom(snap, rank):
        raise RuntimeError("no prometheus")

    tr = ForwardTracker(StepStats(), publish=boom)
    assert tr.maybe_publish(now=10.0)
    assert not tr.maybe_publish(now=20.0)


def test_tag_forward_reads_vllms_keyword_arguments():
    desc = SimpleNamespace(num_tokens=16)
    assert tag_forward({"num_tokens": 13, "batch_descriptor": desc, "cudagraph_runtime_mode": 1}) == (16, True)
    assert tag_forward({"num_tokens": 13, "batch_descriptor": None, "cudagraph_runtime_mode": 0}) == (13, False)
    assert tag_forward({}) == (None, False)


def test_call_index_lives_in_the_forward_kwargs():
    stats = StepStats()
    tr = ForwardTracker(stats)
    kw = {}
    tr.next_call(kw, 4)
    tr.next_call(kw, 4)
    assert kw[CALL_INDEX_KEY] == 2


# -- a plugin that could not install its hook ------------------------------------


def test_an_engine_asking_for_echo_is_refused_without_the_hook():
    from echo_vllm.vllm_glue.guards import check_hook_installed

    for raw in ({"tp_comm": "echo"}, {"tp_comm_emulate": 4}, {"tp_comm": "echo", "tp_comm_emulate": 2}):
        with pytest.raises(EchoEngineConfigError, match="vLLM 0.25 is too old"):
            check_hook_installed(SimpleNamespace(additional_config=raw), "vLLM 0.25 is too old")
    for raw in (None, {}, {"tp_comm": "nccl"}, {"other": 1}):
        check_hook_installed(SimpleNamespace(additional_config=raw), "vLLM 0.25 is too old")
    check_hook_installed(SimpleNamespace(additional_config={"tp_comm": "echo"}), None)  # installed


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


# -- the TP group's communicator: its backend chosen once, from the group's facts --


class _ProcessGroup(FakeRank):
    """Stands in for ProcessGroupTransport(group) of the glue."""


@pytest.fixture
def tp_group(monkeypatch):
    """A CUDA TP group of 2 (a stand-in coordinator) whose bytes move over
    pynccl; the fused backend's probe and builder record what they get."""
    from echo_vllm import backends
    from echo_vllm.vllm_glue import communicator as glue

    group = SimpleNamespace(unique_name="tp:0", world_size=2, rank_in_group=0, device=torch.device("cuda", 0),
                            device_group="nccl-group", cpu_group="gloo-group", device_communicator=None,
                            probed=[], built=[])
    monkeypatch.setattr(glue, "make_transport", lambda coordinator: FakeRank("pynccl"))
    monkeypatch.setattr(glue, "ProcessGroupTransport", _ProcessGroup)
    monkeypatch.setattr(backends, "fused_support", lambda peers, device: group.probed.append(peers) or (True, "P2P"))

    def build(cfg, transport, env, **facts):
        backend = SimpleNamespace(name="fused", close=lambda: None)
        group.built.append((transport, facts, backend))
        return backend

    monkeypatch.setitem(backends.BACKENDS, "fused", dataclasses.replace(backends.BACKENDS["fused"], build=build))
    monkeypatch.delenv("ECHO_KERNELS", raising=False)
    return group


def _communicator(group, **echo):
    from echo_vllm.vllm_glue.communicator import tp_communicator

    return tp_communicator(group, EchoConfig(**echo), ForwardTracker(StepStats()), lambda x: x,
                           hidden_size=256, max_num_tokens=512)


def test_the_tp_group_gets_the_backend_make_backend_picks_from_its_facts(tp_group, monkeypatch):
    comm = _communicator(tp_group)
    (peers,) = tp_group.probed  # probed over the NCCL process group (pynccl maps no peer memory)
    assert isinstance(peers, _ProcessGroup) and peers.name == "nccl-group"
    (transport, facts, built), = tp_group.built
    # the communicator reduces with the one backend built for the group
    assert comm.backend(torch.device("cuda")) is built and built.name == "fused"
    assert transport.name == "pynccl" and facts["peers"] is peers
    assert facts["max_numel"] == 512 * WireLayout(256, 2, 32).padded_cols  # the largest batch's rows
    # ECHO_KERNELS overrides the choice in vLLM too: the group is not even probed
    monkeypatch.setenv("ECHO_KERNELS", "triton")
    assert _communicator(tp_group).backend(tp_group.device).name == "triton"
    assert len(tp_group.probed) == 1 and len(tp_group.built) == 1


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
