"""Echo's all-reduce (``all_reduce(path=Path.ECHO)``: Echo whatever the policy says)
over real gloo process groups (P = 2, 3, 4, one ``EchoCommunicator`` per
rank) and in-process virtual ranks (``StackedCommunicator``): same bits
everywhere, error within the derived bound, clear errors for bad input."""

import math

import pytest
import torch

from echo_vllm import (
    EchoCommunicator,
    EchoConfig,
    EchoConfigError,
    EchoShapeMismatch,
    FeedbackChain,
    ProcessGroupTransport,
    StackedCommunicator,
    VirtualTransport,
)
from echo_vllm.numbering import CallSlot
from echo_vllm.policy import Path
from echo_vllm.quant import WireLayout
from echo_vllm.spawn import run_processes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (dtype, shape, hadamard): none of the sizes is a multiple of P * 8 * group
CASES = [
    ("bf16", (7, 333), False),
    ("fp16", (5, 97), True),
    ("fp32", (1, 1), False),
    ("bf16", (3, 1000), True),
]
CALLS = 3  # consecutive calls of one chain: the feedback path is compared too


def _inputs(rank: int, case_id: int, call: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case_id + 10 * call + rank)
    x = torch.randn(shape, generator=g) * (1 + rank)
    x.view(-1)[:: 11] *= 20  # some outliers
    return x.to(dtype)


def _worker(rank, world, cases):
    transport = ProcessGroupTransport()
    results = []
    for cid, (dt, shape, hadamard) in enumerate(cases):
        cfg = EchoConfig(min_bytes=0, hadamard=hadamard)
        comm = EchoCommunicator(cfg, transport)
        chain = FeedbackChain(1)
        outs = [
            comm.all_reduce(_inputs(rank, cid, t, shape, DTYPES[dt]), slot=CallSlot(t), path=Path.ECHO, chain=chain)
            for t in range(CALLS)
        ]
        results.append(outs)
    # mismatched sizes must raise on every rank, not hang
    comm = EchoCommunicator(EchoConfig(min_bytes=0), transport)
    try:
        comm.all_reduce(torch.zeros(100 + rank, dtype=torch.bfloat16), path=Path.ECHO)
        mismatch = "no error"
    except EchoShapeMismatch as e:
        mismatch = str(e)
    # the exact path still works afterwards: 16-bit sum of rank+1
    exact = comm.all_reduce(torch.full((4,), float(rank + 1), dtype=torch.bfloat16), path=Path.EXACT)
    return results, mismatch, exact


def _virtual(world, cases):
    results = []
    for cid, (dt, shape, hadamard) in enumerate(cases):
        cfg = EchoConfig(min_bytes=0, hadamard=hadamard)
        comm = StackedCommunicator(cfg, VirtualTransport(world))
        chain = FeedbackChain(world)
        outs = []
        for t in range(CALLS):
            xs = torch.stack([_inputs(r, cid, t, shape, DTYPES[dt]) for r in range(world)])
            outs.append(comm.all_reduce(xs, slot=CallSlot(t), path=Path.ECHO, chain=chain))
        results.append(outs)
    return results


