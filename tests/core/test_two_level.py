"""Two-level Echo (``echo_vllm.two_level``, ``backends.two_level``): the
reference against an independent oracle (flat Echo over H ranks whose inputs
are the host sums), the backend on virtual ranks (reference and numba
stages) and over gloo processes (2 x 2 and 2 x 3: chains with feedback, the
first and last exact calls, side calls) against the reference bit for bit,
the carried error on 1/G of the flat buffer, and the bytes each level
sends. (Its error flat in depth: tests/core/test_feedback.py, beside the
flat path's.)"""

import pytest
import torch

from echo_vllm import EchoCommunicator, EchoConfig, FeedbackChain, StackedCommunicator, VirtualTransport
from echo_vllm import quant
from echo_vllm import two_level as tl
from echo_vllm.communicator import ResidualStream, message_layout
from echo_vllm.hosts import HostMap
from echo_vllm.numbering import CallSlot
from echo_vllm.policy import Path
from echo_vllm.quant import WireLayout
from echo_vllm.spawn import run_processes
from echo_vllm.wire_bytes import echo_bytes, per_host, ring_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: (host map, rows, cols): contiguous, round-robin, three hosts; widths not a multiple of P * g
MAPS = [((0, 0, 1, 1), 5, 333), ((0, 1, 0, 1), 3, 100), ((0, 0, 0, 1, 1, 1), 4, 1000), ((0, 0, 1, 1, 2, 2), 2, 70)]


