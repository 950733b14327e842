"""HF-backend TP emulation hooks on tiny random transformers models (no downloads).

Tolerances are derived, not guessed:

* exact mode: each rank's partial is an fp32-accumulated dot product of
  length n rounded to bf16, the P partials are summed in fp32 and rounded
  to bf16 once. Against the fp64 product, per element,
  ``|y - x.w| <= sum_r [gamma_n (|x_r|.|w_r|) (1 + u_b) + u_b |p_r|]
  + (P - 1) u_32 sum_r |p_r| (1 + u_b) + u_b |y|``, with u_b = 2^-8,
  u_32 = 2^-24, gamma_n = n u_32 / (1 - n u_32).
* Echo on a call without carried error: every stage quantizes a group with
  step s = bf16(amax / 7) and rounds to nearest, error <= s / 2; stage 1 per
  rank, stage 2 on the sum (amax <= sum of the ranks' amax). In the rotated
  domain the inverse rotation H / g averages g errors, so the same bound
  holds per element: ``|y - S| <= (1 + u_b)^2 sum_r amax_r / 7 + u_b |y|``
  with amax_r the group max of rank r's (rotated) partial.
* Echo with feedback and an exact last call: y_t = S_t + E_{t-1} - E_t with
  E_0 = E_T = 0, so the deviations of one forward sum to zero up to the
  output roundings: ``|sum_t (y_t - S_t)| <= u_b sum_t |y_t| + u_b sum_r |x_r,T + e_r|
  + (fp32 terms)`` -- checked against that, while single calls deviate by
  4-bit amounts (so the check is not vacuous).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from echo_vllm.config import EchoConfig, EchoConfigError
from echo_vllm.eval.hf_emulation import HFEmulation, find_backbone, is_postnorm
from echo_vllm.eval.variants import PRESETS, parse_variant, parse_variants
from echo_vllm.rotation import fwht

transformers = pytest.importorskip("transformers")

U_B = 2.0**-8
U_32 = 2.0**-24
P = 3


def _gamma(n: int) -> float:
    return n * U_32 / (1 - n * U_32)


def tiny_llama(dtype=torch.bfloat16, layers=2):
    cfg = transformers.LlamaConfig(
        vocab_size=192, hidden_size=96, intermediate_size=192, num_hidden_layers=layers,
        num_attention_heads=3, num_key_value_heads=3, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_gemma3(dtype=torch.bfloat16):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=192, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        sliding_window=16,
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).to(dtype).eval()


def _ids(batch=2, seq=11, vocab=192, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


# -- exact mode: sharding is right and rounding within the derived bound -------


@pytest.mark.parametrize("site", ["0.o_proj", "1.down_proj"])
def test_row_parallel_exact_within_rounding_bound(site):
    model = tiny_llama()
    emu = HFEmulation(model, P, "exact")
    module = dict(emu.sites())[site]
    n_in = module.in_features
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 5, n_in, generator=g) * 3).to(torch.bfloat16)
    with emu:
        y = module(x).double()
    x64, w64 = x.double(), module.weight.double()
    ref = F.linear(x64, w64)
    per = n_in // P
    bound = torch.zeros_like(ref)
    for r in range(P):
        xs, ws = x64[..., r * per:(r + 1) * per], w64[:, r * per:(r + 1) * per]
        p_r = F.linear(xs, ws)
        mag = F.linear(xs.abs(), ws.abs())
        bound += _gamma(per) * mag * (1 + U_B) + U_B * p_r.abs() + (P - 1) * U_32 * p_r.abs() * (1 + U_B)
    bound += U_B * y.abs()
    err = (y - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    assert emu.calls_per_forward == 1 + 2 * 2


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-scaled"])
def test_embedding_exact_is_bitwise_and_restored(make):
    model = make()
    ids = _ids()
    emb = find_backbone(model).embed_tokens
    before = emb(ids)
    with HFEmulation(model, P, "exact"):
        during = emb(ids)
    after = emb(ids)
    # one rank holds each row and the others add exact zeros
    assert torch.equal(before, during)
    assert torch.equal(before, after)
    assert "forward" not in emb.__dict__


def test_install_remove_restores_model_bitwise():
    model = tiny_llama()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        with HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0)):
            echo = model(ids).logits
        again = model(ids).logits
    assert torch.equal(ref, again)
    assert not torch.equal(ref, echo)


def test_call_indices_restart_every_forward():
    model = tiny_llama(layers=3)
    emu = HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0), record=True)
    with emu, torch.no_grad():
        model(_ids(seed=1))
        model(_ids(seed=2))
    idx = [r.index for r in emu.records]
    assert idx == list(range(7)) * 2
    assert [r.site for r in emu.records[:3]] == ["embed", "0.o_proj", "0.down_proj"]
    calls = emu.tp.comm.stats.snapshot()["calls"]
    assert calls == {"echo/echo": 12, "exact/exact_last_call": 2}


def test_fp32_model_needs_comm_dtype_for_echo():
    model = tiny_llama(torch.float32)
    with pytest.raises(EchoConfigError, match="bf16/fp16"):
        with HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0)), torch.no_grad():
            model(_ids())
    emu = HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0), comm_dtype=torch.bfloat16, record=True)
    with emu, torch.no_grad():
        out = model(_ids()).logits
    assert out.dtype == torch.float32 and emu.records[1].partials.dtype == torch.bfloat16


def test_indivisible_width_fails_early():
    model = tiny_llama()
    with pytest.raises(EchoConfigError, match="not divisible"):
        HFEmulation(model, 5, "exact")


# -- Echo: within the quantization bound -----------------------------------------


def _group_amax(partials: torch.Tensor, g: int, hadamard: bool) -> torch.Tensor:
    """Per-element group max of each rank's (rotated) partial, summed over ranks."""
    v = partials.float().reshape(P, -1, g)
    if hadamard:
        v = fwht(v)
    amax = v.abs().amax(-1, keepdim=True).expand_as(v)
    return amax.sum(0).reshape(partials.shape[1:]).double()


