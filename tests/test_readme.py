"""README's "From Python" example runs as written and does what its comments
say (a stale example was found calling a 16-bit first call "Echo")."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
#: the module map README links to
ARCHITECTURE = README.parent / "docs" / "architecture.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_from_python_example_runs_and_prints_what_it_says():
    block = next(b for b in _python_blocks() if "StackedCommunicator" in b)
    printed_line = next(line for line in block.splitlines() if line.startswith("print("))
    promised = ast.literal_eval(printed_line.split("#", 1)[1].strip())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})
    assert ast.literal_eval(out.getvalue().strip()) == promised


def test_demo_table_in_readme_is_what_the_demo_prints(tmp_path, capsys):
    """The rows README quotes from `echo-vllm demo` (default arguments) are
    the demo's current output, digit for digit (it is seeded; a change in
    defaults or numerics must update README)."""
    from echo_vllm.cli import main

    block = re.search(r"\$ echo-vllm demo[^\n]*\n(.*?)```", README.read_text(), flags=re.S).group(1)
    rows = [line for line in block.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert len(rows) >= 3
    assert main(["demo", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    for row in rows:
        assert row in printed
    growth = next(line for line in block.splitlines() if line.startswith("growth"))
    assert growth in printed


def test_module_table_matches_the_tree():
    """Every module and package of echo_vllm has its row in the module map
    (docs/architecture.md), and every path the table names exists."""
    root = README.parent
    table = re.search(r"^\| path \| what it holds \|\n(.*?)\n\n", ARCHITECTURE.read_text(), flags=re.M | re.S).group(1)
    rows = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    listed = {row.rstrip("/") for row in rows}
    assert {"echo_vllm/config.py", "tests"} <= listed
    for row in rows:
        assert (root / row).exists(), f"docs/architecture.md's module table names {row}, which does not exist"
    package = root / "echo_vllm"
    tree = {f"echo_vllm/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"}
    tree |= {f"echo_vllm/{p.name}" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert sorted(tree - listed) == [], "modules missing from docs/architecture.md's table"
