"""The compilation pass that folds vLLM's norm after an all-reduce into Echo.

* pure: which pairs fuse (``site_reason``), when the pass is registered
  (``pass_decision``), the log line;
* an FX graph of vLLM's real ops (``vllm.all_reduce``, the ``vllm_ir`` norm
  ops): what is replaced, what is left and why;
* over real vLLM TP = 2 (gloo processes): the pass is registered at
  TP-group creation, and the rewritten graph's fused op gives Echo's output
  followed by ``rmsnorm.add_rms_norm(..., variance="kernel")`` bit for bit,
  counted as fused;
* the one-device emulation under ``torch.compile`` (Inductor, vLLM's
  pre-grad functionalization, this pass as ``post_grad_custom_post_pass``)
  on vLLM's own layers (row-parallel linears, embedding, ``RMSNorm``): the
  compiled forward equals the eager spec.
"""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch

EPS = 1e-6
HIDDEN = 64
# the pass is asked for (echo_fuse_norm is off by default)
TP_ECHO = {"tp_comm": "echo", "echo_min_bytes": 0, "echo_first_exact_calls": 0, "echo_exact_last_call": False,
           "echo_fuse_norm": True}


def _nf():
    """In a worker process: vLLM on the CPU platform, its ops and the fused ones defined."""
    from support.vllm_cpu import use_cpu_platform

    use_cpu_platform()
    import vllm.distributed.parallel_state  # noqa: F401  (defines torch.ops.vllm.all_reduce)
    import vllm.ir  # noqa: F401  (torch.ops.vllm_ir.*)

    from echo_vllm.vllm_glue import rmsnorm_fusion

    rmsnorm_fusion.register_ops()
    return rmsnorm_fusion


# -- pure (no vLLM imported) ------------------------------------------------------------


def test_site_reasons():
    from echo_vllm.vllm_glue import rmsnorm_fusion as nf

    ok = nf.SiteFacts("tp", True, "fused_add_rms_norm", 0, 0, False, True)
    assert nf.site_reason(ok) is None and nf.site_reason(ok._replace(reduce="vocab", norm="rms_norm")) is None
    assert nf.site_reason(ok._replace(echo_group=False)) == "an all-reduce of another group"
    assert nf.site_reason(ok._replace(norm=None)) == "not followed by vLLM's RMSNorm"
    assert nf.site_reason(ok._replace(other_uses=1)) == "the reduced output is used beyond the norm"
    assert nf.site_reason(ok._replace(other_uses=1, uses_after_norm=1)) == "the reduced output is used beyond the norm"
    # rms_norm's input used after it too (a decoder's first norm): the fused op keeps it
    kept = ok._replace(norm="rms_norm", other_uses=2, uses_after_norm=2)
    assert nf.site_reason(kept) is None
    assert nf.site_reason(kept._replace(uses_after_norm=1)) == "the reduced output is used before its norm"
    assert nf.site_reason(ok._replace(partial_variance=True)) == "the norm's variance covers part of the row"
    assert nf.site_reason(ok._replace(weight=False)) == "the norm has no weight"


def test_pass_is_registered_only_for_echo_with_fusion_on_and_a_pre_norm_model():
    from echo_vllm.vllm_glue import rmsnorm_fusion as nf

    class Ours:
        echo_norm_fusion = True

    assert nf.pass_decision("echo", True, False, None)[0]
    assert nf.pass_decision("echo", True, False, Ours())[0]
    assert nf.pass_decision("nccl", True, False, None) == (False, "tp_comm=nccl: no Echo to fuse the norm into")
    assert nf.pass_decision("echo", False, False, None) == (False, "echo_fuse_norm is off")
    assert nf.pass_decision("echo", True, True, None)[1].startswith("a post-norm model")
    assert nf.pass_decision("echo", True, False, object())[1] == "post_grad_custom_post_pass already holds object"


def test_report_line():
    from echo_vllm.vllm_glue import rmsnorm_fusion as nf

    assert nf.report(Counter({"fused": 3})) == "fused the norm into 3 of 3 Echo all-reduces"
    assert (nf.report(Counter({"fused": 2, "not followed by vLLM's RMSNorm": 1}))
            == "fused the norm into 2 of 3 Echo all-reduces (not: 1 not followed by vLLM's RMSNorm)")


# -- an FX graph of vLLM's real ops ---------------------------------------------------


INPUTS = 9


