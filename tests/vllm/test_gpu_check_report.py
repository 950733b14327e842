"""The GPU check's report logic (scripts/gpu_vllm_check.py ``compare``), on
synthetic phase results: which rows it builds, and that "identical" means
identical tokens *and* bit-equal logits. Runs on CPU; the engines themselves
run only on the GPU host (tests/vllm/test_vllm_gpu.py)."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_vllm_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_vllm_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _phase(tmp, phase, name, tokens, logits, **stats):
    torch.save(logits, tmp / f"logits_{phase}_{name}.pt")
    return {name: {"tokens": tokens, "stats": {"calls": {"echo/echo": 10}, **stats}}}


def test_compare_rows_and_identity(tmp_path):
    check = _script()
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(5, 16, generator=g), torch.randn(7, 16, generator=g)]
    base[1][3, 2] = 0.25
    moved = [t.clone() for t in base]
    moved[1][3, 2] = 0.75  # one logit off by exactly 0.5
    tokens, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    res = {
        "eager": {"variants": {**_phase(tmp_path, "eager", "exact", tokens, base),
                               **_phase(tmp_path, "eager", "echo", tokens, base)}},
        "graphs_eager_ops": {"variants": _phase(tmp_path, "graphs_eager_ops", "echo", tokens, base,
                                                forwards_replayed=31, forwards_observed=2)},
        "graphs": {"variants": _phase(tmp_path, "graphs", "echo", other, moved, forwards_replayed=31)},
    }
    table = check.compare(tmp_path, res)
    assert set(table) == {"eager/exact vs exact", "eager/echo vs exact",
                          "graphs(no compile)/echo vs eager/echo", "graphs/echo vs eager/echo"}
    same = table["graphs(no compile)/echo vs eager/echo"]
    assert same["tokens_identical_to_eager"] and same["logit_max_abs_diff"] == 0.0
    assert same["sequences_identical"] == "2/2" and same["forwards_replayed"] == 31
    differ = table["graphs/echo vs eager/echo"]
    assert not differ["tokens_identical_to_eager"] and differ["sequences_identical"] == "1/2"
    assert differ["logit_max_abs_diff"] == 0.5 and differ["mean_agreeing_prefix"] == (1 + 1 / 3) / 2
