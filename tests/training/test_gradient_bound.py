"""Gradients of a two-layer TP model under Echo vs exact, within a derived bound.

The model: two residual blocks ``x_{k+1} = x_k + g(f(x_k) A_k B_k)``, each
a column-parallel linear (A) feeding a row-parallel one (B) -- Megatron's
MLP pair without the activation, so that the backward pass is linear and
the bound below propagates exactly -- over P = 4 emulated ranks, fp64
weights and compute, bf16 all-reduce messages, loss ``sum(x_2 * C)``. Each
direction makes two Echo calls (forward: g of block 0 then 1; backward: f
of block 1 then 0), every call quantized (no exact first/last calls), so the
second call of each chain carries the first one's error.

Per call (``_echo_call``), from the quantizer alone: with u_r = rot(x_r) +
e_r per group of g values (rot = the Walsh-Hadamard rotation, or identity),
stage 1 rounds to scale s1_r = bf16(amax|u_r| / 7) and errs by at most
s1_r / 2 per value; stage 2 sums the P dequantized chunks (|D| <= 7 s1_r) and
rounds again at s2 <= sum_r s1_r, erring by at most s2 / 2 on the owner's
chunk -- two quantizations per value, whatever P. The call returns ``S +
rot^-1(E_in) - rot^-1(E_out)`` plus fp32/bf16 roundings; E_out (the error it
carries on) is the sum of those quantization errors and is stored in bf16
(2^-8 relative, twice on the owner's chunk). The error of the second call's
output telescopes with the first's: what is left is one call's error, plus
the first call's error taken through the second block (|M| = sum_r |A_r||B_r|
applied to it), plus the storage rounding.

Both runs are compared with the ideal model (real arithmetic, no
quantization, no bf16 messages): |echo - ideal| <= B_echo and |exact -
ideal| <= B_exact elementwise, so |echo - exact| <= B_echo + B_exact for the
output, the input gradient and every weight gradient. The test can fail: in
each case one block is made small so that the first call's error must
telescope away, and the naive 4-bit run (no feedback) breaks the Echo bound.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from echo_vllm import EchoConfig
from echo_vllm.quant import input_scale
from echo_vllm.training import TPComm, TPCommConfig, TPGroup, copy_to_tp, reduce_from_tp
from echo_vllm.training.layers import ColumnParallelLinear, RowParallelLinear

P, G = 4, 32
T, H, FF = 64, 128, 256  # T*H = 8192: a multiple of P * 8 * G, so no padding
U32, UB, U64 = 2.0**-24, 2.0**-8, 2.0**-53  # unit roundoffs: fp32, bf16, fp64
FLT_MIN = 2.0**-126  # Echo clamps scales to it, in its wire domain (x times quant.input_scale)
GAMMA5_32 = 5 * U32 / (1 - 5 * U32)  # an fp32 Walsh-Hadamard of 32 = 2^5 values: 5 rounded levels
# |e| <= CQ * s per quantization: 1/2 for round-to-nearest, plus the fp32
# rounding of u * fl(1/s) (2 roundings of a value |u/s| <= 7.03: < 2^-20)
CQ = 0.5 + 2.0**-19
# stored carried error vs the true one: fl32 of the error, bf16 storage, on the
# owner's chunk + stage-2 error in fp32 and bf16 again:
# (1+u32)^2 (1+ub)^2 - 1 <= 2.01 ub
KSTORE = 2.01 * UB
# fp64 matmul chains (x A B, its backward): gamma_n |.||.||.| with n <= T + H + FF
GAM64 = 1.01 * (T + H + FF) * U64


class TwoLayerTP(nn.Module):
    def __init__(self, group: TPGroup, stds: tuple[float, float], seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.up, self.down = nn.ModuleList(), nn.ModuleList()
        for std in stds:
            a = torch.randn(FF, H, generator=gen, dtype=torch.float64) * std
            b = torch.randn(H, FF, generator=gen, dtype=torch.float64) * std
            self.up.append(ColumnParallelLinear(group, [a], torch.float64))
            self.down.append(RowParallelLinear(group, b, torch.float64))

    def forward(self, x, comm: TPComm):
        comm.begin_forward(2)
        for up, down in zip(self.up, self.down):
            x = x + reduce_from_tp(down(up(copy_to_tp(x, comm))), comm, x.dtype)
        comm.end_forward()
        return x

    def mats(self, k: int):
        """Per-rank A_r [P, H, FF/P] and B_r [P, FF/P, H] of block k (x A B)."""
        return self.up[k].weight.detach().transpose(1, 2), self.down[k].weight.detach().transpose(1, 2)


def _run(mode: str, stds, hadamard: bool) -> dict:
    cfg = EchoConfig(min_bytes=0, hadamard=hadamard, first_exact_calls=0, exact_last_call=False)
    comm = TPComm(TPCommConfig(mode=mode, forward=cfg, backward=cfg), TPGroup.virtual(P))
    model = TwoLayerTP(comm.group, stds)
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(T, H, generator=gen, dtype=torch.float64).requires_grad_()
    c = torch.randn(T, H, generator=gen, dtype=torch.float64)
    rec = []
    comm.set_trace(rec)
    x2 = model(x0, comm)
    (x2 * c).sum().backward()
    calls = {(r.direction, r.index): r for r in rec}
    out = {"x2": x2.detach(), "gx0": x0.grad, "calls": calls, "model": model, "x0": x0.detach(), "c": c,
           "comm": comm}
    for k in range(2):
        out[f"gA{k}"] = model.up[k].weight.grad.transpose(1, 2)  # [P, H, FF/P]
        out[f"gB{k}"] = model.down[k].weight.grad.transpose(1, 2)  # [P, FF/P, H]
    return out


def _grp(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(*v.shape[:-1], -1, G)


def _per_elem(v: torch.Tensor) -> torch.Tensor:
    """[..., groups] -> [..., groups * G] (a group's value on each element)."""
    return v.unsqueeze(-1).expand(*v.shape, G).reshape(*v.shape[:-1], -1)


def _grp_mean(v: torch.Tensor) -> torch.Tensor:
    """|rot^-1(v)| <= the mean of |v| over the group (rot^-1 = W / g, W = +-1)."""
    return _per_elem(_grp(v).mean(-1))


def _echo_call(x: torch.Tensor, y: torch.Tensor, ein: torch.Tensor | None, hadamard: bool):
    """One Echo call of per-rank messages ``x`` [P, N] (bf16 values) with output
    ``y`` [N] and a per-rank bound ``ein`` [P, N] (rotated domain) on the
    stored incoming error. Returns (Q, Hn, eout): |rot^-1(E_out)| <= Q, and
    |y - S - rot^-1(E_in) + rot^-1(E_out)| <= Hn (both [N]); eout [P, N]
    bounds each rank's carried error E_out,r (rotated domain)."""
    x = x.double().reshape(P, -1)
    n = x.shape[1]
    xg = _grp(x)
    if hadamard:
        w = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(G)] for i in range(G)], dtype=torch.float64)
        l1 = _per_elem(xg.abs().sum(-1))
        # |fl32(W x)| <= |W x| + gamma_5 sum|x|; |W x| in fp64 to within 5 u64 sum|x|
        ux = (xg @ w).abs().reshape(P, n) + (GAMMA5_32 + 5 * U64) * l1
        rho1 = GAMMA5_32 * l1
    else:
        ux, rho1 = x.abs(), torch.zeros_like(x)
    if ein is not None:  # u = fl32(rot x + e)
        ux = (ux + ein) * (1 + U32)
        rho1 = rho1 + U32 * ux
    floor = FLT_MIN / input_scale(G, hadamard)  # the clamp, in the units of x used here
    s1 = (_grp(ux).amax(-1) / 7 * (1 + U32) ** 2 * (1 + UB)).clamp_min(floor)  # [P, groups]
    s2 = (s1.sum(0) * (1 + (P - 1) * U32) * (1 + U32) ** 2 * (1 + UB)).clamp_min(floor)  # [groups]
    rho2 = _per_elem(U32 * (P - 1) * 7 * s1.sum(0))  # the fp32 rank-order sum of |D1| <= 7 s1
    own = torch.arange(n) // (n // P)  # chunk j is reduced by rank j
    eout = CQ * _per_elem(s1) + CQ * _per_elem(s2).unsqueeze(0) * (own.unsqueeze(0) == torch.arange(P).unsqueeze(1))
    if hadamard:
        q = _grp_mean(eout.sum(0))
        hn = _grp_mean(rho1.sum(0) + rho2) + GAMMA5_32 * 7 * _per_elem(s2)  # + inverse W in fp32
    else:
        q, hn = eout.sum(0), rho1.sum(0) + rho2
    return q, hn + UB * y.double().reshape(-1).abs(), eout  # + bf16 output cast


