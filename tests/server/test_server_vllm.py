"""The rewrite against vLLM's real ``vllm serve`` parser, and ``--help``.

One subprocess (vLLM's parser needs a platform; the CPU one is set there, not
in the test process) parses every row of a table with vLLM's own parser and
reports back as JSON; ~20 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (echo-vllm serve argv, the same intent for stock vLLM without Echo's flags)
ROWS = [
    (["m", "-tp", "4", "--tp-comm", "echo", "--port=8001", "--echo-group-size=64", "--no-echo-feedback"],
     ["m", "-tp", "4", "--port=8001"]),
    (["m", "--tp-comm=echo", "--echo-emulate-tp", "4", "--max_model_len=4k", "--gpu-memory-utilization", "0.3",
      "--additional-config", '{"user": 1}', "--additional-config.nested.k=2k", "-cc.mode", "3",
      "--compilation-config", '{"cudagraph_mode": "PIECEWISE"}', "-O3"],
     ["m", "--max_model_len=4k", "--gpu-memory-utilization", "0.3", "-O3"]),
    (["m", "--tensor_parallel_size=2", "--tp-comm", "echo", "--lora-modules", "a=/x", "--lora-modules", "b=/y",
      "--enable-lora", "--served-model-name", "x", "y", "--no-enable-dbo", "--echo-min-bytes", "1MiB"],
     ["m", "--tensor_parallel_size=2", "--lora-modules", "a=/x", "--lora-modules", "b=/y",
      "--enable-lora", "--served-model-name", "x", "y", "--no-enable-dbo"]),
]

SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    from echo_vllm.server import cli, vllm_serve
    from echo_vllm.server.rewrite import rewrite_args, verify_parsed, parse_dotted_value

    rows = json.loads(sys.argv[1])
    help_out = io.StringIO()
    with contextlib.redirect_stdout(help_out):
        help_rc = cli.main(["--help"])

    vllm_serve.ensure_platform_for_parsing()
    parser = vllm_serve.build_parser()
    report = {"help_rc": help_rc, "help": help_out.getvalue(), "rows": []}
    for argv, stock in rows:
        vllm_argv, settings = rewrite_args(argv)
        ours = parser.parse_args(["serve", *vllm_argv])
        plain = parser.parse_args(["serve", *stock])
        differing = sorted(k for k in vars(plain) if k not in ("additional_config", "compilation_config")
                           and getattr(plain, k) != getattr(ours, k))
        report["rows"].append({
            "problems": verify_parsed(ours, settings),
            "additional": ours.additional_config,
            "expected_additional": settings.additional_config,
            "pass_config": {k: getattr(ours.compilation_config.pass_config, k) for k in settings.bypass_passes},
            "mode": int(ours.compilation_config.mode) if ours.compilation_config.mode is not None else None,
            "cudagraph_mode": str(ours.compilation_config.cudagraph_mode),
            "differing_from_stock": differing,
        })
    # argparse accepts abbreviations: the scan misses them, verify_parsed must not
    vllm_argv, settings = rewrite_args(["m", "-tp", "2", "--tp-comm", "echo"])
    abbreviated = parser.parse_args(["serve", *vllm_argv, "--enable-db"])
    report["abbreviated"] = verify_parsed(abbreviated, settings)
    serve = parser._subparsers._group_actions[0].choices["serve"]
    options = [o for a in serve._actions for o in a.option_strings]
    report["n_options"] = len(options)
    report["collisions"] = [o for o in options if o.startswith(("--echo", "--no-echo", "--tp-comm"))]
    from vllm.utils.argparse_utils import human_readable_int
    report["human"] = [[t, human_readable_int(t), parse_dotted_value(t)] for t in ("2k", "2K", "25.6k", "3G", "7")]

    # the whole `echo-vllm serve` flow up to vLLM's dispatch (replaced: no GPU here)
    import os
    from vllm.entrypoints.cli.serve import ServeSubcommand
    dispatched = []
    def fake_cmd(args):
        from prometheus_client import values
        dispatched.append({"additional": args.additional_config, "port": args.port,
                           "multiproc_dir": os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
                           "value_class": values.ValueClass.__name__})
    real_cmd = ServeSubcommand.__dict__["cmd"]  # the staticmethod itself
    ServeSubcommand.cmd = staticmethod(fake_cmd)
    report["main_rc"] = cli.main(["m", "--tp-comm", "echo", "--echo-emulate-tp", "4", "--port", "8123"])
    report["dispatched"] = list(dispatched)
    report["multiproc_files"] = sorted(os.listdir(dispatched[0]["multiproc_dir"])) if dispatched else []
    report["main_rc_abbreviated"] = cli.main(["m", "-tp", "2", "--tp-comm", "echo", "--enable-db"])
    report["main_rc_rejected"] = cli.main(["m", "--tp-comm", "echo"])
    report["n_dispatched"] = len(dispatched)

    # secrets, every spelling: vLLM's real serve runs up to its argument log, then stops
    import logging
    for handler in logging.getLogger("vllm").handlers:  # made while --help's output was redirected
        handler.setStream(sys.stdout)
    from vllm.entrypoints.openai import api_server
    class Stop(Exception):
        pass
    reached = []
    def stop_after_the_log(args):
        reached.append({"api_key": args.api_key, "hf_token": args.hf_token,
                        "env": [os.environ.get("VLLM_API_KEY") == "sk-SECRET1",
                                os.environ.get("HF_TOKEN") == "hf_SECRET2"]})
        raise Stop()
    api_server.validate_api_server_args = stop_after_the_log
    from echo_vllm.vllm_glue import metrics
    metrics.publish_config = lambda labels, registry=None: None  # registered once per process, by the first run
    ServeSubcommand.cmd = real_cmd
    report["secret_runs"] = []
    echo = ["--tp-comm", "echo", "--echo-emulate-tp", "2"]
    for secret, extra in ((["--api-key", "sk-SECRET1"], []), (["--api-key=sk-SECRET1"], []),
                          (["--api_key", "sk-SECRET1"], []), (["--api-k", "sk-SECRET1"], []),
                          (["--hf-token", "hf_SECRET2"], []), (["--hf-token=hf_SECRET2"], []),
                          (["--hf_token", "hf_SECRET2"], []), (["--hf-tok=hf_SECRET2"], []),
                          (["--api-key", "sk-SECRET1"], echo), (["--hf-token=hf_SECRET2"], echo)):
        os.environ.pop("VLLM_API_KEY", None), os.environ.pop("HF_TOKEN", None)
        try:
            cli.main(["m", "--port", "8125", *secret, *extra])
            report["secret_runs"].append("not stopped")
        except Stop:
            report["secret_runs"].append(reached[-1])
    ServeSubcommand.cmd = staticmethod(fake_cmd)

    # the plugin would not run in vLLM's processes: an Echo run must not start as stock vLLM
    import echo_vllm.vllm_glue.plugin as plugin
    def refused(argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cli.main(argv)
        return rc, err.getvalue()
    echo_argv = ["m", "--tp-comm", "echo", "--echo-emulate-tp", "4"]
    os.environ["VLLM_PLUGINS"] = "other"
    report["vllm_plugins"] = refused(echo_argv)
    del os.environ["VLLM_PLUGINS"]
    plugin._problem = "vLLM 0.25.0 is older than 0.26 (simulated)"  # as a failed register() leaves it
    report["no_hook"] = refused(echo_argv)
    report["no_hook_nccl"] = refused(["m", "--port", "8124"])
    report["n_dispatched_after"] = len(dispatched)
    print("REPORT" + json.dumps(report, default=str))
""")


