"""Echo inside real vLLM 0.26 tensor parallelism: two gloo processes, vLLM's
own groups and layers (CPU platform), the plugin's hook.

One launch (two ranks forked from the vLLM tests' server, ``support.vllm_cpu``)
runs every check; each rank returns what it saw and the assertions run here, against the
in-process Echo reference (VirtualTransport) fed the same partials.
"""

import pytest
import torch

pytest.importorskip("vllm")

from echo_vllm import EchoConfig  # noqa: E402
from echo_vllm.emulation import EmulatedTP, row_parallel_partials, vocab_parallel_partials  # noqa: E402
from support.vllm_cpu import run_vllm_processes, toy_mlp_in as _mlp_in, toy_norm as _norm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYERS = 3  # 1 + 2 * LAYERS all-reduces per forward pass
HIDDEN, VOCAB = 128, 1000
TOKENS = (5, 3, 8)  # one forward pass each; other sizes reuse the buffer
SIDE_TOKENS = 64  # the side-call passes: 64 x 128 values per call
# every call eligible for Echo (the defaults keep the first calls in 16-bit)
ECHO = {"tp_comm": "echo", "echo_min_bytes": 0, "echo_first_exact_calls": 0}


def _stack():
    from support.vllm_cpu import ToyStack

    return ToyStack.random(layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, tokens=TOKENS, seed=1234)


def _guard_rail():
    """1. guard rails fire where the TP group is created, naming the flag:
    the error's text, or None if none was raised."""
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from echo_vllm.vllm_glue import EchoEngineConfigError

    bad = vllm_config(
        tp=2,
        additional_config=ECHO,
        pass_config=dict(fuse_allreduce_rms=True, fi_allreduce_fusion_max_size_mb=64),
    )
    message = None
    with set_current_vllm_config(bad):
        try:
            init_model_parallel(bad)
        except EchoEngineConfigError as e:
            message = str(e)
    ps.destroy_model_parallel()
    return message


def _spy_main_calls(tp, calls, tagged, forward_no):
    """Wrap the TP group's hooked all-reduce: each call appends ``(forward,
    index, partial, output)`` to ``calls`` and the token count the per-forward
    host hook stored to ``tagged``."""
    from echo_vllm.vllm_glue import compat
    from echo_vllm.vllm_glue.tracking import CALL_INDEX_KEY, TOKENS_KEY

    hooked = type(tp)._all_reduce_out_place

    def spy(x):
        partial = x.clone()  # vLLM's CPU all-reduce works in place
        y = hooked(tp, x)
        kw = compat.forward_kwargs()
        index = kw[CALL_INDEX_KEY] - 1 if kw is not None else None
        tagged.append(kw.get(TOKENS_KEY) if kw is not None else None)
        calls.append((forward_no[0], index, partial, y.clone()))
        return y

    tp._all_reduce_out_place = spy


def _main_passes(cfg, stack, forward_no, comm, out):
    """2. Echo on: real layers, three forward passes, every call recorded;
    the stats and the chain's state after them."""
    from vllm.forward_context import set_forward_context

    from echo_vllm.vllm_glue import current_stats

    emb, o, down = stack.vllm_layers()
    for f, tok in enumerate(stack.ids):
        forward_no[0] = f
        with set_forward_context(None, cfg, num_tokens=len(tok)):
            h = emb(tok)
            for layer in range(LAYERS):
                h = h + o[layer](_norm(h))
                h = h + down[layer](_mlp_in(h))
    out["main_stats"] = current_stats().snapshot()
    chain = comm.chain
    out["chain"] = dict(
        carried=chain.stats.carried, dropped=chain.stats.dropped, pending=chain.pending,
        capacity=chain.capacity_numel,
    )


def _extra_calls(tp, cfg, g, forward_no, out):
    """3. calls Echo must leave to vLLM: counted with their reason."""
    from vllm.forward_context import set_forward_context

    from echo_vllm.vllm_glue import current_stats

    forward_no[0] = "extra"
    extra_in = {
        "fp32": torch.randn(4, HIDDEN, generator=g),
        "int32": torch.randint(-100, 100, (4, HIDDEN), generator=g, dtype=torch.int32),
        "3d": torch.randn(2, 4, HIDDEN, generator=g).bfloat16(),
        "no_context": torch.randn(4, HIDDEN, generator=g).bfloat16(),
    }
    extra = {}
    with set_forward_context(None, cfg, num_tokens=4):
        for name in ("fp32", "int32", "3d"):
            extra[name] = (extra_in[name].clone(), tp.all_reduce(extra_in[name].clone()))
    extra["no_context"] = (extra_in["no_context"].clone(), tp.all_reduce(extra_in["no_context"].clone()))
    out["extra"] = extra
    out["extra_stats"] = current_stats().snapshot()


