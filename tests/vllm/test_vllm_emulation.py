"""One-device TP emulation inside real vLLM layers, the plugin's entry point
and the guard rails on real VllmConfig objects.

One vLLM process (vLLM patches classes; the pytest process stays clean;
forked from the vLLM tests' server, ``support.vllm_cpu``):
vLLM finds and runs the plugin through its entry point, the TP group of size
1 is created with ``tp_comm_emulate: 4``, and vLLM's own
``VocabParallelEmbedding`` / ``RowParallelLinear`` run eagerly and under
``torch.compile(fullgraph=True)`` (the emulated reduce is an opaque custom
op). Outputs are compared here with the in-process reference (EmulatedTP)
fed the emulation's partials of the same weights.
"""

import importlib.metadata

import pytest
import torch

from echo_vllm import EchoConfig
from echo_vllm.emulation import EmulatedTP, row_parallel_partials, vocab_parallel_partials

P = 4
LAYERS = 3
HIDDEN, VOCAB = 128, 1000
TOKENS = (5, 3, 8)
# every call eligible for Echo (the defaults keep the first calls in 16-bit)
SETTINGS = {"tp_comm": "echo", "tp_comm_emulate": P, "echo_min_bytes": 0, "echo_first_exact_calls": 0}
CONFIG = EchoConfig.from_mapping(SETTINGS, prefix="echo_")


def test_plugin_is_declared_as_a_vllm_general_plugin():
    found = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "echo_vllm"]
    assert len(found) == 1
    assert found[0].value == "echo_vllm.vllm_glue.plugin:register"
    from echo_vllm.vllm_glue.plugin import register

    assert found[0].load() is register


def _stack():
    from support.vllm_cpu import ToyStack

    return ToyStack.random(layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, tokens=TOKENS, seed=99)


def _model(embed, o, down, ids):
    """A residual stack of 1 + 2L reduces built from ops that round the same
    way eagerly and in Inductor (lookups, matmuls, cat, neg, bf16 adds)."""
    h = embed(ids)
    for layer in range(LAYERS):
        h = h + o[layer](h)
        h = h + down[layer](torch.cat([h, -h], dim=-1))
    return h


def _plugin_loads():
    """1. vLLM loads the plugin through its entry point; registering is idempotent."""
    import vllm.plugins
    from vllm.distributed.parallel_state import GroupCoordinator

    vllm.plugins.load_general_plugins()
    import echo_vllm.vllm_glue.plugin as plugin

    patched = (GroupCoordinator.__init__, GroupCoordinator._all_reduce_out_place)
    again = plugin.register()
    return dict(
        status=plugin._status,
        again=again,
        originals=GroupCoordinator.__dict__.get("_echo_originals") is not None,
        same=patched == (GroupCoordinator.__init__, GroupCoordinator._all_reduce_out_place),
    )


def _guards():
    """2. guard rails on real (finalized) configs."""
    from support.vllm_cpu import vllm_config

    from echo_vllm.vllm_glue import EngineFacts, TpCommSettings, conflicts

    passes = dict(
        fuse_allreduce_rms=True, enable_sp=True, fuse_gemm_comms=True,
        sp_min_token_num=1, fi_allreduce_fusion_max_size_mb=64,
    )
    fused = vllm_config(tp=2, additional_config={"tp_comm": "echo"}, pass_config=passes)
    dbo = vllm_config(tp=2, additional_config={"tp_comm": "echo"})
    dbo.parallel_config.enable_dbo = True
    emulate_tp2 = vllm_config(tp=2, additional_config={"tp_comm": "echo", "tp_comm_emulate": 2})
    off = vllm_config(tp=2, pass_config=passes)
    return {
        name: [p.message for p in conflicts(TpCommSettings.from_vllm_config(c), EngineFacts.from_vllm_config(c))]
        for name, c in (("fused", fused), ("dbo", dbo), ("emulate_tp2", emulate_tp2), ("off", off))
    }