def _one_call_bound(xs: torch.Tensor, g: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Element-wise bound on |y - sum(x)| for one call with no incoming error
    and no rotation: each stage-1 error <= s1_r/2 with s1_r = bf16(amax_r/7)
    <= amax_r/7 * (1 + 2^-8); the stage-2 sum's group max is <= sum_r
    (amax_r + s1_r/2), giving s2 likewise; plus half an ulp of the output
    cast. Groups are row-aligned: each row (last dim) is cut into groups of
    g from its first column."""
    p = xs.shape[0]
    cols = xs.shape[-1] if xs.dim() > 1 else 1
    rows = xs.double().reshape(p, -1, cols)
    pad = (-cols) % g
    grouped = torch.nn.functional.pad(rows, (0, pad)).reshape(p, rows.shape[1], -1, g)
    amax = grouped.abs().amax(-1)  # [P, rows, groups per row]
    s1 = amax / 7 * (1 + 2**-8)
    s2 = (amax + s1 / 2).sum(0) / 7 * (1 + 2**-8)
    per_group = s1.sum(0) / 2 + s2 / 2
    bound = per_group.repeat_interleave(g, dim=-1)[..., :cols]
    exact = rows.sum(0)
    ulp_half = (exact.abs() + bound) * (torch.finfo(out_dtype).eps / 2)
    return (bound + ulp_half).reshape(xs.shape[1:])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_matches_virtual_and_bound(world):
    per_rank = run_processes(_worker, world, CASES)
    virtual = _virtual(world, CASES)
    for cid, (dt, shape, hadamard) in enumerate(CASES):
        for t in range(CALLS):
            ref = per_rank[0][0][cid][t]
            assert ref.dtype == DTYPES[dt] and ref.shape == shape
            for r in range(1, world):
                assert torch.equal(per_rank[r][0][cid][t], ref), "ranks disagree"
            assert torch.equal(virtual[cid][t], ref), "virtual transport differs"
        if not hadamard:
            xs = torch.stack([_inputs(r, cid, 0, shape, DTYPES[dt]) for r in range(world)])
            err = (per_rank[0][0][cid][0].double() - xs.double().sum(0)).abs()
            assert torch.all(err <= _one_call_bound(xs, 32, DTYPES[dt]))
    for r in range(world):
        assert "disagree" in per_rank[r][1]
        assert torch.equal(
            per_rank[r][2], torch.full((4,), world * (world + 1) / 2, dtype=torch.bfloat16)
        )


def test_virtual_one_call_bound_many_shapes():
    for world in (2, 3, 4):
        for n in (1, 31, 33 * 32, 1000 * 32 + 5):
            torch.manual_seed(n + world)
            xs = torch.randn(world, n).bfloat16()
            comm = StackedCommunicator(EchoConfig(min_bytes=0, hadamard=False), VirtualTransport(world))
            y = comm.all_reduce(xs, path=Path.ECHO)
            err = (y.double() - xs.double().sum(0)).abs()
            assert torch.all(err <= _one_call_bound(xs, 32, torch.bfloat16))


def test_world_size_one_is_rejected():
    class One(VirtualTransport):
        def __init__(self):
            self.world_size = 1
            self.local_ranks = (0,)

    for cls in (EchoCommunicator, StackedCommunicator):
        with pytest.raises(EchoConfigError, match="at least 2 ranks"):
            cls(EchoConfig(), One())
    with pytest.raises(ValueError, match="world_size >= 2"):
        VirtualTransport(1)


def test_one_rank_communicator_refuses_a_transport_of_several_local_ranks():
    with pytest.raises(EchoConfigError, match="StackedCommunicator"):
        EchoCommunicator(EchoConfig(), VirtualTransport(4))


def test_bad_inputs_are_rejected():
    comm = StackedCommunicator(EchoConfig(), VirtualTransport(4))
    with pytest.raises(ValueError, match="stacked"):
        comm.all_reduce(torch.zeros(3, 64), path=Path.ECHO)
    with pytest.raises(TypeError, match="floating-point"):
        comm.all_reduce(torch.zeros(4, 64, dtype=torch.int32), path=Path.ECHO)


def test_each_rank_alone_computes_the_virtual_ranks_bits():
    """A process of a real group holds one rank (R = 1); the virtual
    transport computes all P at once. Per rank r, alone: its stage-1 wire and
    feedback row, its reduced chunk (stage 2 on what it received, owning
    chunk r) and the output it decodes from the chunks gathered from every
    rank are the bits of the batched call."""
    from echo_vllm import quant

    world, n = 3, 4000
    torch.manual_seed(0)
    xs = torch.randn(world, n).bfloat16()
    cfg = EchoConfig(min_bytes=0)
    t = VirtualTransport(world)
    comm = StackedCommunicator(cfg, t)
    lay = WireLayout(n, world, cfg.group_size)
    fb = torch.zeros(world, lay.padded_numel)
    wire = quant.stage1_reference(xs, fb, lay, hadamard=True)
    recv = t.all_to_all(wire)
    q2 = quant.stage2_reference(recv, fb, list(range(world)), lay)
    y = comm.all_reduce(xs, path=Path.ECHO)
    assert torch.equal(quant.output_reference(t.all_gather(q2), lay, torch.bfloat16, hadamard=True), y)
    chunks = []
    for r in range(world):
        fb_r = torch.zeros(1, lay.padded_numel)
        wire_r = quant.stage1_reference(xs[r : r + 1], fb_r, lay, hadamard=True)
        assert torch.equal(wire_r[0], wire[r])
        recv_r = torch.stack([wire[i, r] for i in range(world)]).unsqueeze(0)  # chunk r of every rank
        assert torch.equal(recv_r[0], recv[r])
        chunk = quant.stage2_reference(recv_r, fb_r, [r], lay)
        assert torch.equal(chunk[0], q2[r])
        assert torch.equal(fb_r[0], fb[r])  # stage-1 error, plus stage 2's on chunk r
        chunks.append(chunk[0])
    assert len({c.numpy().tobytes() for c in chunks}) == world  # distinct per rank: not vacuous
    # every rank's all-gather assembles these same bytes (chunk i from rank
    # i), and decoding is a pure function of them: one decode covers all ranks
    assert torch.equal(quant.output_reference(torch.stack(chunks), lay, torch.bfloat16, hadamard=True), y)


# -- any shape, dtype and magnitude: finite in, finite out, every CPU backend the same --

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from support.extremes import PATTERNS, extreme_inputs  # noqa: E402

from echo_vllm.config import FEEDBACK_DTYPES, SUPPORTED_GROUP_SIZES  # noqa: E402

try:
    import numba  # noqa: F401
except Exception:  # pragma: no cover - depends on the installation
    CPU_BACKENDS = ("reference",)
else:
    CPU_BACKENDS = ("reference", "numba")


def _scaled_inputs(world, rows, cols, dtype, seed, log2_magnitude):
    """Log-normal values around 2**log2_magnitude, clipped to max / P per
    rank (so the exact sum is within the range), of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.finfo(dtype).max
    x = torch.randn(world, rows, cols, generator=gen, dtype=torch.float64)
    x = x * torch.exp(2 * torch.randn(world, rows, 1, generator=gen, dtype=torch.float64)) * 2.0**log2_magnitude
    return x.clamp(-big / world, big / world).to(dtype)


@st.composite
def echo_calls(draw):
    """A chain of 1-3 calls on P virtual ranks: group size, dtype, rotation,
    feedback format, message shape, and per call an input pattern of
    support.extremes or log-normal values at any magnitude of the dtype."""
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    world = draw(st.sampled_from([2, 3, 4, 8]))
    rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 300))
    fi = torch.finfo(dtype)
    lo, hi = int(math.log2(fi.tiny * fi.eps)), int(math.log2(fi.max))
    xs = []
    for _ in range(draw(st.integers(1, 3)) + 1):  # the last one is absorbed by an exact call
        seed = draw(st.integers(0, 2**16))
        pattern = draw(st.sampled_from((*PATTERNS, "scaled")))
        if pattern == "scaled":
            xs.append(_scaled_inputs(world, rows, cols, dtype, seed, draw(st.integers(lo, hi))))
        else:  # rows of a 12-row sweep (or of cancelling pairs, subnormals), any of its magnitudes
            picked = draw(st.lists(st.integers(0, 11), min_size=rows, max_size=rows))
            xs.append(extreme_inputs(pattern, world, 12, cols, dtype, seed)[:, picked])
    cfg = dict(group_size=draw(st.sampled_from(SUPPORTED_GROUP_SIZES)), hadamard=draw(st.booleans()),
               feedback_dtype=draw(st.sampled_from(FEEDBACK_DTYPES)))
    return world, cfg, xs


