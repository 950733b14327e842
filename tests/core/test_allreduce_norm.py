"""Echo followed by the residual add and RMSNorm, through the communicator:
the same bits as Echo then ``rmsnorm.norm_into`` on every path (fused in the
output phase, unfused past the widest row, the exact path), counted by how
the norm ran; over gloo processes the ranks agree."""

from __future__ import annotations

import torch
from support.norm_chains import EPS, assert_same, chain_pair, check_pair, partials, weight

from echo_vllm import (CallSlot, EchoCommunicator, EchoConfig, ProcessGroupTransport, StackedCommunicator,
                        VirtualTransport)
from echo_vllm.rmsnorm import NormOperands, norm_into
from echo_vllm.rmsnorm_plan import MAX_NORM_COLS
from echo_vllm.spawn import run_processes


def test_fused_norm_matches_echo_then_norm_over_a_chain():
    """Reference backend, 4 calls (call 0 exact, feedback carried through
    calls 1-3): the outputs, the residual stream, the chain's counts."""
    check_pair(chain_pair(3, 5, 96, 4), 4, "fused")


def test_rows_past_the_widest_take_the_unfused_path_with_the_reason():
    runs = chain_pair(2, 2, MAX_NORM_COLS + 8, 3)
    reason = f"rows of {MAX_NORM_COLS + 8} values (the fused norm holds rows of up to {MAX_NORM_COLS})"
    check_pair(runs, 3, reason)


def _gloo_worker(rank, world):
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, exact_last_call=False)
    comm = EchoCommunicator(cfg, ProcessGroupTransport())
    w = weight(64)
    res = torch.zeros(4, 64, dtype=torch.bfloat16)
    outs = []
    for c in range(2):
        out, _ = comm.all_reduce_norm(partials(world, 4, 64, c)[rank], NormOperands(w, EPS, residual=res),
                                      slot=CallSlot(c))
        outs.append(out)
    return outs, res, comm.stats.snapshot()["norm_calls"]


def test_gloo_ranks_agree_with_the_virtual_ranks():
    world = 3
    got = run_processes(_gloo_worker, world, timeout_s=120)
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, exact_last_call=False)
    comm = StackedCommunicator(cfg, VirtualTransport(world))
    w, res = weight(64), torch.zeros(4, 64, dtype=torch.bfloat16)
    want = [comm.all_reduce_norm(partials(world, 4, 64, c), NormOperands(w, EPS, residual=res), slot=CallSlot(c))[0]
            for c in range(2)]
    for outs, r, counts in got:
        for c in range(2):
            assert_same(outs[c], want[c], f"call {c}")
        assert_same(r, res, "residual")
        assert counts == {"fused": 2}


def test_norm_into_writes_where_it_is_told():
    """The unfused path: out and residual_out given, the residual itself is
    left alone; without them, the new residual replaces it."""
    y = torch.randn(3, 16).to(torch.bfloat16)
    res = torch.randn(3, 16).to(torch.bfloat16)
    res0, out, res_out = res.clone(), torch.empty(3, 16, dtype=torch.bfloat16), torch.empty(3, 16, dtype=torch.bfloat16)
    o, r = norm_into(y, None, EPS, residual=res, out=out, residual_out=res_out)
    assert o is out and r is res_out and torch.equal(res, res0)
    o2, r2 = norm_into(y, None, EPS, residual=res)
    assert r2 is res and torch.equal(o2, out) and torch.equal(res, res_out)
