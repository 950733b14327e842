"""``vllm_glue.guards``: the rule book -- what the settings cannot run with
(the same function runs on real VllmConfigs in test_vllm_emulation, and
behind echo-vllm serve in tests/server) -- and the refusal of Echo engines
when the plugin could not install its hook (no vLLM import)."""

from types import SimpleNamespace

import pytest

from echo_vllm import EchoConfig
from echo_vllm.vllm_glue import EngineFacts, TpCommSettings, check_engine_config, conflicts
from echo_vllm.vllm_glue.guards import EchoEngineConfigError

GEMMA3 = ["Gemma3ForCausalLM"]


def _config(tp=2, dbo=False, ubatch=0, **passes):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, enable_dbo=dbo, ubatch_size=ubatch),
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace(**passes)),
    )


def _problems(vllm_config, settings, refused=True):
    return [c.message for c in conflicts(settings, EngineFacts.from_vllm_config(vllm_config))
            if c.refused is refused]


ECHO = TpCommSettings(tp_comm="echo")


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
    emu = TpCommSettings(tp_comm="echo", emulate_world_size=4)
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
    baseline = TpCommSettings(tp_comm="nccl", emulate_world_size=2, postnorm="exact")
    assert check_engine_config(_config(tp=1), baseline) == [
        "tp_comm_postnorm=exact needs tp_comm=echo (it decides what Echo does on post-norm models)"]
    # a post-norm model whose policy turned Echo off has spent the policy: nothing to say
    spent, _ = TpCommSettings(tp_comm="echo", emulate_world_size=2, postnorm="exact").for_model(GEMMA3)
    assert spent.tp_comm == "nccl" and check_engine_config(_config(tp=1), spent) == []


def test_guards_refuse_stochastic_rounding_under_cuda_graphs():
    stochastic = TpCommSettings(tp_comm="echo", echo=EchoConfig(rounding="stochastic"))
    graphs = _config()
    graphs.compilation_config.cudagraph_mode = SimpleNamespace(name="FULL_AND_PIECEWISE")
    (msg,) = _problems(graphs, stochastic)
    assert "--enforce-eager" in msg and "echo_rounding=nearest" in msg
    assert _problems(graphs, ECHO) == []  # nearest rounding replays fine
    graphs.compilation_config.cudagraph_mode = SimpleNamespace(name="NONE")
    assert _problems(graphs, stochastic) == []



def test_an_engine_asking_for_echo_is_refused_without_the_hook():
    from echo_vllm.vllm_glue.guards import check_hook_installed

    for raw in ({"tp_comm": "echo"}, {"tp_comm_emulate": 4}, {"tp_comm": "echo", "tp_comm_emulate": 2}):
        with pytest.raises(EchoEngineConfigError, match="vLLM 0.25 is too old"):
            check_hook_installed(SimpleNamespace(additional_config=raw), "vLLM 0.25 is too old")
    for raw in (None, {}, {"tp_comm": "nccl"}, {"other": 1}):
        check_hook_installed(SimpleNamespace(additional_config=raw), "vLLM 0.25 is too old")
    check_hook_installed(SimpleNamespace(additional_config={"tp_comm": "echo"}), None)  # installed


# -- hosts: where the launch runs the TP group, and what a host map may say --------

LAUNCHES = [
    # (tp, pp, dp, nnodes, executor) -> the node of each TP rank, or None (decided at start)
    ((4, 1, 1, 1, None), (0, 0, 0, 0)),
    ((4, 1, 1, 2, "mp"), (0, 0, 1, 1)),
    ((4, 1, 1, 4, None), (0, 1, 2, 3)),
    ((8, 2, 1, 2, "mp"), (0,) * 8),  # each pipeline stage's TP group on its own node
    ((8, 2, 1, 4, "mp"), (0, 0, 0, 0, 1, 1, 1, 1)),
    ((4, 1, 1, 2, "ray"), None),  # Ray's placement group decides
    ((4, 1, 1, 1, "external_launcher"), None),  # torchrun places the ranks
    ((4, 1, 1, 1, object), None),  # an executor class of the user's
    ((4, 1, 2, 2, "mp"), None),  # data parallelism splits the nodes
    ((4, 1, 1, 3, "mp"), None),  # vLLM refuses a world its nodes cannot divide
]