def _graph(group="tp:0", other="pp:0"):
    """Every case at once (``other``: another group's name; None: no such
    site); returns (graph, names of its outputs)."""
    ar, add_norm, rms = torch.ops.vllm.all_reduce.default, torch.ops.vllm_ir.fused_add_rms_norm.default, \
        torch.ops.vllm_ir.rms_norm.default
    g = torch.fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(INPUTS)]
    res, w = g.placeholder("res"), g.placeholder("w")
    outs = {}
    y0 = g.call_function(ar, (xs[0],), {"group_name": group})  # o_proj + post-attention norm: fused
    t = g.call_function(add_norm, (y0, res, w, EPS))
    outs["out0"], outs["res0"] = g.call_function(operator.getitem, (t, 0)), g.call_function(operator.getitem, (t, 1))
    y1 = g.call_function(ar, (xs[1], group))  # the embedding's all-reduce + the first input norm: fused
    outs["out1"] = g.call_function(rms, (y1, w, 1e-5))
    y2 = g.call_function(ar, (xs[2],), {"group_name": group})  # also an output later (the embedding's): fused, kept
    outs["out2"] = g.call_function(rms, (y2, w, EPS))
    outs["y2"] = y2
    if other is not None:
        y3 = g.call_function(ar, (xs[3],), {"group_name": other})  # another group: not Echo's
        outs["out3"] = g.call_function(rms, (y3, w, EPS))
    y4 = g.call_function(ar, (xs[4],), {"group_name": group})  # no norm after it
    outs["out4"] = g.call_function(torch.ops.aten.add.Tensor, (y4, res))
    y5 = g.call_function(ar, (xs[5],), {"group_name": group})  # partial variance
    outs["out5"] = g.call_function(rms, (y5, w, EPS, 32))
    y6 = g.call_function(ar, (xs[6],), {"group_name": group})  # no weight
    outs["out6"] = g.call_function(rms, (y6, None, EPS))
    y7 = g.call_function(ar, (xs[7],), {"group_name": group})  # used before its rms_norm: left
    outs["add7"] = g.call_function(torch.ops.aten.add.Tensor, (y7, res))
    outs["out7"] = g.call_function(rms, (y7, w, EPS))
    y8 = g.call_function(ar, (xs[8],), {"group_name": group})  # fused_add_rms_norm's input used after it: left
    t8 = g.call_function(add_norm, (y8, res, w, EPS))
    outs["out8"] = g.call_function(operator.getitem, (t8, 0))
    outs["y8"] = y8
    g.output(tuple(outs.values()))
    return g, list(outs)


def _fx_worker(rank, world):
    nf = _nf()

    def args(node):
        return [a.name if isinstance(a, torch.fx.Node) else a for a in node.args]

    out = {}
    g, names = _graph()
    out["first"] = dict(nf.fuse_graph(g, "tp:0"))
    g.lint()
    calls = [n for n in g.nodes if n.op == "call_function"]
    out["fused_args"] = [args(n) for n in calls if n.target == torch.ops.echo.all_reduce_norm.default]
    out["left"] = [args(n)[0] for n in calls if n.target == torch.ops.vllm.all_reduce.default]
    returned = dict(zip(names, next(n for n in g.nodes if n.op == "output").args[0]))["y2"]
    out["y2_from"] = [returned.target.__name__, returned.args[1], returned.args[0].target._opname]
    out["again"] = dict(nf.fuse_graph(g, "tp:0"))
    other, _ = _graph("tp:1")
    before = [n.target for n in other.nodes]
    out["other"] = (dict(nf.fuse_graph(other, "tp:0")), [n.target for n in other.nodes] == before)
    # install(): where the pass goes, and what it refuses to replace
    from types import SimpleNamespace

    engine = SimpleNamespace(compilation_config=SimpleNamespace(inductor_compile_config={}))
    said = [nf.install(engine, "echo", True, False, "tp:0"), nf.install(engine, "echo", True, False, "tp:0")]
    ours = engine.compilation_config.inductor_compile_config[nf.PASS_KEY]
    import copy

    copied = copy.deepcopy(ours)  # vLLM's backend deep-copies its Inductor config
    engine.compilation_config.inductor_compile_config[nf.PASS_KEY] = "someone else's"
    said.append(nf.install(engine, "echo", True, False, "tp:0"))
    said.append(nf.install(SimpleNamespace(), "echo", True, False, "tp:0"))
    out["install"] = (said, type(ours).__name__, copied.echo_group, copied.uuid() == ours.uuid(),
                      ours.uuid() != nf.EchoNormFusionPass("tp:1").uuid())
    return out


@pytest.fixture(scope="module")
def fx():
    from support.vllm_cpu import run_vllm_processes

    return run_vllm_processes(_fx_worker, 1)[0]


LEFT = {"the reduced output is used beyond the norm": 1, "the reduced output is used before its norm": 1,
        "not followed by vLLM's RMSNorm": 1, "the norm's variance covers part of the row": 1,
        "the norm has no weight": 1}


