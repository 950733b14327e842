"""What ``echo-vllm serve`` checks and prepares before vLLM starts: secrets
taken off the command line (handed to vLLM through its environment), the
``ECHO_*`` variables, the Prometheus multiprocess folder (nothing of the
user's ever deleted). vLLM itself is replaced (no import)."""

from __future__ import annotations

import os

import pytest

from echo_vllm.server import cli, vllm_serve
from echo_vllm.server.credentials import (looks_secret, misspelled_secret, scrub, take_secrets,
                                          unknown_secret_option)
from echo_vllm.server.rewrite import ServeArgsError
from echo_vllm.vllm_glue import metrics

TAKEN = [
    (["m", "--api-key", "s3cret", "--port", "8000"], ["m", "--port", "8000"], {"VLLM_API_KEY": "s3cret"}),
    (["m", "--api-key=s3cret"], ["m"], {"VLLM_API_KEY": "s3cret"}),
    (["m", "--api_key", "s3cret", "-tp", "2"], ["m", "-tp", "2"], {"VLLM_API_KEY": "s3cret"}),
    (["m", "--api-key=-starts-with-dash"], ["m"], {"VLLM_API_KEY": "-starts-with-dash"}),
    (["--hf-token", "hf_x", "m"], ["m"], {"HF_TOKEN": "hf_x"}),
    (["m", "--hf_token=hf_x", "--hf-t", "hf_y"], ["m"], {"HF_TOKEN": "hf_y"}),
    # --hf-token alone: the stored login, no secret on the line
    (["m", "--hf-token", "hf_x", "--hf-token", "--seed", "1"], ["m", "--hf-token", "--seed", "1"], {}),
    # not secrets: other options sharing the first word (or a word), and plain tokens after "--"
    (["m", "--api-server-count", "2", "--hf-overrides", "{}", "--tokenizer", "t", "--", "x"],
     ["m", "--api-server-count", "2", "--hf-overrides", "{}", "--tokenizer", "t", "--", "x"], {}),
]


@pytest.mark.parametrize("argv,kept,env", TAKEN)
def test_secrets_leave_the_command_line_for_the_environment(argv, kept, env):
    assert take_secrets(argv) == (kept, env)


@pytest.mark.parametrize("argv,message", [
    (["m", "--api-key"], "--api-key needs a value"),
    (["m", "--api-key", "--port", "1"], "--api-key needs a value (write --api-key=VALUE"),
    (["m", "--api-key", "s3cretA", "s3cretB"],
     "--api-key takes exactly one value, got 2: echo-vllm serve hands the key to vLLM as VLLM_API_KEY"),
    # the model name after the key is not a second key: the message says where it goes
    (["--api-key", "s3cretA", "m"], "give one key (and the model name first: echo-vllm serve MODEL ... --api-key KEY)"),
    # repeated: VLLM_API_KEY holds one (argparse would silently keep the last)
    (["m", "--api-key", "s3cretA", "--api-key", "s3cretB"], "--api-key given more than once: echo-vllm serve"),
    (["m", "--api-k=s3cretA", "--port", "1", "--api_key", "s3cretB"], "--api_key given more than once"),
    (["m", "--api-key", "s3cretA", "--api-key", "s3cretA"], "--api-key given more than once"),
    # near misses of a secret option: vLLM's "unrecognized arguments" would print the value
    (["m", "--api-kye", "s3cret"], "--api-kye is not an option of vllm serve; did you mean --api-key?"),
    (["m", "--apikey=s3cret"], "--apikey is not an option of vllm serve; did you mean --api-key?"),
    (["m", "-api-key", "s3cret"], "-api-key is not an option of vllm serve; did you mean --api-key?"),
    (["m", "--api", "s3cret"], "--api is not an option of vllm serve; did you mean --api-key?"),
    (["m", "--hf-tokn", "s3cret"], "--hf-tokn is not an option of vllm serve; did you mean --hf-token?"),
    (["m", "--api-keys", "s3cret"], "--api-keys is not an option of vllm serve; did you mean --api-key?"),
    # after "--" every token is a positional argument: vLLM would refuse and print it
    (["m", "--", "--api-key", "s3cret"], "--api-key after '--': argparse reads every token after '--' as a positional"),
    (["m", "--", "--api-kye=s3cret"], "--api-kye after '--'"),
    (["m", "--", "--auth-token", "s3cret"], "--auth-token after '--'"),
    (["m", "--api-key="], "--api-key is empty (vLLM would then check no key at all)"),
    (["m", "--hf-token="], "--hf-token is empty: give a value or drop the option"),
])
def test_secret_options_refused(argv, message):
    with pytest.raises(ServeArgsError) as info:
        take_secrets(argv)
    assert message in str(info.value) and "\n" not in str(info.value) and "s3cret" not in str(info.value)