def _emulation(stack, out):
    """3. emulation: vLLM's layers at TP=1 compute 4 partials, Echo reduces
    them -- eagerly, compiled, measured, exact and naive."""
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.linear import RowParallelLinear

    from echo_vllm.vllm_glue import current_stats
    from echo_vllm.vllm_glue.emulation import current_session

    cfg = vllm_config(tp=1, additional_config=dict(SETTINGS, tp_comm_emulate_measure=True))
    ids = stack.ids
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        session = current_session()
        embed, o, down = stack.vllm_layers()
        unreduced = RowParallelLinear(HIDDEN, HIDDEN, bias=False, reduce_results=False)
        out["marks"] = [embed._echo_emulated, o[0]._echo_emulated, unreduced._echo_emulated]
        out["skipped"] = dict(session.skipped_layers)

        def forward(fn, tok):
            with set_forward_context(None, cfg, num_tokens=len(tok)):
                return fn(embed, o, down, tok)

        out["eager"] = [forward(_model, tok) for tok in ids] + [forward(_model, ids[0])]
        session.flush()
        out["eager_stats"] = current_stats().snapshot()
        compiled = torch.compile(_model, backend="inductor", fullgraph=True, dynamic=True)
        out["compiled"] = [forward(compiled, ids[0]), forward(compiled, ids[2])]

        session.reset_stats()
        out["measured"] = forward(_model, ids[1])
        session.flush()
        out["measure_stats"] = current_stats().snapshot()

        session.set_variant(tp_comm="nccl")
        session.reset_stats()
        out["exact"] = forward(_model, ids[1])
        out["exact_stats"] = current_stats().snapshot()
        session.set_variant(tp_comm="echo", feedback=False, exact_last_call=False, hadamard=False)
        out["naive"] = forward(_model, ids[1])
    out["ops"] = [hasattr(torch.ops.echo, n) for n in ("emulated_row_parallel", "emulated_vocab_embedding")]


def _graph_replays(stack):
    """4. a CUDA-graph engine (capture and replays simulated on CPU, through
    the calls vLLM makes): replays are counted like the passes they stand for."""
    from support.vllm_cpu import init_model_parallel, vllm_config
    from support.vllm_graphs import replay_accounting
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from echo_vllm.vllm_glue.emulation import current_session

    ps.destroy_model_parallel()
    cfg = vllm_config(tp=1, additional_config=SETTINGS)
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        embed, o, down = stack.vllm_layers()
        return replay_accounting(current_session(), cfg, lambda n: _model(embed, o, down, stack.ids[2][:n]))


def _worker(rank, world):
    from support.vllm_cpu import use_cpu_platform

    use_cpu_platform()
    out = {"plugin": _plugin_loads(), "guards": _guards()}
    stack = _stack()
    _emulation(stack, out)
    out["graphs"] = _graph_replays(stack)
    return out


@pytest.fixture(scope="module")
def proc():
    pytest.importorskip("vllm")
    from support.vllm_cpu import run_vllm_processes

    return run_vllm_processes(_worker, 1)[0]


def _reference(config, mode="echo"):
    """The emulation's math, from the full weights: EmulatedTP over the
    partials real TP=4 ranks would compute. Returns (forward, last S_t list)."""
    stack = _stack()
    ref = EmulatedTP(P, config, mode=mode)
    sums = []

    def reduce(partials):
        sums.append(partials.float().sum(0))
        return ref.reduce(partials), partials

    def forward(tok):
        ref.begin_forward()
        sums.clear()
        outs = []
        h, _ = reduce(vocab_parallel_partials(tok, stack.embed, P))
        outs.append(h)
        for layer in range(LAYERS):
            y, _ = reduce(row_parallel_partials(h, stack.o[layer], P, stack.o_bias[layer]))
            outs.append(y)
            h = h + y
            y, _ = reduce(row_parallel_partials(torch.cat([h, -h], -1), stack.down[layer], P))
            outs.append(y)
            h = h + y
        ref.end_forward()
        return h, outs, list(sums)

    return forward


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_loads_the_plugin_once(proc):
    p = proc["plugin"]
    assert p["status"].startswith("installed on vLLM")
    assert p["again"] == p["status"] and p["originals"] and p["same"]