@pytest.fixture(scope="module")
def run():
    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(ROWS)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def report(run):
    # vLLM's serve prefixes every later line of the process with "(APIServer pid=N) "
    line = next(l for l in run.stdout.splitlines() if "REPORT{" in l)
    return json.loads(line.partition("REPORT")[2])


@pytest.mark.vllm
def test_vllm_parses_the_rewrite_as_decided(report):
    for (argv, _), row in zip(ROWS, report["rows"]):
        assert row["problems"] == [], argv
        assert row["additional"] == row["expected_additional"]
        assert set(row["pass_config"].values()) == {False}
        # every other setting is exactly what stock vLLM parses from the same flags
        assert row["differing_from_stock"] == [], argv
    second = report["rows"][1]
    assert second["additional"] == {"user": 1, "nested": {"k": 2000}, "tp_comm": "echo", "tp_comm_emulate": 4}
    assert second["mode"] == 3 and second["cudagraph_mode"].endswith("PIECEWISE")


@pytest.mark.vllm
def test_abbreviations_are_caught_after_parsing(report):
    assert report["abbreviated"] == ["enable_dbo is on"]


@pytest.mark.vllm
def test_echo_flags_do_not_collide_with_vllms(report):
    assert report["n_options"] > 100
    assert report["collisions"] == []


