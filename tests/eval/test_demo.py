"""`echo-vllm demo` end to end: gloo processes, table, JSON and PNG."""

import json

from echo_vllm.cli import main


def test_demo_runs_and_shows_the_property(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's file")
    for name in ("demo.json", "demo.png"):  # links at the result names: replaced, never written through
        (out / name).symlink_to(mine)
    rc = main(["demo", "-p", "3", "-l", "16", "--tokens", "16", "--hidden", "256", "--out", str(out)])
    assert rc == 0
    assert mine.read_text() == "the user's file" and not any(p.is_symlink() for p in out.iterdir())
    data = json.loads((out / "demo.json").read_text())
    assert (out / "demo.png").stat().st_size > 1000
    naive = data["relative_error"]["naive 4-bit"]
    echo = data["relative_error"]["Echo"]
    exact = data["relative_error"]["exact 16-bit"]
    # independent errors add up for naive 4-bit (sqrt(15) ~ 3.9x expected)
    assert naive[14] >= 2.5 * naive[0]
    # Echo telescopes (same 1.5x bound as tests/core/test_feedback.py) ...
    assert max(echo[:15]) <= 1.5 * echo[0]
    # ... and the exact last call leaves no more than 16-bit-like error
    assert echo[-1] < echo[0] / 3 and echo[-1] < 10 * exact[-1]
    assert data["bits_per_value"]["echo"] == 4.5
    text = capsys.readouterr().out
    assert "depth" in text and "exact last call" in text


def test_cli_help_and_unknown_command(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["nope"]) == 2
