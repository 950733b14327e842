"""The package's shape: no import circle anywhere (module level, under
``TYPE_CHECKING`` or inside a function), ``__all__`` names only what each
module defines, and ``from echo_vllm import *`` works."""

from __future__ import annotations

import ast
import pathlib

import echo_vllm

PACKAGE = pathlib.Path(echo_vllm.__file__).parent
REPO = PACKAGE.parent
#: The folders that install as subpackages of echo_vllm (pyproject.toml's package-dir).
MAPPED = {"echo_vllm.server": REPO / "server", "echo_vllm.eval": REPO / "eval"}
#: The one library module that may import the serving wrapper and the evaluation harness: it dispatches to them.
DISPATCHER = "echo_vllm.cli"


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is a package's __init__), the mapped folders included."""
    out = {}
    roots = [("echo_vllm", PACKAGE, True), *((name, folder, False) for name, folder in MAPPED.items())]
    for dotted, folder, recursive in roots:
        for path in sorted(folder.rglob("*.py") if recursive else folder.glob("*.py")):
            parts = (*dotted.split("."), *path.relative_to(folder).with_suffix("").parts)
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, init, set(modules)) for name, (path, init) in modules.items()}


def test_pyproject_lists_every_package():
    """Every folder with an ``__init__.py`` installs (pyproject's static package list)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {name for name, (_, init) in _modules().items() if init}
    assert set(project["packages"]) == on_disk
    assert {k: REPO / v for k, v in project["package-dir"].items()} == MAPPED


def test_the_library_imports_neither_the_server_nor_the_harness():
    """echo_vllm/ is the backend library: only the command-line dispatcher
    reaches into echo_vllm.server or echo_vllm.eval."""
    apps = tuple(MAPPED)
    graph = _graph()
    back = sorted(f"{src} -> {dst}" for src, dsts in graph.items() if src != DISPATCHER and not src.startswith(apps)
                  for dst in dsts if dst.startswith(apps))
    assert back == []
    assert "echo_vllm.server.rewrite" in graph["echo_vllm.server.cli"]  # the scan sees the mapped folders


def _imports(name: str, path: pathlib.Path, init: bool, known: set[str]) -> set[str]:
    """Every module of the package ``name`` imports, wherever the import stands."""
    here = name.split(".") if init else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & known - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, as a path that ends where it starts."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_circle_even_under_type_checking():
    graph = _graph()
    assert "echo_vllm.vllm_glue.session" in graph["echo_vllm.vllm_glue.emulation"]  # the scan sees imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    # the check can fail: one edge back closes a circle
    graph["echo_vllm.vllm_glue.communicator"].add("echo_vllm.vllm_glue.session")
    assert _cycle(graph)[0] == _cycle(graph)[-1]


def _defined(body: list[ast.stmt]) -> set[str]:
    """Names a module binds at its top level (inside ``if`` / ``try`` too)."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                names |= _defined(block)
    return names


def test_every_all_names_what_its_module_defines():
    checked = 0
    for name, (path, _) in _modules().items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                listed = ast.literal_eval(node.value)
                missing = sorted(set(listed) - _defined(tree.body))
                assert not missing, f"{name}.__all__ names {missing}, which it does not define"
                assert len(set(listed)) == len(listed), f"{name}.__all__ repeats a name"
                checked += 1
    assert checked > 20


def test_star_import_of_the_package():
    namespace: dict = {}
    exec("from echo_vllm import *", namespace)
    assert set(echo_vllm.__all__) <= set(namespace)
    for name in ("EchoCommunicator", "EchoConfig", "make_backend", "choose_backend", "BACKENDS", "EchoBackend"):
        assert namespace[name] is getattr(echo_vllm, name)
