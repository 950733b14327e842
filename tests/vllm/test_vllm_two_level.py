"""Two-level Echo inside real vLLM 0.26 tensor parallelism: four gloo
processes, vLLM's own TP group and layers (CPU platform), the plugin's hook;
the ranks told they sit on two hosts through ``echo_host_map``.

One launch: first the TP group without a host map (vLLM's node test finds
one host: flat, with the reason), then with ``0,0,1,1`` (two-level: the
sub-groups made when the TP group is, every residual call reduced over them).
The assertions run here, against the in-process emulation (VirtualTransport,
the same config) fed the ranks' partials.
"""

import pytest
import torch

pytest.importorskip("vllm")

from echo_vllm import EchoConfig  # noqa: E402
from echo_vllm.emulation import EmulatedTP  # noqa: E402
from echo_vllm.hosts import HostMap  # noqa: E402
from echo_vllm.quant import WireLayout  # noqa: E402
from echo_vllm.wire_bytes import echo_bytes  # noqa: E402
from support.vllm_cpu import run_vllm_processes, toy_mlp_in as _mlp_in, toy_norm as _norm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORLD, LAYERS, HIDDEN, VOCAB = 4, 2, 128, 500
TOKENS = (5, 7)  # one forward pass each
ECHO = {"tp_comm": "echo", "echo_min_bytes": 0, "echo_first_exact_calls": 0}
HOST_MAP = "0,0,1,1"


def _stack():
    from support.vllm_cpu import ToyStack

    return ToyStack.random(layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, tokens=TOKENS, seed=4321)


def _topology(comm, session):
    backend = comm.backend(comm.chain.device)
    return dict(topology=backend.topology, reason=backend.topology_reason, kind=type(backend).__name__,
                hosts=backend.hosts.host_of_rank, snapshot=session.stats.snapshot())


def _without_host_map(out):
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from echo_vllm.vllm_glue.session import current

    cfg = vllm_config(tp=WORLD, additional_config=ECHO)
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        out["auto"] = _topology(ps.get_tp_group()._echo_comm, current())
    ps.destroy_model_parallel()


def _with_host_map(rank, stack, out):
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.forward_context import set_forward_context

    from echo_vllm.vllm_glue.session import current

    cfg = vllm_config(tp=WORLD, additional_config={**ECHO, "echo_host_map": HOST_MAP})
    calls = []  # (forward, partial, output)
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        tp = ps.get_tp_group()
        comm = tp._echo_comm
        hooked = type(tp)._all_reduce_out_place

        def spy(x):
            partial = x.clone()  # vLLM's CPU all-reduce works in place
            y = hooked(tp, x)
            calls.append((forward[0], partial, y.clone()))
            return y

        tp._all_reduce_out_place = spy
        emb, o, down = stack.vllm_layers()
        forward = [0]
        for forward[0], tok in enumerate(stack.ids):
            with set_forward_context(None, cfg, num_tokens=len(tok)):
                h = emb(tok)
                for layer in range(LAYERS):
                    h = h + o[layer](_norm(h))
                    h = h + down[layer](_mlp_in(h))
        tp.__dict__.pop("_all_reduce_out_place")
        out["two_level"] = _topology(comm, current())
        out["feedback_capacity"] = comm.chain.capacity_numel
        out["in_host"] = [t.world_size for t, _ in comm.backend(comm.chain.device).in_host]
        out["cross_host"] = [t.world_size for t, _ in comm.backend(comm.chain.device).cross_host]
    ps.destroy_model_parallel()
    out["calls"] = calls


def _worker(rank, world):
    from support.vllm_cpu import use_cpu_platform

    use_cpu_platform()
    from echo_vllm.vllm_glue.plugin import register

    register()
    out = {}
    _without_host_map(out)
    _with_host_map(rank, _stack(), out)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_vllm_processes(_worker, WORLD)


def test_the_node_test_finds_one_host_so_the_group_stays_flat(ranks):
    for r in ranks:
        auto = r["auto"]
        assert auto["topology"] == "flat" and auto["hosts"] == (0,) * WORLD and "one host" in auto["reason"]
        assert auto["snapshot"]["topology"] == ["flat", auto["reason"]]


def test_a_host_map_makes_the_tp_group_two_level_with_its_sub_groups(ranks):
    for r in ranks:
        two = r["two_level"]
        assert two["topology"] == "two_level" and two["kind"] == "TwoLevelBackend"
        assert two["hosts"] == (0, 0, 1, 1) and two["snapshot"]["topology"] == ["two_level", "2 hosts x 2 ranks"]
        assert r["in_host"] == [2] and r["cross_host"] == [2]  # this rank's host, and its local index's group
        # the buffer reserved for the largest batch holds a shard's errors: half the flat path's
        lay = WireLayout(2048 * HIDDEN, WORLD, 32, HIDDEN)
        assert r["feedback_capacity"] == lay.padded_numel // 2


def test_every_rank_gets_the_emulations_bits_on_the_same_partials(ranks):
    """The ranks return the same bits, and every Echo call the bits of
    EmulatedTP (virtual ranks, the same two-level config) fed the four ranks'
    partials. The second pass's last call is exact (the first pass taught the
    call count): there the ranks agree on vLLM's own sum (gloo's bf16 sum of
    four ranks rounds in its own order, not the emulation's fp32 one; the
    error it absorbs is checked bit for bit in tests/core/test_two_level.py)."""
    per_rank = [r["calls"] for r in ranks]
    per_pass = 1 + 2 * LAYERS
    assert len(per_rank[0]) == len(TOKENS) * per_pass
    config = EchoConfig.from_mapping({**ECHO, "echo_host_map": HOST_MAP}, prefix="echo_")
    ref = EmulatedTP(WORLD, config)
    for n, calls in enumerate(zip(*per_rank)):
        f, index = calls[0][0], n % per_pass
        if index == 0:
            ref.begin_forward()
        expect = ref.reduce(torch.stack([partial for _, partial, _ in calls]))
        for _, _, y in calls:
            assert torch.equal(y, calls[0][2]), (f, index)
            if not (f == 1 and index == per_pass - 1):
                assert torch.equal(y, expect), (f, index)
        if index == per_pass - 1:
            ref.end_forward()


def test_the_records_count_the_bytes_of_each_level(ranks):
    hosts = HostMap((0, 0, 1, 1))
    for rank, r in enumerate(ranks):
        snap = r["two_level"]["snapshot"]
        echo_calls = snap["calls"]["echo/echo"]
        assert snap["calls"] == {"echo/echo": echo_calls, "exact/exact_last_call": len(TOKENS) - 1}
        want = [echo_bytes(WireLayout(t * HIDDEN, WORLD, 32, HIDDEN), hosts, rank, "two_level")
                for t in TOKENS for _ in range(1 + 2 * LAYERS)]
        want = want[: echo_calls]  # the last pass's last call took the exact path
        assert snap["level_bytes"] == {"cross_host": sum(b.cross_host for b in want),
                                       "in_host": sum(b.in_host for b in want)}