def _exact_call(x: torch.Tensor, y: torch.Tensor):
    """The 16-bit path: fp32 rank-order sum (P - 1 roundings of partial sums
    <= sum|x_r|), then bf16."""
    x = x.double().reshape(P, -1)
    return U32 * (P - 1) * x.abs().sum(0) + UB * y.double().reshape(-1).abs()


def _bounds(run: dict, kind: str, hadamard: bool) -> dict:
    """Elementwise bounds on |run - ideal| for x2, gx0 and the weight grads."""
    m, x0, c, calls = run["model"], run["x0"], run["c"], run["calls"]
    (a0, b0), (a1, b1) = m.mats(0), m.mats(1)

    def call(direction, index, ein=None):
        r = calls[(direction, index)]
        assert r.path == ("echo" if kind == "echo" else "exact")
        if kind == "echo":
            return _echo_call(r.x, r.y, ein, hadamard)
        return torch.zeros(T * H, dtype=torch.float64), _exact_call(r.x, r.y), None

    def msg(direction, index):  # sum_r |X_r| [T, H]
        return calls[(direction, index)].x.double().abs().sum(0)

    def absmm(v, *mats):  # |v| |M1| |M2| ... summed over ranks
        return sum(_chain(v.abs(), [mm[r].abs() for mm in mats]) for r in range(P))

    def view(v):
        return v.reshape(T, H)

    # forward. x1 = x0 + y0, y0 = S(X0) - eps0 + n0; X0_r = bf16(p0_r) with
    # |X0_r - p0_r| <= ub |X0_r| and p0_r = fp64 x0 A0_r B0_r (gamma |x0||A0||B0|)
    q0, h0, e0 = call("forward", 0)
    x1 = x0 + calls[("forward", 0)].y.double()
    d1 = UB * msg("forward", 0) + GAM64 * absmm(x0, a0, b0) + view(h0) + U64 * x1.abs()  # |dx1 + eps0|
    ein = None if e0 is None else e0 * (1 + KSTORE)
    q1, h1, _ = call("forward", 1, ein)
    q0, q1 = view(q0), view(q1)
    b1m = UB * msg("forward", 1) + GAM64 * absmm(x1, a1, b1)
    # x2 - ideal = d1 (1 + M1) - eps0 M1 + b1 + (stored - true E0) - eps1 + n1
    x2 = d1 + absmm(d1, a1, b1) + absmm(q0, a1, b1) + b1m + KSTORE * q0 + q1 + view(h1) + U64 * run["x2"].abs()
    dx1 = d1 + q0  # |x1 - ideal| (no telescoping yet)

    # backward. g1 = C + z0, z0 = S(X'0) - eps'0 + n'0 with X'0_r = bf16(C B1_r^T A1_r^T)
    bq0, bh0, be0 = call("backward", 0)
    g1 = c + calls[("backward", 0)].y.double()
    bt1, at1 = b1.transpose(1, 2), a1.transpose(1, 2)
    bt0, at0 = b0.transpose(1, 2), a0.transpose(1, 2)
    dg = UB * msg("backward", 0) + GAM64 * absmm(c, bt1, at1) + view(bh0) + U64 * g1.abs()  # |dg1 + eps'0|
    ein = None if be0 is None else be0 * (1 + KSTORE)
    bq1, bh1, _ = call("backward", 1, ein)
    bq0, bq1 = view(bq0), view(bq1)
    bm = UB * msg("backward", 1) + GAM64 * absmm(g1, bt0, at0)
    gx0 = dg + absmm(dg, bt0, at0) + absmm(bq0, bt0, at0) + bm + KSTORE * bq0 + bq1 + view(bh1) + U64 * run["gx0"].abs()
    dg1 = dg + bq0  # |g1 - ideal|

    out = {"x2": x2, "gx0": gx0}
    # block 1: grad A1_r = x1^T (C B1_r^T), grad B1_r = (x1 A1_r)^T C; x1 off by dx1, C exact
    out["gA1"] = torch.stack([dx1.T @ (c @ bt1[r]).abs() + GAM64 * x1.abs().T @ (c.abs() @ bt1[r].abs())
                              for r in range(P)])
    out["gB1"] = torch.stack([(dx1 @ a1[r].abs()).T @ c.abs() + GAM64 * (x1.abs() @ a1[r].abs()).T @ c.abs()
                              for r in range(P)])
    # block 0: grad A0_r = x0^T (g1 B0_r^T), grad B0_r = (x0 A0_r)^T g1; x0 exact, g1 off by dg1
    out["gA0"] = torch.stack([x0.abs().T @ (dg1 @ bt0[r].abs()) + GAM64 * x0.abs().T @ (g1.abs() @ bt0[r].abs())
                              for r in range(P)])
    out["gB0"] = torch.stack([(x0 @ a0[r]).abs().T @ dg1 + GAM64 * (x0.abs() @ a0[r].abs()).T @ g1.abs()
                              for r in range(P)])
    return out


