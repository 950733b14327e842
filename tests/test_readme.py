"""README's "From Python" example runs as written and does what its comments
say (a stale example was found calling a 16-bit first call "Echo")."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_from_python_example_runs_and_prints_what_it_says():
    block = next(b for b in _python_blocks() if "EchoCommunicator" in b)
    printed_line = next(line for line in block.splitlines() if line.startswith("print("))
    promised = ast.literal_eval(printed_line.split("#", 1)[1].strip())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})
    assert ast.literal_eval(out.getvalue().strip()) == promised