@pytest.mark.parametrize("name", ["--api-key", "--api_key", "--api-k", "--hf-token", "--hf-tok", "--api-kye",
                                  "--apikey", "-api-key", "--hf-tokn", "--auth-token", "--password",
                                  "--my-secret", "--ssl-key", "--API-KEY"])
def test_what_looks_secret(name):
    assert looks_secret(name)


@pytest.mark.parametrize("name", ["--api-server-count", "--hf-overrides", "--hf-config-path", "--tokenizer",
                                  "--tokenizer-mode", "--max-num-batched-tokens", "--dbo-decode-token-threshold",
                                  "--return-tokens-as-token-ids", "--ssl-keyfile", "--allow-credentials",
                                  "--port", "-tp", "-O3", "--", "-", "m", "api-key"])
def test_what_does_not_look_secret(name):
    assert not looks_secret(name) and misspelled_secret(name) is None


@pytest.mark.parametrize("argv,shown", [
    (["m", "--auth-token", "s3cret", "--port", "8000"], ["m", "--auth-token", "***", "--port", "8000"]),
    (["m", "--my_password=s3cret"], ["m", "--my_password=***"]),
    (["m", "--x-key", "s3cretA", "s3cretB", "-tp", "2"], ["m", "--x-key", "***", "***", "-tp", "2"]),
    (["m", "--", "--api-key", "s3cret"], ["m", "--", "--api-key", "***"]),
    (["m", "--hf-token", "--tokenizer", "t"], ["m", "--hf-token", "--tokenizer", "t"]),
    (["m", "--otlp-traces-endpoint", "http://bob:hunter2@collector:4317/v1"],
     ["m", "--otlp-traces-endpoint", "http://bob:***@collector:4317/v1"]),
    (["m", "--otlp-traces-endpoint=https://:hunter2@c", "--x", "git+ssh://u:p%40ss@h/r@v1"],
     ["m", "--otlp-traces-endpoint=https://:***@c", "--x", "git+ssh://u:***@h/r@v1"]),
    (["m", "--served-model-name", "user@example", "http://bob@h:80/a:b@c"],
     ["m", "--served-model-name", "user@example", "http://bob@h:80/a:b@c"]),
    # a secret-looking key of --additional-config, as JSON or dotted, was printed in clear
    (["m", "--additional-config", '{"hf_token": "s3cret", "p": {"api-key": "s3cret"}, "echo_seed": 1}'],
     ["m", "--additional-config", '{"hf_token": "***", "p": {"api-key": "***"}, "echo_seed": 1}']),
    (["m", "--additional-config.plugin.api_key", "s3cret", "--additional-config.echo_seed=1"],
     ["m", "--additional-config.plugin.api_key", "***", "--additional-config.echo_seed=1"]),
])
def test_the_printed_command_line_hides_secret_values(argv, shown):
    assert scrub(argv) == shown


