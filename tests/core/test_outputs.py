"""Result files (echo_vllm.outputs): written whole, never through a link,
and a name that is a folder refused before the work."""

from __future__ import annotations

import json
import os
import stat

import pytest

from echo_vllm import outputs
from echo_vllm.cli_args import UsageError


def _linked(tmp_path, name: str):
    """``tmp_path/out/name`` a link to a file of the user's, which must survive."""
    out = tmp_path / "out"
    out.mkdir()
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's file")
    (out / name).symlink_to(mine)
    return out, mine


@pytest.mark.parametrize("write", [
    lambda p: outputs.write_text(p, "new"),
    lambda p: outputs.write_bytes(p, b"new"),
    lambda p: outputs.write_json(p, {"new": 1}),
    lambda p: outputs.write_file(p, lambda f: f.write(b"new")),
], ids=["text", "bytes", "json", "file"])
def test_a_link_at_the_name_is_replaced_not_followed(tmp_path, write):
    out, mine = _linked(tmp_path, "result")
    write(out / "result")
    assert mine.read_text() == "the user's file"
    assert not (out / "result").is_symlink() and "new" in (out / "result").read_text()
    assert os.listdir(out) == ["result"]  # no temporary file left


def test_a_dangling_link_is_replaced_and_creates_nothing_where_it_pointed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "r.json").symlink_to(tmp_path / "elsewhere.json")
    outputs.write_json(out / "r.json", [1])
    assert not (tmp_path / "elsewhere.json").exists() and json.loads((out / "r.json").read_text()) == [1]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    (tmp_path / "r.json").write_text("old")
    with pytest.raises(TypeError):
        outputs.write_json(tmp_path / "r.json", {"x": object()})
    with pytest.raises(ZeroDivisionError):
        outputs.write_file(tmp_path / "r.json", lambda f: (f.write(b"half"), 1 / 0))
    assert os.listdir(tmp_path) == ["r.json"] and (tmp_path / "r.json").read_text() == "old"


def test_files_get_the_permissions_a_plain_open_gives(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    outputs.write_text(tmp_path / "atomic", "x")
    assert stat.S_IMODE(os.stat(tmp_path / "atomic").st_mode) == stat.S_IMODE(os.stat(plain).st_mode)


def test_a_figure_is_saved_through_the_same_path(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, mine = _linked(tmp_path, "plot.png")
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    outputs.save_figure(fig, out / "plot.png", dpi=20)
    plt.close(fig)
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and mine.read_text() == "the user's file"


def test_open_fresh_replaces_a_link_for_a_streamed_log(tmp_path):
    out, mine = _linked(tmp_path, "run.log")
    with outputs.open_fresh(out / "run.log") as log:
        log.write("line\n")
    assert mine.read_text() == "the user's file" and (out / "run.log").read_text() == "line\n"


def test_check_names_refuses_a_folder_at_a_result_name_before_the_work(tmp_path):
    (tmp_path / "demo.json").mkdir()
    (tmp_path / "keep").mkdir()
    (tmp_path / "demo.png").symlink_to(tmp_path / "keep")  # a link to a folder: the result replaces the link
    with pytest.raises(UsageError, match=r"--out .*: demo.json is a folder, where the tool writes its result file "
                                         r"demo.json; move it or give another --out"):
        outputs.check_names(tmp_path, ["demo.png", "demo.json"])
    outputs.check_names(tmp_path, ["demo.png", "absent.json"])
    with pytest.raises(UsageError, match="cannot hold the result file x{60}: the name 'x+.*is 300 bytes"):
        outputs.check_names(tmp_path, ["x" * 300])
    assert sorted(os.listdir(tmp_path)) == ["demo.json", "demo.png", "keep"]