def _other_group(rank, out):
    """4. another group of the same ranks: untouched by the hook."""
    from vllm.distributed import parallel_state as ps

    from echo_vllm.vllm_glue import current_stats

    other = ps.init_model_parallel_group(
        [[0, 1]], ps.get_world_group().local_rank, "gloo", group_name="echo_test_other"
    )
    x = torch.full((4, HIDDEN), float(rank + 1), dtype=torch.bfloat16)
    out["other"] = ("_echo_comm" in other.__dict__, other.all_reduce(x))
    out["other_stats"] = current_stats().snapshot()


def _echo_on(rank, stack, out):
    """Sections 2-4, in one TP group with Echo on."""
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = vllm_config(tp=2, additional_config=ECHO)
    calls = []  # (forward, index, partial, output)
    tagged = []  # token count the per-forward host hook stored
    forward_no = [None]
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        tp = ps.get_tp_group()
        out["sessions"] = sorted(
            name for name, ref in ps._groups.items() if ref() is not None and "_echo_comm" in ref().__dict__
        )
        out["tp_name"] = tp.unique_name
        _spy_main_calls(tp, calls, tagged, forward_no)
        _main_passes(cfg, stack, forward_no, tp._echo_comm, out)
        g = torch.Generator().manual_seed(7 + rank)
        _extra_calls(tp, cfg, g, forward_no, out)
        _other_group(rank, out)
        tp.__dict__.pop("_all_reduce_out_place")
    ps.destroy_model_parallel()
    out["calls"] = calls
    out["tagged"] = tagged


def _graph_replays(stack):
    """5. a CUDA-graph engine (capture and replays simulated on CPU, through
    the calls vLLM makes): replays are counted like the passes they stand
    for. gloo cannot be captured; pretend it can (as pynccl), so that
    capture takes the eager decisions."""
    from support.vllm_cpu import init_model_parallel, vllm_config
    from support.vllm_graphs import replay_accounting
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from echo_vllm.vllm_glue.session import current

    cfg = vllm_config(tp=2, additional_config=ECHO)
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        emb, o, down = stack.vllm_layers()
        session = current()
        assert session.communicator is ps.get_tp_group()._echo_comm
        session.communicator.transport.capturable = True

        def run(n):
            h = emb(stack.ids[2][:n])
            for layer in range(LAYERS):
                h = h + o[layer](_norm(h))
                h = h + down[layer](_mlp_in(h))

        accounting = replay_accounting(session, cfg, run)
    ps.destroy_model_parallel()
    return accounting


def _min_bytes_auto():
    """6. min_bytes=auto (the default): the crossover is measured on the
    group at start, for the model's rows (a model-less config here: its
    shape stands in)."""
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from echo_vllm.vllm_glue import compat as glue_compat
    from echo_vllm.vllm_glue.session import current

    saved = glue_compat.hidden_size, glue_compat.max_num_batched_tokens
    glue_compat.hidden_size, glue_compat.max_num_batched_tokens = (lambda c: HIDDEN), (lambda c: 512)
    auto = vllm_config(tp=2, additional_config={"tp_comm": "echo"})
    try:
        with set_current_vllm_config(auto):
            init_model_parallel(auto)
            comm = current().communicator
            got = dict(config_min=comm.config.min_bytes, config_max=comm.config.max_bytes,
                       snapshot=current().stats.snapshot())
        ps.destroy_model_parallel()
    finally:
        glue_compat.hidden_size, glue_compat.max_num_batched_tokens = saved
    return got


