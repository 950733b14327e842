"""EchoConfig refuses bad values in one line naming the value and what is
allowed, from the Python API and from mappings alike; any mapping gives a
valid config or one EchoConfigError (property tests), never another
exception."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.cli_args import UsageError
from echo_vllm.config import (MANY_CALLS, MAX_MESSAGE_BYTES, MAX_SEED, EchoConfig, EchoConfigError)
from echo_vllm.vllm_glue.settings import TpCommSettings

FIELDS = [f.name for f in dataclasses.fields(EchoConfig)]


@pytest.mark.parametrize("kwargs,message", [
    ({"bits": 4.0}, "bits: Echo's payload is 4-bit only"),
    ({"group_sise": 64}, "unknown option 'group_sise'; did you mean 'group_size'?"),
    ({"feedback": "no"}, "feedback='no': must be True or False"),
    ({"hadamard": 1}, "hadamard=1: must be True or False"),
    ({"seed": MAX_SEED + 1}, "seed=9223372036854775808: must be an integer from 0 to 9223372036854775807 "
                             "(seeds are int64)"),
    ({"timeout_s": 1e300}, "timeout_s=1e+300: must be a number of seconds above 0, at most 86400"),
    ({"timeout_s": float("nan")}, "timeout_s=nan"),
    ({"timeout_s": 0}, "timeout_s=0"),
    ({"timeout_s": True}, "timeout_s=True"),
    # the fused kernel counts whole nanoseconds: 5e-324 s was 0 ns there, a trap at the first spin
    ({"timeout_s": 5e-324}, "timeout_s=5e-324: must be at least 1e-09 s (the fused kernel counts the wait in "
                            "whole nanoseconds: less is 0 ns, a trap at the first spin)"),
    ({"timeout_s": 9.99e-10}, "timeout_s=9.99e-10: must be at least 1e-09 s"),
    # only the word means auto: -1 (its old stand-in) was taken for it silently
    ({"min_bytes": -1}, "min_bytes=-1: must be an integer from 0 to 4611686018427387904 (2^62: byte counts stay "
                        "int64; no message comes near it), or 'auto' (the word: no number means it)"),
    ({"group_size": "64"}, "group_size='64': choose one of 16, 32, 64, 128 (a number, not text)"),
    ({"group_size": 64.0}, "group_size=64.0: choose one of"),
    ({"rounding": "nearst"}, "rounding='nearst': choose one of nearest, stochastic; did you mean 'nearest'?"),
    ({"encoder": "signed-mse"}, "encoder='signed-mse': choose one of absmax, signed_mse; did you mean 'signed_mse'?"),
    ({"encoder": None}, "encoder=None: choose one of absmax, signed_mse"),
    ({"min_bytes": MAX_MESSAGE_BYTES + 1}, "min_bytes=4611686018427387905: must be an integer from 0 to "
                                           "4611686018427387904 (2^62: byte counts stay int64"),
    ({"first_exact_calls": 10**9}, "first_exact_calls=1000000000: must be an integer from 0 to 65536"),
    ({"rotation_seed": -1}, "rotation_seed=-1: must be an integer from 0 to 9223372036854775807 (seeds are int64)"),
    ({"rotation_seed": MAX_SEED + 1}, "rotation_seed=9223372036854775808: must be an integer from 0 to"),
    ({"rotation_seed": True}, "rotation_seed=True: must be an integer"),
    ({"rotation_seed": 2.0}, "rotation_seed=2.0: must be an integer"),
    ({"rotation_seed": "3"}, "rotation_seed='3': must be an integer"),
    ({"rotation_seed": 3, "hadamard": False}, "rotation_seed=3 with hadamard=False: the seed picks the signs "
                                              "flipped before the Hadamard rotation, and without one it changes "
                                              "nothing"),
])
def test_the_python_api_refuses_bad_values_by_name(kwargs, message):
    with pytest.raises(EchoConfigError) as info:
        EchoConfig(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(EchoConfigError):  # replace() builds through the same checks
        EchoConfig().replace(**kwargs)


def test_rotation_seeds_read_from_text_and_span_int64():
    assert EchoConfig.from_mapping({"echo_rotation_seed": "12"}, prefix="echo_").rotation_seed == 12
    assert EchoConfig(rotation_seed=MAX_SEED).rotation_seed == MAX_SEED
    assert EchoConfig().rotation_seed == 0  # the shipped rotation
    assert EchoConfig.naive().rotation_seed == 0  # no rotation, no seed


def test_an_echo_config_error_is_a_value_error_and_a_usage_error():
    assert issubclass(EchoConfigError, ValueError) and issubclass(EchoConfigError, UsageError)


def test_the_timeout_in_the_kernels_unit():
    assert EchoConfig(timeout_s=1e-9).timeout_ns == 1 and EchoConfig().timeout_ns == 60 * 10**9
    assert EchoConfig(timeout_s=2.5e-9).timeout_ns == 2  # rounded down, as the kernel's launch takes it


def test_auto_survives_replace_and_a_round_trip_through_json():
    config = EchoConfig().replace(group_size=64)
    assert config.min_bytes_auto and config.effective_min_bytes == 256 << 10
    assert EchoConfig.from_mapping(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(EchoConfigError, match="min_bytes=-1: must be an integer from 0"):
        EchoConfig.from_mapping({"echo_min_bytes": -1}, prefix="echo_")


@pytest.mark.parametrize("raw,prefix,message", [
    ({"group_size": 64, "group-size": 32}, "", "'group_size' and 'group-size' are one option, given twice with "
                                               "different values (64 and 32)"),
    ({"echo-seed": "7", "echo_seed": 8}, "echo_", "'echo-seed' and 'echo_seed' are one option"),
])
def test_one_option_in_two_spellings_must_agree(raw, prefix, message):
    with pytest.raises(EchoConfigError, match=re.escape(message)):
        EchoConfig.from_mapping(raw, prefix=prefix)


@pytest.mark.parametrize("raw,message", [
    ({"tp_comm": "echo", "echo_group_size": 64, "echo-group-size": 32},
     "'echo_group_size' and 'echo-group-size' are one option, given twice with different values (64 and 32)"),
    ({"tp-comm": "nccl", "tp_comm": "echo"}, "'tp-comm' and 'tp_comm' are one option"),
])
def test_the_plugin_refuses_one_key_in_two_spellings_with_two_values(raw, message):
    with pytest.raises(EchoConfigError, match=re.escape(message)):
        TpCommSettings.from_additional_config(raw)


def test_one_option_in_two_spellings_with_one_value_is_one_setting():
    assert EchoConfig.from_mapping({"group_size": 64, "group-size": 64}).group_size == 64
    assert EchoConfig.from_mapping({"echo_seed": 7, "echo-seed": "7"}, prefix="echo_").seed == 7  # read alike
    settings = TpCommSettings.from_additional_config({"tp_comm": "echo", "tp-comm": "echo", "echo_seed": 3})
    assert settings.tp_comm == "echo" and settings.echo.seed == 3


def test_min_bytes_auto_reads_in_python_too():
    assert EchoConfig(min_bytes="auto") == EchoConfig() and EchoConfig(min_bytes="auto").min_bytes_auto
    with pytest.raises(EchoConfigError, match="min_bytes='AUTO'"):
        EchoConfig(min_bytes="AUTO")  # Python takes the one spelling; text from a CLI is read by from_mapping


def test_a_huge_value_is_shown_short():
    with pytest.raises(EchoConfigError) as info:
        EchoConfig(timeout_s=10**400)
    assert len(str(info.value)) < 200


def test_configs_still_copy_and_pickle():
    config = EchoConfig(group_size=64, feedback=False)
    assert pickle.loads(pickle.dumps(config)) == config == copy.deepcopy(config)
    assert config.replace(seed=3).seed == 3 and config.qmax == 7 and config.wire_bits_per_value == 4.25


@pytest.mark.parametrize("raw,prefix,message", [
    (None, "", "expected a mapping of option: value, got NoneType None"),
    ([("group_size", 64)], "", "expected a mapping of option: value, got list"),
    ({"group_sise": 64}, "", "unknown option 'group_sise'; did you mean 'group_size'?"),
    ({"echo_group_sise": 64}, "echo_", "unknown option 'echo_group_sise'; did you mean 'echo_group_size'?"),
    ({"echo_zzz": 64}, "echo_", "unknown option 'echo_zzz'; known: echo_group_size"),
    ({"bits": 4}, "", "bits: Echo's payload is 4-bit only"),
    ({"echo_bits": 4}, "echo_", "echo_bits: Echo's payload is 4-bit only"),
    ({7: 1}, "", "option name 7: must be text"),
    ({"seed": 3.7}, "", "seed=3.7: expected an integer"),
    ({"seed": "9223372036854775808"}, "", "seed=9223372036854775808: must be an integer from 0 to"),
    ({"first_exact_calls": True}, "", "first_exact_calls=True: expected an integer"),
    ({"rotation_seed": "7k"}, "", "rotation_seed='7k': expected an integer (size suffixes"),
    ({"echo_rotation_seed": "-2"}, "echo_", "rotation_seed=-2: must be an integer from 0 to"),
    ({"feedback": None}, "", "feedback=None: expected a boolean"),
    ({"feedback": 2}, "", "feedback=2: expected a boolean"),
    ({"rounding": 1}, "", "rounding=1: expected text"),
    ({"echo_encoder": "mse"}, "echo_", "encoder='mse': choose one of absmax, signed_mse"),
    ({"timeout_s": "1e300"}, "", "timeout_s=1e+300: must be a number of seconds above 0, at most 86400"),
    ({"timeout_s": 10**400}, "", "timeout_s=1000"),
    ({"min_bytes": "99999999999999999999T"}, "", "min_bytes='99999999999999999999T' (1.1e+32 bytes): must be at "
                                                 "most 4611686018427387904"),
    ({"min_bytes": "1.1k"}, "", "'1.1k' is 1126.4 bytes, not a whole number"),
    ({"max_bytes": "9" * 400}, "", "max_bytes='99999"),
])
def test_mappings_refuse_bad_input_by_name(raw, prefix, message):
    with pytest.raises(EchoConfigError) as info:
        EchoConfig.from_mapping(raw, prefix=prefix)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_settings_that_leave_echo_idle_warn():
    assert EchoConfig().warnings() == []
    (warning,) = EchoConfig(min_bytes=2 << 30).warnings()
    assert warning.startswith("min_bytes=2147483648 (2 GiB): only messages at least this large take Echo")
    (warning,) = EchoConfig(first_exact_calls=MANY_CALLS + 1).warnings()
    assert "first_exact_calls=258: a forward pass of a 128-layer model makes 257 all-reduce calls" in warning
    assert EchoConfig(min_bytes=2 << 30, batch_invariant=True).warnings() == []  # thresholds off there


@pytest.mark.parametrize("raw,message", [
    ({"tp_comm": ""}, "tp_comm='': choose one of ('nccl', 'echo')"),
    ({"tp_comm": "eco"}, "did you mean 'echo'?"),
    ({"tp_comm": "echo", "tp_comm_emulate": 3.7}, "tp_comm_emulate=3.7: expected an integer"),
    ({"tp_comm": "echo", "tp_comm_emulate": 65}, "tp_comm_emulate=65: must be from 2 to 64"),
    ({"tp_comm": "echo", "tp_comm_emulate": True}, "tp_comm_emulate=True: expected an integer"),
])
def test_the_plugins_settings_refuse_bad_input_by_name(raw, message):
    with pytest.raises(EchoConfigError) as info:
        TpCommSettings.from_additional_config(raw)
    assert message in str(info.value)


# -- property tests ------------------------------------------------------------------

#: Values of every kind a JSON or YAML file, a CLI or a careless caller hands over.
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=True),
    st.text(max_size=30), st.sampled_from(["auto", "4k", "1.5G", "0x40", "true", "off", "nearest", "int8",
                                           "99999999999999999999T", "1e400", "nan", "-1", " 7 ", "64"]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
KEY = st.one_of(st.sampled_from(FIELDS + ["bits", "group_sise", "echo", "tp_comm"]), st.text(max_size=12),
                st.integers())


def _one_clear_error(make):
    try:
        return make()
    except EchoConfigError as e:
        assert str(e) and "\n" not in str(e)
        return None


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEY, ANY_VALUE, max_size=4), st.sampled_from(["", "echo_", "echo-"]))
def test_from_mapping_gives_a_valid_config_or_one_clear_error(raw, prefix):
    if prefix:
        raw = {(prefix + k if isinstance(k, str) else k): v for k, v in raw.items()}
    config = _one_clear_error(lambda: EchoConfig.from_mapping(raw, prefix=prefix))
    if config is not None:  # valid: its dict reads back to itself
        assert EchoConfig.from_mapping(config.to_dict()) == config


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS + ["bits"]), ANY_VALUE, max_size=3))
def test_the_constructor_gives_a_valid_config_or_one_clear_error(kwargs):
    _one_clear_error(lambda: EchoConfig(**kwargs))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["tp_comm", "tp_comm_emulate", "tp_comm_emulate_measure", "tp_comm_postnorm",
                                        "tp-comm", "tp_comm_emulat", "echo_group_size", "echo_feedback"]),
                       ANY_VALUE, max_size=4))
def test_the_plugins_settings_give_settings_or_one_clear_error(raw):
    _one_clear_error(lambda: TpCommSettings.from_additional_config(raw))
