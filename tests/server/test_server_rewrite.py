"""``echo-vllm serve`` argument rewriting: table-driven, pure, no vLLM import."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.config import BYTE_SIZE_FIELDS, EchoConfig
from echo_vllm.server.flags import echo_flags, flags_by_option, format_help
from echo_vllm.server.rewrite import (
    BYPASS_PASSES_0_26,
    BYPASS_PASSES_0_33,
    ServeArgsError,
    bypass_passes_for,
    parse_dotted_value,
    rewrite_args,
    verify_parsed,
)
from echo_vllm.vllm_glue.guards import EngineFacts, conflicts
from echo_vllm.vllm_glue.settings import TpCommSettings

OFF = {k: False for k in BYPASS_PASSES_0_26}


def rewrite(argv, **kw):
    kw.setdefault("bypass_passes", BYPASS_PASSES_0_26)
    return rewrite_args(argv, **kw)


def split_tail(vllm_argv):
    """(tokens before Echo's two appended options, additional, compilation)."""
    assert vllm_argv[-4] == "--additional-config" and vllm_argv[-2] == "--compilation-config"
    return vllm_argv[:-4], json.loads(vllm_argv[-3]), json.loads(vllm_argv[-1])


# -- stock vLLM (--tp-comm nccl / no flag): argv reaches vLLM untouched ---------

PASSTHROUGH = [
    (["Qwen/Qwen3-8B"], ["Qwen/Qwen3-8B"]),
    (["m", "--tp-comm", "nccl", "-tp", "4", "--port=8001", "--max-model-len", "2048"],
     ["m", "-tp", "4", "--port=8001", "--max-model-len", "2048"]),
    (["m", "--tp-comm=nccl", "--additional-config", '{"a": 1}', "-cc.mode", "3",
      "--compilation-config={\"pass_config\": {\"fuse_allreduce_rms\": true}}"],
     ["m", "--additional-config", '{"a": 1}', "-cc.mode", "3",
      "--compilation-config={\"pass_config\": {\"fuse_allreduce_rms\": true}}"]),
    # repeated flags, = forms, underscores, values that look like options
    (["m", "--lora-modules", "a=/x", "--lora-modules", "b=/y", "--tp_comm", "nccl",
      "--max_model_len=4k", "--override-generation-config", '{"temperature": 0.5}', "--seed", "-1"],
     ["m", "--lora-modules", "a=/x", "--lora-modules", "b=/y", "--max_model_len=4k",
      "--override-generation-config", '{"temperature": 0.5}', "--seed", "-1"]),
    # --enable-dbo is fine with stock vLLM; tokens after "--" are never inspected
    (["m", "--enable-dbo", "-tp", "2", "--", "--tp-comm"], ["m", "--enable-dbo", "-tp", "2", "--", "--tp-comm"]),
]


@pytest.mark.parametrize("argv,expected", PASSTHROUGH)
def test_stock_vllm_passthrough(argv, expected):
    vllm_argv, settings = rewrite(argv)
    assert vllm_argv == expected
    assert settings.tp_comm == "nccl" and settings.echo is None and settings.compilation_config is None


# -- every Echo flag ------------------------------------------------------------

#: One non-default value per EchoConfig field: (as typed, as the plugin gets it).
SAMPLE = {
    "group_size": ("64", 64),
    "min_bytes": ("1MiB", 1 << 20),
    "max_bytes": ("64m", 64 << 20),
    "rounding": ("stochastic", "stochastic"),
    "seed": ("7", 7),
    "rotation_seed": ("3", 3),
    "feedback_dtype": ("float32", "float32"),
    "encoder": ("signed_mse", "signed_mse"),
    "first_exact_calls": ("2", 2),
    "backend": ("reference", "reference"),
    "health_every": ("4", 4),
    "topology": ("two_level", "two_level"),
    "host_map": ("0,0,1,1", [0, 0, 1, 1]),  # JSON's list; EchoConfig holds it as a tuple
    "timeout_s": ("2.5", 2.5),
}

def test_every_config_field_has_a_flag_and_a_sample():
    fields = [f.name for f in dataclasses.fields(EchoConfig)]
    options = {f.option for f in echo_flags()}
    assert options == {"--tp-comm", "--echo-emulate-tp", "--echo-emulate-measure", "--echo-postnorm"} | {
        "--echo-" + n.replace("_", "-") for n in fields}
    bools = [f.field for f in echo_flags() if f.kind == "bool" and f.field is not None]
    assert sorted(bools + list(SAMPLE)) == sorted(fields)


def test_every_sample_value_is_not_the_default():
    """A sample equal to the default would pass even if its flag were ignored."""
    default = EchoConfig()
    for name, (_, parsed) in SAMPLE.items():
        assert parsed != getattr(default, name), f"SAMPLE[{name!r}] is EchoConfig's default"


def _value_cases():
    for flag in echo_flags():
        if flag.field is None or flag.kind == "bool":
            continue
        typed, parsed = SAMPLE[flag.field]
        yield pytest.param([flag.option, typed], flag.key, parsed, id=f"{flag.option}-space")
        yield pytest.param([f"{flag.option}={typed}"], flag.key, parsed, id=f"{flag.option}-eq")
        yield pytest.param([flag.option.replace("-", "_").replace("__", "--", 1), typed], flag.key, parsed,
                           id=f"{flag.option}-underscore")


def _bool_cases():
    for flag in echo_flags():
        if flag.kind != "bool" or flag.field is None:
            continue
        for tokens, expected in (([flag.option], True), ([flag.negative], False),
                                 ([f"{flag.option}=false"], False), ([f"{flag.negative}=false"], True)):
            yield pytest.param(tokens, flag.key, expected, id=tokens[0])


@pytest.mark.parametrize("tokens,key,expected", list(_value_cases()) + list(_bool_cases()))
def test_echo_flag_lands_in_additional_config(tokens, key, expected):
    # eager: stochastic rounding (a sample) is refused under CUDA graphs; two nodes: two-level
    # (a sample) is refused on a TP group the launch keeps on one node
    argv = ["m", "-tp", "4", "--nnodes", "2", "--tp-comm", "echo", *tokens, "--port", "8001", "--enforce-eager"]
    vllm_argv, settings = rewrite(argv)
    head, additional, compilation = split_tail(vllm_argv)
    assert head == ["m", "-tp", "4", "--nnodes", "2", "--port", "8001", "--enforce-eager"]
    assert additional == {"tp_comm": "echo", key: expected}
    assert compilation == {"pass_config": OFF}
    held = getattr(settings.echo, key[len("echo_"):])
    assert held == (tuple(expected) if isinstance(expected, list) else expected)


def test_defaults_when_no_echo_option_given():
    vllm_argv, settings = rewrite(["m", "--tensor-parallel-size=2", "--tp-comm=echo"])
    head, additional, compilation = split_tail(vllm_argv)
    assert head == ["m", "--tensor-parallel-size=2"]
    assert additional == {"tp_comm": "echo"}
    assert settings.echo == EchoConfig() and settings.tensor_parallel_size == 2
    assert compilation == {"pass_config": OFF}


@pytest.mark.parametrize("policy", ["no-feedback", "exact", "feedback"])
def test_postnorm_policy_lands_in_additional_config(policy):
    vllm_argv, _ = rewrite(["m", "-tp", "2", "--tp-comm", "echo", f"--echo-postnorm={policy}"])
    _, additional, _ = split_tail(vllm_argv)
    assert additional == {"tp_comm": "echo", "tp_comm_postnorm": policy}
    assert TpCommSettings.from_additional_config(additional).postnorm == policy


def test_postnorm_policy_rejects_unknown_values_and_nccl():
    with pytest.raises(ServeArgsError, match=r"tp_comm_postnorm='skip': choose one of \('no-feedback', 'exact', 'feedback'\)"):
        rewrite(["m", "-tp", "2", "--tp-comm", "echo", "--echo-postnorm", "skip"])
    # the engine would only warn (its rule book's conflict, not refused there): serve refuses it
    for argv in (["m", "-tp", "2", "--echo-postnorm", "exact"], ["m", "--echo-emulate-tp", "2", "--echo-postnorm=exact"]):
        with pytest.raises(ServeArgsError, match="tp_comm_postnorm=exact needs tp_comm=echo"):
            rewrite(argv)


def test_emulation_on_one_gpu():
    vllm_argv, settings = rewrite(["m", "--tp-comm", "echo", "--echo-emulate-tp", "4"])
    head, additional, _ = split_tail(vllm_argv)
    assert head == ["m"]
    assert additional == {"tp_comm": "echo", "tp_comm_emulate": 4}
    assert settings.emulate_tp == 4 and settings.tensor_parallel_size == 1 and settings.glue_active
    vllm_argv, _ = rewrite(["m", "--tp-comm", "echo", "--echo-emulate-tp=2", "--echo-emulate-measure"])
    assert split_tail(vllm_argv)[1] == {"tp_comm": "echo", "tp_comm_emulate": 2, "tp_comm_emulate_measure": True}


def test_emulated_exact_baseline_with_nccl():
    """--tp-comm nccl with emulation: the same P partials summed in 16-bit.
    Only --additional-config is rewritten; the compilation config is the user's."""
    argv = ["m", "--echo-emulate-tp", "4", "--no-echo-emulate-measure", "-cc.mode", "3",
            "--additional-config", '{"a": 1}', "--port", "1"]
    vllm_argv, settings = rewrite(argv)
    assert vllm_argv == ["m", "-cc.mode", "3", "--port", "1", "--additional-config",
                         json.dumps({"a": 1, "tp_comm": "nccl", "tp_comm_emulate": 4,
                                     "tp_comm_emulate_measure": False})]
    assert settings.tp_comm == "nccl" and settings.emulate_tp == 4 and settings.glue_active
    assert settings.echo is None and settings.compilation_config is None
    assert not rewrite(["m", "-tp", "2"])[1].glue_active


# -- merging with the user's own vLLM options ------------------------------------

MERGES = [
    # JSON (space and = forms) + dotted (space and = forms), in order, later keys win
    (["--additional-config", '{"a": 1, "b": {"c": 1}}', "--additional-config.b.d", "x",
      "--additional-config.e=2k", "--additional-config={\"a\": 3}"],
     {"a": 3, "b": {"c": 1, "d": "x"}, "e": 2000, "tp_comm": "echo"}, {"pass_config": OFF}),
    # -cc alias, JSON + dotted, an explicit false kept false, other pass keys kept
    (["-cc", '{"mode": 3, "pass_config": {"fuse_norm_quant": true}}', "-cc.cudagraph_mode=PIECEWISE",
      "--compilation-config.pass_config.enable_sp", "false"],
     {"tp_comm": "echo"},
     {"mode": 3, "cudagraph_mode": "PIECEWISE", "pass_config": {"fuse_norm_quant": True, **OFF}}),
    # vLLM's list append (key+) and binary size suffix
    (["--additional-config.xs+", "a,b", "--additional-config.xs+=c", "--additional-config.n", "2K"],
     {"xs": ["a", "b", "c"], "n": 2048, "tp_comm": "echo"}, {"pass_config": OFF}),
    # the user's own echo_* keys are Echo options too
    (["--additional-config", '{"echo_group_size": 64}', "--echo-group-size", "64"],
     {"echo_group_size": 64, "tp_comm": "echo"}, {"pass_config": OFF}),
]


@pytest.mark.parametrize("extra,additional,compilation", MERGES)
def test_merges_user_configs(extra, additional, compilation):
    vllm_argv, _ = rewrite(["m", "-tp", "2", "--tp-comm", "echo", *extra, "--port", "9000"])
    head, got_additional, got_compilation = split_tail(vllm_argv)
    assert head == ["m", "-tp", "2", "--port", "9000"]
    assert got_additional == additional
    assert got_compilation == compilation


@pytest.mark.parametrize("field,text,value", [
    ("min_bytes", "256k", 262144), ("min_bytes", "4MiB", 4194304), ("min_bytes", "1024", 1024),
    ("min_bytes", "auto", EchoConfig(min_bytes="auto").min_bytes), ("group_size", "64", 64),
    ("feedback", "false", False), ("first_exact_calls", "7", 7),
    # vLLM's "human integer" reading would take these as 1100, 5000 and 1500
    ("min_bytes", "1.1k", None), ("first_exact_calls", "5k", None), ("seed", "1.5k", None),
    ("group_size", "true", None),
])
def test_dotted_echo_keys_read_like_their_flags(field, text, value):
    """``--additional-config.echo_<field> TEXT`` is read by the parser of
    ``--echo-<field>=TEXT`` (and of the JSON string form): the same value,
    or the same refusal."""
    key, dashed = "echo_" + field, field.replace("_", "-")
    forms = {"flag": [f"--echo-{dashed}={text}"],
             "dotted": [f"--additional-config.{key}", text],
             "dotted, dashed, =": [f"--additional-config.echo-{dashed}={text}"],
             "json": ["--additional-config", json.dumps({key: text})]}
    got = {}
    for form, tokens in forms.items():
        try:
            got[form] = split_tail(rewrite(["m", "-tp", "2", "--tp-comm", "echo", *tokens])[0])[1][key]
        except ServeArgsError as e:
            got[form] = "refused: " + str(e).partition(f"{field}=")[2]  # EchoConfig's message, without the source
    assert set(got.values()) == {value if value is not None else got["flag"]}, got
    if value is None:
        assert got["flag"].startswith(f"refused: {text!r}")


def test_dotted_tp_comm_keys_read_like_their_flags():
    for tokens in (["--echo-emulate-tp", "2k"], ["--additional-config.tp_comm_emulate", "2k"]):
        with pytest.raises(ServeArgsError, match="'2k' is not an integer"):
            rewrite(["m", "--tp-comm", "echo", *tokens])
    _, settings = rewrite(["m", "--additional-config.tp-comm-emulate=2", "--additional-config.tp_comm", "echo",
                           "--additional-config.tp_comm_emulate_measure", "on"])
    assert settings.emulate_tp == 2 and settings.additional_config["tp_comm_emulate_measure"] is True


def test_echo_selected_from_additional_config_alone():
    vllm_argv, settings = rewrite(["m", "-tp", "2", "--additional-config.tp_comm", "echo"])
    assert settings.echo_on and split_tail(vllm_argv)[1] == {"tp_comm": "echo"}


def test_unrelated_flags_pass_through_in_order_in_echo_mode():
    others = ["--lora-modules", "a=/x", "--lora-modules", "b=/y", "--max_model_len=4k", "-O3",
              "--speculative-config", '{"method": "ngram"}', "--api-key", "--secret--", "--seed", "-1"]
    vllm_argv, _ = rewrite(["m", *others[:4], "--tp-comm", "echo", "-tp=8", *others[4:]])
    assert split_tail(vllm_argv)[0] == ["m", *others[:4], "-tp=8", *others[4:]]


def test_config_file_counts_before_the_command_line():
    files = {"c.yaml": {"tensor_parallel_size": 2, "compilation-config": {"mode": 3, "pass_config": {"enable_sp": False}},
                        "additional-config": {"k": "file", "j": 1}, "port": 9000}}
    vllm_argv, settings = rewrite(["m", "--additional-config.k", "cli", "--config", "c.yaml", "--tp-comm", "echo"],
                                  read_config=files.__getitem__)
    head, additional, compilation = split_tail(vllm_argv)
    assert head == ["m", "--config", "c.yaml"]
    assert settings.tensor_parallel_size == 2
    assert additional == {"k": "cli", "j": 1, "tp_comm": "echo"}
    assert compilation == {"mode": 3, "pass_config": OFF}
    # the command line beats the file
    _, settings = rewrite(["m", "-tp", "4", "--config", "c.yaml", "--tp-comm", "echo"], read_config=files.__getitem__)
    assert settings.tensor_parallel_size == 4


def test_dbo_last_flag_wins():
    _, settings = rewrite(["m", "-tp", "2", "--tp-comm", "echo", "--enable-dbo", "--no-enable-dbo", "--ubatch-size", "1"])
    assert settings.echo_on


# -- rejected combinations: one line each, naming the problem -------------------

REJECTS = [
    (["m", "--tp-comm", "echo"], "needs --tensor-parallel-size > 1"),
    (["m", "-tp", "1", "--tp-comm", "echo"], "needs --tensor-parallel-size > 1"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--enable-dbo"], "cannot run with --enable-dbo"),
    (["m", "-tp", "2", "--enable_dbo", "--tp-comm", "echo"], "cannot run with --enable-dbo"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--ubatch-size=2"], "tp_comm=echo cannot run with --ubatch-size 2"),
    (["m", "--echo-emulate-tp", "2", "--enable-dbo"], "tp_comm_emulate=2 cannot run with --enable-dbo"),
    (["m", "-tp", "2", "--tp-comm", "echo", "-cc.pass_config.fuse_allreduce_rms", "true"],
     "cannot run with -cc.pass_config.fuse_allreduce_rms=true"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--compilation-config.pass_config.fuse_allreduce_rms=True"],
     "fuse_allreduce_rms"),
    (["m", "-tp", "2", "--tp-comm", "echo", "-cc", '{"pass_config": {"enable_sp": true}}'],
     "cannot run with -cc.pass_config.enable_sp=true"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--compilation-config={\"pass_config\": {\"fuse_gemm_comms\": 1}}"],
     "cannot run with -cc.pass_config.fuse_gemm_comms=1"),
    (["m", "-tp", "2", "--tp-comm", "echo", "-cc.pass_config", "3"], "pass_config must be an object"),
    (["m", "-tp", "4", "--tp-comm", "echo", "--echo-emulate-tp", "4"], "needs --tensor-parallel-size 1 (got 4)"),
    (["m", "--tp-comm", "echo", "--echo-emulate-tp", "1"], "tp_comm_emulate=1: must be from 2 to 64"),
    (["m", "--tp-comm", "echo", "--echo-emulate-tp", "four"], "is not an integer"),
    (["m", "--echo-group-size", "64"], "--echo-group-size needs --tp-comm echo"),
    (["m", "--tp-comm", "nccl", "--no-echo-feedback"], "--no-echo-feedback needs --tp-comm echo"),
    (["m", "--tp-comm", "gloo"], "tp_comm='gloo': choose one of ('nccl', 'echo')"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-group", "64"],
     "unknown Echo option --echo-group; did you mean '--echo-group-size'?"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-zzz", "64"], "unknown Echo option --echo-zzz; known: --echo-"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-group-size", "48"], "--echo-group-size: group_size=48"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-feedback=maybe"], "expected true or false"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-min-bytes", "lots"], "expected an integer"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-rounding", "up"], "rounding='up'"),
    (["m", "-tp", "2", "--tp-comm"], "--tp-comm needs a value"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--additional-config"], "--additional-config needs a value"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--additional-config", "{bad"], "is not valid JSON"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--additional-config", "[1]"], "must be a JSON object"),
    (["m", "-tp", "two", "--tp-comm", "echo"], "-tp 'two' is not an integer"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--additional-config.tp_comm", "nccl"],
     "--tp-comm echo contradicts --additional-config tp_comm=nccl"),
    (["m", "-tp", "2", "--additional-config.tp_comm", "ring"], "tp_comm='ring': choose one of"),
    (["m", "-tp", "2", "--additional-config.tp_comm_emulat", "2"],
     "unknown option(s) ['tp_comm_emulat'] in additional_config; did you mean 'tp_comm_emulate'? known: "
     "['tp_comm', 'tp_comm_emulate',"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-emulate-measure"], "tp_comm_emulate_measure needs tp_comm_emulate"),
    (["m", "-tp", "2", "--echo-emulate-tp", "2"], "needs --tensor-parallel-size 1 (got 2)"),
    (["m", "--echo-emulate-tp", "2", "--echo-seed", "3"], "--echo-seed needs --tp-comm echo"),
    (["m", "--echo-emulate-tp", "2", "--additional-config.tp_comm_emulate_measure", "perhaps"],
     "--additional-config tp_comm_emulate_measure='perhaps': expected true or false"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-group-size", "64", "--additional-config.echo_group_size", "32"],
     "--echo-group-size 64 contradicts --additional-config echo_group_size=32"),
    (["m", "--tp-comm", "echo", "--echo-emulate-tp", "4", "--additional-config.tp_comm_emulate", "2"],
     "--echo-emulate-tp 4 contradicts"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--additional-config.echo_groupsize", "64"],
     "unknown option 'echo_groupsize'; did you mean 'echo_group_size'?"),
]


@pytest.mark.parametrize("argv,message", REJECTS)
def test_rejected(argv, message):
    with pytest.raises(ServeArgsError) as info:
        rewrite(argv)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize("argv,settings,engine", [
    (["m", "--tp-comm", "echo"], TpCommSettings(tp_comm="echo"), EngineFacts()),
    (["m", "-tp", "4", "--tp-comm", "echo", "--echo-emulate-tp", "4"],
     TpCommSettings(tp_comm="echo", emulate_world_size=4), EngineFacts(tensor_parallel_size=4)),
    (["m", "--echo-emulate-tp", "2", "--ubatch-size", "2"],
     TpCommSettings(emulate_world_size=2), EngineFacts(ubatch_size=2)),
])
def test_serve_refuses_what_the_plugins_rule_book_finds(argv, settings, engine):
    """One rule book: serve only turns the plugin's conflicts into argument
    errors (TP=1 Echo included, which the engine would run unchanged)."""
    (found,) = conflicts(settings, engine)
    with pytest.raises(ServeArgsError) as info:
        rewrite(argv)
    assert str(info.value) == found.message


def test_rejected_from_config_file():
    files = {"dbo.yaml": {"enable-dbo": True}, "echo.yaml": {"echo-group-size": 64}, "list.yaml": [1],
             "ubatch.yaml": {"ubatch_size": 4}}
    for name, message in (("dbo.yaml", "--enable-dbo"), ("echo.yaml", "on the command line"),
                          ("ubatch.yaml", "--ubatch-size 4"),
                          ("list.yaml", "expected a mapping")):
        with pytest.raises(ServeArgsError, match=message):
            rewrite(["m", "-tp", "2", "--tp-comm", "echo", "--config", name], read_config=files.__getitem__)


def test_config_file_read_with_yaml(tmp_path):
    good = tmp_path / "serve.yaml"
    good.write_text("tensor-parallel-size: 2\ncompilation-config:\n  mode: 3\n")
    vllm_argv, settings = rewrite(["m", "--config", str(good), "--tp-comm", "echo"])
    assert settings.tensor_parallel_size == 2 and split_tail(vllm_argv)[2]["mode"] == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [8000\n")
    for path in (bad, tmp_path / "missing.yaml"):
        with pytest.raises(ServeArgsError, match=f"--config {path}: ") as info:
            rewrite(["m", "--config", str(path), "--tp-comm", "echo"])
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_config_file_that_is_a_pipe_or_a_device_is_refused_not_read(kind, tmp_path):
    """``--config <(...)`` or ``/dev/zero``: reading a FIFO blocks until a
    writer comes (forever), and vLLM reads the file a second time anyway."""
    import os
    import threading

    if kind == "fifo":
        path = str(tmp_path / "serve.yaml")
        os.mkfifo(path)
    else:
        path = "/dev/zero"
    outcome = []

    def run():
        try:
            rewrite(["m", "--config", path, "--tp-comm", "echo"])
        except ServeArgsError as e:
            outcome.append(str(e))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=20)
    if kind == "fifo" and worker.is_alive():  # unblock the read, so the thread can end
        with open(path, "w") as f:
            f.write("{}")
    assert not worker.is_alive() and outcome, f"--config {path} was read as a file"
    assert outcome == [f"--config {path}: not a regular file (vLLM reads it a second time; a pipe or a device "
                       "cannot be read twice)"]


# -- helpers ---------------------------------------------------------------------


@pytest.mark.parametrize("version,passes", [("0.26.0", BYPASS_PASSES_0_26), ("0.32.9", BYPASS_PASSES_0_26),
                                            ("0.33.0", BYPASS_PASSES_0_33), ("0.33.1rc1", BYPASS_PASSES_0_33),
                                            (None, BYPASS_PASSES_0_26)])
def test_bypass_passes_by_vllm_version(version, passes):
    assert bypass_passes_for(version) == passes


def test_version_spelling_reaches_the_argv():
    vllm_argv, settings = rewrite_args(["m", "-tp", "2", "--tp-comm", "echo"], bypass_passes=BYPASS_PASSES_0_33)
    assert split_tail(vllm_argv)[2] == {"pass_config": {"fuse_allreduce_rms": False}}
    assert settings.bypass_passes == BYPASS_PASSES_0_33


@pytest.mark.parametrize("text,value", [("false", False), ("3", 3), ('{"a": 1}', {"a": 1}), ("2k", 2000),
                                        ("2K", 2048), ("1.5g", 1_500_000_000), ("PIECEWISE", "PIECEWISE"),
                                        ("1.5K", "1.5K")])
def test_dotted_values_parse_like_vllm(text, value):
    assert parse_dotted_value(text) == value


def test_verify_parsed_reports_what_vllm_saw_differently():
    vllm_argv, settings = rewrite(["m", "-tp", "2", "--tp-comm", "echo"])
    good = SimpleNamespace(tensor_parallel_size=2, enable_dbo=False, additional_config={"tp_comm": "echo"},
                           compilation_config=SimpleNamespace(pass_config=SimpleNamespace(**OFF)))
    assert verify_parsed(good, settings) == []
    bad = SimpleNamespace(tensor_parallel_size=4, enable_dbo=True, ubatch_size=2, additional_config={},
                          compilation_config=SimpleNamespace(pass_config=SimpleNamespace(
                              fuse_allreduce_rms=None, enable_sp=False, fuse_gemm_comms=True)))
    problems = verify_parsed(bad, settings)
    assert problems == ["tensor_parallel_size=4 where the rewrite read 2", "enable_dbo is on", "ubatch_size=2, expected <= 1",
                        "additional_config tp_comm=None, expected 'echo'",
                        "compilation_config.pass_config.fuse_allreduce_rms=None, expected False",
                        "compilation_config.pass_config.fuse_gemm_comms=True, expected False"]
    nccl = rewrite(["m"])[1]
    assert verify_parsed(bad, nccl) == []


#: Echo's integer flags that are counts, not byte sizes.
COUNT_FLAGS = [f.option for f in echo_flags() if f.kind == "int" and f.field and f.field not in BYTE_SIZE_FIELDS]


@pytest.mark.parametrize("option", COUNT_FLAGS)
def test_integer_flags_refuse_size_suffixes(option):
    """``--echo-first-exact-calls 5k`` is a typo, not 5120 calls."""
    assert "--echo-first-exact-calls" in COUNT_FLAGS and "--echo-seed" in COUNT_FLAGS
    for spelled in ([option, "5k"], [f"{option}=2K"]):
        with pytest.raises(ServeArgsError, match=r"expected an integer \(size suffixes such as k are for "
                                                 r"max_bytes and min_bytes only\)"):
            rewrite(["m", "-tp", "2", "--tp-comm", "echo", *spelled])


def test_byte_size_flags_keep_their_suffixes():
    _, settings = rewrite(["m", "-tp", "2", "--tp-comm", "echo", "--echo-min-bytes", "256k",
                           "--echo-max-bytes=4MiB", "--echo-first-exact-calls", "7"])
    assert (settings.echo.min_bytes, settings.echo.max_bytes, settings.echo.first_exact_calls) == (256 << 10, 4 << 20, 7)
    assert "--echo-min-bytes SIZE" in format_help() and "--echo-first-exact-calls N" in format_help()


def test_help_lists_every_flag_with_its_default():
    text = format_help()
    for flag in echo_flags():
        assert flag.option in text
        if flag.negative:
            assert flag.negative in text
    assert "(default: 32)" in text and "(default: nccl)" in text and "(default: auto)" in text


def test_dashed_keys_in_additional_config_read_like_the_plugin_reads_them():
    # the plugin reads "tp-comm" as "tp_comm": the rewrite must decide the same,
    # or serve would skip its checks for an engine that then runs Echo
    argv, s = rewrite(["m", "-tp", "2", "--additional-config",
                       '{"tp-comm": "echo", "echo-group-size": 64, "other-key": 1}'])
    _, additional, _ = split_tail(argv)
    assert s.tp_comm == "echo" and s.echo.group_size == 64
    assert additional["tp_comm"] == "echo" and additional["echo_group_size"] == 64
    assert additional["other-key"] == 1  # a platform's own keys are passed as given
    plugin = TpCommSettings.from_additional_config(additional)
    assert plugin.tp_comm == "echo" and plugin.echo == s.echo


def test_a_nested_echo_object_is_refused_up_front():
    with pytest.raises(ServeArgsError, match="nested"):
        rewrite(["m", "-tp", "2", "--additional-config", '{"tp_comm": "echo", "echo": {"group_size": 64}}'])


# -- bad input: refused before vLLM starts, one line naming the value -------------

BAD_INPUT = [
    (["m", "-tp", "2", "--tp-comm", ""], "tp_comm='': choose one of ('nccl', 'echo')"),
    (["m", "-tp", "2", "--additional-config", '{"tp_comm": ""}'], "tp_comm='': choose one of"),
    (["m", "--tp-comm", "eco", "-tp", "2"], "tp_comm='eco': choose one of ('nccl', 'echo'); did you mean 'echo'?"),
    (["m", "--tp-comm", "echo", "--additional-config", '{"tp_comm_emulate": 3.7}'],
     "--additional-config tp_comm_emulate 3.7 is not an integer"),
    (["m", "--tp-comm", "echo", "--echo-emulate-tp", "true"], "--echo-emulate-tp 'true' is not an integer"),
    (["m", "-tp", "2.5", "--tp-comm", "echo"], "-tp '2.5' is not an integer"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-seed", "9223372036854775808"],
     "--echo-seed: seed=9223372036854775808: must be an integer from 0 to 9223372036854775807 (seeds are int64)"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-timeout-s", "1e300"],
     "--echo-timeout-s: timeout_s=1e+300: must be a number of seconds above 0, at most 86400"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-timeout-s", "nan"], "timeout_s=nan"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-min-bytes", "99999999999999999999T"],
     "min_bytes='99999999999999999999T' (1.1e+32 bytes): must be at most 4611686018427387904"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-bits", "4"], "--echo-bits: Echo's payload is 4-bit only"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--additional-config.echo_bits", "4"],
     "echo_bits: Echo's payload is 4-bit only"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-rounding", "stochastic"],
     "echo_rounding=stochastic draws its noise from a torch generator; a CUDA-graph replay would repeat"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-rounding", "stochastic", "--enforce-eager", "--no-enforce-eager"],
     "Run eager (--enforce-eager)"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-rounding", "stochastic", "-O0", "-cc.cudagraph_mode", "FULL"],
     "Run eager (--enforce-eager)"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-feedbak"],
     "unknown Echo option --echo-feedbak; did you mean '--echo-feedback'?"),
    (["m", "-tp", "2", "--tp-comm-emulate", "2"], "unknown Echo option --tp-comm-emulate; did you mean"),
    (["m", "-tp", "99999999999999999999", "--tp-comm", "echo"],
     "--tensor-parallel-size 99999999999999999999: Echo runs on groups of at most 64"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-group-size", "32.0"], "group_size='32.0': expected an integer"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-first-exact-calls", "99999999"],
     "first_exact_calls=99999999: must be an integer from 0 to 65536"),
    (["m", "--tp-comm", "echo", "--echo-emulate-tp", "1000"], "tp_comm_emulate=1000: must be from 2 to 64"),
    (["m", "-tp", "2", "--tp-comm", "echo", "--echo-backend", "fusd"], "did you mean 'fused'?"),
]


@pytest.mark.parametrize("eager", [["--enforce-eager"], ["--enforce_eager"], ["-O0"], ["-O", "0"], ["-O=0"],
                                   ["--optimization-level", "0"], ["-cc.cudagraph_mode", "NONE"],
                                   ["--compilation-config", '{"cudagraph_mode": "NONE"}']])
def test_stochastic_rounding_runs_eager(eager):
    _, settings = rewrite(["m", "-tp", "2", "--tp-comm", "echo", "--echo-rounding", "stochastic", *eager])
    assert settings.echo.rounding == "stochastic"


def test_eager_from_a_config_file():
    files = {"eager.yaml": {"enforce-eager": True}, "o0.yaml": {"optimization-level": 0}}
    for name in files:
        rewrite(["m", "-tp", "2", "--config", name, "--tp-comm", "echo", "--echo-rounding", "stochastic"],
                read_config=files.__getitem__)


@pytest.mark.parametrize("key", ["api-key", "api_key", "hf-token"])
def test_a_config_file_with_a_secret_is_refused(key):
    with pytest.raises(ServeArgsError, match=f"holds {key}, which vLLM would print in its argument log") as info:
        rewrite(["m", "--config", "c.yaml"], read_config={"c.yaml": {key: "s3cret"}}.__getitem__)
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize("key,near", [("api-kye", "api-key"), ("apikey", "api-key"), ("hf_tokn", "hf-token")])
def test_a_config_file_with_a_near_miss_of_a_secret_is_refused(key, near):
    with pytest.raises(ServeArgsError, match=f"holds {key}, not an option of vllm serve; did you mean {near}") as info:
        rewrite(["m", "--config", "c.yaml"], read_config={"c.yaml": {key: "s3cret"}}.__getitem__)
    assert "s3cret" not in str(info.value)


def test_settings_that_idle_echo_come_back_as_warnings():
    _, settings = rewrite(["m", "-tp", "2", "--tp-comm", "echo", "--echo-min-bytes", "2G"])
    (warning,) = settings.warnings
    assert warning.startswith("min_bytes=2147483648 (2 GiB): only messages at least this large take Echo")
    assert rewrite(["m", "-tp", "2", "--tp-comm", "echo"])[1].warnings == ()


def test_help_shows_values_where_the_docs_name_constants():
    from echo_vllm import config

    text = " ".join(format_help().split())
    assert "one of 16, 32, 64, 128; also the Hadamard block size" in text
    assert config.DEFAULT_MIN_BYTES == 256 << 10 and "elsewhere 256 KiB" in text
    leaked = [name for name in dir(config) if name.isupper() and name in text]
    assert leaked == []
    assert "names the barrier and the late peer" in text and "naming nothing" not in text


# -- property: any command line gives a rewrite or one clear error ----------------

_FLAG_TOKENS = sorted(f for f in flags_by_option())
_TOKENS = st.one_of(
    st.sampled_from(_FLAG_TOKENS + ["-tp", "--tensor-parallel-size", "--enable-dbo", "--ubatch-size", "--enforce-eager",
                                    "-O0", "-O", "--additional-config", "-cc", "--compilation-config", "--", "--port",
                                    "--echo-bits", "--echo-groupsize", "--tp-comm=echo", "--tp-comm=", "-cc.mode",
                                    "--additional-config.echo_seed", "--additional-config.tp_comm_emulate"]),
    st.sampled_from(["echo", "nccl", "2", "4", "0", "-1", "3.7", "64", "48", "true", "maybe", "1MiB", "99999T", "",
                     "stochastic", '{"tp_comm": "echo"}', '{"echo_group_size": "x"}', "[1]", "{bad", "NONE",
                     '{"pass_config": {"enable_sp": true}}', "1e300", "nan", "9223372036854775808"]),
    st.text(max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TOKENS, max_size=8))
def test_any_command_line_gives_a_rewrite_or_one_clear_error(tokens):
    try:
        vllm_argv, settings = rewrite(["m", *tokens])
    except ServeArgsError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert all(isinstance(t, str) for t in vllm_argv)
    if settings.echo_on:  # what the plugin will read is what the rewrite decided
        _, additional, _ = split_tail(vllm_argv)
        assert TpCommSettings.from_additional_config(additional).echo == settings.echo


@pytest.mark.parametrize("yaml_value,found", [
    ({"additional-config": {"plugin": {"hf_token": "s3cret"}}}, "the key additional-config.plugin.hf_token"),
    ({"model": "https://bob:s3cret@host/m"}, "a URL with a password at model"),
    ({"hf-overrides": {"list": [{"password": "s3cret"}]}}, "the key hf-overrides.list[0].password"),
])
def test_a_config_file_with_a_secret_at_any_depth_is_refused(yaml_value, found):
    with pytest.raises(ServeArgsError) as info:
        rewrite(["m", "--config", "c.yaml"], read_config={"c.yaml": yaml_value}.__getitem__)
    assert str(info.value).startswith(f"--config c.yaml holds {found}") and "s3cret" not in str(info.value)


def test_a_yaml_error_names_the_place_not_the_line(tmp_path):
    """PyYAML's own message quotes the offending line, which may hold a secret."""
    path = tmp_path / "c.yaml"
    path.write_text("port: 8000\napi-key: s3cret: [\n")
    with pytest.raises(ServeArgsError) as info:
        rewrite(["m", "--config", str(path)])
    assert "mapping values are not allowed here (line 2, column 16)" in str(info.value) and "s3cret" not in str(info.value)


#: abbreviations vLLM's parser expands (argparse: a prefix only one option starts with)
ABBREVIATED = [
    (["m", "--tensor-parallel", "2"], 2),
    (["m", "--tensor_parallel=4"], 4),
    (["m", "--te", "8"], 8),
    (["m", "-t", "2"], 2),
]


@pytest.mark.parametrize("argv,tp", ABBREVIATED)
def test_an_abbreviated_tp_size_is_read_as_vllm_reads_it(argv, tp):
    """``--tensor-parallel 2`` was refused, saying the TP size was 1."""
    _, settings = rewrite([*argv, "--tp-comm", "echo"])
    assert settings.tensor_parallel_size == tp


def test_abbreviated_config_options_are_merged_not_passed_on():
    vllm_argv, settings = rewrite(["m", "-tp", "2", "--tp-comm", "echo", "--additional-con", '{"k": 1}',
                                   "--ad.echo_seed", "7", "--com", '{"mode": 3}', "-c.cudagraph_mode", "NONE",
                                   "--enf"])
    head, additional, compilation = split_tail(vllm_argv)
    assert head == ["m", "-tp", "2", "--enf"]
    assert additional == {"k": 1, "echo_seed": 7, "tp_comm": "echo"} and settings.echo.seed == 7
    assert compilation == {"mode": 3, "cudagraph_mode": "NONE", "pass_config": OFF}


def test_an_ambiguous_or_foreign_prefix_is_left_to_vllm():
    """``--no-en`` starts --no-enable-dbo and --no-enforce-eager (vLLM refuses
    it as ambiguous); ``--tensor`` is vLLM's to judge too."""
    from echo_vllm.server.rewrite import expand_abbreviation

    assert expand_abbreviation("--no-en") == "--no-en" and expand_abbreviation("--no-enf") == "--no-enforce-eager"
    assert expand_abbreviation("--t") == "--t" and expand_abbreviation("--ubatch") == "--ubatch-size"
    assert expand_abbreviation("--tensor-parallel-size-x") == "--tensor-parallel-size-x"


ECHO2 = ["-tp", "2", "--tp-comm", "echo"]


def test_one_key_twice_in_a_json_object_is_refused_but_a_later_option_replaces():
    with pytest.raises(ServeArgsError, match="--additional-config: the key 'echo_seed' is given twice, with "
                                             "different values"):
        rewrite(["m", *ECHO2, "--additional-config", '{"echo_seed": 1, "echo_seed": 2}'])
    _, settings = rewrite(["m", *ECHO2, "--additional-config", '{"echo_seed": 1, "echo_seed": 1}'])
    assert settings.echo.seed == 1  # the same value twice is one setting
    # two occurrences of the option: the later replaces the earlier (argparse's rule), in either spelling
    _, settings = rewrite(["m", *ECHO2, "--additional-config", '{"echo-seed": 1}', "--additional-config.echo_seed", "2"])
    assert settings.echo.seed == 2


# -- across hosts: vLLM's multi-node flags pass through; bad host settings are refused ---

MULTI_NODE = [
    # docs/multi-node.md's commands: node 0, node 1 (headless), Ray's head
    ["m", "--tp-comm", "echo", "-tp", "4", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
     "--master-port", "29501"],
    ["m", "--tp-comm", "echo", "-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
     "--master-port", "29501", "--headless"],
    ["m", "--tp-comm", "echo", "-tp", "4", "--distributed-executor-backend", "ray"],
    ["m", "--tp-comm", "echo", "-tp", "4", "-n", "2", "-r", "1", "--headless", "--echo-topology", "two_level"],
    ["m", "--tp-comm", "echo", "-tp", "8", "-pp", "2", "--nnodes=4", "--echo-topology=two_level"],
    ["m", "--tp-comm", "echo", "-tp", "4", "--distributed-executor-backend=ray", "--echo-host-map", "0,0,1,1",
     "--echo-topology", "two_level"],
    ["m", "--tp-comm", "echo", "-tp", "4", "--echo-host-map", "0,0,1,1"],  # hosts emulated on one node
]


@pytest.mark.parametrize("argv", MULTI_NODE)
def test_multi_node_flags_reach_vllm_unchanged(argv):
    vllm_argv, settings = rewrite(argv)
    kept, additional, _ = split_tail(vllm_argv)
    echo_flags = {i for i, token in enumerate(argv) if token.startswith(("--tp-comm", "--echo-"))}
    echo_values = {i + 1 for i in echo_flags if "=" not in argv[i]}
    assert kept == [t for i, t in enumerate(argv) if i not in echo_flags | echo_values]
    assert additional["tp_comm"] == "echo" and settings.echo is not None


HOST_REJECTS = [
    (["m", "--tp-comm", "echo", "-tp", "4", "--echo-host-map", "0,0,1"],
     "echo_host_map=0,0,1 names 3 ranks but the group has 4: give the host of every rank, in group-rank order "
     "(--tensor-parallel-size 4)"),
    (["m", "--tp-comm", "echo", "-tp", "4", "--echo-topology", "two_level"],
     "echo_topology='two_level' cannot run on this group: 1 host x 4 ranks: one host, nothing crosses the network "
     "(hosts from --nnodes and the parallel sizes); use echo_topology=auto or flat"),
    (["m", "--tp-comm", "echo", "-tp", "4", "--nnodes", "4", "--echo-topology", "two_level"],
     "4 hosts x 1 rank: one rank per host, two-level would be flat"),
    (["m", "--tp-comm", "echo", "-tp", "4", "--nnodes", "2", "--echo-host-map", "0,1,0,1"],
     "echo_host_map=0,1,0,1 puts the TP group's ranks on other hosts than the launch does: it runs them on "
     "nodes 0,0,1,1"),
    (["m", "--tp-comm", "echo", "-tp", "4", "--distributed-executor-backend", "ray", "--echo-topology",
      "two_level", "--echo-host-map", "0,0,0,1"], "2 hosts (3, 1 ranks): hosts of unequal size"),
    (["m", "--tp-comm", "echo", "-tp", "4", "--nnodes", "two"], "--nnodes 'two' is not an integer"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUT + HOST_REJECTS)
def test_bad_input_is_refused_before_vllm_starts(argv, message):
    """One line, before vLLM starts: bad values, and host settings the launch cannot run."""
    with pytest.raises(ServeArgsError) as info:
        rewrite(argv)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_launch_in_a_config_file_counts_too():
    files = {"nodes.yaml": {"nnodes": 2, "tensor-parallel-size": 4}}
    with pytest.raises(ServeArgsError, match="echo_host_map=0,1,0,1 puts the TP group's ranks"):
        rewrite(["m", "--config", "nodes.yaml", "--tp-comm", "echo", "--echo-host-map", "0,1,0,1"],
                read_config=files.__getitem__)
    rewrite(["m", "--config", "nodes.yaml", "--tp-comm", "echo", "--echo-host-map", "0,0,1,1"],
            read_config=files.__getitem__)