def _side_passes(rank, cfg, layers, ids, label):
    """The learn, plain and side passes of :func:`_side_calls` (``label[0]``
    names the running one): the side pass adds a Mamba2 gated norm and
    MiniMax-M2's TP RMSNorm after each layer's first all-reduce."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.mamba.mamba_mixer2 import Mixer2RMSNormGated
    from vllm.model_executor.layers.minimax_rms_norm import MiniMaxText01RMSNormTP

    emb, o, down = layers
    mamba_norm = Mixer2RMSNormGated(2 * HIDDEN, 1)
    qk_norm = MiniMaxText01RMSNormTP(HIDDEN)
    g = torch.Generator().manual_seed(5 + rank)
    for label[0] in ("learn", "plain", "side"):
        with set_forward_context(None, cfg, num_tokens=SIDE_TOKENS):
            h = emb(ids)
            for layer in range(LAYERS):
                h = h + o[layer](_norm(h))
                if label[0] == "side":  # their outputs feed nothing here: only the chain matters
                    shard = torch.randn(SIDE_TOKENS, HIDDEN, generator=g).bfloat16()
                    mamba_norm(shard, torch.randn(SIDE_TOKENS, HIDDEN, generator=g).bfloat16())
                    qk_norm(torch.randn(SIDE_TOKENS, HIDDEN // 2, generator=g).bfloat16())
                h = h + down[layer](_mlp_in(h))


def _nan_pass(rank, cfg, layers, ids, label):
    """A pass with a NaN in rank 0's residual before call 3 (sampled)."""
    from vllm.forward_context import set_forward_context

    emb, o, down = layers
    label[0] = "nan"
    with set_forward_context(None, cfg, num_tokens=SIDE_TOKENS):
        h = emb(ids)
        for layer in range(LAYERS):
            if layer == 1 and rank == 0:  # call 3, sampled: rank 0's partial holds a NaN row
                h = h.clone()
                h[0, 0] = float("nan")
            h = h + o[layer](_norm(h))
            h = h + down[layer](_mlp_in(h))


def _side_calls(rank, stack):
    """6b. side calls of real vLLM layers between the residual calls: a
    Mamba2 gated norm (n_groups=1: a [T, 1] fp32 sum of squares) and
    MiniMax-M2's TP RMSNorm (a 1-D fp32 variance); the same passes without
    them. Then a pass with a NaN in rank 0's residual: the sampled checks
    count it. ``(side, nan)``: the calls and stats of the first passes, the
    stats after the NaN pass."""
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from echo_vllm.vllm_glue import current_stats

    cfg = vllm_config(tp=2, additional_config=dict(ECHO, echo_health_every=2))
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        tp = ps.get_tp_group()
        layers = stack.vllm_layers()
        hooked = type(tp)._all_reduce_out_place
        seen = []  # (pass, partial, output) of each call
        label = [None]

        def spy_side(x):
            partial = x.detach().clone()
            y = hooked(tp, x)
            seen.append((label[0], partial, y.detach().clone()))
            return y

        tp._all_reduce_out_place = spy_side
        ids = torch.randint(0, VOCAB, (SIDE_TOKENS,), generator=torch.Generator().manual_seed(99))
        _side_passes(rank, cfg, layers, ids, label)
        side = dict(calls=seen, stats=current_stats().snapshot())
        _nan_pass(rank, cfg, layers, ids, label)
        tp.__dict__.pop("_all_reduce_out_place")
        nan = current_stats().snapshot()
    ps.destroy_model_parallel()
    return side, nan


def _echo_off(rank):
    """7. Echo off (no tp_comm): no session, vLLM's sum."""
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.forward_context import set_forward_context

    from echo_vllm.vllm_glue import current_stats

    off = vllm_config(tp=2)
    with set_current_vllm_config(off):
        init_model_parallel(off)
        tp = ps.get_tp_group()
        x = torch.full((4, HIDDEN), float(rank + 1), dtype=torch.bfloat16)
        with set_forward_context(None, off, num_tokens=4):
            y = tp.all_reduce(x)
        got = ("_echo_comm" in tp.__dict__, y, current_stats())
    ps.destroy_model_parallel()
    return got


def _worker(rank, world):
    from support.vllm_cpu import use_cpu_platform

    use_cpu_platform()
    from echo_vllm.vllm_glue.plugin import register

    register()
    out = {"guard": _guard_rail()}
    stack = _stack()
    _echo_on(rank, stack, out)
    out["graphs"] = _graph_replays(stack)
    out["auto"] = _min_bytes_auto()
    out["side"], out["nan"] = _side_calls(rank, stack)
    out["off"] = _echo_off(rank)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_vllm_processes(_worker, 2)


def test_min_bytes_auto_is_measured_and_the_same_on_every_rank(ranks):
    from echo_vllm.crossover import NEVER, SMALLEST_BYTES

    got = [r["auto"] for r in ranks]
    assert got[0]["config_min"] == got[1]["config_min"]  # ranks that disagreed would hang
    m = got[0]["config_min"]
    assert m == NEVER or m >= SMALLEST_BYTES  # a measured ladder size, not the 256 KiB fallback's -1
    for g in got:
        assert (g["snapshot"]["min_bytes"], g["snapshot"]["max_bytes"]) == (g["config_min"], g["config_max"])


