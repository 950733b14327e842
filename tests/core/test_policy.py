"""The routing policy, branch by branch, and configuration validation."""

import dataclasses

import pytest
import torch

from echo_vllm import CallInfo, EchoConfig, EchoConfigError, Path, Reason, decide
from echo_vllm.config import DEFAULT_MIN_BYTES

CFG = EchoConfig(min_bytes=1024, max_bytes=1 << 20, first_exact_calls=2)
BASE = CallInfo(nbytes=4096, dtype=torch.bfloat16, world_size=4, call_index=5)

# (change to the base call, config override, expected path, expected reason)
TABLE = [
    ({}, {}, Path.ECHO, Reason.ECHO),
    ({"dtype": torch.float16}, {}, Path.ECHO, Reason.ECHO),
    ({"world_size": 1}, {}, Path.EXACT, Reason.WORLD_SIZE_1),
    ({"dtype": torch.float32}, {}, Path.EXACT, Reason.DTYPE),
    ({"dtype": torch.int32}, {}, Path.EXACT, Reason.DTYPE),
    ({"call_index": None}, {}, Path.EXACT, Reason.NO_FORWARD_CONTEXT),
    ({"residual": False}, {}, Path.EXACT, Reason.NOT_RESIDUAL),
    ({"nbytes": 1023}, {}, Path.EXACT, Reason.BELOW_MIN_BYTES),
    ({"nbytes": 1024}, {}, Path.ECHO, Reason.ECHO),
    ({"nbytes": (1 << 20) + 1}, {}, Path.EXACT, Reason.ABOVE_MAX_BYTES),
    ({"nbytes": 1 << 40}, {"max_bytes": 0}, Path.ECHO, Reason.ECHO),
    ({"capturing": True, "transport_capturable": False}, {}, Path.EXACT, Reason.CAPTURE_UNSUPPORTED),
    ({"capturing": True}, {}, Path.ECHO, Reason.ECHO),
    ({"fits_buffer": False}, {}, Path.EXACT, Reason.EXCEEDS_BUFFER),
    ({"fits_buffer": False}, {"feedback": False}, Path.ECHO, Reason.ECHO),
    ({"call_index": 1}, {}, Path.EXACT, Reason.FIRST_EXACT_CALLS),
    ({"call_index": 2}, {}, Path.ECHO, Reason.ECHO),
    ({"last_call": True}, {}, Path.EXACT, Reason.LAST_CALL),
    ({"last_call": True}, {"exact_last_call": False}, Path.ECHO, Reason.ECHO),
    # several reasons: the structural one wins
    ({"world_size": 1, "nbytes": 1}, {}, Path.EXACT, Reason.WORLD_SIZE_1),
    ({"nbytes": 1, "last_call": True}, {}, Path.EXACT, Reason.BELOW_MIN_BYTES),
]


@pytest.mark.parametrize("change,override,path,reason", TABLE)
def test_decide_table(change, override, path, reason):
    call = dataclasses.replace(BASE, **change)
    d = decide(call, CFG.replace(**override))
    assert (d.path, d.reason) == (path, reason)
    assert d.echo == (path is Path.ECHO)


def test_a_missing_config_is_echo_disabled():
    assert decide(BASE, None).reason is Reason.DISABLED