def _run_chain(world, cfg, xs, backend):
    """The chain's Echo outputs, then the input of its last call, exact, with
    the carried error absorbed (its ``exact_all_reduce`` hands it back)."""
    config = EchoConfig(min_bytes=0, first_exact_calls=0, backend=backend, **cfg)
    comm = StackedCommunicator(config, VirtualTransport(world), exact_all_reduce=lambda xs: xs)
    chain = FeedbackChain.of(config, world, "cpu")
    outs = [comm.all_reduce(x, slot=CallSlot(t), path=Path.ECHO, chain=chain) for t, x in enumerate(xs[:-1])]
    return outs + [comm.all_reduce(xs[-1], slot=CallSlot(len(xs) - 1), path=Path.EXACT, chain=chain)]


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(echo_calls())
def test_any_finite_input_gives_finite_outputs_the_same_on_every_cpu_backend(case):
    """Echo calls of any shape, dtype, group size and magnitude (inputs
    finite, each call's exact sum within the range, P <= 8: the envelope of
    quant's Range section): every output is finite, every rank's input plus
    the carried error an exact call absorbs is finite, and the numba loops
    give the references' bits."""
    world, cfg, xs = case
    results = {b: _run_chain(world, cfg, xs, b) for b in CPU_BACKENDS}
    for t, y in enumerate(results["reference"]):
        assert torch.isfinite(y).all(), f"call {t} of {len(xs)} ({cfg}, P={world}, {xs[t].dtype}): non-finite"
    for b in CPU_BACKENDS[1:]:
        for t, (a, r) in enumerate(zip(results[b], results["reference"])):
            assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                               r.view(torch.int16 if r.element_size() == 2 else torch.int32)), f"{b}, call {t}"
