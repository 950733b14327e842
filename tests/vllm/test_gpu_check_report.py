"""The GPU check's report logic (scripts/gpu_vllm_check.py ``compare``), on
synthetic phase results: which rows it builds, and that "identical" means
identical tokens *and* bit-equal logits. Runs on CPU; the engines themselves
run only on the GPU host (tests/vllm/test_vllm_gpu.py)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
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
    assert "(control: graphs/exact vs eager/exact)" in check.norm_verdict(table(other, fused, exact_tokens=tokens))
    # Echo's own control wins where it ran: the fused run (prefix 2/4) keeps as much as compilation keeps
    # eager Echo's tokens (1/4), though the exact sum kept all of them
    assert check.norm_verdict(table(other, fused, exact_tokens=tokens, eager_echo_tokens=[[1, 7, 7, 7]])) is None
    verdict = check.norm_verdict(table(other, fused, exact_tokens=[[1, 9, 9, 9]], eager_echo_tokens=tokens))
    assert "keeps (1.00)" in verdict and "(control: graphs/echo vs eager/echo)" in verdict  # 2/4 is less
    assert check.norm_verdict({}) is None


def test_norm_verdict_allows_the_noise_of_its_prompts_and_no_more(tmp_path):
    """Several prompts: the fused run may agree less than the control by
    NOISE_Z standard errors (the prefixes paired by prompt; the prompt
    logits' top-1 as two proportions), not more; a broken norm fails by its
    logits even against a control whose prefixes are too noisy to tell."""
    check = _script()
    g = torch.Generator().manual_seed(1)
    ref_logits = [torch.randn(50, 8, generator=g) for _ in range(4)]
    ref = [[1, 2, 3, 4]] * 4
    fused = {"norm_calls": {"fused": 12}}

    def verdict(on_tokens, eager_echo_tokens, on_logits=ref_logits):
        res = {"graphs_norm_on": {"variants": _phase(tmp_path, "graphs_norm_on", "echo", on_tokens, on_logits,
                                                     **fused)},
               "graphs": {"variants": _phase(tmp_path, "graphs", "echo", ref, ref_logits)},
               "eager": {"variants": _phase(tmp_path, "eager", "echo", eager_echo_tokens, ref_logits)}}
        table = check.compare(tmp_path, res)
        return table, check.norm_verdict(table)

    ctrl = [[1, 2, 7, 7], [1, 2, 7, 7], [1, 2, 3, 7], [1, 2, 3, 7]]  # prefixes 2/4, 2/4, 3/4, 3/4
    # fused 1/4, 2/4, 2/4, 3/4: paired differences -1/4, 0, -1/4, 0 (mean -0.125, se 0.0722): within 2 se
    table, v = verdict([[1, 9, 9, 9], [1, 2, 9, 9], [1, 2, 9, 9], [1, 2, 3, 9]], ctrl)
    assert table[check.NORM_ROW]["agreeing_prefixes"] == [0.25, 0.5, 0.5, 0.75]
    assert table[check.NORM_ROW]["positions"] == 200 and v is None
    # fused 1/4, 1/4, 2/4, 2/4: differences -1/4, -1/4, -1/4, -1/4... mean -0.25 with no spread: past it
    _, v = verdict([[1, 9, 9, 9], [1, 9, 9, 9], [1, 2, 9, 9], [1, 2, 9, 9]], ctrl)
    assert v is not None and "paired difference (0.00)" in v and "(control: graphs/echo vs eager/echo)" in v
    # a broken norm against a noisy control (6 of 8 prompts off at their first token, two kept): the
    # prefixes cannot tell (mean -0.25, se 0.16), the logits can
    noisy = [[9, 9, 9, 9]] * 6 + [[1, 2, 3, 4]] * 2
    broken = [[9, 9, 9, 9]] * 8
    ref8 = ref * 2
    res = {"graphs_norm_on": {"variants": _phase(tmp_path, "graphs_norm_on", "echo", broken,
                                                 [-t for t in ref_logits], **fused)},
           "graphs": {"variants": _phase(tmp_path, "graphs", "echo", ref8, ref_logits)},
           "eager": {"variants": _phase(tmp_path, "eager", "echo", noisy, ref_logits)}}
    table = check.compare(tmp_path, res)
    assert check.shortfall({**table[check.NORM_ROW], "top1_agree": 1.0}, table["graphs/echo vs eager/echo"]) is None
    v = check.norm_verdict(table)
    assert v is not None and "top-1" in v and "agrees with the unfused run at 0.000" in v


def kv_bytes_per_token(model_dir: pathlib.Path) -> int:
    """K and V of every layer, bf16, from the model's config.json."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    assert c["torch_dtype"] == "bfloat16"
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2


def test_every_phase_holds_a_fixed_kv_cache_of_vllm_engine_args(tmp_path):
    """A fixed KV cache: vLLM then skips its free-memory profile, which failed
    the acceptance's vLLM run when an engine beside it exited. Large enough for the
    phase's sequences, and every argument a field of vLLM's EngineArgs."""
    pytest.importorskip("vllm")
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from echo_vllm.testing_models import make_tiny_qwen3

    check = _script()
    args = check.parse_args([])
    model = make_tiny_qwen3(tmp_path / "m", num_layers=args.layers, hidden_size=args.hidden,
                            intermediate_size=args.intermediate, num_heads=args.heads,
                            num_kv_heads=args.kv_heads, vocab_size=args.vocab)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for phase in args.phases.split(","):
        args.phase, args.model = phase, str(model)
        kw = check.engine_kwargs(args)
        assert kw["kv_cache_memory_bytes"] == check.KV_CACHE_BYTES, phase
        assert check.KV_CACHE_BYTES >= kw["max_num_seqs"] * kw["max_model_len"] * kv_bytes_per_token(model)
        assert set(kw) <= fields, set(kw) - fields
        assert ("enforce_eager" in kw) == (phase not in check.GRAPHS_PHASES), phase


def test_the_serve_checks_kv_cache_holds_its_streams(tmp_path):
    """server/gpu_serve_check.sh's fixed KV cache holds CONCURRENCY streams of
    --max-model-len tokens of the tiny model it serves (vLLM's parser takes
    the flag through ``echo-vllm serve``: tests/server/test_server_vllm.py)."""
    import re

    from echo_vllm.testing_models import make_tiny_qwen3

    text = (SCRIPT.parents[1] / "server" / "gpu_serve_check.sh").read_text()
    kv = int(re.search(r"--kv-cache-memory-bytes (\d+)", text).group(1))
    streams = int(re.search(r"CONCURRENCY=\$\{CONCURRENCY:-(\d+)\}", text).group(1))
    tokens = int(re.search(r"--max-model-len (\d+)", text).group(1))
    assert kv >= streams * tokens * kv_bytes_per_token(make_tiny_qwen3(tmp_path / "m"))
