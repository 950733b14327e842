"""``vllm_glue.settings``: what ``--additional-config`` asks for
(``tp_comm``, ``tp_comm_emulate``, ``echo_*``), and how the settings adjust
for a post-norm model (no vLLM import)."""

from types import SimpleNamespace

import pytest

from echo_vllm import EchoConfig, EchoConfigError
from echo_vllm.vllm_glue import TpCommSettings

def test_settings_default_is_off():
    for raw in (None, {}, {"unrelated": 1}, SimpleNamespace(tp_comm="echo")):
        s = TpCommSettings.from_additional_config(raw)
        assert not s.active and s.tp_comm == "nccl" and not s.emulated


def test_settings_parse_echo_options_and_emulation():
    s = TpCommSettings.from_additional_config(
        {"tp_comm": "Echo", "tp_comm_emulate": "4", "echo_group_size": "64", "echo_feedback": "off"}
    )
    assert s.active and s.tp_comm == "echo" and s.emulate_world_size == 4
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
    assert exact.tp_comm == "nccl" and not exact.active
    assert "Echo is off" in note and arch in note and "tp_comm_postnorm=no-feedback" in note


def test_post_norm_policies_no_feedback_and_feedback():
    s = TpCommSettings.from_additional_config(
        {"tp_comm": "echo", "echo_group_size": 64, "tp_comm_postnorm": "no-feedback"})
    adjusted, note = s.for_model(GEMMA3)
    assert adjusted.echo == EchoConfig(group_size=64, feedback=False) and adjusted.tp_comm == "echo"
    assert "feedback off" in note
    # with emulation, "exact" keeps the emulation and sums the partials in 16-bit
    emu, _ = TpCommSettings.from_additional_config(
        {"tp_comm": "echo", "tp_comm_emulate": 4}).for_model(GEMMA3)
    assert emu.tp_comm == "nccl" and emu.emulated and emu.active
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