@pytest.mark.vllm
@pytest.mark.slow  # traces vLLM's ops into an FX graph
def test_fx_graph_of_vllms_ops_is_rewritten_where_it_can_be(fx):
    assert fx["first"] == {"fused": 3, **LEFT}
    assert fx["fused_args"] == [["x0", "res", "w", EPS, False, "tp:0"], ["x1", None, "w", 1e-5, False, "tp:0"],
                                ["x2", None, "w", EPS, True, "tp:0"]]
    assert fx["left"] == ["x3", "x4", "x5", "x6", "x7", "x8"]
    assert fx["again"] == LEFT  # what is left keeps its reason
    # the kept output replaced y2 where the graph returns it: the op's second output
    assert fx["y2_from"] == ["getitem", 1, "all_reduce_norm"]


@pytest.mark.vllm
def test_fx_graph_without_echos_group_is_left_alone(fx):
    assert fx["other"] == ({}, True)


# -- real vLLM tensor parallelism over gloo ------------------------------------------------


def _tp_worker(rank, world):
    from support.vllm_cpu import init_model_parallel, vllm_config

    nf = _nf()
    from echo_vllm.vllm_glue.plugin import register

    register()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.forward_context import set_forward_context

    from echo_vllm import rmsnorm
    from echo_vllm.vllm_glue import current_stats

    out = {}
    cfg = vllm_config(tp=2, additional_config=TP_ECHO)
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        tp = ps.get_tp_group()
        registered = cfg.compilation_config.inductor_compile_config.get(nf.PASS_KEY)
        out["registered"] = type(registered).__name__
        g = torch.Generator().manual_seed(rank)
        xs = [(torch.randn(5, HIDDEN, generator=g) * (1 + rank)).bfloat16() for _ in range(INPUTS)]
        res = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9)).bfloat16()
        w = (1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(8))).bfloat16()
        graph, names = _graph(tp.unique_name, None)  # a one-rank group has no all-reduce to run
        plain = torch.fx.GraphModule(torch.nn.Module(), graph)
        fused_graph, _ = _graph(tp.unique_name, None)
        out["outcomes"] = dict(nf.fuse_graph(fused_graph, tp.unique_name))
        fused = torch.fx.GraphModule(torch.nn.Module(), fused_graph)
        # the plain graph's all-reduce outputs (the hook's Echo) and the spec's norm of them
        ys = []
        hooked = type(tp)._all_reduce_out_place

        def spy(x):
            ys.append(hooked(tp, x.clone()))  # vLLM's CPU all-reduce works in place
            return ys[-1]

        tp._all_reduce_out_place = spy
        with set_forward_context(None, cfg, num_tokens=5):
            plain(*xs, res, w)
        tp.__dict__.pop("_all_reduce_out_place")
        before = dict(current_stats().snapshot()["norm_calls"])
        with set_forward_context(None, cfg, num_tokens=5):
            got = dict(zip(names, fused(*xs, res, w)))
        out["norm_calls"] = {k: v - before.get(k, 0) for k, v in current_stats().snapshot()["norm_calls"].items()}
        out["got"] = {k: got[k] for k in FUSED_OUTPUTS}
        out["want"] = dict(zip(("out0", "res0"), rmsnorm.add_rms_norm(ys[0], res, w, EPS, variance="kernel")))
        out["want"]["out1"] = rmsnorm.rms_norm(ys[1], w, 1e-5, variance="kernel")
        out["want"]["out2"], out["want"]["y2"] = rmsnorm.rms_norm(ys[2], w, EPS, variance="kernel"), ys[2]
        out["res_untouched"] = torch.equal(res, torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
                                           .bfloat16())
    ps.destroy_model_parallel()
    return out


#: The fused sites' outputs in :func:`_graph`: the add + norm's two, two norms, the kept reduced output.
FUSED_OUTPUTS = ("out0", "res0", "out1", "out2", "y2")


@pytest.fixture(scope="module")
def tp_ranks():
    from support.vllm_cpu import run_vllm_processes

    return run_vllm_processes(_tp_worker, 2)


@pytest.mark.vllm
def test_pass_is_registered_at_tp_group_creation(tp_ranks):
    assert [r["registered"] for r in tp_ranks] == ["EchoNormFusionPass"] * 2


@pytest.mark.vllm
def test_fused_op_is_echo_then_the_kernels_norm_on_every_rank(tp_ranks):
    from support.norm_chains import assert_same

    for r in tp_ranks:
        assert r["outcomes"]["fused"] == 3
        for k in FUSED_OUTPUTS:
            assert_same(r["got"][k], r["want"][k], k)
        assert_same(r["got"]["out0"], tp_ranks[0]["got"]["out0"], "ranks agree")
        assert r["norm_calls"] == {"fused": 3}
        assert r["res_untouched"]  # functional: the graph's residual input is not written