def test_guard_rail_raises_at_tp_group_creation(ranks):
    for r in ranks:
        assert r["guard"] is not None
        assert "fuse_allreduce_rms" in r["guard"]
        assert "-cc.pass_config.fuse_allreduce_rms=false" in r["guard"]


def test_hook_engages_only_for_the_tp_group(ranks):
    for r in ranks:
        assert r["sessions"] == [r["tp_name"]] and r["tp_name"].startswith("tp:")
        has_session, y = r["other"]
        assert not has_session
        assert torch.equal(y, torch.full((4, HIDDEN), 3.0, dtype=torch.bfloat16))
        assert r["other_stats"]["calls"] == r["extra_stats"]["calls"]


def test_hook_is_off_without_the_config(ranks):
    for r in ranks:
        has_session, y, stats = r["off"]
        assert not has_session and stats is None
        assert torch.equal(y, torch.full((4, HIDDEN), 3.0, dtype=torch.bfloat16))


def test_call_indices_restart_with_every_forward_pass(ranks):
    per_call = 1 + 2 * LAYERS
    for r in ranks:
        main = [(f, i) for f, i, _, _ in r["calls"] if isinstance(f, int)]
        assert main == [(f, i) for f in range(len(TOKENS)) for i in range(per_call)]
        assert r["main_stats"]["calls_per_forward"] == per_call
        # the per-forward host hook (wrapped set_additional_forward_context) ran
        assert r["tagged"][: len(main)] == [t for t in TOKENS for _ in range(per_call)]


def test_outputs_equal_the_in_process_reference_on_the_same_partials(ranks):
    """Both ranks return the same bits, and the bits of EmulatedTP fed the two
    ranks' partials. The first pass has no exact last call (the call count is
    learned from it), the later ones do -- in both."""
    r0, r1 = ranks
    main0 = [c for c in r0["calls"] if isinstance(c[0], int)]
    main1 = [c for c in r1["calls"] if isinstance(c[0], int)]
    ref = EmulatedTP(2, EchoConfig.from_mapping(ECHO, prefix="echo_"))
    forward = None
    for (f, i, p0, y0), (_, _, p1, y1) in zip(main0, main1):
        if f != forward:
            ref.begin_forward()
            forward = f
        expect = ref.reduce(torch.stack([p0, p1]))
        assert torch.equal(y0, y1), (f, i)
        assert torch.equal(y0, expect), (f, i)
    ref.end_forward()


def test_real_layers_split_like_the_emulation(ranks):
    """vLLM's VocabParallelEmbedding / RowParallelLinear partials on two ranks
    are the emulation's partials of the full weights (same shard bounds,
    rank 0 alone adds the bias)."""
    stack = _stack()
    r0, r1 = ranks
    main0 = [c for c in r0["calls"] if isinstance(c[0], int)]
    main1 = [c for c in r1["calls"] if isinstance(c[0], int)]
    per_call = 1 + 2 * LAYERS
    for f, tok in enumerate(stack.ids):
        c0, c1 = main0[f * per_call:(f + 1) * per_call], main1[f * per_call:(f + 1) * per_call]
        got = torch.stack([c0[0][2], c1[0][2]])
        assert torch.equal(got, vocab_parallel_partials(tok, stack.embed, 2))
        h = c0[0][3]
        for layer in range(LAYERS):
            for k, (w, b, make_in) in enumerate(
                ((stack.o[layer], stack.o_bias[layer], _norm), (stack.down[layer], None, _mlp_in))
            ):
                t = 1 + 2 * layer + k
                got = torch.stack([c0[t][2], c1[t][2]])
                want = row_parallel_partials(make_in(h), w, 2, b)
                assert torch.equal(got, want), (f, t)
                h = h + c0[t][3]


def test_fallback_paths_consume_feedback(ranks):
    """Each pass: calls 1..2L take the previous call's error -- including the
    exact last call of passes 2 and 3, which consumes it and leaves none."""
    per_call = 1 + 2 * LAYERS
    for r in ranks:
        s = r["main_stats"]
        n = len(TOKENS)
        assert s["calls"] == {"echo/echo": n * per_call - (n - 1), "exact/exact_last_call": n - 1}
        assert r["chain"]["carried"] == n * (per_call - 1)
        assert r["chain"]["dropped"] == 0
        assert not r["chain"]["pending"]
        # the buffer was sized once, for the largest batch vLLM allows
        assert r["chain"]["capacity"] >= 2048 * HIDDEN


