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
  with amax_r the group max of rank r's (rotated) partial; the fp32
  roundings on the path are counted one by one in :func:`_echo_call`.
* Echo with feedback and an exact last call: y_t = S_t + E_{t-1} - E_t with
  E_0 = E_T = 0, so the deviations of one forward sum to zero up to the
  roundings: ``|sum_t (y_t - S_t)| <= u_b sum_t |y_t| + u_b sum_r |x_r,T + e_r|
  + (the carried errors' storage roundings: u_store |E| each) + (fp32
  terms)`` -- checked against that, while single calls deviate by 4-bit
  amounts (so the check is not vacuous).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from echo_vllm.config import EchoConfig, EchoConfigError
from echo_vllm.eval.hf_emulation import HFEmulation, find_backbone, postnorm_decision
from echo_vllm.eval.variants import PRESETS, parse_variant, parse_variants
from echo_vllm.rotation import fwht

transformers = pytest.importorskip("transformers")

U_B = 2.0**-8
U_32 = 2.0**-24
P = 3
G = 32  # EchoConfig's default group size, used by every config here
GAMMA_5 = 5 * U_32 / (1 - 5 * U_32)  # fp32 FWHT of g = 32 = 2^5 values: 5 rounded levels
#: s = bf16(fp32(amax * fp32(1/7))) <= K amax / 7: two fp32 roundings, one bf16
K = (1 + U_B) * (1 + U_32) ** 2
#: |u - q s| <= s (1/2 + EPS_Q): y = fp32(u * fp32(1/s)) is off u/s by <= 2.0001
#: U_32 |u/s| <= 2.0001 U_32 * 7 K < 15 U_32 before rounding to q (a clamp to
#: +-7 gives less: u - 7s <= amax - 7s <= 7s (K - 1) < s/2)
EPS_Q = 15 * U_32


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
    emu = HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0), trace=True)
    with emu, torch.no_grad():
        model(_ids(seed=1))
        model(_ids(seed=2))
    idx = [r.index for r in emu.traced]
    assert idx == list(range(7)) * 2
    assert [r.site for r in emu.traced[:3]] == ["embed", "0.o_proj", "0.down_proj"]
    calls = emu.tp.comm.stats.snapshot()["calls"]
    assert calls == {"echo/echo": 12, "exact/exact_last_call": 2}


def test_fp32_model_needs_comm_dtype_for_echo():
    model = tiny_llama(torch.float32)
    with pytest.raises(EchoConfigError, match="bf16/fp16"):
        with HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0)), torch.no_grad():
            model(_ids())
    emu = HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0), comm_dtype=torch.bfloat16, trace=True)
    with emu, torch.no_grad():
        out = model(_ids()).logits
    assert out.dtype == torch.float32 and emu.traced[1].partials.dtype == torch.bfloat16


def test_indivisible_width_fails_early():
    model = tiny_llama()
    with pytest.raises(EchoConfigError, match="not divisible"):
        HFEmulation(model, 5, "exact")


# -- Echo: within the quantization bound -----------------------------------------


def _echo_call(partials: torch.Tensor, hadamard: bool, e_in: torch.Tensor | float = 0.0) -> dict:
    """Bounds for one Echo call, per rank and group ([P, groups, 1] or
    [groups, 1], rotated domain), from the partials [P, ...] and a bound
    ``e_in`` on the incoming carried error (0 on a call without one).

    Assumes no underflow (|values| >= 2^-126 or exactly 0). Per rank r:
    A_r = amax(fl(rot p_r)) is production's (same fp32 FWHT); rot in fp32
    is off W p_r by rho_r <= gamma_5 sum_grp |p_r|; u_r = fl(rot p_r + E_in)
    has amax <= au_r = (A_r + e_in)(1 + U_32); s1_r <= K au_r / 7 and the
    stage-1 error |e1_r| <= b1_r = s1_r (1/2 + EPS_Q), |D1_r| <= 7 s1_r. The
    stage-2 fp32 sum of P decoded chunks: P - 1 roundings, each <= U_32
    sum_r 7 s1_r (1 + U_32)^P =: U_32 a2 (a2 bounds its amax too); then s2
    <= K a2 / 7, |e2| <= b2 = s2 (1/2 + EPS_Q), |D2| <= 7 s2 <= K a2. The
    inverse rotation of D2 in fp32 is off by gamma_5 sum_grp |D2| / g <=
    gamma_5 K a2 (1/g is a power of two: exact).
    """
    v = partials.float().reshape(P, -1, G)
    a = (fwht(v) if hadamard else v).abs().amax(-1, keepdim=True).double()
    rho = GAMMA_5 * v.double().abs().sum(-1, keepdim=True) if hadamard else torch.zeros_like(a)
    au = (a + e_in) * (1 + U_32)
    s1 = K * au / 7
    b1 = s1 * (0.5 + EPS_Q)
    a2 = (7 * s1).sum(0) * (1 + U_32) ** P
    b2 = K * a2 / 7 * (0.5 + EPS_Q)
    out_rot = GAMMA_5 * K * a2 if hadamard else torch.zeros_like(a2)
    return dict(rho=rho, au=au, b1=b1, a2=a2, b2=b2, out_rot=out_rot)