def _chain(v, mats):
    for mm in mats:
        v = v @ mm
    return v


KEYS = ("x2", "gx0", "gA0", "gB0", "gA1", "gB1")


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("sharp", ["forward", "backward"])
def test_echo_gradients_within_derived_bound(sharp, hadamard):
    # "forward": block 0 large, block 1 small, so the forward chain's first
    # error must cancel in the second call; "backward": the mirror image for
    # the backward chain (whose first call is block 1's)
    stds = (0.1, 1e-3) if sharp == "forward" else (1e-3, 0.1)
    runs = {mode: _run(mode, stds, hadamard) for mode in ("exact", "echo", "naive")}
    for mode in ("echo", "naive"):
        assert {r.path for r in runs[mode]["calls"].values()} == {"echo"}
    stats = runs["echo"]["comm"].stats()
    assert stats["forward"]["chain"]["carried"] == 1 and stats["backward"]["chain"]["carried"] == 1
    b_echo = _bounds(runs["echo"], "echo", hadamard)
    b_exact = _bounds(runs["exact"], "exact", hadamard)
    for key in KEYS:
        err = (runs["echo"][key] - runs["exact"][key]).abs()
        bound = b_echo[key] + b_exact[key]
        assert bool((err <= bound).all()), (key, (err - bound).max().item())
        assert err.max() > 0, key  # Echo did change the numbers
    if hadamard:
        # A rotated error is spread over g values by W / g: the elementwise
        # worst case (every value at s/2, all signs aligned) is ~sqrt(3 g)
        # above the typical size, so no elementwise bound can tell one
        # call's error from two here; the rotation-off cases check that.
        return
    # not vacuous: without feedback the first call's error stays, and breaks
    # the bound; the telescoped bound is far below one call's error
    key = "x2" if sharp == "forward" else "gx0"
    naive_err = (runs["naive"][key] - runs["exact"][key]).abs()
    assert bool((naive_err > b_echo[key] + b_exact[key]).any()), key
    assert (b_echo[key] + b_exact[key]).max() < naive_err.max() / 2
