"""Scripts that cannot rot: every script under scripts/, server/, eval/ and
docker/ (the GPU host's, which CI cannot run) still starts here. (server/
and eval/ also hold the package's serving and evaluation modules: those are
read with the package, not run as scripts.)

* Python scripts answer ``--help`` (importing them, with only the package on
  the path), and every ``echo_vllm`` name they import anywhere -- inside
  functions too, where ``--help`` does not reach -- exists.
* Shell scripts parse (``bash -n``), answer ``--help`` without running
  anything (a sourced helper, without a shebang, only parses), and the
  ``echo_vllm`` modules and names their commands use exist.
* None reaches into ``tests/``: what scripts share with the tests lives in
  the package (``echo_vllm.testing_models``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("scripts", "server", "eval", "docker")
#: Folders that install as subpackages of echo_vllm (pyproject.toml's package-dir): folder -> package.
MAPPED = {folder: package for package, folder in
          tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}


def _scripts(suffix: str) -> list[Path]:
    # a file beside an __init__.py is a module of a package, not a script
    return sorted(p for folder in FOLDERS if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob(f"*{suffix}")
                  if suffix != ".py" or not (p.parent / "__init__.py").exists())


PYTHON = _scripts(".py")
SHELL = _scripts(".sh")
#: The package's modules, its mapped folders' included.
MODULES = sorted((ROOT / "echo_vllm").rglob("*.py")) + sorted(p for folder in MAPPED for p in (ROOT / folder).glob("*.py"))


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _env() -> dict:
    # the package from this checkout, and nothing of tests/
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_every_folder_has_scripts():
    assert {p.relative_to(ROOT).parts[0] for p in PYTHON + SHELL} >= {"scripts", "server", "eval"}


@pytest.fixture(scope="module")
def help_runs(tmp_path_factory) -> dict[Path, subprocess.CompletedProcess]:
    """``--help`` of every script, run side by side (each imports torch)."""
    cwd = tmp_path_factory.mktemp("cwd")  # scripts must not depend on where they are called from
    procs = {}
    for path in PYTHON + [p for p in SHELL if p.read_text().startswith("#!")]:
        cmd = [sys.executable, str(path), "--help"] if path.suffix == ".py" else ["bash", str(path), "--help"]
        procs[path] = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    done = {}
    for path, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        done[path] = subprocess.CompletedProcess(proc.args, proc.returncode, out)
    return done


@pytest.mark.parametrize("path", PYTHON, ids=_id)
def test_python_script_answers_help(help_runs, path):
    run = help_runs[path]
    assert run.returncode == 0 and "usage:" in run.stdout, run.stdout[-2000:]


def _echo_imports(text: str) -> list[tuple[str, str | None]]:
    """(module, name or None) of every ``echo_vllm`` import in Python source."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("echo_vllm"):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.startswith("echo_vllm")]
    return found


def _unresolved(imports: list[tuple[str, str | None]]) -> list[str]:
    missing = []
    for module, name in imports:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module} ({e})")
            continue
        if name is not None and not hasattr(mod, name):
            try:  # a submodule not imported by its package
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    return missing


@pytest.mark.parametrize("path", PYTHON, ids=_id)
def test_python_script_imports_exist(path):
    text = path.read_text()
    assert not re.search(r"^\s*(from|import) support\b", text, re.M), "scripts must not import tests/support"
    assert not re.search(r"sys\.path.*tests|\"tests\"|'tests'", text), "scripts must not put tests/ on the path"
    imports = _echo_imports(text)
    assert imports, "a script of this repository that uses nothing of the package?"
    assert _unresolved(imports) == []


def test_the_import_check_can_fail():
    assert _unresolved(_echo_imports("def f():\n    from echo_vllm import ops\n")) == ["echo_vllm.ops"]


def _undefined_names(source: str, filename: str) -> list[str]:
    """pyflakes' undefined names (and locals used before assignment, and
    ``__all__`` entries that name nothing) in ``source``: found without
    running it."""
    from pyflakes import checker, messages

    kinds = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
    found = checker.Checker(ast.parse(source, filename), filename).messages
    return [f"{m.filename}:{m.lineno}: {m.message % m.message_args}" for m in found if isinstance(m, kinds)]