def _inputs(p: int, shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(p, *shape, generator=g) * torch.arange(1, p + 1).view(-1, *([1] * len(shape)))
    x.view(-1)[::13] *= 30  # outliers
    return x.to(dtype)


def _host_sums(xs: torch.Tensor, hosts: HostMap) -> torch.Tensor:
    """Each host's fp32 sum of its ranks' inputs, in rank order: [H, ...]."""
    flat = xs.reshape(xs.shape[0], 1, -1)
    return torch.stack([tl.host_sum_reference(flat[list(g)].transpose(0, 1))[0] for g in hosts.in_host_groups])


# -- the reference ----------------------------------------------------------------


@pytest.mark.parametrize("host_map,rows,cols", MAPS)
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("feedback", [False, True])
def test_reference_is_flat_echo_over_the_hosts_fed_their_sums(host_map, rows, cols, hadamard, feedback):
    """Two-level quantizes each g-column group of a row as flat Echo over H
    ranks does when rank h holds host h's fp32 sum: the same groups (shards
    are whole groups of the row), the same stage-2 sum over the hosts in
    order, the same shift; the output is the flat one cast once. That holds
    for a call without an incoming error (the first of a chain, and every
    call without feedback); with one, a group's stage-2 error is carried by
    the host that owns its column block, which differs between the two
    layouts (H blocks of a row flat, P two-level), so chains part there."""
    hosts = HostMap(host_map)
    p, h = hosts.world_size, hosts.hosts
    lay = WireLayout(rows * cols, p, 32, cols)
    fb = torch.zeros(p, tl.shard_layout(lay, h).padded_numel) if feedback else None
    cfg = EchoConfig(hadamard=hadamard, feedback=feedback, feedback_dtype="float32", min_bytes=0)
    flat = StackedCommunicator(cfg, VirtualTransport(h))
    chain = FeedbackChain.of(cfg, h)
    for t in range(1 if feedback else 3):
        xs = _inputs(p, (rows, cols), 10 * t + p)
        y = tl.two_level_reference(xs.reshape(p, -1), fb, lay, hosts, hadamard=hadamard)
        want = flat.all_reduce(_host_sums(xs, hosts).reshape(h, rows, cols), slot=CallSlot(t), path=Path.ECHO,
                               chain=chain)
        assert torch.equal(y.view(rows, cols), want.to(torch.bfloat16)), t


def test_reference_keeps_tokens_apart():
    """A row's bits do not depend on the rows beside it (alone, or inside a
    larger batch in either order), over a chain."""
    hosts, cols = HostMap((0, 0, 1, 1)), 200
    a, b = _inputs(4, (3, cols), 1), _inputs(4, (5, cols), 2)
    outs = {}
    for name, xs, rows in (("a", a, slice(0, 3)), ("ab", torch.cat([a, b], 1), slice(0, 3)),
                           ("ba", torch.cat([b, a], 1), slice(5, 8))):
        lay = WireLayout(xs[0].numel(), 4, 32, cols)
        fb = torch.zeros(4, tl.shard_layout(lay, 2).padded_numel)
        ys = [tl.two_level_reference((xs * (t + 1)).reshape(4, -1), fb, lay, hosts, hadamard=True, has_incoming=t > 0)
              .view(-1, cols)[rows] for t in range(2)]
        outs[name] = torch.stack(ys)
    assert torch.equal(outs["a"], outs["ab"]) and torch.equal(outs["a"], outs["ba"])


def test_a_host_sum_beyond_fp32_saturates_and_non_finite_inputs_stay_non_finite():
    big = torch.finfo(torch.bfloat16).max
    recv = torch.tensor([[[big, 1.0, float("inf"), float("nan"), -big]], [[big, 2.0, 1.0, 1.0, -big]]],
                        dtype=torch.bfloat16).transpose(0, 1)  # [1 rank, 2 senders, 5 values]
    s = tl.host_sum_reference(recv)[0]
    assert s[0].item() == torch.finfo(torch.float32).max and s[4].item() == -torch.finfo(torch.float32).max
    assert s[1].item() == 3.0 and s[2].item() == float("inf") and s[3].isnan()
    hosts, lay = HostMap((0, 0, 1, 1)), WireLayout(64, 4, 32)
    xs = torch.full((4, 64), big, dtype=torch.bfloat16)
    y = tl.two_level_reference(xs, None, lay, hosts, hadamard=True)
    assert torch.isfinite(y).all() and (y == big).all()  # the exact sum is beyond bf16's range: saturated


# -- the backend on virtual ranks -------------------------------------------------------


def _stages(name: str):
    from echo_vllm.backends import ReferenceStages

    if name == "numba":
        pytest.importorskip("numba")
        from echo_vllm.backends.numba_stages import NumbaStages

        return NumbaStages()
    return ReferenceStages()


@pytest.mark.parametrize("stages", ["reference", "numba"])
@pytest.mark.parametrize("host_map,rows,cols", MAPS)
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("rotation_seed,encoder", [(0, "absmax"), (3, "signed_mse")])
def test_virtual_backend_matches_the_reference_over_a_chain(stages, host_map, rows, cols, dt, rotation_seed, encoder):
    """Three Echo calls of a chain, then an exact call that absorbs the last
    error: outputs, absorbed inputs and the carried error, bit for bit (a
    rotation seed's flips and the encoder reach the cross-host stages)."""
    from echo_vllm.backends import TwoLevelBackend
    from echo_vllm.rotation import sign_flips

    hosts, p = HostMap(host_map), len(host_map)
    cfg = EchoConfig(min_bytes=0, topology="two_level", host_map=host_map, feedback_dtype="bfloat16",
                     rotation_seed=rotation_seed, encoder=encoder)
    flips = sign_flips(rotation_seed, cfg.group_size)
    backend = TwoLevelBackend.over(cfg, VirtualTransport(p), _stages(stages), hosts)
    # the exact path hands back its input, the carried error absorbed
    comm = StackedCommunicator(cfg, VirtualTransport(p), backend=backend, exact_all_reduce=lambda xs: xs)
    chain = FeedbackChain.of(cfg, p)
    lay = message_layout((rows, cols), p, cfg.group_size)
    n_fb = tl.shard_layout(lay, hosts.hosts).padded_numel
    assert backend.feedback_numel(lay) == n_fb == lay.padded_numel // hosts.ranks_per_host[0]
    fb = torch.zeros(p, n_fb, dtype=torch.bfloat16)
    for t in range(3):
        xs = _inputs(p, (rows, cols), 100 + t, DTYPES[dt])
        y = comm.all_reduce(xs, slot=CallSlot(t), path=Path.ECHO, chain=chain)
        want = tl.two_level_reference(xs.reshape(p, -1), fb, lay, hosts, hadamard=True, has_incoming=t > 0,
                                      flips=flips, encoder=encoder)
        assert torch.equal(y.reshape(-1), want), t
        assert torch.equal(chain.buffer(n_fb)[:, :n_fb], fb), t
    assert chain.buffer(n_fb).shape == (p, n_fb)  # the shard's, not the flat path's
    xs = _inputs(p, (rows, cols), 200, DTYPES[dt])
    absorbed = comm.all_reduce(xs, slot=CallSlot(3), path=Path.EXACT, chain=chain)
    assert torch.equal(absorbed.reshape(p, -1),
                       tl.consume_reference(xs.reshape(p, -1), fb, lay, hosts, hadamard=True, flips=flips))
    assert not torch.equal(absorbed, xs)  # the error was added: not vacuous


@pytest.mark.parametrize("stages", ["reference", "numba"])
def test_the_norm_in_the_output_stage_gives_echo_then_the_norm(stages):
    """``all_reduce_norm`` on two-level (the flat layout's output stage with
    the residual add and RMSNorm) against ``all_reduce`` then the norm, over
    a chain (tests/support/norm_chains.py, as the flat path's test)."""
    from support.norm_chains import chain_pair, check_pair

    from echo_vllm.backends import TwoLevelBackend

    def two_level(cfg, transport):
        return TwoLevelBackend.over(cfg, transport, _stages(stages), HostMap((0, 0, 1, 1)))

    check_pair(chain_pair(4, 5, 96, 4, backend=two_level), 4, "fused")


def test_auto_builds_two_level_from_the_host_map_and_counts_bytes_per_level():
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, exact_last_call=False, host_map=(0, 0, 1, 1))
    comm = StackedCommunicator(cfg, VirtualTransport(4), stream=ResidualStream(hidden_size=256))
    y = comm.all_reduce(_inputs(4, (8, 256), 5), slot=CallSlot(0))
    backend = comm.backend(y.device)
    assert type(backend).__name__ == "TwoLevelBackend" and backend.topology == "two_level"
    lay = message_layout((8, 256), 4, cfg.group_size)
    sent = echo_bytes(lay, backend.hosts, 0, "two_level")
    snap = comm.stats.snapshot()
    assert snap["level_bytes"] == {"cross_host": sent.cross_host, "in_host": sent.in_host}
    assert snap["wire_bytes"] == sent.total and sent.cross_host > 0