@pytest.mark.parametrize("hadamard", [False, True])
def test_echo_without_feedback_within_quantization_bound(hadamard):
    model = tiny_llama()
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, feedback=False, hadamard=hadamard, exact_last_call=False)
    emu = HFEmulation(model, P, "echo", cfg, record=True)
    with emu, torch.no_grad():
        model(_ids(seq=13))
    assert len(emu.records) == 5
    worst = 0.0
    for rec in emu.records:
        s = rec.partials.double().sum(0)
        y = rec.output.double()
        bound = (1 + U_B) ** 2 * _group_amax(rec.partials, cfg.group_size, hadamard) / 7 + U_B * y.abs()
        # fp32 work in the stages (rotation, sum): a few u_32 of the magnitudes
        bound += 64 * U_32 * (rec.partials.double().abs().sum(0) + y.abs())
        err = (y - s).abs()
        assert bool((err <= bound).all()), f"{rec.site}: excess {(err - bound).max().item():.3g}"
        worst = max(worst, (err / bound.clamp_min(1e-30)).max().item())
    assert worst > 0.05  # the bound is not absurdly loose: 4-bit errors are visible


def test_echo_feedback_telescopes_over_a_real_forward():
    """Sum over the calls of one forward of (y_t - S_t) vanishes to rounding
    with feedback + exact last call; each call alone deviates at 4-bit scale."""
    model = tiny_llama(layers=3)
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, hadamard=True, exact_last_call=True)
    emu = HFEmulation(model, P, "echo", cfg, record=True)
    with emu, torch.no_grad():
        model(_ids(seq=13))
    total = torch.zeros_like(emu.records[0].output, dtype=torch.float64)
    slack = torch.zeros_like(total)
    single = 0.0
    for rec in emu.records:
        s = rec.partials.double().sum(0)
        y = rec.output.double()
        total += y - s
        mag = rec.partials.double().abs().sum(0) + y.abs()
        slack += U_B * y.abs() + 64 * U_32 * mag
        single = max(single, (y - s).abs().max().item())
    # the exact last call rounds x_r + e_r to bf16 on each rank: u_b |x_r + e_r|;
    # |e_r| is one call's error, below the previous call's deviation bound.
    last = emu.records[-1]
    prev = emu.records[-2]
    carried = (1 + U_B) ** 2 * _group_amax(prev.partials, cfg.group_size, True) / 7
    slack += U_B * (last.partials.double().abs().sum(0) + carried) * (1 + U_B)
    assert bool((total.abs() <= slack).all()), f"excess {(total.abs() - slack).max().item():.3g}"
    assert single > 10 * total.abs().max().item()


def test_batch_composition_and_quantization():
    """Groups never straddle tokens (hidden % group == 0) and chunks never
    straddle groups, so without feedback a sequence's result does not depend
    on what else is in the batch. With feedback it does, slightly: the
    stage-2 error of element i is carried by the rank owning i's chunk, and
    chunk boundaries move with the message size -- the same sum of errors,
    split differently between ranks (as in real vLLM batches)."""
    model = tiny_llama()
    a, b = _ids(batch=1, seq=9, seed=5), _ids(batch=1, seq=9, seed=6)
    with torch.no_grad():
        with HFEmulation(model, P, "echo", EchoConfig.naive(min_bytes=0)):
            alone = model(a).logits
            both = model(torch.cat([a, b])).logits
        assert torch.equal(alone[0], both[0])
        with HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0)):
            alone = model(a).logits
            both = model(torch.cat([a, b])).logits
        assert not torch.equal(alone[0], both[0])


# -- post-norm (Gemma-3) ----------------------------------------------------------


def test_gemma3_postnorm_detected_and_feedback_off_by_default():
    model = tiny_gemma3()
    assert is_postnorm(model) and not is_postnorm(tiny_llama())
    emu = HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0))
    assert emu.effective_mode == "echo" and emu.effective_config.feedback is False
    assert HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0), postnorm_policy="exact").effective_mode == "exact"
    assert HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0), postnorm_policy="feedback").effective_config.feedback
    assert HFEmulation(tiny_llama(), P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0)).effective_config.feedback


def test_gemma3_echo_runs():
    model = tiny_gemma3()
    ids = _ids()
    with HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0)), torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