def test_no_undefined_name_in_code_ci_cannot_run():
    """The package and the GPU host's scripts: the kernels' launchers, the
    fused backend, the vLLM glue and the GPU scripts run nowhere in CI, so a
    misspelt name there would first fail on the GPU host."""
    sources = MODULES + PYTHON
    assert len(sources) > 50
    assert [u for path in sources for u in _undefined_names(path.read_text(), _id(path))] == []


def test_the_undefined_name_check_can_fail():
    assert _undefined_names("def f():\n    return launch_plan\n", "x.py") == [
        "x.py:2: undefined name 'launch_plan'"]


def _module_name(path: Path) -> str:
    """``echo_vllm.a.b`` of a package file (``__init__``: the package; ``eval/x.py``:
    ``echo_vllm.eval.x``); a script: ``__main__``."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    if parts[0] in MAPPED and path in MODULES:
        parts = (*MAPPED[parts[0]].split("."), *parts[1:])
    return ".".join(parts) if parts[0] == "echo_vllm" else "__main__"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a name inside a module, not a package
        return False


def _missing_attributes(source: str, module: str, is_package: bool = False) -> list[str]:
    """``alias.name`` uses in ``source`` where ``alias`` is a module of the
    package (``from ..kernels import fused_kernel as fk``, ``import
    echo_vllm.x as y``, anywhere in the file) and that module has no
    ``name``: what pyflakes cannot see, found without running the code."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    aliases = {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            pkg = node.module or ""
            if node.level:
                pkg = ".".join(base[:len(base) - node.level + 1] + ([pkg] if pkg else []))
            for a in node.names:
                if pkg.startswith("echo_vllm") and _is_module(f"{pkg}.{a.name}"):
                    aliases[a.asname or a.name] = f"{pkg}.{a.name}"
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("echo_vllm")})
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            mod = importlib.import_module(aliases[node.value.id])
            if not hasattr(mod, node.attr) and not _is_module(f"{mod.__name__}.{node.attr}"):
                missing.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({mod.__name__} has no {node.attr})")
    return missing


def test_every_attribute_of_a_package_module_exists():
    """``fk.tiling_for_norm`` and the like, in the package and the GPU
    host's scripts: a misspelt function of a module, in a path only the GPU
    runs, fails here."""
    sources = MODULES + PYTHON
    found = {_id(p): _missing_attributes(p.read_text(), _module_name(p), p.name == "__init__.py") for p in sources}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_attribute_check_can_fail():
    src = "def f():\n    from ..kernels import fused_kernel as fk\n    return fk.tiling_for_nrom\n"
    assert _missing_attributes(src, "echo_vllm.bench.norm_bench") == [
        "line 3: fk.tiling_for_nrom (echo_vllm.kernels.fused_kernel has no tiling_for_nrom)"]
    # the mapped folders are read as the package: their relative imports resolve
    assert _module_name(ROOT / "eval" / "accuracy.py") == "echo_vllm.eval.accuracy"
    assert _missing_attributes("from ..bench import cli as c\nc.no_such\n", "echo_vllm.eval.accuracy") == [
        "line 2: c.no_such (echo_vllm.bench.cli has no no_such)"]


@pytest.mark.parametrize("path", SHELL, ids=_id)
def test_shell_script_parses_and_answers_help(help_runs, path):
    text = path.read_text()
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert not re.search(r"PYTHONPATH=.*tests|(from|import) support\b|tests/support", text), "scripts must not reach into tests/"
    if not text.startswith("#!"):  # a helper the scripts source
        return
    run = help_runs[path]
    assert run.returncode == 0 and path.name in run.stdout, run.stdout[-2000:]  # its usage, nothing run
    # what its commands use of the package exists
    modules = [(m, None) for m in re.findall(r"-m (echo_vllm[\w.]*)", text)]
    names = [(m, n.strip()) for m, ns in re.findall(r"from (echo_vllm[\w.]*) import ([\w, ]+)", text)
             for n in ns.split(",")]
    assert _unresolved(modules + names) == []


