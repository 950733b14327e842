"""The rewrite against vLLM's real ``vllm serve`` parser, and ``--help``.

One subprocess (vLLM's parser needs a platform; the CPU one is set there, not
in the test process) parses every row of a table with vLLM's own parser and
reports back as JSON; ~20 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

# vLLM's own parser and engine start in subprocesses: CI's second tier
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: server/gpu_serve_check.sh's fixed KV cache (bytes), as the script passes it
SERVE_CHECK_KV = re.search(r"--kv-cache-memory-bytes (\d+)",
                           pathlib.Path(REPO, "server", "gpu_serve_check.sh").read_text()).group(1)

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
    # abbreviations, read by the rewrite as vLLM's parser reads them
    (["m", "--tensor-parallel", "2", "--tp-comm", "echo", "--ad.user", "1", "--enf", "--com", '{"mode": 0}'],
     ["m", "--tensor-parallel", "2", "--enf"]),
    # server/gpu_serve_check.sh's server (its fixed KV cache passes through to vLLM)
    (["m", "--tp-comm", "echo", "--echo-emulate-tp", "4", "--echo-min-bytes", "0", "--gpu-memory-utilization", "0.3",
      "--kv-cache-memory-bytes", SERVE_CHECK_KV, "--max-model-len", "1024", "--max-num-seqs", "64", "--echo-fuse-norm"],
     ["m", "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", SERVE_CHECK_KV, "--max-model-len", "1024",
      "--max-num-seqs", "64"]),
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
    report = {"help_rc": help_rc, "help": help_out.getvalue(), "rows": [], "no_device": vllm_serve._no_device}
    vllm_serve._no_device = False  # the runs below as on a GPU host (vLLM's dispatch is replaced)
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
            "kv_cache_memory_bytes": ours.kv_cache_memory_bytes,
        })
    # argparse accepts abbreviations: the scan misses them, verify_parsed must not
    vllm_argv, settings = rewrite_args(["m", "-tp", "2", "--tp-comm", "echo"])
    abbreviated = parser.parse_args(["serve", *vllm_argv, "--enable-db"])
    report["abbreviated"] = verify_parsed(abbreviated, settings)
    serve = parser._subparsers._group_actions[0].choices["serve"]
    options = [o for a in serve._actions for o in a.option_strings]
    report["n_options"] = len(options)
    report["collisions"] = [o for o in options if o.startswith(("--echo", "--no-echo", "--tp-comm"))]
    from echo_vllm.server.rewrite import SHORTEST_ABBREVIATION
    report["shortest"] = {o: next(o[:n] for n in range(2, len(o) + 1)
                                  if [x for x in options if x.startswith(o[:n])] == [o])
                          for o in SHORTEST_ABBREVIATION}
    from echo_vllm.server.credentials import looks_secret, misspelled_secret, secret_option
    report["secret_looking"] = sorted(o for o in options if looks_secret(o))
    report["secret_spellings"] = sorted({secret_option(o) for o in options} - {None})
    report["near_misses"] = [o for o in options if misspelled_secret(o)]
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

    # the user's folder: an earlier run's value file stays while vLLM parses and every check runs;
    # it is removed only once all have passed, right before the start (a refused run removes nothing)
    import tempfile
    from echo_vllm.vllm_glue import metrics
    metrics.publish_config = lambda labels, registry=None: None  # registered once per process, by the first run
    private_dir, user_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"], tempfile.mkdtemp()
    stale = os.path.join(user_dir, "counter_%d.db" % (2**22 + 12345))  # above pid_max: no such process
    real_prepare, seen_at_prepare = metrics.prepare_multiprocess_dir, []
    def prepare(remove_stale=True):
        if remove_stale:  # the removal, right before the start
            seen_at_prepare.append(sorted(os.listdir(user_dir)))  # nothing of this process's yet
        return real_prepare(remove_stale)
    metrics.prepare_multiprocess_dir = prepare
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = user_dir
    def user_run(argv):
        with open(stale, "w") as f:
            f.write("x")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # vLLM's parser refused
                rc = e.code
        return [rc, os.path.exists(stale), err.getvalue()]
    runs = report["user_dir_runs"] = {}
    runs["bad_flag"] = user_run(["m", "--tp-comm", "echo", "-tp", "2", "--max-model-len", "abc"])
    runs["abbreviated"] = user_run(["m", "-tp", "2", "--tp-comm", "echo", "--enable-db"])
    runs["unknown_secret"] = user_run(["m", "--tp-comm", "echo", "-tp", "2", "--auth-token", "sk-SECRET1"])
    runs["no_model"] = user_run(["/nonexistent/model", "--tp-comm", "echo", "-tp", "2"])
    vllm_serve._no_device = True
    runs["no_device"] = user_run(["m", "--tp-comm", "echo", "-tp", "2"])
    vllm_serve._no_device = False
    runs["started"] = user_run(["m", "--tp-comm", "echo", "-tp", "2", "--port", "8126"])
    report["seen_at_prepare"] = seen_at_prepare
    metrics.prepare_multiprocess_dir = real_prepare
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = private_dir
    report["n_dispatched_user_dir"] = len(dispatched)

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
    assert report["rows"][4]["kv_cache_memory_bytes"] == int(SERVE_CHECK_KV) > 0
    second = report["rows"][1]
    assert second["additional"] == {"user": 1, "nested": {"k": 2000}, "tp_comm": "echo", "tp_comm_emulate": 4}
    assert second["mode"] == 3 and second["cudagraph_mode"].endswith("PIECEWISE")


@pytest.mark.vllm
def test_abbreviations_are_caught_after_parsing(report):
    assert report["abbreviated"] == ["enable_dbo is on"]


@pytest.mark.vllm
def test_the_rewrite_expands_abbreviations_as_vllms_parser_does(report):
    """The table of shortest abbreviations is the installed parser's (a prefix
    only that option starts with), and vLLM parses an abbreviated command
    line as the rewrite read it (row 3)."""
    from echo_vllm.server.rewrite import SHORTEST_ABBREVIATION

    assert report["shortest"] == SHORTEST_ABBREVIATION
    row = report["rows"][3]
    assert row["additional"] == {"user": 1, "tp_comm": "echo"} and row["mode"] == 0


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
def test_a_users_stale_metric_files_are_removed_only_by_a_run_that_starts(report):
    """Refused by vLLM's parser, by verify_parsed, by the secret check or for
    want of a GPU: the earlier run's value file is still there. Kept while
    vLLM parsed, removed right before the start."""
    runs = report["user_dir_runs"]
    for name in ("bad_flag", "abbreviated", "unknown_secret", "no_device", "no_model"):
        rc, kept, err = runs[name]
        assert rc == 2 and kept and "removed" not in err, (name, err)
    assert "error: argument --max-model-len: invalid human_readable_int_or_auto value: 'abc'" in runs["bad_flag"][2]
    # --enable-db is --enable-dbo to vLLM's parser, and to the rewrite: refused by the guard rails
    assert "error: tp_comm=echo cannot run with --enable-dbo" in runs["abbreviated"][2]
    # a model path that does not exist: vLLM took it for a hub repo id and failed in a traceback
    assert runs["no_model"][2].startswith("echo-vllm serve: tp_comm=echo") and runs["no_model"][2].splitlines()[-1] \
        .startswith("echo-vllm serve: error: model '/nonexistent/model': no such file or folder, and not a Hugging")
    assert "error: --auth-token is not an option of vllm serve" in runs["unknown_secret"][2]
    assert "SECRET" not in runs["unknown_secret"][2]
    assert "error: no GPU: vLLM finds no accelerator on this host" in runs["no_device"][2]
    rc, kept, err = runs["started"]
    assert rc == 0 and not kept and "removed 1 prometheus_client value file(s) of an earlier run" in err
    # parsing wrote no value file of this process's into the folder (removing stale files then is safe)
    assert report["seen_at_prepare"] == [["counter_%d.db" % (2**22 + 12345)]]
    assert report["n_dispatched_user_dir"] == report["n_dispatched"] + 1


@pytest.mark.vllm
def test_only_vllms_secret_options_look_secret(report):
    """Of vLLM's own options, only --api-key and --hf-token look like secrets
    (their values hidden), and none is taken for a near miss of one."""
    assert report["secret_looking"] == ["--api-key", "--hf-token"]
    assert report["secret_spellings"] == ["--api-key", "--hf-token"]
    assert report["near_misses"] == []


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
    assert report["n_dispatched_after"] == report["n_dispatched_user_dir"] + 1  # only the run without Echo


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


#: ``echo-vllm serve`` as a user runs it on this (GPU-less) host: name ->
#: (argv, extra environment, whether PROMETHEUS_MULTIPROC_DIR holds an earlier run's file)
CPU_RUNS = {
    "bad_flag": (["m", "--tp-comm", "echo", "-tp", "2", "--max-model-len", "abc"], {}, True),
    "no_plugin": (["m", "--tp-comm", "echo", "-tp", "2"], {"VLLM_PLUGINS": "foo"}, True),
    "no_gpu_echo": (["m", "--tp-comm", "echo", "-tp", "2"], {}, True),
    "no_gpu_stock": (["m", "-tp", "2", "--api-key", "SECRETK1"], {}, False),
}
STALE = "counter_%d.db" % (2**22 + 12345)  # above Linux's pid_max: no such process


@pytest.fixture(scope="module")
def cpu_runs(report, tmp_path_factory):
    """Every row of :data:`CPU_RUNS` in its own process, all at once:
    name -> (exit status, stdout + stderr, whether the stale file is left)."""
    if not report["no_device"]:
        pytest.skip("this host has an accelerator")
    started = {}
    for name, (argv, extra, stale) in CPU_RUNS.items():
        folder = tmp_path_factory.mktemp(name)
        if stale:
            (folder / STALE).write_text("an earlier run's")
        env = dict(os.environ, PYTHONPATH=REPO, PROMETHEUS_MULTIPROC_DIR=str(folder), **extra)
        for name_ in ("VLLM_API_KEY", "HF_TOKEN", *(() if "VLLM_PLUGINS" in extra else ("VLLM_PLUGINS",))):
            env.pop(name_, None)
        proc = subprocess.Popen([sys.executable, "-m", "echo_vllm.cli", "serve", *argv], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started[name] = (proc, folder / STALE)
    done = {}
    for name, (proc, stale) in started.items():
        out, _ = proc.communicate(timeout=300)
        done[name] = (proc.returncode, out, stale.exists())
    return done


def _refusals(out):
    return [line for line in out.splitlines() if "error:" in line]


@pytest.mark.vllm
def test_on_a_host_without_gpu_serve_refuses_in_one_line(cpu_runs):
    """No traceback from vLLM's parser (it parses on the CPU platform): its
    own refusal of a bad flag, Echo's refusals, and with good arguments one
    line saying the GPU is missing. A refused run removes no file from
    PROMETHEUS_MULTIPROC_DIR. (Secrets: test_a_users_stale_metric_files...'s
    unknown_secret run, and test_server_cli.py.)"""
    for name, (rc, out, _) in cpu_runs.items():
        assert rc == 2 and "Traceback" not in out and len(_refusals(out)) == 1, (name, out[-3000:])
    assert "error: argument --max-model-len: invalid human_readable_int_or_auto value: 'abc'" in \
        _refusals(cpu_runs["bad_flag"][1])[0]
    assert "VLLM_PLUGINS='foo' does not list 'echo_vllm'" in _refusals(cpu_runs["no_plugin"][1])[0]
    for name in ("no_gpu_echo", "no_gpu_stock"):
        (line,) = _refusals(cpu_runs[name][1])
        assert line.startswith("echo-vllm serve: error: no GPU: vLLM finds no accelerator on this host"), line
    for name in ("bad_flag", "no_plugin", "no_gpu_echo"):
        rc, out, kept = cpu_runs[name]
        assert kept and "removed" not in out, name
    assert "SECRETK" not in cpu_runs["no_gpu_stock"][1]
