"""Fixtures shared by the evaluation tools' tests."""

from __future__ import annotations

import pytest

from echo_vllm import cli


@pytest.fixture
def refused(capsys):
    """``refused(argv)``: runs ``echo-vllm ARGV``, checks the answer to bad
    input (exit 2, one error line, no traceback) and returns that line with
    everything else printed (to check that no secret was)."""

    def check(argv: list[str]) -> tuple[str, str]:
        assert cli.main(argv) == 2
        out = capsys.readouterr()
        errors = [line for line in out.err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in out.err, out.err
        return errors[0], out.out + out.err

    return check