def test_gpu_acceptance_stash_keeps_the_carried_parts_and_runs_nothing(tmp_path):
    """`gpu_accept.sh stash` (a host lost between runs): the parts it
    carries go to $STASH for run 4, and no step runs."""
    bundle, stash, out = tmp_path / "bundle", tmp_path / "stash", tmp_path / "out"
    bundle.mkdir()
    for name in ("bundle.part.02", "SHA256SUMS", "install.py"):
        (bundle / name).write_text(name)
    env = {**os.environ, "BUNDLE": str(bundle), "STASH": str(stash), "OUT": str(out)}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_accept.sh"), "stash"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in stash.iterdir()) == ["SHA256SUMS", "bundle.part.02", "install.py"]
    assert [p.read_text() for p in sorted(stash.iterdir())] == ["SHA256SUMS", "bundle.part.02", "install.py"]
    assert "stashed bundle parts: bundle.part.02" in r.stdout
    assert list(out.iterdir()) == []  # no step, no summary
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_accept.sh"), "7"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "RUN must be 1, 2, 3, 4, 5, 6 or stash, got '7'" in bad.stderr


def test_gpu_acceptance_refuses_an_out_folder_holding_other_files(tmp_path):
    """A run ends by deleting every file in $OUT but its summary and log
    archive: OUT=$HOME lost everything in it. Such a folder is refused
    before any step; an earlier run's summary and archive are kept."""
    out, stash = tmp_path / "out", tmp_path / "stash" / "parts"
    out.mkdir()
    (out / "thesis.tex").write_text("mine")
    env = {**os.environ, "BUNDLE": str(tmp_path / "none"), "STASH": str(stash), "OUT": str(out),
           "PYTHON": "false", "STEP_TAIL": "0"}  # a step that does run fails at once
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_accept.sh"), "3"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and f"OUT={out} holds files of its own" in run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"] and (out / "thesis.tex").read_text() == "mine"
    (out / "thesis.tex").unlink()
    many = out / "photos"  # more names than a pipe holds: a check piped into `grep -q` lets this through
    many.mkdir()
    for i in range(3000):
        (many / f"holiday-{i:05d}-{'x' * 60}.jpg").touch()
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_accept.sh"), "3"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and len(list(many.iterdir())) == 3000
    shutil.rmtree(many)
    for n in (1, 2):
        run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_accept.sh"), str(n)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, run.stderr  # steps failed: ran, not refused
    assert sorted(p.name for p in out.iterdir()) == ["accept_logs_run1.tgz", "accept_logs_run2.tgz",
                                                     "accept_summary.txt"]


def test_gpu_bundle_cuts_the_wheelhouse_bundle_in_four_and_never_mixes(tmp_path):
    """`gpu_bundle.sh`: the wheelhouse's one-part bundle cut in 4 parts that
    join to it, their SHA256SUMS and install.py; a .gpu-bundle holding
    anything is refused, untouched."""
    import hashlib
    import random

    repo, wheelhouse = tmp_path / "repo", tmp_path / "wheelhouse"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_bundle.sh", repo / "scripts")
    wheelhouse.mkdir()
    payload = random.Random(0).randbytes(1_000_003)
    (wheelhouse / "payload").write_bytes(payload)
    (wheelhouse / "build.sh").write_text('mkdir -p "$1" && cp "$(dirname "$0")/payload" "$1/bundle.part.00"\n')
    (wheelhouse / "install.py").write_text("# unpacks\n")
    run = subprocess.run(["bash", str(repo / "scripts" / "gpu_bundle.sh"), str(wheelhouse)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = repo / ".gpu-bundle"
    parts = sorted(out.glob("bundle.part.*"))
    assert [p.name for p in parts] == [f"bundle.part.0{i}" for i in range(4)]
    assert b"".join(p.read_bytes() for p in parts) == payload
    sums = dict(reversed(line.split()) for line in (out / "SHA256SUMS").read_text().splitlines())
    assert sums == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in parts}
    assert (out / "install.py").read_text() == "# unpacks\n"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = subprocess.run(["bash", str(repo / "scripts" / "gpu_bundle.sh"), str(wheelhouse)], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2 and ".gpu-bundle holds files already" in again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
