"""The property that defines Echo: errors telescope along a forward pass.

A residual stream fed by T calls holds ``sum S_t + E_0 - E_T``: with feedback
its error stays one call's error at any depth, while naive 4-bit errors add
up (~sqrt(T) for independent partials). Plus the chain rule: call 0 starts
clean, exact calls consume the pending error, gaps and shape changes drop it
(counted), and the exact last call leaves no quantization error at all.
"""

import pytest
import torch

from echo_vllm import (
    EchoAllReduce,
    EchoCommunicator,
    EchoConfig,
    FeedbackChain,
    VirtualTransport,
)

P, TOKENS, HIDDEN = 4, 32, 512


def _partials(t: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)
    return torch.randn(P, TOKENS, HIDDEN, generator=g).to(dtype)


def _residual_errors(cfg: EchoConfig, calls: int) -> list[float]:
    """RMS error of the residual stream after each call (fp64 reference)."""
    ar = EchoAllReduce(cfg, VirtualTransport(P))
    chain = FeedbackChain(P)
    res = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    ref = torch.zeros_like(res)
    errs = []
    for t in range(calls):
        xs = _partials(t)
        res += ar.all_reduce(xs, chain, t).double()
        ref += xs.double().sum(0)
        errs.append(((res - ref).norm() / res.numel() ** 0.5).item())
    return errs


@pytest.mark.parametrize("hadamard", [False, True])
def test_echo_error_stays_flat_while_naive_grows(hadamard):
    calls = 64
    echo = _residual_errors(EchoConfig(hadamard=hadamard, exact_last_call=False), calls)
    naive = _residual_errors(EchoConfig.naive(hadamard=hadamard), calls)
    assert echo[0] == pytest.approx(naive[0], rel=1e-12)  # same first call
    # Echo: E_T is one call's stage-1 + stage-2 error at every depth.
    assert max(echo) <= 1.5 * echo[0], (echo[0], max(echo))
    # Naive: independent errors add, sqrt(64) = 8x expected; assert >= 3x.
    assert naive[-1] >= 3 * naive[0], (naive[0], naive[-1])
    assert naive[-1] > 4 * echo[-1]


def test_telescoping_identity_holds_exactly():
    """sum_t y_t == sum_t S_t - E_T (fp64 bookkeeping, fp32 inputs so no
    output rounding): the residual error IS the last carried error."""
    cfg = EchoConfig(hadamard=False, exact_last_call=False)
    ar = EchoAllReduce(cfg, VirtualTransport(P))
    chain = FeedbackChain(P)
    res = torch.zeros(TOKENS * HIDDEN, dtype=torch.float64)
    ref = torch.zeros_like(res)
    n = TOKENS * HIDDEN
    for t in range(10):
        xs = _partials(t, torch.float32)
        res += ar.all_reduce(xs, chain, t).double().reshape(-1)
        ref += xs.double().sum(0).reshape(-1)
        carried = chain.buffer(n)[:, :n].double().sum(0)
        # fp32 rounding only: each of 2 ops per call per element ~ 2^-24 rel
        tol = 1e-5 * (t + 1) * ref.abs().max().item()
        assert torch.allclose(res, ref - carried, rtol=0, atol=tol)


def test_exact_last_call_flushes_the_error():
    cfg = EchoConfig(hadamard=True, exact_last_call=True, min_bytes=0, first_exact_calls=0)
    comm = EchoCommunicator(cfg, VirtualTransport(P))
    calls = 9
    res = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    ref = torch.zeros_like(res)
    for t in range(calls):
        xs = _partials(t)
        res += comm.all_reduce(xs, t, last_call=(t == calls - 1)).double()
        ref += xs.double().sum(0)
        if t == calls - 2:
            err_before = (res - ref).abs().max().item()
    # after the exact call only bf16 roundings remain: the absorbed input is
    # rounded to bf16 per rank and the sum once more, each <= 2^-9 relative
    # (half an ulp), plus the earlier outputs' own bf16 roundings.
    err_after = (res - ref).abs().max().item()
    assert err_after < err_before / 5
    snap = comm.stats.snapshot()["calls"]
    assert snap == {"echo/echo": calls - 1, "exact/exact_last_call": 1}
    assert comm.chain.stats.carried == calls - 1 and not comm.chain.pending