# -- over gloo processes --------------------------------------------------------------

#: One pass: slot 0 exact (first_exact_calls=1), 1 and 2 Echo, a side call,
#: slot 3 Echo (carries across the side call), slot 4 exact (the last call, absorbs).
PASS = ["exact", "echo", "echo", "side", "echo", "last"]
ROWS, COLS = 6, 200


def _call_inputs(p: int, dt: str, i: int) -> torch.Tensor:
    if PASS[i] == "side":  # an fp32 message: not the residual stream
        return _inputs(p, (2, 8), 500 + i, torch.float32)
    return _inputs(p, (ROWS, COLS), 300 + i + (7 if dt == "fp16" else 0), DTYPES[dt])


def _fp32_rank_order_sum(x: torch.Tensor) -> torch.Tensor:
    """The exact path of the test: every rank's tensor gathered and summed in
    fp32 in rank order (VirtualTransport.exact_all_reduce's bits)."""
    import torch.distributed as dist

    flat = x.contiguous().view(-1).view(torch.uint8)
    every = torch.empty(dist.get_world_size() * flat.numel(), dtype=torch.uint8, device=x.device)
    dist.all_gather_into_tensor(every, flat)
    return VirtualTransport(dist.get_world_size()).exact_all_reduce(every.view(dist.get_world_size(), -1)
                                                                    .view(x.dtype).view(-1, *x.shape))