def test_unsupported_calls_take_vllms_path_with_a_counted_reason(ranks):
    r0, r1 = ranks
    for name in ("fp32", "int32", "3d", "no_context"):
        (x0, y0), (x1, y1) = r0["extra"][name], r1["extra"][name]
        assert torch.equal(y0, y1)
        assert torch.equal(y0, x0 + x1 if name == "int32" else (x0.float() + x1.float()).to(x0.dtype)), name
    for r in ranks:
        calls = r["extra_stats"]["calls"]
        assert calls["exact/unsupported_dtype"] == 2  # fp32 and int32
        assert calls["exact/not_residual_shape"] == 1
        assert calls["exact/no_forward_context"] == 1


def test_graph_replays_are_counted_like_the_passes_they_replay(ranks):
    """Model Runner V2's FULL replays (no forward context), PIECEWISE and V1
    FULL replays (a context, no calls), and the last pass of the window
    (settled by flush): the counters equal those of executing every pass."""
    from support.vllm_graphs import accounting_problems

    for r in ranks:
        assert accounting_problems(r["graphs"], calls_per_forward=1 + 2 * LAYERS) == []


def test_side_calls_of_real_vllm_layers_leave_the_chain_alone(ranks):
    """A Mamba2 gated norm ([T, 1]) and MiniMax-M2's TP RMSNorm (1-D fp32)
    between the residual all-reduces of real vLLM layers take vLLM's exact
    sum, and the residual stream's error at the end of the pass (exact last
    call) stays within 1.5x of the same pass without them: the pending error
    waits for the next residual call. (Why 1.5x: see
    tests/core/test_feedback.py::test_a_side_call_leaves_the_carried_error_to_the_next_residual_call;
    on the old code each side call dropped the pending error.)"""
    (r0, r1) = ranks
    per_pass = {}
    for (label, p0, y0), (_, p1, y1) in zip(r0["side"]["calls"], r1["side"]["calls"]):
        if label == "nan":  # test_sampled_health_checks_count_nonfinite_values_under_real_tp
            continue
        assert torch.equal(y0, y1)
        if p0.dtype == torch.float32:  # a side call: vLLM's exact sum
            assert p0.shape[-1] == 1 or p0.dim() == 1
            assert torch.equal(y0, p0 + p1)
            continue
        per_pass.setdefault(label, []).append((p0.double() + p1.double(), y0.double()))
    errors = {}
    for label, calls in per_pass.items():
        assert len(calls) == 1 + 2 * LAYERS
        err = sum(y - s for s, y in calls)
        one = calls[-1][0].pow(2).mean().sqrt()
        errors[label] = float(err.pow(2).mean().sqrt() / one)
    assert errors["side"] <= 1.5 * errors["plain"], errors
    # sharper: the side calls' outputs feed nothing here, so the residual calls see the same
    # inputs and the same carried errors, and give the same bits
    assert all(torch.equal(a[1], b[1]) for a, b in zip(per_pass["plain"], per_pass["side"]))
    for r in ranks:
        stats = r["side"]["stats"]
        assert stats["calls"]["exact/unsupported_dtype"] == 2 * LAYERS  # the side calls, with their reason
        assert stats["calls_per_forward"] == 1 + 2 * LAYERS  # the numbering skips them
        assert stats["feedback_dropped"] == {}  # no chain broke


def test_sampled_health_checks_count_nonfinite_values_under_real_tp(ranks):
    """``echo_health_every=2`` checks calls 1, 3, 5 of each pass; a NaN row
    entering rank 0's residual before call 3 is counted there (rank 0's
    input, every rank's output) and again at call 5, where it has reached
    rank 1's partial too."""
    for r in ranks:
        assert r["side"]["stats"]["health_checked"] == 3 * 3  # learn, plain and side passes
        assert r["side"]["stats"]["nonfinite"] == {"input": 0, "output": 0}
        assert r["nan"]["health_checked"] == 4 * 3
    assert ranks[0]["nan"]["nonfinite"] == {"input": 2, "output": 2}
    assert ranks[1]["nan"]["nonfinite"] == {"input": 1, "output": 2}