def test_unknown_secret_options_against_a_parsers_options():
    known = {"--api-key", "--hf-token", "--tokenizer", "--port", "--hf-overrides"}
    assert unknown_secret_option(["m", "--api-key", "k", "--hf_token=t", "--port", "1"], known) is None
    assert unknown_secret_option(["m", "--api-k", "k", "--hf-to", "t"], known) is None  # abbreviations
    assert unknown_secret_option(["m", "--auth-token", "s3cret"], known) == "--auth-token"
    assert unknown_secret_option(["m", "--my_secret=s3cret"], known) == "--my-secret"
    assert unknown_secret_option(["m", "--", "--auth-token", "s3cret"], known) is None  # take_secrets' case


@pytest.fixture
def served(monkeypatch, tmp_path):
    """Run ``cli.main``; vLLM's serve replaced by a recorder of what it saw.
    The multiprocess directory is ``tmp_path`` (restored afterwards, like
    the client's value class, which prepare_multiprocess_dir switches, and
    the secrets' variables, which main sets for vLLM)."""
    from prometheus_client import values

    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    monkeypatch.setenv(metrics.MULTIPROC_ENV, str(tmp_path))
    for name in ("VLLM_API_KEY", "HF_TOKEN", "ECHO_KERNELS", cli.RAY_PREFIXES_VAR, cli.RAY_NAMES_VAR):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    seen = []

    def fake_serve(vllm_argv, settings, on_ready=None):
        path = os.environ.get(metrics.MULTIPROC_ENV)
        before = sorted(os.listdir(path)) if path and os.path.isdir(path) else None
        if on_ready is not None:  # every check passed: the start of the server
            monkeypatch.setattr(metrics, "publish_config", lambda labels: None)
            on_ready(None)
        seen.append({"argv": vllm_argv, "files_before": before,
                     "files": sorted(os.listdir(path)) if path else None,
                     "api_key": os.environ.get("VLLM_API_KEY"), "hf_token": os.environ.get("HF_TOKEN"),
                     "ray_copy": {v: os.environ.get(v) for v in (cli.RAY_PREFIXES_VAR, cli.RAY_NAMES_VAR)}})
        return 0

    monkeypatch.setattr(vllm_serve, "serve", fake_serve)
    return seen


ECHO = ["--tp-comm", "echo", "--echo-emulate-tp", "2"]


@pytest.mark.parametrize("secret", [["--api-key", "s3cret"], ["--api-key=s3cret"], ["--api_key", "s3cret"],
                                    ["--api-k", "s3cret"], ["--hf-token", "s3cret"], ["--hf_token=s3cret"]])
def test_no_secret_in_what_serve_prints_or_hands_vllm_as_arguments(served, capsys, secret):
    """The full start of a serve on CPU with vLLM's parser and argument log
    is tests/server/test_server_vllm.py's; here every spelling, both modes."""
    for extra in ([], ECHO):
        assert cli.main(["m", *secret, "--port", "8000", *extra]) == 0
        err = capsys.readouterr().err
        assert "running: vllm serve m --port 8000" in err and "s3cret" not in err
        assert "set from the command line (handed to vLLM through the environment" in err
        got = served[-1]
        assert "s3cret" not in " ".join(got["argv"])
        assert "s3cret" in (got["api_key"], got["hf_token"])  # vLLM reads it from there


@pytest.mark.parametrize("argv,start", [
    (["m", "--api-key", "SECRETK1", "SECRETK2"], "--api-key takes exactly one value, got 2"),
    (["--api-key", "SECRETK1", "m"], "--api-key takes exactly one value, got 2"),
    (["m", "--api-key", "SECRETK1", "--api-key", "SECRETK2"], "--api-key given more than once"),
    (["m", "--api-kye", "SECRETK1"], "--api-kye is not an option of vllm serve; did you mean --api-key?"),
    (["m", "--", "--api-key", "SECRETK1"], "--api-key after '--'"),
])
def test_a_refused_secret_stops_before_vllm(served, capsys, argv, start):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"echo-vllm serve: error: {start}") and not served
    assert "SECRETK" not in out + err