# -- the emulation, compiled by Inductor with the pass ---------------------------------------------


def _emulated_model(embed, o, down, norms, ids):
    """A decoder's first norm: ``rms_norm`` of the embedding's reduce, whose
    output is also the residual of the next add (fused, the reduced output
    kept); an o_proj-like reduce + the add + norm; a down_proj-like reduce +
    a norm without a residual (all three fused)."""
    h = embed(ids)
    a = norms[0](h)
    x, h = norms[1](o(a), h)
    z = norms[2](down(torch.cat([x, -x], dim=-1)))
    return a, x, h, z


def _emulation_worker(rank, world):
    from support.vllm_cpu import ToyStack, init_model_parallel, vllm_config

    nf = _nf()
    from echo_vllm.vllm_glue.plugin import register

    register()
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.config.utils import Range
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.layernorm import RMSNorm

    from echo_vllm import rmsnorm
    from echo_vllm.vllm_glue import current_stats
    from echo_vllm.vllm_glue.emulation import current_session

    stack = ToyStack.random(layers=1, hidden=HIDDEN, vocab=300, tokens=(6,), seed=5)
    cfg = vllm_config(tp=1, additional_config=dict(TP_ECHO, tp_comm_emulate=4))
    out = {}
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        session = current_session()
        registered = cfg.compilation_config.inductor_compile_config.get(nf.PASS_KEY)
        out["registered"] = type(registered).__name__
        embed, o, down = stack.vllm_layers()
        norms = [RMSNorm(HIDDEN, eps=EPS, dtype=torch.bfloat16) for _ in range(3)]
        for i, n in enumerate(norms):
            n.weight.data = (1 + 0.05 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(i))).bfloat16()
        ids = stack.ids[0]

        def forward(fn):
            with set_forward_context(None, cfg, num_tokens=len(ids)):
                return fn(embed, o[0], down[0], norms, ids)

        def spec(embed, o_layer, down_layer, norms, ids):  # Echo's reduces, then the kernels' norm
            h = embed(ids)
            a = rmsnorm.rms_norm(h, norms[0].weight.data, EPS, variance="kernel")
            x, h = rmsnorm.add_rms_norm(o_layer(a), h, norms[1].weight.data, EPS, variance="kernel")
            z = rmsnorm.rms_norm(down_layer(torch.cat([x, -x], dim=-1)), norms[2].weight.data, EPS, variance="kernel")
            return a, x, h, z

        out["spec"] = forward(spec)
        compiled = torch.compile(_emulated_model, backend="inductor", fullgraph=True, dynamic=False, options={
            "pre_grad_custom_pass": VllmIRInplaceFunctionalizationPass(cfg), nf.PASS_KEY: registered})
        session.flush()
        session.reset_stats()
        with pass_context(Range(1, 1 << 20)):  # what vLLM's backend sets around a compilation
            out["compiled"] = forward(compiled)
        session.flush()
        snap = current_stats().snapshot()
        out["norm_calls"], out["norm_sites"] = snap["norm_calls"], snap["norm_sites"]
    return out


@pytest.fixture(scope="module")
def emulated():
    from support.vllm_cpu import run_vllm_processes

    return run_vllm_processes(_emulation_worker, 1, timeout_s=900)[0]


@pytest.mark.vllm
@pytest.mark.slow
def test_compiled_emulation_fuses_the_norms_and_equals_the_spec(emulated):
    from support.norm_chains import assert_same

    assert emulated["registered"] == "EchoNormFusionPass"
    assert emulated["norm_sites"] == {"fused": 3}
    assert emulated["norm_calls"] == {"fused": 3}
    whats = ("first norm", "out", "residual", "rms_norm out")
    assert len(emulated["compiled"]) == len(emulated["spec"]) == len(whats)
    for got, want, what in zip(emulated["compiled"], emulated["spec"], whats):
        assert_same(got, want, what)


@pytest.mark.vllm
def test_install_registers_the_pass_once_and_replaces_no_other(fx):
    said, name, group, same_uuid, group_in_uuid = fx["install"]
    assert said[0] == said[1] == "the norm after each residual all-reduce is fused into Echo under compilation " \
                                 "(not --enforce-eager)"
    assert name == "EchoNormFusionPass" and group == "tp:0" and same_uuid and group_in_uuid
    assert said[2] == "the norm after each all-reduce stays unfused (post_grad_custom_post_pass already holds str)"
    assert said[3] == "the norm after each all-reduce stays unfused (the engine has no Inductor config)"