def _rank(rank, world, host_map, device="cpu"):
    """One rank's pass of each dtype (tensors on ``device``: ``cuda`` takes
    GPU ``rank`` and the Triton stages over NCCL sub-groups, ``cuda:0`` the
    one GPU every rank shares); CPU results."""
    import torch.distributed as dist

    from echo_vllm.transport import ProcessGroupTransport

    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    out = {}
    for dt in DTYPES:
        cfg = EchoConfig(min_bytes=0, first_exact_calls=1, topology="two_level", host_map=host_map)
        seen = []

        def exact(x):
            seen.append(x.clone())
            if x.is_cuda and dist.get_backend() == "gloo":  # ranks sharing one GPU: gathered on the host
                return _fp32_rank_order_sum(x.cpu()).to(x.device)
            return _fp32_rank_order_sum(x)

        comm = EchoCommunicator(cfg, ProcessGroupTransport(), device=device, exact_all_reduce=exact,
                                stream=ResidualStream(hidden_size=COLS, ndim=2))
        ys, slot = [], 0
        for i, kind in enumerate(PASS):
            x = _call_inputs(world, dt, i)[rank].to(device)
            if kind == "side":
                ys.append(comm.all_reduce(x))
                continue
            ys.append(comm.all_reduce(x, slot=CallSlot(slot, last_call=kind == "last")))
            slot += 1
        backend = comm.backend(torch.device(device))
        out[dt] = ([y.cpu() for y in ys], [x.cpu() for x in seen], comm.chain.buffer(0).cpu(),
                   comm.stats.snapshot()["calls"], backend.topology)
    return out


def _reference_pass(hosts: HostMap, dt: str):
    """What every rank must see: outputs, each rank's inputs of the exact
    calls (absorbed where an error was pending), and the carried errors."""
    p = hosts.world_size
    lay = WireLayout(ROWS * COLS, p, 32, COLS)
    fb = torch.zeros(p, tl.shard_layout(lay, hosts.hosts).padded_numel, dtype=torch.bfloat16)
    exact = VirtualTransport(p).exact_all_reduce
    ys, seen, pending = [], [], False
    for i, kind in enumerate(PASS):
        xs = _call_inputs(p, dt, i)
        if kind == "echo":
            ys.append(tl.two_level_reference(xs.reshape(p, -1), fb, lay, hosts, hadamard=True, has_incoming=pending)
                      .view(ROWS, COLS))
            pending = True
            continue
        if kind == "last" and pending:
            xs = tl.consume_reference(xs.reshape(p, -1), fb, lay, hosts, hadamard=True).view(xs.shape)
            pending = False
        seen.append(xs)
        ys.append(exact(xs))
    return ys, seen, fb


def _check_ranks(hosts: HostMap, per_rank: list) -> None:
    for dt in DTYPES:
        ys, seen, fb = _reference_pass(hosts, dt)
        for rank, got in enumerate(per_rank):
            got_ys, got_seen, got_fb, calls, topology = got[dt]
            assert topology == "two_level"
            for i, (a, b) in enumerate(zip(got_ys, ys)):
                assert a.dtype == b.dtype and torch.equal(a, b), (dt, rank, i, PASS[i])
            assert len(got_seen) == len(seen) == 3  # the first call, the side call, the last call
            for a, b in zip(got_seen, seen):
                assert torch.equal(a, b[rank]), (dt, rank)
            assert torch.equal(got_fb[0, : fb.shape[1]], fb[rank])  # the last call absorbed it: left as it was
            assert calls == {"echo/echo": 3, "exact/first_exact_calls": 1, "exact/exact_last_call": 1,
                             "exact/unsupported_dtype": 1}, calls  # the fp32 side call
        assert not torch.equal(seen[2], _call_inputs(hosts.world_size, dt, 5))  # the error was absorbed


@pytest.mark.parametrize("host_map", [pytest.param((0, 0, 1, 1), id="2x2"),
                                      pytest.param((0, 0, 0, 1, 1, 1), id="2x3", marks=pytest.mark.slow)])
def test_every_gloo_rank_gets_the_references_bits(host_map):
    _check_ranks(HostMap(host_map), run_processes(_rank, len(host_map), host_map))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="two hosts of two GPUs need 4 GPUs")