# -- variants ----------------------------------------------------------------------


def test_variant_specs():
    vs = parse_variants(["exact", "naive", "default:group_size=16,first_exact_calls=2", "echo+hadamard+last"])
    assert [v.mode for v in vs] == ["exact", "echo", "echo", "echo"]
    # the ladder pins what defines it, whatever EchoConfig's defaults are
    assert vs[1].config == EchoConfig.naive(min_bytes=0, first_exact_calls=0, feedback_dtype="float32")
    assert vs[3].config == EchoConfig(min_bytes=0, first_exact_calls=0, feedback_dtype="float32",
                                      hadamard=True, feedback=True, exact_last_call=True)
    # "default" is EchoConfig() as shipped
    assert vs[2].config == EchoConfig(min_bytes=0, group_size=16, first_exact_calls=2)
    assert parse_variant("default").config == EchoConfig(min_bytes=0)
    assert vs[2].bits_per_value == 5.0 and vs[0].bits_per_value == 16.0
    assert set(PRESETS) >= {"exact", "naive", "echo", "echo+last", "echo+hadamard", "echo+hadamard+last"}
    with pytest.raises(EchoConfigError, match="unknown EchoConfig"):
        parse_variant("default:gropu_size=16")
    with pytest.raises(EchoConfigError, match="unknown variant"):
        parse_variant("fast")
    with pytest.raises(EchoConfigError, match="duplicate"):
        parse_variants(["naive", "naive"])


def test_vllm_additional_config_roundtrips_through_echoconfig():
    v = parse_variant("echo+last:group_size=64")
    extra = v.vllm_additional_config(emulate=4)
    assert extra["tp_comm"] == "echo" and extra["tp_comm_emulate"] == 4
    assert EchoConfig.from_mapping(extra, prefix="echo_") == v.config
    exact = parse_variant("exact").vllm_additional_config(emulate=3)
    assert EchoConfig.from_mapping(exact, prefix="echo_").min_bytes > 2**50  # every call exact
    assert parse_variant("exact").vllm_additional_config(emulate=0) == {}
    assert "tp_comm_emulate" not in parse_variant("naive").vllm_additional_config(emulate=0)
    assert math.isclose(parse_variant("naive").bits_per_value, 4.5)


def test_vllm_model_args_carry_the_postnorm_policy_to_the_plugin(tmp_path):
    from types import SimpleNamespace

    from echo_vllm.eval.accuracy import vllm_model_args
    from echo_vllm.vllm_glue.settings import TpCommSettings

    args = SimpleNamespace(world=4, real_tp=1, gpu_memory_utilization=0.5, max_length=2048,
                           enforce_eager=True, postnorm="exact", kv_cache_gib=None, parallel=False)
    echo = vllm_model_args(args, parse_variant("default"), tmp_path)["additional_config"]
    settings = TpCommSettings.from_additional_config(echo)
    assert settings.postnorm == "exact" and settings.emulate_world_size == 4 and settings.mode == "echo"
    # the exact baseline stays all 16-bit on a post-norm model whatever the policy
    for policy in ("exact", "no-feedback", "feedback"):
        args.postnorm = policy
        exact = vllm_model_args(args, parse_variant("exact"), tmp_path)["additional_config"]
        s, _ = TpCommSettings.from_additional_config(exact).for_model(["Gemma3ForCausalLM"])
        assert s.mode == "nccl" or s.echo.min_bytes > 2**50


def test_side_by_side_engines_get_a_fixed_kv_cache_that_vllm_accepts(tmp_path):
    """With --parallel each engine's KV cache is a fixed size (vLLM's own
    estimate counts the other engines' start-up memory); alone, vLLM sizes it."""
    import dataclasses
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    from echo_vllm.eval.accuracy import PARALLEL_KV_CACHE_GIB, vllm_model_args

    args = SimpleNamespace(world=4, real_tp=1, gpu_memory_utilization=0.25, max_length=2048,
                           enforce_eager=True, postnorm="exact", kv_cache_gib=None, parallel=True)
    margs = vllm_model_args(args, parse_variant("default"), tmp_path)
    assert margs["kv_cache_memory_bytes"] == int(PARALLEL_KV_CACHE_GIB * 2**30)
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(margs) - {"pretrained"} <= engine_fields  # lm-eval hands them to vllm.LLM
    args.kv_cache_gib = 2.5
    assert vllm_model_args(args, parse_variant("exact"), tmp_path)["kv_cache_memory_bytes"] == 5 * 2**29
    args.parallel, args.kv_cache_gib = False, None
    assert "kv_cache_memory_bytes" not in vllm_model_args(args, parse_variant("exact"), tmp_path)


def test_variant_files_have_plain_names(tmp_path):
    from types import SimpleNamespace

    from echo_vllm.eval.accuracy import variant_file

    args = SimpleNamespace(out=str(tmp_path), stem="acc")
    assert variant_file(args, "default:group_size=16,bits=4").name == "acc.variant.default_group_size_16_bits_4.json"
    assert variant_file(args, "echo+hadamard+last").name == "acc.variant.echo+hadamard+last.json"