def test_a_secret_looking_option_is_shown_hidden(served, capsys):
    """An option vLLM may not know (refused by vllm_serve before vLLM's parser
    sees it): the printed command line never holds its value."""
    assert cli.main(["m", "--auth-token", "SECRETK1", "--port", "8000"]) == 0
    out, err = capsys.readouterr()
    assert "running: vllm serve m --auth-token '***' --port 8000" in err and "SECRETK" not in out + err


def test_a_user_folder_of_user_files_is_refused_and_kept(served, capsys, tmp_path):
    (tmp_path / "customers.db").write_text("precious")
    (tmp_path / "counter_123.db").write_text("x")
    assert cli.main(["m", *ECHO]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: PROMETHEUS_MULTIPROC_DIR=" in err and "customers.db" in err
    assert (tmp_path / "customers.db").read_text() == "precious" and (tmp_path / "counter_123.db").exists()
    assert not served


def test_an_earlier_runs_value_files_are_removed(served, capsys, tmp_path):
    dead = 2**22 + 12345  # above Linux's pid_max default: no such process
    names = [f"counter_{dead}.db", f"gauge_livemostrecent_{dead}.db", f"histogram_{os.getpid()}.db"]
    for name in names:
        (tmp_path / name).write_text("x")
    assert cli.main(["m", *ECHO]) == 0
    assert served[-1]["files_before"] == sorted(names)  # kept while vLLM parses (it may still refuse)
    assert served[-1]["files"] == []  # gone once every check passed, before vLLM started
    assert "removed 3 prometheus_client value file(s) of an earlier run" in capsys.readouterr().err
    assert cli.main(["m", *ECHO]) == 0  # nothing stale, nothing said
    assert "removed" not in capsys.readouterr().err


def test_another_running_servers_files_are_refused(served, capsys, tmp_path):
    (tmp_path / f"counter_{os.getppid()}.db").write_text("x")
    assert cli.main(["m", *ECHO]) == 2
    assert f"metric files of running process(es) [{os.getppid()}]" in capsys.readouterr().err
    assert (tmp_path / f"counter_{os.getppid()}.db").exists()


@pytest.mark.parametrize("where", ["/proc/echo-vllm-x", "file", "file/sub"])
def test_an_unusable_folder_is_refused_in_one_line(served, capsys, monkeypatch, tmp_path, where):
    (tmp_path / "file").write_text("mine")
    path = where if where.startswith("/") else str(tmp_path / where)
    monkeypatch.setenv(metrics.MULTIPROC_ENV, path)
    assert cli.main(["m", *ECHO]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: PROMETHEUS_MULTIPROC_DIR={path}" in err and not served
    assert (tmp_path / "file").read_text() == "mine"


def test_stock_vllm_leaves_the_directory_alone(served, tmp_path):
    """--tp-comm nccl is vLLM as is: its multiprocess rules are vLLM's."""
    (tmp_path / "counter_1.db").write_text("x")
    (tmp_path / "customers.db").write_text("x")
    assert cli.main(["m"]) == 0
    assert served[-1]["files"] == ["counter_1.db", "customers.db"]


def test_echo_variables_are_checked_before_vllm_starts(served, capsys, monkeypatch):
    monkeypatch.setenv("ECHO_KERNELS", "trition")
    assert cli.main(["m", *ECHO]) == 2
    assert capsys.readouterr().err == ("echo-vllm serve: error: ECHO_KERNELS='trition': choose one of auto, "
                                       "reference, triton, numba; did you mean 'triton'?\n")
    assert cli.main(["m"]) == 0  # stock vLLM never reads them
    monkeypatch.setenv("ECHO_KERNELS", "numba")
    monkeypatch.setenv("ECHO_KERNEL", "numba")
    assert cli.main(["m", *ECHO]) == 0
    assert "warning: ECHO_KERNEL is not a variable echo-vllm reads; did you mean 'ECHO_KERNELS'?" in \
        capsys.readouterr().err


def test_settings_that_idle_echo_warn(served, capsys):
    assert cli.main(["m", *ECHO, "--echo-min-bytes", "2G"]) == 0
    assert "warning: min_bytes=2147483648 (2 GiB): only messages at least this large take Echo" in \
        capsys.readouterr().err
    assert cli.main(["m", *ECHO, "--echo-min-bytes", "99999999999999999999T"]) == 2
    assert "must be at most 4611686018427387904 (2^62: byte counts stay int64" in capsys.readouterr().err


#: (argv, the start of the one refusal): secrets by routes other than --api-key / --hf-token,
#: which vLLM would print (banner, "non-default args", errors); never passed on, never shown
SECRET_ROUTES = [
    (["m", "\u2013api-key", "SECRETK1"], "'\u2013api-key' begins with '\u2013' (U+2013 EN DASH)"),
    (["m", "\u2014api-key=SECRETK1"], "'\u2014api-key' begins with '\u2014' (U+2014 EM DASH)"),
    (["m", "\uff0d\uff0dapi-key", "SECRETK1"], "'\uff0d\uff0dapi-key' begins with '\uff0d' (U+FF0D FULLWIDTH"),
    (["m", "\u2212\u2212hf-token=SECRETK1"], "(U+2212 MINUS SIGN), which only looks like '-'"),
    (["m", "--hf\u2010token", "SECRETK1"], "--hf\u2010token is not an option of vllm serve; did you mean --hf-token?"),
    (["m", "--port\u2010x", "SECRETK1"], "'--port\u2010x' holds '\u2010' (U+2010 HYPHEN)"),
    (["m", "--", "\u2013api-key", "SECRETK1"], "(U+2013 EN DASH)"),
    # a key that begins with a look-alike dash is not shown by the look-alike's refusal
    (["m", "--api-key", "\u2013SECRETK1"], "--api-key needs a value (write --api-key=VALUE"),
    (["m", "--hf-token", "\u2013\u2013port", "8000"], "'\u2013\u2013port' begins with '\u2013' (U+2013 EN DASH)"),
    (["m", "--additional-config", '{"hf_token": "SECRETK1"}'], "--additional-config holds the key hf_token, "
                                                               "which looks like a secret: vLLM prints every argument"),
    (["m", "--additional-config={\"p\": {\"q\": [{\"api_key\": \"SECRETK1\"}]}}"],
     "--additional-config holds the key p.q[0].api_key"),
    (["m", *ECHO, "--additional-config", '{"plugin": {"password": "SECRETK1"}}'], "holds the key plugin.password"),
    (["m", "--additional-config.plugin.api_key", "SECRETK1"], "--additional-config holds the key plugin.api_key"),
    (["m", "-cc.x.my_secret=SECRETK1"], "-cc holds the key x.my_secret"),
    (["m", "--hf-overrides", '{"auth": {"token": "SECRETK1"}}'], "--hf-overrides holds the key auth.token"),
    (["https://bob:SECRETK1@example.com/org/model", "--port", "8000"],
     "the model (a positional argument) holds a URL with a password"),
    (["m", "--", '{"api_key": "SECRETK1"}'], "the model (a positional argument) holds the key api_key"),
    (["--model", "https://bob:SECRETK1@example.com/m"], "--model holds a URL with a password"),
    (["m", "--otlp-traces-endpoint=http://bob:SECRETK1@c:4317"], "--otlp-traces-endpoint holds a URL with a password"),
    (["m", "--additional-config", '{"u": "s3://k:SECRETK1@b/x"}'], "--additional-config holds a URL with a password "
                                                                  "at u"),
    # bounded JSON (vLLM's own reading ended in a traceback) and one key twice (the last won silently)
    (["m", "--additional-config", "[" * 5000 + "]" * 5000], "--additional-config: nested more than 64 levels deep"),
    (["m", "--additional-config", '{"x": ' + "9" * 5000 + "}"], "--additional-config: an integer of 5000 digits"),
    (["m", *ECHO, "--additional-config", '{"echo_seed": 1, "echo_seed": 2}'],
     "--additional-config: the key 'echo_seed' is given twice, with different values"),
    (["m", *ECHO, "--additional-config", '{"echo_group_size": 64, "echo-group-size": 32}'],
     "--additional-config: 'echo_group_size' and 'echo-group-size' are one option"),
    # no JSON (cut short), but what vLLM's error would print holds a secret-looking key
    (["m", "--additional-config", '{"api_key": "SECRETK1"'], "--additional-config holds the key api_key"),
    (["m", "--hf-overrides", "{'token': 'SECRETK1'}"], "--hf-overrides holds the key token"),
]


@pytest.mark.parametrize("argv,start", SECRET_ROUTES, ids=[str(i) for i in range(len(SECRET_ROUTES))])
def test_a_secret_by_another_route_is_refused_unshown(served, capsys, argv, start):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    if "SECRETK1" in " ".join(argv) and rc == 0:  # passed: then neither printed nor handed over
        pytest.fail(f"passed on: {served[-1]['argv']}")
    assert rc == 2 and err.count("\n") == 1 and err.startswith("echo-vllm serve: error: ") and start in err, err
    assert "SECRETK" not in out + err and not served


def test_a_json_value_that_is_not_json_shows_no_text(served, capsys):
    assert cli.main(["m", *ECHO, "--additional-config", '{"seed": SECRETK1}']) == 2
    err = capsys.readouterr().err
    assert "--additional-config is not valid JSON (Expecting value at character 9)" in err and "SECRETK" not in err


@pytest.mark.parametrize("value", ["{dir} ", " {dir}", "{dir}\t"])
def test_a_multiprocess_folder_with_a_space_at_an_end_is_refused(served, capsys, monkeypatch, tmp_path, value):
    """The space made a new folder (``'dir '``) silently: refused, naming the value; nothing is made."""
    path = value.format(dir=tmp_path / "metrics")
    monkeypatch.setenv(metrics.MULTIPROC_ENV, path)
    assert cli.main(["m", *ECHO]) == 2
    err = capsys.readouterr().err
    assert err == (f"echo-vllm serve: error: PROMETHEUS_MULTIPROC_DIR={path!r}: begins or ends with a space "
                   "(a relative path, made in the current folder)\n")
    assert os.listdir(tmp_path) == [] and not served


def test_a_multiprocess_folder_under_a_quoted_tilde_is_the_home_folder(served, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(metrics.MULTIPROC_ENV, "~/metrics")
    assert cli.main(["m", *ECHO]) == 0
    assert os.environ[metrics.MULTIPROC_ENV] == str(tmp_path / "metrics") and (tmp_path / "metrics").is_dir()


def test_ray_workers_are_given_echos_variables(served, monkeypatch):
    """vLLM's Ray executor copies only its own prefixes to its workers:
    with Echo on, serve adds Echo's (keeping what the user listed); stock
    vLLM is left alone."""
    monkeypatch.setenv(cli.RAY_NAMES_VAR, "MY_VAR, PROMETHEUS_MULTIPROC_DIR")
    assert cli.main(["m", "-tp", "2", "--tp-comm", "echo", "--distributed-executor-backend", "ray"]) == 0
    assert served[-1]["ray_copy"] == {cli.RAY_PREFIXES_VAR: "ECHO_",
                                      cli.RAY_NAMES_VAR: "MY_VAR,PROMETHEUS_MULTIPROC_DIR,TRITON_INTERPRET"}
    monkeypatch.delenv(cli.RAY_NAMES_VAR)
    monkeypatch.delenv(cli.RAY_PREFIXES_VAR)
    assert cli.main(["m", "-tp", "2", "--distributed-executor-backend", "ray"]) == 0
    assert served[-1]["ray_copy"] == {cli.RAY_PREFIXES_VAR: None, cli.RAY_NAMES_VAR: None}
