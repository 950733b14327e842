"""Dockerfile, compose and Docker script checks that need no Docker engine.

CI has no engine, so the image is not built here (docker/build_and_smoke.sh
builds and smoke-tests it by hand; docker/README.md records the run). These
check that the compose file parses and means what it says (TP=4 Echo,
published on loopback unless an API key is set), that the entrypoint is this
package's console script, that the base image is the vLLM version we pin,
that the build context holds what the Dockerfile copies, and that the Docker
scripts parse and answer --help without an engine.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import re
import stat
import subprocess
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
    assert sources == ["pyproject.toml", "README.md", "echo_vllm"]
    for path in sources + ["echo_vllm/cli.py", "echo_vllm/server/rewrite.py"]:
        assert not dockerignored(path, rules), path
    for path in (".git/HEAD", ".venv/bin/python", ".gpu-bundle/x", "tests/server/test_docker.py",
                 "docker/compose.yaml", "out/demo/demo.png", "echo_vllm/__pycache__/cli.cpython-311.pyc",
                 "echo_vllm/server/__pycache__/rewrite.cpython-311.pyc", "EVAL.md"):
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


def test_compose_says_how_it_binds():
    header = (DOCKER / "compose.yaml").read_text().split("services:")[0]
    assert "127.0.0.1" in header and "ECHO_BIND" in header and "VLLM_API_KEY" in header


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
    assert "hf-cache:/root/.cache/huggingface" in service["volumes"]


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
    ("build_and_smoke.sh", ["--base IMAGE", "--image TAG", "--no-build", "PASS/FAIL"]),
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
