"""Dockerfile, compose and Docker script checks that need no Docker engine.

CI has no engine, so the image is not built here (docker/build_and_smoke.sh
builds and smoke-tests it by hand; docker/README.md records the run). These
check that the compose file parses and means what it says (TP=4 Echo,
published on loopback unless an API key is set, BASE and GIT_COMMIT passed
to the build), that the entrypoint is this package's console script, that
the base image is the vLLM version we pin, that the build context holds
what the Dockerfile copies, that the image runs as a non-root user, has a
HEALTHCHECK whose command really tells a /health 200 from anything else,
OCI labels with the pyproject version and the commit, and that its install
step leaves no build/ or *.egg-info (the step itself is run here, with a
fake installer); and that the Docker scripts parse, answer --help and stop
when the base image or the build fails, all without an engine.
"""

from __future__ import annotations

import fnmatch
import http.server
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from echo_vllm.cli import SUBCOMMANDS
from echo_vllm.server.rewrite import rewrite_args

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
SCRIPTS = sorted(DOCKER.glob("*.sh"))
yaml = pytest.importorskip("yaml")


def dockerfile_instructions(path: Path = REPO / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stage() -> list[tuple[str, str]]:
    """The instructions after FROM (the build stage: its ARGs are the ones RUN and LABEL see)."""
    instructions = dockerfile_instructions()
    words = [word for word, _ in instructions]
    assert words.count("FROM") == 1
    return instructions[words.index("FROM") + 1:]


def stage_args() -> dict[str, str | None]:
    """ARG NAME[=default] of the build stage."""
    out = {}
    for word, args in stage():
        if word == "ARG":
            name, eq, default = args.partition("=")
            out[name] = default if eq else None
    return out


def key_values(instruction: str) -> dict[str, str]:
    """The KEY=value pairs of every ``instruction`` (LABEL, ENV) of the build stage."""
    out = {}
    for word, args in stage():
        if word == instruction:
            for pair in shlex.split(args):
                key, eq, value = pair.partition("=")
                assert eq, f"{instruction} {pair!r}: use the KEY=value form"
                out[key] = value
    return out


def labels() -> dict[str, str]:
    return key_values("LABEL")


def env() -> dict[str, str]:
    return key_values("ENV")


def install_run() -> tuple[int, str]:
    """(index in stage(), shell script) of the RUN that installs echo-vllm."""
    runs = [(i, args) for i, (word, args) in enumerate(stage()) if word == "RUN" and "--constraint /tmp/keep.txt ." in args]
    assert len(runs) == 1, runs
    return runs[0]


def project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def pinned_vllm() -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {m.group(1) for extra in project["optional-dependencies"].values() for req in extra
            if (m := re.fullmatch(r"vllm\s*==\s*([\w.]+)", req.strip()))}
    assert len(pins) == 1, f"expected exactly one vllm==X pin in pyproject extras, got {pins}"
    return pins.pop()


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation for the forms these files use: ${VAR:-default}, $$."""
    assert not re.search(r"\$(?!\$|\{\w+:-[^}]*\})", text.replace("$$", "")), f"unhandled $ in {text!r}"
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)
    return text.replace("$$", "$")


# --- Dockerfile ---------------------------------------------------------------

def test_base_image_is_an_arg_defaulting_to_the_pinned_vllm():
    instructions = dockerfile_instructions()
    # ARG before FROM: the only kind of ARG a FROM line can use
    assert instructions[0] == ("ARG", f"BASE=vllm/vllm-openai:v{pinned_vllm()}")
    assert [args for word, args in instructions if word == "FROM"] == ["${BASE}"]


def test_entrypoint_is_the_installed_console_script():
    entry = [json.loads(args) for word, args in dockerfile_instructions() if word == "ENTRYPOINT"]
    assert entry == [["echo-vllm", "serve"]]
    script, subcommand = entry[0]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[script] == "echo_vllm.cli:main"
    installed = importlib.metadata.entry_points(group="console_scripts", name=script)
    assert [e.value for e in installed] == ["echo_vllm.cli:main"]
    assert subcommand in SUBCOMMANDS


def test_image_installs_this_package_and_keeps_vllm():
    instructions = dockerfile_instructions()
    copied = " ".join(args for word, args in instructions if word == "COPY")
    for path in ("pyproject.toml", "README.md", "echo_vllm"):
        assert path in copied
    run = " ".join(args for word, args in instructions if word == "RUN")
    # torch / triton / vllm pinned to what the image has, then the plugin entry point checked
    assert "--constraint /tmp/keep.txt ." in run and "(torch|triton|vllm|numpy)==" in run
    assert "vllm.general_plugins" in run and "command -v echo-vllm" in run


def test_every_variable_the_stage_uses_is_declared_in_it():
    # an ARG declared only before FROM is empty after it: RUN and LABEL would see ""
    declared = set(stage_args()) | set(env())
    for word, args in stage():
        if word in ("RUN", "LABEL", "ENV", "WORKDIR", "USER"):
            for name in re.findall(r"\$\{(\w+)\}", args):
                assert name in declared, f"{word} uses ${{{name}}}, not declared after FROM"


def test_runs_as_a_non_root_user():
    instructions = stage()
    users = [(i, args) for i, (word, args) in enumerate(instructions) if word == "USER"]
    assert len(users) == 1, users
    at, user = users[0]
    uid, _, gid = user.partition(":")
    # numeric, so Kubernetes' runAsNonRoot can check it; not root by name or number
    assert uid.isdigit() and gid.isdigit() and int(uid) != 0 and int(gid) != 0, user
    # installs run as root before it; nothing after it switches back
    assert at > install_run()[0]
    assert all(word != "RUN" for word, _ in instructions[at:])
    made = " ".join(args for word, args in instructions[:at] if word == "RUN")
    assert f"groupadd --gid {gid} " in made and f"useradd --uid {uid} --gid {gid} " in made
    home = env()["HOME"]
    assert f"--home-dir {home} " in made and f"chown -R {uid}:{gid} {home}" in made
    assert env()["HF_HOME"].startswith(home + "/"), "the model cache must be the user's, writable"
    workdirs = [args for word, args in instructions[at:] if word == "WORKDIR"]
    assert workdirs == [home], "after USER, work where the user can write (the demo writes out/)"


def healthcheck() -> tuple[dict[str, str], list[str]]:
    checks = [args for word, args in stage() if word == "HEALTHCHECK"]
    assert len(checks) == 1, checks
    options, cmd, command = checks[0].partition(" CMD ")
    assert cmd, "HEALTHCHECK NONE or without CMD"
    opts = dict(opt.lstrip("-").split("=", 1) for opt in options.split())
    return opts, json.loads(command)


def seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)([smh])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_healthcheck_asks_health_with_a_long_start_period(service):
    opts, command = healthcheck()
    # options Docker 20.10 knows (--start-interval is 25+), and a start period
    # long enough for a model to download, compile and capture graphs
    assert set(opts) == {"interval", "timeout", "start-period", "retries"}, opts
    assert seconds(opts["start-period"]) >= 10 * 60
    assert seconds(opts["timeout"]) < seconds(opts["interval"]) and int(opts["retries"]) >= 1
    assert command[:2] == ["python3", "-c"] and len(command) == 3 and "/health" in command[2]
    # the port it asks by default is the one the server listens on in compose
    # (and vLLM's default)
    assert env()["ECHO_HEALTH_PORT"] == "8000" and "--port=8000" in service["command"]
    assert "'ECHO_HEALTH_PORT', '8000'" in command[2]


class HealthServer(http.server.BaseHTTPRequestHandler):
    status = {"/health": 200}

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status.get(self.path, 404))
        self.end_headers()

    def log_message(self, *args):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("health, healthy", [(200, True), (503, False), (None, False)])
def test_healthcheck_command_tells_a_healthy_server(health, healthy):
    """The HEALTHCHECK's own command, run here against a stand-in server."""
    _, command = healthcheck()
    port = free_port()
    server = None
    if health is not None:
        handler = type("H", (HealthServer,), {"status": {"/health": health}})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = subprocess.run([sys.executable, *command[1:]], env={**os.environ, "ECHO_HEALTH_PORT": str(port)},
                             capture_output=True, text=True, timeout=30)
    finally:
        if server:
            server.shutdown()
            server.server_close()
    assert (out.returncode == 0) == healthy, out.stderr


def test_oci_labels_carry_version_and_commit():
    found = labels()
    args = stage_args()
    assert found["org.opencontainers.image.title"] == "echo-vllm"
    assert found["org.opencontainers.image.version"] == "${ECHO_VERSION}"
    assert args["ECHO_VERSION"] == project_version()
    assert found["org.opencontainers.image.revision"] == "${GIT_COMMIT}" and "GIT_COMMIT" in args
    assert found["org.opencontainers.image.source"] == "${SOURCE_URL}" and "SOURCE_URL" in args
    assert found["org.opencontainers.image.base.name"] == "${BASE}" and "BASE" in args
    assert found["org.opencontainers.image.licenses"] == "Apache-2.0"
    # the install step checks the installed version is the one the label says
    assert '"$ECHO_VERSION"' in install_run()[1] and "m.version('echo-vllm')" in install_run()[1]
    # the commit changes every build: declared after the install, so it does not rebuild it
    where = [i for i, (word, a) in enumerate(stage()) if word == "ARG" and a.startswith("GIT_COMMIT")]
    assert where[0] > install_run()[0]
    smoke = (DOCKER / "build_and_smoke.sh").read_text()
    assert '--build-arg GIT_COMMIT="$GIT_COMMIT"' in smoke and '--build-arg ECHO_VERSION="$VERSION"' in smoke


FAKE_INSTALLER = """#!/bin/sh
# stands in for uv / pip: freeze prints pins, install leaves what setuptools leaves
log={log}
case "$*" in
  *freeze*) printf 'numpy==2.3.5\\nsix==1.16.0\\ntorch==2.11.0\\ntriton==3.6.0\\n{vllm}' ;;
  *install*)
    echo "$*" >> "$log"
    for a in "$@"; do case $prev in --constraint) {cat} "$a" >> "$log" ;; esac; prev=$a; done
    {mkdir} -p build/lib/echo_vllm echo_vllm.egg-info {extra}
    : > echo_vllm.egg-info/PKG-INFO ;;
  *) echo "fake installer: unexpected $*" >&2; exit 3 ;;
esac
"""


def run_install_step(tmp_path: Path, branch: str, vllm: str = "vllm==0.26.0\\n", extra: str = ""):
    """The Dockerfile's install RUN, run by /bin/sh in tmp_path/src, on a PATH of
    fakes and a few plain tools only (so it cannot install or touch anything)."""
    _, script = install_run()
    assert not re.search(r"(?<![\w.$])/(usr|bin|sbin|etc|opt|home|root|var|tmp)\b", script.replace("/tmp/keep.txt", "")), \
        "the install step names an absolute path: refusing to run it on this machine"
    keep = tmp_path / "keep.txt"
    script = script.replace("/tmp/keep.txt", str(keep))
    bin_dir, src, log = tmp_path / "bin", tmp_path / "src", tmp_path / "install.log"
    bin_dir.mkdir()
    src.mkdir()
    for tool in ("grep", "rm", "find"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    fake = FAKE_INSTALLER.format(log=log, vllm=vllm, extra=extra, cat=shutil.which("cat"), mkdir=shutil.which("mkdir"))
    python3 = f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; exec {bin_dir}/pip "$@"; fi\nexec {sys.executable} "$@"\n'
    tools = {"pip": fake, "python3": python3, "echo-vllm": "#!/bin/sh\n"}
    if branch == "uv":
        tools["uv"] = fake
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run_env = {"PATH": str(bin_dir), "ECHO_VERSION": project_version(), "HOME": str(tmp_path)}
    out = subprocess.run(["/bin/sh", "-c", script], cwd=src, env=run_env, capture_output=True, text=True, timeout=60)
    return out, src, log


@pytest.mark.parametrize("branch", ["uv", "pip"])
def test_install_step_leaves_no_build_leftovers(tmp_path, branch):
    out, src, log = run_install_step(tmp_path, branch)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in src.iterdir()) == [], "build/ or *.egg-info left in /opt/echo-vllm"
    installed = log.read_text().splitlines()
    command = installed[0].split()
    # a regular install of ".", not editable, held to the base's pins (six is not one)
    assert command[-1] == "." and "-e" not in command and "--editable" not in command
    assert ("--system" in command) == (branch == "uv")
    assert installed[1:] == ["numpy==2.3.5", "torch==2.11.0", "triton==3.6.0", "vllm==0.26.0"]
    assert not (tmp_path / "keep.txt").exists()


def test_install_step_fails_on_a_leftover_it_cannot_remove(tmp_path):
    out, src, _ = run_install_step(tmp_path, "uv", extra="echo_vllm/sub/build")
    assert out.returncode != 0 and "build leftovers in" in out.stderr and "sub/build" in out.stderr


def test_install_step_needs_vllm_in_the_base(tmp_path):
    out, _, log = run_install_step(tmp_path, "pip", vllm="")
    assert out.returncode != 0 and not log.exists()


def dockerignored(path: str, rules: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for rule in rules:
        keep, pattern = rule.startswith("!"), rule.lstrip("!")
        patterns = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in patterns):
            ignored = not keep
    return ignored


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_else():
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    sources = [src for word, args in dockerfile_instructions() if word == "COPY" for src in args.split()[:-1]]
    assert sources == ["pyproject.toml", "README.md", "echo_vllm", "server", "eval"]
    for path in sources + ["echo_vllm/cli.py", "server/rewrite.py", "eval/perplexity.py"]:
        assert not dockerignored(path, rules), path
    for path in (".git/HEAD", ".venv/bin/python", ".gpu-bundle/x", "tests/server/test_docker.py",
                 "docker/compose.yaml", "out/demo/demo.png", "echo_vllm/__pycache__/cli.cpython-311.pyc",
                 "server/__pycache__/rewrite.cpython-311.pyc", "EVAL.md", "server/README.md",
                 "server/gpu_serve_check.sh", "eval/gpu_eval.sh", "results/bench/x.json",
                 "build/lib/echo_vllm/cli.py", "echo_vllm.egg-info/PKG-INFO", "dist/echo_vllm-0.1.0.whl"):
        assert dockerignored(path, rules), path


# --- compose -----------------------------------------------------------------

@pytest.fixture(scope="module")
def service():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert list(compose["services"]) == ["echo-vllm"]
    assert "hf-cache" in compose["volumes"]
    return compose["services"]["echo-vllm"]


def test_compose_builds_this_repository(service):
    context = (DOCKER / service["build"]["context"]).resolve()
    assert context == REPO and (context / service["build"]["dockerfile"]) == REPO / "Dockerfile"


def test_compose_passes_base_and_commit_to_the_build(service):
    build_args = service["build"]["args"]
    global_base = dict(args.split("=", 1) for word, args in dockerfile_instructions()[:1] if word == "ARG")
    # every argument compose passes is one the Dockerfile takes (BASE before FROM)
    assert set(build_args) == {"BASE", "GIT_COMMIT"} and set(build_args) <= set(stage_args()) | set(global_base)
    assert interpolate(build_args["BASE"], {}) == global_base["BASE"]
    assert interpolate(build_args["GIT_COMMIT"], {}) == stage_args()["GIT_COMMIT"] == "unknown"
    offline = {"BASE": "echo-vllm-base/vllm-cpu:0.26.0", "IMAGE": f"echo-vllm:{project_version()}-cpu", "GIT_COMMIT": "abc123"}
    assert {k: interpolate(v, offline) for k, v in build_args.items()} == {"BASE": offline["BASE"], "GIT_COMMIT": "abc123"}
    assert interpolate(service["image"], {}) == f"echo-vllm:{project_version()}"
    assert interpolate(service["image"], offline) == offline["IMAGE"]


def test_compose_serves_tp4_with_echo(service):
    command = [interpolate(token, {}) for token in service["command"]]
    vllm_argv, settings = rewrite_args(command)  # what the container's entrypoint will do
    assert settings.echo_on and settings.tensor_parallel_size == 4 and settings.emulate_tp == 0
    assert "--host=0.0.0.0" in vllm_argv and "--port=8000" in vllm_argv
    assert any(port.endswith(":8000") for port in service["ports"])


@pytest.mark.parametrize("env", [{}, {"PORT": "9000"}, {"VLLM_API_KEY": "k"}])
def test_compose_publishes_on_loopback_by_default(service, env):
    ports = [interpolate(port, env) for port in service["ports"]]
    assert ports == [f"127.0.0.1:{env.get('PORT', '8000')}:8000"]
    # the guard reads the same variable, with the same default, as the port binding
    assert service["environment"]["ECHO_BIND"] == "${ECHO_BIND:-127.0.0.1}"
    assert service["ports"][0].startswith("${ECHO_BIND:-127.0.0.1}:")
    assert service["environment"]["VLLM_API_KEY"] == "${VLLM_API_KEY:-}"
    assert interpolate(service["ports"][0], {"ECHO_BIND": "0.0.0.0"}) == "0.0.0.0:8000:8000"


def run_compose_entrypoint(service, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The compose entrypoint as the container runs it, with a stub echo-vllm."""
    stub = tmp_path / "echo-vllm"
    stub.write_text('#!/bin/sh\necho "ran: echo-vllm $*"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    container_env = {k: interpolate(v, env) for k, v in service["environment"].items()}
    argv = [interpolate(token, env) for token in service["entrypoint"] + service["command"]]
    return subprocess.run(argv, env={"PATH": f"{tmp_path}:/usr/bin:/bin", **container_env},
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("env, allowed", [
    ({}, True),
    ({"ECHO_BIND": "127.0.0.1"}, True),
    ({"ECHO_BIND": "0.0.0.0"}, False),
    ({"ECHO_BIND": "192.168.1.5", "VLLM_API_KEY": ""}, False),
    ({"ECHO_BIND": "0.0.0.0", "VLLM_API_KEY": "secret"}, True),
])
def test_compose_refuses_other_interfaces_without_an_api_key(service, tmp_path, env, allowed):
    assert service["entrypoint"][:2] == ["/bin/sh", "-c"]
    out = run_compose_entrypoint(service, tmp_path, env)
    if allowed:
        assert out.returncode == 0, out.stderr
        model = env.get("MODEL", "Qwen/Qwen3-8B")
        assert out.stdout.startswith(f"ran: echo-vllm serve {model} --tensor-parallel-size=4 --tp-comm=echo")
    else:
        assert out.returncode == 64 and out.stdout == ""
        assert "VLLM_API_KEY" in out.stderr and env["ECHO_BIND"] in out.stderr


def test_compose_reserves_four_gpus(service):
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 4, "capabilities": ["gpu"]}]
    assert service["ipc"] == "host"


def test_compose_health_check_hits_health(service):
    check = service["healthcheck"]
    assert check["test"][0] == "CMD"
    assert "http://localhost:8000/health" in " ".join(check["test"])
    assert check["test"][1:3] == ["python3", "-c"]
    assert check["start_period"] and check["retries"] >= 1


def test_compose_keeps_the_model_cache(service):
    # where the image's (non-root) user keeps it, not /root
    volumes = [v.split(":") for v in service["volumes"]]
    assert volumes == [["hf-cache", env()["HF_HOME"]]]
    assert "user" not in service, "compose must not override the image's non-root user"


# --- docker/*.sh ---------------------------------------------------------------

def test_docker_scripts_exist_and_parse():
    assert [p.name for p in SCRIPTS] == ["build_and_smoke.sh", "make_base.sh"]
    for script in SCRIPTS:
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text, script.name
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script.name}: {out.stderr}"


def run_script(script: Path, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run a docker/ script with a `docker` on PATH that only leaves a mark (CI has no engine)."""
    mark = tmp_path / "docker-was-called"
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$@" >> {mark}\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=30)
    assert not mark.exists(), f"{script.name} {' '.join(args)} ran docker {mark.read_text()!r}"
    return out


@pytest.mark.parametrize("name, options", [
    ("build_and_smoke.sh", ["--base IMAGE", "--image TAG", "--no-build", "PASS/FAIL", "GIT_COMMIT",
                            "Not proven", "server/gpu_serve_check.sh"]),
    ("make_base.sh", ["--debian-only", "--force", "debootstrap", "CA_BUNDLE"]),
])
def test_docker_script_help(name, options, tmp_path):
    for flag in ("--help", "-h"):
        out = run_script(DOCKER / name, flag, tmp_path=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: bash docker/{name} "), out.stdout
        for option in options:
            assert option in out.stdout, option
    out = run_script(DOCKER / name, "--no-such-option", tmp_path=tmp_path)
    assert out.returncode == 2 and "unknown argument --no-such-option" in out.stderr
    assert f"usage: bash docker/{name} " in out.stderr


def test_local_base_is_the_pinned_vllm():
    pin = pinned_vllm()
    base_args = dict(args.split("=", 1) for word, args in dockerfile_instructions(DOCKER / "vllm-base.Dockerfile")
                     if word == "ARG")
    assert base_args["VLLM_VERSION"] == pin
    assert re.search(rf"^VLLM_VERSION=\$\{{VLLM_VERSION:-{re.escape(pin)}\}}$",
                     (DOCKER / "make_base.sh").read_text(), re.M)
    smoke = (DOCKER / "build_and_smoke.sh").read_text()
    assert f"BASE=echo-vllm-base/vllm-cpu:{pin}\n" in smoke
    # the smoke test builds the repository's Dockerfile on that base, through BASE
    assert 'docker build --network host --build-arg BASE="$BASE"' in smoke


FAKE_DOCKER = """#!/bin/sh
# a Docker CLI that logs each call and answers as the test asks
echo "$*" >> {log}
case "$1 $2" in
  "info "*) exit 0 ;;
  "image inspect") exit {inspect} ;;
  "build "*) echo "build failed" ; exit {build} ;;
esac
exit 0
"""


def run_smoke(tmp_path: Path, *args: str, make_base: int = 0, inspect: int = 0, build: int = 0):
    """build_and_smoke.sh in a copy of the repository, with a fake docker and make_base.sh."""
    repo = tmp_path / "repo"
    (repo / "docker").mkdir(parents=True)
    shutil.copy(DOCKER / "build_and_smoke.sh", repo / "docker")
    shutil.copy(REPO / "pyproject.toml", repo)
    (repo / "docker" / "make_base.sh").write_text(f"#!/usr/bin/env bash\necho 'debootstrap: no network'\nexit {make_base}\n")
    log = tmp_path / "docker.log"
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(FAKE_DOCKER.format(log=log, inspect=inspect, build=build))
    fake.chmod(0o755)
    run_env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    out = subprocess.run(["bash", str(repo / "docker" / "build_and_smoke.sh"), *args], env=run_env,
                         capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return out, calls


def test_smoke_stops_when_the_base_cannot_be_made(tmp_path):
    out, calls = run_smoke(tmp_path, make_base=1)
    assert out.returncode == 1
    assert "making the base image echo-vllm-base/vllm-cpu:0.26.0 failed; stopping" in out.stderr
    assert "debootstrap: no network" in out.stderr  # the log's tail, where the reason is
    assert not any(c.startswith(("build", "run")) for c in calls), calls


def test_smoke_stops_when_the_given_base_is_missing(tmp_path):
    out, calls = run_smoke(tmp_path, "--base", "no/such:image", inspect=1)
    assert out.returncode == 1 and "the base image no/such:image does not exist; stopping" in out.stderr
    assert not any(c.startswith(("build", "run")) for c in calls), calls


def test_smoke_stops_when_the_build_fails(tmp_path):
    out, calls = run_smoke(tmp_path, "--base", "some/base:1", build=1)
    assert out.returncode == 1 and "docker build failed; stopping" in out.stderr
    built = [c for c in calls if c.startswith("build ")]
    assert len(built) == 1 and "--build-arg BASE=some/base:1" in built[0]
    # outside a git checkout the revision label says so, and the version is pyproject's, as is the CPU tag
    assert "--build-arg GIT_COMMIT=unknown" in built[0] and f"--build-arg ECHO_VERSION={project_version()}" in built[0]
    assert built[0].endswith(f"-t echo-vllm:{project_version()}-cpu .")
    assert not any(c.startswith("run") for c in calls), "it went on to test a stale image"