@pytest.mark.vllm
@pytest.mark.slow
def test_guard_rails_name_the_flag_to_change(proc):
    g = proc["guards"]
    text = "\n".join(g["fused"])
    for flag in ("fuse_allreduce_rms", "enable_sp", "fuse_gemm_comms"):
        assert f"-cc.pass_config.{flag}=false" in text
    assert len(g["dbo"]) == 1 and "--enable-dbo" in g["dbo"][0]
    assert len(g["emulate_tp2"]) == 1 and "--tensor-parallel-size 1" in g["emulate_tp2"][0]
    assert g["off"] == []  # without tp_comm=echo nothing is refused


@pytest.mark.vllm
@pytest.mark.slow
def test_layers_are_marked_for_emulation(proc):
    assert proc["marks"] == [True, True, False]
    assert proc["skipped"] == {"reduce_results=False (the caller reduces)": 1}
    assert proc["ops"] == [True, True]


@pytest.mark.vllm
@pytest.mark.slow
def test_eager_emulation_equals_the_reference(proc):
    forward = _reference(CONFIG)
    ids = _stack().ids
    for tok, got in zip(list(ids) + [ids[0]], proc["eager"]):
        want, _, _ = forward(tok)
        assert torch.equal(got, want)
    s = proc["eager_stats"]
    per_call = 1 + 2 * LAYERS
    assert s["calls_per_forward"] == per_call
    assert s["calls"] == {"echo/echo": 4 * per_call - 3, "exact/exact_last_call": 3}


@pytest.mark.vllm
@pytest.mark.slow
def test_compiled_emulation_equals_eager(proc):
    """fullgraph torch.compile traces the layers around the opaque custom ops;
    the reduce inside gives the eager bits (chain state and call index are
    the same Python)."""
    forward = _reference(CONFIG)
    ids = _stack().ids
    forward(ids[0])  # the reference's first pass learns the call count
    assert torch.equal(proc["compiled"][0], proc["eager"][3])
    assert torch.equal(proc["compiled"][1], forward(ids[2])[0])


@pytest.mark.vllm
@pytest.mark.slow
def test_exact_variant_is_the_fp32_sum_of_the_same_partials(proc):
    forward = _reference(CONFIG, mode="exact")
    ids = _stack().ids
    assert torch.equal(proc["exact"], forward(ids[1])[0])
    assert proc["exact_stats"]["calls"] == {"exact/forced_exact_calls": 1 + 2 * LAYERS}
    naive = _reference(EchoConfig.naive(min_bytes=0, first_exact_calls=0))
    naive(ids[0])
    assert torch.equal(proc["naive"], naive(ids[1])[0])


@pytest.mark.vllm
@pytest.mark.slow
def test_residual_measurement_matches_its_definition(proc):
    """tp_comm_emulate_measure: |sum_t (y_t - S_t)| / |sum_t S_t| at the end of
    the pass, S_t the fp32 sum of the pass's partials."""
    forward = _reference(CONFIG)
    ids = _stack().ids
    forward(ids[0])
    _, outs, sums = forward(ids[1])
    err = sum(y.float() - s for y, s in zip(outs, sums))
    end = float(err.norm() / sum(sums).norm())
    s = proc["measure_stats"]
    assert s["residual_samples"] == 1
    assert s["residual_err_end_mean"] == end  # same fp32 ops in the same order
    assert s["residual_err_max_mean"] >= s["residual_err_end_mean"]
    assert s["rel_err_samples"] == 1 + 2 * LAYERS


@pytest.mark.vllm
@pytest.mark.slow
def test_graph_replays_are_counted_like_the_passes_they_replay(proc):
    """Model Runner V2's FULL replays (no forward context), PIECEWISE and V1
    FULL replays (a context, no calls), and the last pass of the window
    (settled by flush): the counters equal those of executing every pass."""
    from support.vllm_graphs import accounting_problems

    assert accounting_problems(proc["graphs"], calls_per_forward=1 + 2 * LAYERS) == []