def test_exact_call_mid_chain_consumes_pending_error():
    cfg = EchoConfig(hadamard=True, exact_last_call=False, min_bytes=1 << 30, first_exact_calls=0)  # all exact
    echo_cfg = cfg.replace(min_bytes=0)
    transport = VirtualTransport(P)
    comm = EchoCommunicator(echo_cfg, transport)
    xs0, xs1 = _partials(0), _partials(1)
    y0 = comm.all_reduce(xs0, 0)
    pending = comm.chain.buffer(1)[:, : TOKENS * HIDDEN].clone()
    comm.config = cfg  # next call falls below min_bytes -> exact path
    comm.echo.config = cfg
    y1 = comm.all_reduce(xs1, 1)
    assert not comm.chain.pending
    assert comm.stats.snapshot()["calls"]["exact/below_min_bytes"] == 1
    # what the exact path reduced: x + rot^-1(e), rounded per rank to bf16
    from echo_vllm.rotation import fwht

    e = fwht(pending.float().reshape(P, -1, 32)).reshape(P, TOKENS, HIDDEN) / 32
    absorbed = (xs1.float() + e).bfloat16()
    assert torch.equal(y1, transport.all_reduce_exact(absorbed))
    # and the two outputs together carry no error beyond bf16 rounding
    total = y0.double() + y1.double()
    exact = xs0.double().sum(0) + xs1.double().sum(0)
    one_call = (y0.double() - xs0.double().sum(0)).abs().max()
    assert (total - exact).abs().max() < one_call / 5


def test_chain_rule_restarts_and_drops():
    cfg = EchoConfig(min_bytes=0, exact_last_call=False)
    ar = EchoAllReduce(cfg, VirtualTransport(P))
    chain = FeedbackChain(P)
    xs = _partials(0)
    ar.all_reduce(xs, chain, 0)
    assert chain.pending
    ar.all_reduce(xs, chain, 1)  # carries
    ar.all_reduce(xs, chain, 0)  # new forward pass: starts clean, not a drop
    ar.all_reduce(xs, chain, 2)  # gap 0 -> 2: dropped and counted
    ar.all_reduce(xs[:, :16], chain, 3)  # other shape: dropped and counted
    ar.all_reduce(xs[:, :16], chain, None)  # outside a forward pass: never carries
    assert chain.stats.carried == 1
    assert chain.stats.dropped == 2
    assert chain.stats.started_clean == 5
    assert not chain.pending  # a call outside a forward pass leaves nothing


def test_call_zero_ignores_stale_buffer():
    """Whatever the buffer holds, call 0 gives the same bits as a fresh chain."""
    cfg = EchoConfig(min_bytes=0)
    ar = EchoAllReduce(cfg, VirtualTransport(P))
    used = FeedbackChain(P)
    for t in range(3):
        ar.all_reduce(_partials(t), used, t)
    fresh = FeedbackChain(P)
    xs = _partials(7)
    assert torch.equal(ar.all_reduce(xs, used, 0), ar.all_reduce(xs, fresh, 0))


def test_feedback_off_is_stateless():
    cfg = EchoConfig.naive(min_bytes=0)
    ar = EchoAllReduce(cfg, VirtualTransport(P))
    chain = FeedbackChain(P)
    xs = _partials(3)
    a = ar.all_reduce(xs, chain, 0)
    b = ar.all_reduce(xs, chain, 1)
    assert torch.equal(a, b) and not chain.pending


def test_bf16_feedback_buffer_still_telescopes():
    calls = 32
    errs = _residual_errors(EchoConfig(feedback_dtype="bfloat16", exact_last_call=False), calls)
    assert max(errs) <= 1.5 * errs[0]
