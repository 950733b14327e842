"""How the suite is spread over pytest-xdist's workers (the README runs
``pytest -n auto``, CI on 2 cores).

* A file that defines a module-scoped fixture (spawned gloo or vLLM
  processes, a prepared model, kernels compiled for sm_90) runs whole on
  one worker: each worker that got one of its tests would set the fixture
  up again (tens of seconds for a vLLM launch). Every other test is handed
  out on its own, as xdist's default ``--dist load`` does.
* Files with a test marked ``slow`` come first, so that the last thing a
  worker starts is short rather than a minute long while the other idles.
* On a machine without CUDA each worker runs torch on its share of the
  cores (cores // workers threads, as ``echo_vllm.spawn`` gives its ranks):
  two workers with a thread per core each have their threads spin and wait
  on each other (the lm-eval smoke test took 2x as long).

On a CUDA host (the GPU acceptance run's ``-n 14``) only the second point
applies: whole files on one worker would lengthen the run past the limits
its steps were measured for.

None of this changes what a test runs or checks. An explicit ``--dist``
other than ``load`` is left alone. (xdist's own ``loadgroup`` would do the
first point from ``xdist_group`` marks, but with pytest 9 it ignores them:
it renames items through ``item._nodeid``, which pytest 9 no longer reads.)
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


@functools.lru_cache(maxsize=None)
def _has_module_fixture(path: Path) -> bool:
    """Whether the test file at ``path`` defines a fixture of module or
    session scope (read from its source: xdist's controller collects nothing)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and any(
                        kw.arg == "scope" and isinstance(kw.value, ast.Constant) and kw.value.value in ("module", "session")
                        for kw in deco.keywords):
                    return True
    return False


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "load":  # another mode asked for by name: xdist's own
        return None
    import torch

    if torch.cuda.is_available():  # a GPU host keeps xdist's own spread: the acceptance run's limits were measured so
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class WholeFilesWithModuleFixtures(LoadScopeScheduling):
        """Scopes: the file, for a file with a module-scoped fixture; else the test."""

        def _split_scope(self, nodeid: str) -> str:
            return _file(nodeid) if _has_module_fixture(root / _file(nodeid)) else nodeid

    config.option.loadscopereorder = False  # hand scopes out in collection order (below)
    return WholeFilesWithModuleFixtures(config, log)


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in xdist's workers only
    if workers:
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = {_file(item.nodeid) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: _file(item.nodeid) not in slow)  # stable: files in their order, slow ones first


@pytest.fixture
def refused(capsys):
    """``refused(argv)``: runs ``echo-vllm ARGV``, checks the answer to bad
    input (exit 2, one error line, no traceback) and returns that line with
    everything else printed (to check that no secret was)."""
    from echo_vllm import cli

    def check(argv: list[str]) -> tuple[str, str]:
        assert cli.main(argv) == 2
        out = capsys.readouterr()
        errors = [line for line in out.err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in out.err, out.err
        return errors[0], out.out + out.err

    return check