@pytest.mark.parametrize("launch,hosts", LAUNCHES)
def test_the_launch_fixes_the_tp_groups_hosts(launch, hosts):
    from echo_vllm.vllm_glue.guards import launch_tp_hosts

    assert launch_tp_hosts(*launch) == hosts


def _hosts_engine(tp=4, pp=1, dp=1, nnodes=1, executor=None):
    return SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, nnodes=nnodes,
        distributed_executor_backend=executor, enable_dbo=False, ubatch_size=0))


def _echo(**fields):
    return TpCommSettings(tp_comm="echo", echo=EchoConfig(**fields))


HOST_CASES = [
    # (engine, Echo's host settings) -> the refusal's start, or None
    (_hosts_engine(nnodes=2), {}, None),
    (_hosts_engine(nnodes=2), {"topology": "two_level"}, None),
    (_hosts_engine(nnodes=2), {"host_map": (0, 0, 1, 1)}, None),
    (_hosts_engine(nnodes=2), {"host_map": (7, 7, 3, 3)}, None),  # labels are names, not numbers
    (_hosts_engine(), {"topology": "two_level", "host_map": (0, 0, 1, 1)}, None),  # hosts emulated on one node
    (_hosts_engine(executor="ray"), {"topology": "two_level"}, None),  # hosts known at start
    (_hosts_engine(executor="ray"), {"topology": "two_level", "host_map": (0, 0, 1, 1)}, None),
    (_hosts_engine(), {"host_map": (0, 0, 1)}, "echo_host_map=0,0,1 names 3 ranks but the group has 4"),
    (_hosts_engine(executor="ray"), {"host_map": (0, 1, 2, 3, 4)}, "echo_host_map=0,1,2,3,4 names 5 ranks"),
    (_hosts_engine(nnodes=2), {"host_map": (0, 1, 0, 1)}, "echo_host_map=0,1,0,1 puts the TP group's ranks"),
    (_hosts_engine(), {"topology": "two_level"},
     "echo_topology='two_level' cannot run on this group: 1 host x 4 ranks: one host"),
    (_hosts_engine(nnodes=4), {"topology": "two_level"}, "echo_topology='two_level' cannot run on this group: "
     "4 hosts x 1 rank: one rank per host"),
    (_hosts_engine(executor="ray"), {"topology": "two_level", "host_map": (0, 0, 0, 1)},
     "echo_topology='two_level' cannot run on this group: 2 hosts (3, 1 ranks): hosts of unequal size"),
    (_hosts_engine(tp=8, pp=2, nnodes=2), {"topology": "two_level"},
     "echo_topology='two_level' cannot run on this group: 1 host x 8 ranks"),
]


@pytest.mark.parametrize("engine,fields,refusal", HOST_CASES)
def test_host_settings_the_launch_cannot_run_are_refused(engine, fields, refusal):
    found = conflicts(_echo(**fields), EngineFacts.from_vllm_config(engine))
    if refusal is None:
        assert found == []
    else:
        (c,) = found
        assert c.refused and c.message.startswith(refusal), c.message


def test_host_settings_do_not_matter_without_echo_on_a_group():
    engine = EngineFacts.from_vllm_config(_hosts_engine())
    assert conflicts(TpCommSettings(tp_comm="nccl"), engine) == []
    emulated = TpCommSettings(tp_comm="echo", emulate_world_size=4, echo=EchoConfig(topology="two_level"))
    assert conflicts(emulated, EngineFacts.from_vllm_config(_hosts_engine(tp=1))) == []