def _per_element(group_bound: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A bound per (rotated) group [groups, 1] as a bound per element of the
    output (shape of ``like``): the inverse rotation W / g maps an error v of
    the group to |(W v / g)_i| <= max_grp |v|, so it carries over unchanged."""
    return group_bound.expand(-1, G).reshape(like.shape)


def _one_call_bound(rec, hadamard: bool) -> torch.Tensor:
    """Per-element bound on |y - S| of a quantized call without carried error:
    the rotation's rounding and the stage-1 errors per rank, the stage-2
    sum's P - 1 fp32 roundings and its error, the inverse rotation's
    rounding, and the bf16 cast of y (U_B |y|). Without the rotations' terms
    this stays below the docstring's (1 + U_B)^2 sum_r A_r / 7 (stage 1 has
    one factor 1 + U_B, not two: 2^-9 of room, against ~50 U_32 of fp32
    roundings); rho and out_rot add <= ~130 U_32 of it with Hadamard."""
    y = rec.output.double()
    c = _echo_call(rec.partials, hadamard)
    per_group = (c["rho"] + c["b1"]).sum(0) + (P - 1) * U_32 * c["a2"] + c["b2"] + c["out_rot"]
    return _per_element(per_group, y) + U_B * y.abs()


@pytest.mark.parametrize("hadamard", [False, True])
def test_echo_without_feedback_within_quantization_bound(hadamard):
    model = tiny_llama()
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, feedback=False, hadamard=hadamard, exact_last_call=False)
    emu = HFEmulation(model, P, "echo", cfg, trace=True)
    with emu, torch.no_grad():
        model(_ids(seq=13))
    assert len(emu.traced) == 5 and cfg.group_size == G
    worst = 0.0
    for rec in emu.traced:
        s = rec.partials.double().sum(0)
        y = rec.output.double()
        bound = _one_call_bound(rec, hadamard)
        err = (y - s).abs()
        assert bool((err <= bound).all()), f"{rec.site}: excess {(err - bound).max().item():.3g}"
        worst = max(worst, (err / bound.clamp_min(1e-30)).max().item())
    assert worst > 0.05  # the bound is not absurdly loose: 4-bit errors are visible


@pytest.mark.parametrize("feedback_dtype", ["bfloat16", "float32"])
def test_echo_feedback_telescopes_over_a_real_forward(feedback_dtype):
    """Sum over the calls of one forward of (y_t - S_t) vanishes to rounding
    with feedback + exact last call; each call alone deviates at 4-bit scale."""
    model = tiny_llama(layers=3)
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, hadamard=True, exact_last_call=True,
                     feedback_dtype=feedback_dtype)
    u_s = U_B if feedback_dtype == "bfloat16" else 0.0  # unit roundoff of storing an fp32 error
    emu = HFEmulation(model, P, "echo", cfg, trace=True)
    with emu, torch.no_grad():
        model(_ids(seq=13))
    *echo_calls, last = emu.traced
    assert emu.tp.comm.stats.snapshot()["calls"] == {"echo/echo": len(echo_calls), "exact/exact_last_call": 1}
    total = torch.zeros_like(last.output, dtype=torch.float64)
    slack = torch.zeros_like(total)
    mag = torch.zeros_like(total)
    single = 0.0
    e_bound = torch.zeros(P, total.numel() // G, 1, dtype=torch.float64)  # |E| per rank, group
    for rec in echo_calls:
        s = rec.partials.double().sum(0)
        y = rec.output.double()
        total += y - s
        mag += rec.partials.double().abs().sum(0) + y.abs()
        single = max(single, (y - s).abs().max().item())
        # y = S + rot^-1(E_in - E_out + leak): with the bounds of _echo_call,
        # leak = rho + fl(rot p + E_in) (U_32 au, counted on call 0 too) +
        # the fp32 subtraction u - D1 (U_32 b1) and its storage (u_s b1),
        # per rank; the stage-2 sum (P - 1 roundings) and its e2 (U_32 b2);
        # the owner's E1 + e2 (U_32) and its storage (u_s), |E1 + e2| <=
        # (1 + u_s) b1 + b2 (b1 of any rank: the owner is not tracked); then
        # the inverse rotation's rounding and the bf16 cast of y.
        c = _echo_call(rec.partials, True, e_bound)
        own = (U_32 + u_s * (1 + u_s)) * (1 + U_32) * ((1 + u_s) * c["b1"].amax(0) + c["b2"])
        leak = (c["rho"] + U_32 * c["au"] + (U_32 + u_s * (1 + u_s)) * c["b1"]).sum(0)
        leak += (P - 1) * U_32 * c["a2"] + U_32 * c["b2"] + own + c["out_rot"]
        slack += _per_element(leak, y) + U_B * y.abs()
        # what each rank carries out (as stored; every rank bounded as an owner)
        e_bound = (1 + u_s) * (1 + U_32) ** 2 * ((1 + u_s) * c["b1"] + c["b2"])
    # the exact last call rounds x_r + rot^-1(E_r) (rot^-1 in fp32: gamma_5 |E|)
    # to fp32 (U_32) then bf16 (U_B) on each rank, sums in fp32 (P - 1
    # roundings) and rounds the sum to bf16 (U_B |y|); |rot^-1(E_r)| <= |E_r|.
    s = last.partials.double().sum(0)
    y = last.output.double()
    total += y - s
    mag += last.partials.double().abs().sum(0) + y.abs()
    e = torch.stack([_per_element(e_bound[r], y) for r in range(P)])
    xa = last.partials.double().abs() + e * (1 + GAMMA_5)
    absorbed = xa * (1 + U_32) * (1 + U_B)
    slack += (GAMMA_5 * e + U_32 * xa + U_B * absorbed).sum(0) + U_B * y.abs()
    slack += (P - 1) * U_32 * absorbed.sum(0) * (1 + U_32) ** P
    slack += 4 * (len(echo_calls) + 1) * 2.0**-53 * mag  # fp64 here: sum(0), -, += per call
    assert bool((total.abs() <= slack).all()), f"excess {(total.abs() - slack).max().item():.3g}"
    assert single > 10 * total.abs().max().item()
    assert single > 2 * slack.max().item()  # the bound is far below one call's 4-bit error


def test_batch_composition_and_quantization():
    """Groups never straddle tokens and a value's owner rank follows from its
    column alone (the position-owned layout), so a sequence's logits do not
    depend on what else is in the batch -- without feedback, and with it
    (the carried error of a position stays on the same rank whatever the
    message size)."""
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
        assert torch.equal(alone[0], both[0])


# -- post-norm (Gemma-3) ----------------------------------------------------------


def test_gemma3_postnorm_detected_and_feedback_off_by_default():
    model = tiny_gemma3()
    assert postnorm_decision(model).postnorm and not postnorm_decision(tiny_llama()).postnorm
    emu = HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0))
    assert emu.effective_mode == "naive" and emu.effective_config.feedback is False
    assert HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0), postnorm_policy="exact").effective_mode == "exact"
    assert HFEmulation(model, P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0), postnorm_policy="feedback").effective_config.feedback
    assert HFEmulation(tiny_llama(), P, "echo", EchoConfig(min_bytes=0, first_exact_calls=0)).effective_config.feedback


def _gemma3_run(model, ids, mode, config, policy="no-feedback"):
    emu = HFEmulation(model, P, mode, config, postnorm_policy=policy, trace=True)
    with emu, torch.no_grad():
        logits = model(ids).logits.double()
    return emu, logits


def _quantized_calls_within_one_call_bound(emu) -> float:
    """max over the quantized calls of |y - S| / (one call's bound): <= 1
    when no carried error reaches the outputs (0/0, an all-zero group such
    as the padding token's embedding, counts as 0)."""
    cfg = emu.effective_config
    calls = emu.traced[:-1] if cfg.exact_last_call else emu.traced
    worst = 0.0
    for rec in calls:
        err = (rec.output.double() - rec.partials.double().sum(0)).abs()
        worst = max(worst, (err / _one_call_bound(rec, cfg.hadamard)).nan_to_num(nan=0.0).max().item())
    return worst


def test_gemma3_echo_runs():
    """Echo on a post-norm model by default: feedback off, so every call is
    one call's 4-bit error and the model stays as close to exact as naive
    4-bit; the feedback run the policy prevents fails the same checks."""
    model = tiny_gemma3()
    # Real Gemma-3's consecutive all-reduce outputs differ in scale by orders
    # of magnitude (EVAL.md, "Post-norm models"): that is what makes a carried error
    # destroy it. A random tiny model's do not, so scale o_proj by 2^8 (exact
    # in bf16). The exact model does not see it: the post-attention RMSNorm
    # divides o_proj's output by its own RMS (eps 1e-6 only shrinks further
    # against mean x^2 now 2^16 times larger).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(2.0**8)
    ids = _ids()
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0)
    _, exact = _gemma3_run(model, ids, "exact", cfg)
    emu, echo = _gemma3_run(model, ids, "echo", cfg)
    assert emu.effective_mode == "naive" and emu.effective_config == cfg.replace(feedback=False)
    assert emu.tp.comm.stats.snapshot()["calls"] == {"echo/echo": 4, "exact/exact_last_call": 1}
    _, naive = _gemma3_run(model, ids, "echo", EchoConfig.naive(min_bytes=0))

    def rel_err(logits):
        return ((logits - exact).norm() / exact.norm()).item()

    # every quantized call is within the derived one-call bound (a carried
    # error would add rot^-1(E_in - E_out) to it)
    assert _quantized_calls_within_one_call_bound(emu) <= 1
    assert torch.isfinite(echo).all()
    # Without feedback Echo's per-call error bound is naive's (the same
    # quantizer; Hadamard and the exact last call only change which rounding
    # errors occur), and both runs push them through the same network: so
    # Echo's logit error is naive's up to the draw of those errors; 2x
    # allows for the draw.
    assert rel_err(echo) <= 2 * rel_err(naive), (rel_err(echo), rel_err(naive))
    # the checks can fail: with feedback on, the carried error of a call
    # 2^8 larger or smaller enters each output and the model diverges
    fb, diverged = _gemma3_run(model, ids, "echo", cfg, policy="feedback")
    assert fb.effective_config.feedback
    assert _quantized_calls_within_one_call_bound(fb) > 10
    assert rel_err(diverged) > 2 * rel_err(naive), (rel_err(diverged), rel_err(naive))


# -- variants ----------------------------------------------------------------------


def test_variant_specs():
    vs = parse_variants(["exact", "naive", "default:group_size=16,first_exact_calls=2", "echo+hadamard+last"])
    assert [v.mode for v in vs] == ["exact", "naive", "echo", "echo"]
    # the ladder pins what defines it, whatever EchoConfig's defaults are
    assert vs[1].config == EchoConfig.naive(min_bytes=0, first_exact_calls=0, feedback_dtype="float32")
    assert vs[3].config == EchoConfig(min_bytes=0, first_exact_calls=0, feedback_dtype="float32",
                                      hadamard=True, feedback=True, exact_last_call=True)
    # "default" is EchoConfig() as shipped
    assert vs[2].config == EchoConfig(min_bytes=0, group_size=16, first_exact_calls=2)
    assert parse_variant("default").config == EchoConfig(min_bytes=0)
    assert vs[2].bits_per_value == 5.0 and vs[0].bits_per_value == 16.0
    assert set(PRESETS) >= {"exact", "naive", "echo", "echo+last", "echo+hadamard", "echo+hadamard+last"}
    with pytest.raises(EchoConfigError, match="unknown option 'gropu_size'; did you mean 'group_size'"):
        parse_variant("default:gropu_size=16")
    with pytest.raises(EchoConfigError, match="unknown variant"):
        parse_variant("fast")
    with pytest.raises(EchoConfigError, match="duplicate"):
        parse_variants(["naive", "naive"])
    signed = parse_variant("echo:encoder=signed_mse")  # EchoConfig.encoder, as any field
    assert signed.config == _preset_config("echo").replace(encoder="signed_mse") and signed.bits_per_value == 4.5
    with pytest.raises(EchoConfigError, match="encoder='mse': choose one of absmax, signed_mse"):
        parse_variant("echo:encoder=mse")


def _preset_config(name: str) -> EchoConfig:
    """The config a preset names, with the variants' min_bytes=0."""
    return EchoConfig(**{"min_bytes": 0, **PRESETS[name][1]})


def test_vllm_additional_config_roundtrips_through_echoconfig():
    signed = parse_variant("default:encoder=signed_mse").vllm_additional_config(emulate=3)
    assert signed["echo_encoder"] == "signed_mse"
    assert EchoConfig.from_mapping(signed, prefix="echo_").encoder == "signed_mse"
    v = parse_variant("echo+last:group_size=64")
    extra = v.vllm_additional_config(emulate=4)
    assert extra["tp_comm"] == "echo" and extra["tp_comm_emulate"] == 4
    assert EchoConfig.from_mapping(extra, prefix="echo_") == v.config
    # the exact baseline is vLLM's own all-reduce: the emulation's 16-bit sum of the same partials
    assert parse_variant("exact").vllm_additional_config(emulate=3) == {"tp_comm": "nccl", "tp_comm_emulate": 3}
    assert parse_variant("exact").vllm_additional_config(emulate=0) == {}
    naive = parse_variant("naive")
    assert naive.mode == "naive" and not EchoConfig.from_mapping(naive.vllm_additional_config(emulate=2),
                                                                  prefix="echo_").feedback
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
    assert settings.postnorm == "exact" and settings.emulate_world_size == 4 and settings.tp_comm == "echo"
    # the exact baseline stays all 16-bit on a post-norm model whatever the policy
    for policy in ("exact", "no-feedback", "feedback"):
        args.postnorm = policy
        exact = vllm_model_args(args, parse_variant("exact"), tmp_path)["additional_config"]
        s, _ = TpCommSettings.from_additional_config(exact).for_model(["Gemma3ForCausalLM"])
        assert s.tp_comm == "nccl" and s.emulate_world_size == 4


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


def test_side_by_side_kv_cache_fits_small_gpus():
    from echo_vllm.eval.accuracy import PARALLEL_KV_CACHE_GIB, parallel_kv_cache_bytes

    h200, l4 = 150_000_000_000, 24_000_000_000
    assert parallel_kv_cache_bytes(0.8 / 3, h200) == int(PARALLEL_KV_CACHE_GIB * 2**30)
    assert parallel_kv_cache_bytes(0.8 / 3, l4) == int(0.8 / 3 * l4 / 2)  # half the 6.4 GB share
    assert parallel_kv_cache_bytes(0.8 / 3, None) == int(PARALLEL_KV_CACHE_GIB * 2**30)  # unknown GPU


def test_variant_files_have_plain_names(tmp_path):
    from types import SimpleNamespace

    from echo_vllm.eval.accuracy import variant_file

    args = SimpleNamespace(out=str(tmp_path), stem="acc")
    assert variant_file(args, "default:group_size=16,bits=4").name == "acc.variant.default_group_size_16_bits_4.json"
    assert variant_file(args, "echo+hadamard+last").name == "acc.variant.echo+hadamard+last.json"
