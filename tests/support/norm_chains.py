"""Echo then the norm, two ways, over a chain of calls: one function the
core tests (reference backend) and the kernel tests (Triton stages, in the
interpreter worker) share."""

from __future__ import annotations

import torch

from echo_vllm import CallSlot, EchoConfig, StackedCommunicator, VirtualTransport
from echo_vllm.communicator import EXACT_PATH_NORM
from echo_vllm.rmsnorm import NormOperands

EPS = 1e-6


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bits, any NaN equal to any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    differ = (_bits(got.cpu()) != _bits(want.cpu())) & ~(got.cpu().float().isnan() & want.cpu().float().isnan())
    assert not differ.any(), f"{what}: {int(differ.sum())} of {differ.numel()} differ, first at {differ.nonzero()[0]}"


def partials(world, rows, cols, call, dtype=torch.bfloat16):
    """The ranks' partial outputs ``[world, rows, cols]`` of one call."""
    g = torch.Generator().manual_seed(100 * call + cols)
    x = torch.randn(world, rows, cols, generator=g) * torch.exp(torch.randn(world, rows, cols, generator=g))
    return x.to(dtype)


def weight(cols, dtype=torch.bfloat16):
    """A norm weight near 1."""
    return (1 + 0.1 * torch.randn(cols, generator=torch.Generator().manual_seed(cols))).to(dtype)


def chain_pair(world, rows, cols, calls, backend=None, first_exact=1, device="cpu"):
    """Two communicators on the same partials: one ``all_reduce`` then
    ``norm_into``, one ``all_reduce_norm``; ``(outputs, residuals, stats)``
    of each. ``backend(config, transport)`` builds their backend (default:
    ``config.backend``'s)."""
    cfg = EchoConfig(min_bytes=0, first_exact_calls=first_exact, exact_last_call=False)
    w = weight(cols).to(device)
    runs = []
    for fused in (False, True):
        comm = StackedCommunicator(cfg, VirtualTransport(world), device=device,
                                   backend=backend(cfg, VirtualTransport(world)) if backend else None)
        res = torch.randn(rows, cols, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(device)
        outs = []
        for c in range(calls):
            x = partials(world, rows, cols, c).to(device)
            # call 0: rms_norm; call 1: rms_norm whose input is kept as the residual (a decoder's
            # first norm, the embedding's); then the add + norm, in place
            keep = c == 1
            norm = NormOperands(w, EPS, residual=res if c > 1 else None,
                                residual_out=torch.full_like(res, float("nan")) if keep else None)
            if fused:
                out, new = comm.all_reduce_norm(x, norm, slot=CallSlot(c))
            else:
                out, new = norm.apply(comm.all_reduce(x, slot=CallSlot(c)))
            outs.append(out.clone())
            if keep:
                assert new.data_ptr() == norm.residual_out.data_ptr()
                outs.append(new.clone())
                res = new
        runs.append((outs, res.clone(), comm.stats.snapshot()))
    return runs


def check_pair(runs, calls, fused_as):
    """:func:`chain_pair`'s two runs agree bit for bit and in their counts;
    the norm ran ``fused_as`` on every Echo call (call 0 took the exact path)."""
    (outs_a, res_a, stats_a), (outs_b, res_b, stats_b) = runs
    assert len(outs_a) == len(outs_b) == calls + (calls > 1)  # and the kept output of call 1
    for c, (b, a) in enumerate(zip(outs_b, outs_a)):
        assert_same(b, a, f"output {c}")
    assert_same(res_b, res_a, "residual after the chain")
    assert stats_a["calls"] == stats_b["calls"] and stats_a["norm_calls"] == {}
    assert stats_b["norm_calls"] == {EXACT_PATH_NORM: 1, fused_as: calls - 1}, stats_b["norm_calls"]
    assert stats_b["feedback_carried"] == stats_a["feedback_carried"] == calls - 2