@pytest.mark.vllm
def test_dotted_values_match_vllms_own_parser(report):
    for text, vllm_value, ours in report["human"]:
        assert ours == vllm_value, text


@pytest.mark.vllm
def test_main_runs_vllm_serve_with_metrics_set_up(report):
    assert report["main_rc"] == 0
    (seen,) = report["dispatched"]
    assert seen["additional"] == {"tp_comm": "echo", "tp_comm_emulate": 4} and seen["port"] == 8123
    assert seen["multiproc_dir"] and seen["value_class"] == "MmapedValue"  # workers' values go to shared files
    assert any(f.startswith("gauge_mostrecent_") for f in report["multiproc_files"])  # echo:config_info
    assert report["main_rc_abbreviated"] == 2 and report["main_rc_rejected"] == 2
    assert report["n_dispatched"] == 1  # rejected command lines never reach vLLM


@pytest.mark.vllm
def test_help_shows_echo_then_vllm(report):
    text = report["help"]
    assert report["help_rc"] == 0
    assert text.index("--echo-group-size") < text.index("usage: vllm serve")
    assert "(default: 32)" in text and "Config Groups" in text


@pytest.mark.vllm
def test_an_echo_run_without_the_plugin_does_not_start(report):
    """If vLLM's processes would not run the plugin's hook, `--tp-comm echo`
    stops before vLLM starts, naming why; a run without Echo still starts."""
    rc, err = report["vllm_plugins"]
    assert rc == 2 and "VLLM_PLUGINS='other' does not list 'echo_vllm'" in err
    rc, err = report["no_hook"]
    assert rc == 2 and "--tp-comm echo --echo-emulate-tp 4 needs echo-vllm's vLLM plugin" in err
    assert "cannot install its hook: vLLM 0.25.0 is older than 0.26 (simulated)" in err
    assert report["no_hook_nccl"][0] == 0
    assert report["n_dispatched_after"] == report["n_dispatched"] + 1  # only the run without Echo


@pytest.mark.vllm
def test_no_secret_reaches_any_log(run, report):
    """``--api-key`` / ``--hf-token`` in every spelling (and with Echo on):
    vLLM's serve runs past parsing to its ``non-default args`` log
    line, and the whole output of the process (vLLM's logs, echo-vllm's
    lines) never holds the secret; vLLM got it through VLLM_API_KEY /
    HF_TOKEN instead."""
    log = run.stdout + run.stderr
    assert log.count("non-default args:") >= len(report["secret_runs"]) == 10
    assert "SECRET" not in log
    for seen in report["secret_runs"]:
        assert seen != "not stopped" and seen["api_key"] is None and seen["hf_token"] in (None, False)
        assert any(seen["env"])
