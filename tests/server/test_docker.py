"""Dockerfile and compose checks that need no Docker engine (none on CI).

The image itself is not built here: these check that the compose file
parses and means what it says, that the entrypoint is this package's
console script, and that the base image is the vLLM version we pin.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

import pytest

from echo_vllm.cli import SUBCOMMANDS
from echo_vllm.server.rewrite import rewrite_args

REPO = Path(__file__).resolve().parents[2]
yaml = pytest.importorskip("yaml")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined."""
    text = re.sub(r"\\\n", " ", (REPO / "server" / "Dockerfile").read_text())
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


def test_base_image_is_the_pinned_vllm():
    froms = [args for word, args in dockerfile_instructions() if word == "FROM"]
    assert froms == [f"vllm/vllm-openai:v{pinned_vllm()}"]


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
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", ".gpu-bundle"} <= set(ignored)


@pytest.fixture(scope="module")
def service():
    compose = yaml.safe_load((REPO / "server" / "compose.yaml").read_text())
    assert list(compose["services"]) == ["echo-vllm"]
    assert "hf-cache" in compose["volumes"]
    return compose["services"]["echo-vllm"]


def test_compose_builds_this_repository(service):
    context = (REPO / "server" / service["build"]["context"]).resolve()
    assert context == REPO and (context / service["build"]["dockerfile"]) == REPO / "server" / "Dockerfile"


def test_compose_serves_tp4_with_echo(service):
    command = [re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", token) for token in service["command"]]
    vllm_argv, settings = rewrite_args(command)  # what the container's entrypoint will do
    assert settings.echo_on and settings.tensor_parallel_size == 4 and settings.emulate_tp == 0
    assert "--host=0.0.0.0" in vllm_argv and "--port=8000" in vllm_argv
    assert any(port.endswith(":8000") for port in service["ports"])


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