def test_every_nccl_rank_gets_the_references_bits():
    """The same over NCCL, one GPU a rank: the Triton stages compiled, the
    sub-groups NCCL communicators (scripts/gpu_multi.sh runs it)."""
    host_map = (0, 0, 1, 1)
    _check_ranks(HostMap(host_map), run_processes(_rank, 4, host_map, "cuda", backend="nccl"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("host_map", [pytest.param((0, 0, 1, 1), id="2x2"),
                                      pytest.param((0, 0, 0, 0, 1, 1, 1, 1), id="2x4")])
def test_every_rank_on_one_gpu_over_gloo_gets_the_references_bits(host_map):
    """The ranks as processes sharing GPU 0 (NCCL refuses two ranks on one
    GPU): CUDA tensors, the Triton stages, the sub-groups over gloo (the
    bytes staged through the host), bf16 and fp16, feedback carried."""
    _check_ranks(HostMap(host_map), run_processes(_rank, len(host_map), host_map, "cuda:0"))


# -- bytes per level -----------------------------------------------------------------


@pytest.mark.parametrize("h,g", [(2, 2), (2, 8), (4, 8), (3, 2)])
def test_bytes_out_of_a_host_are_the_issues_arithmetic(h, g):
    """Per host, in units of N values per rank (w = 0.5625 B/value at g = 32,
    a message with no padding): 16-bit ring 2 (P-1)/P 2N, flat Echo
    (G (H-1)/H + (P-1)/P) wN, two-level 2 (H-1)/H wN across hosts."""
    from fractions import Fraction as F

    p = h * g
    hosts = HostMap(tuple(r // g for r in range(p)))
    lay = WireLayout(8 * 24576, p, 32, 24576)
    n, w = lay.numel, F(9, 16)
    assert lay.padded_numel == n  # whole chunks: the formulas' units
    ring = per_host(hosts, lambda r: ring_bytes(n, hosts, r))
    flat = per_host(hosts, lambda r: echo_bytes(lay, hosts, r, "flat"))
    two = per_host(hosts, lambda r: echo_bytes(lay, hosts, r, "two_level"))
    for host in range(h):
        assert ring[host].cross_host == F(2 * (p - 1), p) * 2 * n
        assert ring[host].in_host == (g - 1) * F(2 * (p - 1), p) * 2 * n
        assert flat[host].cross_host == (F(g * (h - 1), h) + F(p - 1, p)) * w * n
        assert flat[host].in_host == F(g * (g - 1) + (g - 1) * (p - 1), p) * w * n
        assert two[host].cross_host == F(2 * (h - 1), h) * w * n
        assert two[host].in_host == 2 * (g - 1) * n + (g - 1) * w * n


def test_one_host_sends_nothing_across_and_flat_totals_the_wire_bytes():
    lay = WireLayout(1000, 4, 32)
    one = HostMap((0, 0, 0, 0))
    for r in range(4):
        sent = echo_bytes(lay, one, r, "flat")
        assert sent.cross_host == 0 and sent.total == lay.wire_bytes_per_rank
    two = HostMap((0, 0, 1, 1))
    assert [echo_bytes(lay, two, r, "flat").total for r in range(4)] == [lay.wire_bytes_per_rank] * 4
    # the ring's crossing edges: ranks 1 and 3 send their all-gather to the other host
    assert [echo_bytes(lay, two, r, "flat").cross_host for r in range(4)] == [2 * lay.chunk_bytes, 5 * lay.chunk_bytes,
                                                                              2 * lay.chunk_bytes, 5 * lay.chunk_bytes]


def test_quant_reference_is_untouched_by_the_shard_layout():
    """The shard layout's chunks are the flat layout's (same size, chunk h of
    shard l is column block l H + h), for any row width."""
    for cols in (1, 31, 64, 333, 1000, 4096):
        for p, h in ((4, 2), (6, 2), (6, 3), (8, 2), (8, 4)):
            lay = WireLayout(3 * cols, p, 32, cols)
            sl = tl.shard_layout(lay, h)
            assert sl.chunk_bytes == lay.chunk_bytes and sl.padded_numel * (p // h) == lay.padded_numel
            x = torch.arange(3 * cols, dtype=torch.float32).view(1, -1)
            shards = tl.to_shards(x, lay, p // h)  # [1, G, rows * S]
            flat = quant.to_wire_order(x, lay).view(p, -1)
            for l in range(p // h):
                assert torch.equal(quant.to_wire_order(shards[:, l], sl).view(h, -1), flat[l * h : (l + 1) * h])
