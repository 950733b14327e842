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


def test_norm_fusion_row_and_verdict(tmp_path):
    """The pass-on compiled run against the pass-off one: no fused call fails;
    different tokens fail only where they agree less than compilation alone
    keeps the same sum's tokens: eager Echo's against compiled Echo's where
    both ran, else the exact sum's."""
    check = _script()
    logits = [torch.zeros(3, 8)]
    tokens, other = [[1, 2, 3, 4]], [[1, 2, 9, 9]]
    fused = {"norm_calls": {"fused": 12}, "norm_sites": {"fused": 16, "not followed by vLLM's RMSNorm": 1}}

    def table(on_tokens, on_stats, exact_tokens=None, eager_echo_tokens=None):
        res = {"graphs_norm_on": {"variants": _phase(tmp_path, "graphs_norm_on", "echo", on_tokens, logits,
                                                     **on_stats)},
               "graphs": {"variants": _phase(tmp_path, "graphs", "echo", tokens, logits)}}
        eager = {}
        if exact_tokens is not None:
            eager.update(_phase(tmp_path, "eager", "exact", tokens, logits))
            res["graphs_exact"] = {"variants": _phase(tmp_path, "graphs_exact", "exact", exact_tokens, logits)}
        if eager_echo_tokens is not None:
            eager.update(_phase(tmp_path, "eager", "echo", eager_echo_tokens, logits))
        if eager:
            res["eager"] = {"variants": eager}
        return check.compare(tmp_path, res)

    same = table(tokens, fused)
    assert same[check.NORM_ROW]["tokens_identical"] and check.norm_verdict(same) is None
    assert same[check.NORM_ROW]["norm_sites"] == fused["norm_sites"]
    assert "fused no call" in check.norm_verdict(table(tokens, {"norm_calls": {"exact path": 3}}))
    assert "no compiled run" in check.norm_verdict(table(other, fused))
    # the exact sum's control alone (no eager Echo run)
    assert check.norm_verdict(table(other, fused, exact_tokens=[[1, 9, 9, 9]])) is None  # compilation moves more
    assert "graphs/exact vs eager/exact: 1.00" in check.norm_verdict(table(other, fused, exact_tokens=tokens))
    # Echo's own control wins where it ran: the fused run (prefix 2/4) keeps as much as compilation keeps
    # eager Echo's tokens (1/4), though the exact sum kept all of them
    assert check.norm_verdict(table(other, fused, exact_tokens=tokens, eager_echo_tokens=[[1, 7, 7, 7]])) is None
    verdict = check.norm_verdict(table(other, fused, exact_tokens=[[1, 9, 9, 9]], eager_echo_tokens=tokens))
    assert "graphs/echo vs eager/echo: 1.00" in verdict  # compiled Echo kept eager Echo's tokens: 2/4 is less
    assert check.norm_verdict({}) is None


def test_norm_verdict_allows_the_noise_of_its_prompts_and_no_more(tmp_path):
    """Several prompts: the fused run may agree less than the control by
    NOISE_Z standard errors of the difference of the two means, not more."""
    check = _script()
    logits = [torch.zeros(3, 8)]
    ref = [[1, 2, 3, 4]] * 4
    fused = {"norm_calls": {"fused": 12}}

    def verdict(on_tokens, eager_echo_tokens):
        res = {"graphs_norm_on": {"variants": _phase(tmp_path, "graphs_norm_on", "echo", on_tokens, logits, **fused)},
               "graphs": {"variants": _phase(tmp_path, "graphs", "echo", ref, logits)},
               "eager": {"variants": _phase(tmp_path, "eager", "echo", eager_echo_tokens, logits)}}
        table = check.compare(tmp_path, res)
        return table, check.norm_verdict(table)

    # fused prefixes 1/4, 1/4, 2/4, 3/4 (mean 0.4375, sd 0.239); control 2/4, 2/4, 3/4, 3/4 (0.625, 0.144)
    on = [[1, 9, 9, 9], [1, 9, 9, 9], [1, 2, 9, 9], [1, 2, 3, 9]]
    table, v = verdict(on, [[1, 2, 7, 7], [1, 2, 7, 7], [1, 2, 3, 7], [1, 2, 3, 7]])
    row, base = table[check.NORM_ROW], table["graphs/echo vs eager/echo"]
    assert abs(row["agreeing_prefix_sem"] - 0.239357 / 2) < 1e-6 and abs(base["agreeing_prefix_sem"] - 0.144338 / 2) < 1e-6
    assert v is None  # 0.1875 short, within 2 * 0.1398
    # control 4/4 everywhere (sd 0): 0.5625 short, past 2 * 0.1197
    _, v = verdict(on, ref)
    assert v is not None and "by more than 2 standard errors (0.24)" in v
    # every sequence off at its first token (a broken norm): fails against the same control
    _, v = verdict([[9, 9, 9, 9]] * 4, [[1, 2, 7, 7], [1, 2, 7, 7], [1, 2, 3, 7], [1, 2, 3, 7]])
    assert v is not None and "over 0.00" in v