def test_default_min_bytes_routes_decode_sizes_to_exact():
    # one decode token of a 4096-wide model in bf16 is 8 KiB: latency-bound
    d = decide(dataclasses.replace(BASE, nbytes=8192), EchoConfig())
    assert d.reason is Reason.BELOW_MIN_BYTES
    # a 2048-token prefill is 16 MiB: Echo
    d = decide(dataclasses.replace(BASE, nbytes=2048 * 4096 * 2), EchoConfig())
    assert d.echo and DEFAULT_MIN_BYTES < 2048 * 4096 * 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"group_size": 48}, "group_size=48: choose one of 16, 32, 64, 128"),
        ({"group_size": 256}, "choose one of"),
        ({"bits": 8}, "4-bit only"),
        ({"rounding": "up"}, "rounding"),
        ({"feedback_dtype": "float16"}, "feedback_dtype"),
        ({"min_bytes": -2}, "must be an integer from 0"),
        ({"max_bytes": -1}, "must be an integer from 0"),
        ({"first_exact_calls": True}, "must be an integer from 0"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(EchoConfigError, match=match):
        EchoConfig(**kwargs)


def test_int8_feedback_is_a_config_choice():
    """From the dataclass and from vLLM's additional_config alike (where it
    can run is the backend rule's: tests/core/test_backends.py)."""
    assert EchoConfig(feedback_dtype="int8").feedback_dtype == "int8"
    assert EchoConfig.from_mapping({"echo_feedback_dtype": "int8"}, prefix="echo_").feedback_dtype == "int8"


def test_from_mapping():
    cfg = EchoConfig.from_mapping(
        {"echo_group_size": "64", "echo_feedback": "false", "echo_min_bytes": "4MiB", "tp_comm": "echo"},
        prefix="echo_",
    )
    assert (cfg.group_size, cfg.feedback, cfg.min_bytes) == (64, False, 4 << 20)
    with pytest.raises(EchoConfigError, match="unknown option 'echo_group'"):
        EchoConfig.from_mapping({"echo_group": 64}, prefix="echo_")
    with pytest.raises(EchoConfigError, match="expected a boolean"):
        EchoConfig.from_mapping({"echo_hadamard": "maybe"}, prefix="echo_")
    # the CLI's dashed spelling reads the same, typos in it are caught too
    dashed = EchoConfig.from_mapping({"echo-group-size": 16, "echo-exact-last-call": "off"}, prefix="echo-")
    assert (dashed.group_size, dashed.exact_last_call) == (16, False)
    assert EchoConfig.from_mapping({"echo-group-size": 16}, prefix="echo_").group_size == 16
    with pytest.raises(EchoConfigError, match="unknown option 'echo_group_sise'"):
        EchoConfig.from_mapping({"echo-group-sise": 16}, prefix="echo_")
    # a nested dict would be ignored: refused, with the spelling that works
    with pytest.raises(EchoConfigError, match="echo_group_size"):
        EchoConfig.from_mapping({"echo": {"group_size": 64}}, prefix="echo_")


def test_min_bytes_above_max_bytes_is_refused():
    with pytest.raises(EchoConfigError, match="no message would take Echo"):
        EchoConfig(min_bytes=4 << 20, max_bytes=1 << 20)
    assert EchoConfig(min_bytes=1 << 20, max_bytes=1 << 20).max_bytes == 1 << 20  # one size: allowed
    assert EchoConfig(min_bytes=4 << 20, max_bytes=0).max_bytes == 0  # 0 = no upper limit


def test_naive_preset_and_wire_bits():
    naive = EchoConfig.naive()
    assert not (naive.feedback or naive.hadamard or naive.exact_last_call)
    # the baseline quantizes every call: none of Echo's 16-bit first calls
    assert naive.first_exact_calls == 0
    first = decide(CallInfo(nbytes=1 << 20, dtype=torch.bfloat16, world_size=4, call_index=0), naive)
    assert first.path is Path.ECHO
    assert EchoConfig(group_size=32).wire_bits_per_value == 4.5
    assert EchoConfig(group_size=128).wire_bits_per_value == 4.125
    assert EchoConfig().qmax == 7


@pytest.mark.parametrize("text, nbytes", [
    ("262144", 262144), ("256k", 256 << 10), ("4MiB", 4 << 20), ("64MB", 64 << 20),
    ("1.5G", 3 << 29), ("256 KiB", 256 << 10), ("0x40000", 1 << 18), ("1_000", 1000),
])
def test_byte_counts_parse_one_way_for_config_and_benchmarks(text, nbytes):
    from echo_vllm.bench.report import parse_size
    from echo_vllm.config import parse_bytes

    assert parse_bytes(text) == parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "abc", "-5", "4 MiBs", "1.5"])
def test_bad_byte_counts_are_refused(text):
    from echo_vllm.config import parse_bytes

    with pytest.raises(ValueError, match="not a byte count"):
        parse_bytes(text)
    with pytest.raises(EchoConfigError, match="min_bytes"):
        EchoConfig.from_mapping({"min_bytes": text})


def test_counts_are_plain_integers_and_sizes_take_suffixes():
    """Only the byte-size fields read ``256k``; a count with a suffix is an
    error wherever it comes from (additional_config, variants, the plugin's
    tp_comm_emulate), never 1024 times the number."""
    from echo_vllm.vllm_glue.settings import TpCommSettings

    for raw in ({"first_exact_calls": "5k"}, {"seed": "1k"}, {"first_exact_calls": "0x10"}):
        with pytest.raises(EchoConfigError, match="expected an integer"):
            EchoConfig.from_mapping(raw)
    with pytest.raises(EchoConfigError, match="tp_comm_emulate='4k': expected an integer"):
        TpCommSettings.from_additional_config({"tp_comm": "echo", "tp_comm_emulate": "4k"})
    config = EchoConfig.from_mapping({"min_bytes": "256k", "max_bytes": "4MiB", "first_exact_calls": " 7 "})
    assert (config.min_bytes, config.max_bytes, config.first_exact_calls) == (256 << 10, 4 << 20, 7)
