"""The compilation pass that folds vLLM's norm after a residual all-reduce into Echo's output phase.

Every residual all-reduce of a pre-norm transformer is followed by vLLM's
``fused_add_rms_norm`` (the embedding's by ``rms_norm``). Under compilation
vLLM 0.26's post-grad graph holds, before its IR lowering (its
``PostGradPassManager`` runs ``post_grad_custom_post_pass`` with its own
fusion passes, then lowers the ``vllm_ir`` ops)::

    y = torch.ops.vllm.all_reduce.default(x, group_name="tp:0")      # real TP (Echo's hook is below it)
    y = torch.ops.echo.emulated_row_parallel.default(x, w, bias)      # the one-device emulation
    y = torch.ops.echo.emulated_vocab_embedding.default(ids, w)
    t = torch.ops.vllm_ir.fused_add_rms_norm.default(y, residual, weight, eps)   # out, new residual = t[0], t[1]
    out = torch.ops.vllm_ir.rms_norm.default(y, weight, eps)

The pass (:class:`EchoNormFusionPass`) replaces each such pair, where ``y``
has no other use, by one op of Echo's (:data:`FUSED_OPS`): the same
inputs, the norm's residual, weight and eps, returning ``(out, new
residual)``. A decoder's first norm is ``rms_norm`` of the embedding's
``y``, which is also the next layer's residual: there the op keeps ``y`` as
its second output (``keep_output``, written by Echo's output phase beside
the norm) and ``y``'s later uses take it. The ops are functional (new
tensors), opaque to Inductor, with a fake
implementation for tracing; its Python runs on eager calls and once per
CUDA-graph capture, as the all-reduce it replaces. It reduces through the
session's per-call sequence (the call numbering, the chain, the policy,
the records) and, on Echo's path, normalises in Echo's output phase where
the row fits (``EchoCommunicator.all_reduce_norm``). A pair it leaves alone
keeps its reason (:func:`site_reason`), logged with the count ("fused N of
M") and exported on /metrics (``echo:norm_fusion_sites``).

It is registered (:func:`install`, at TP-group creation) only when Echo
runs, ``echo_fuse_norm`` is on and the model is pre-norm
(:func:`pass_decision`); ``--enforce-eager`` compiles nothing, so eager
engines keep the unfused path.

This module has no ``from __future__ import annotations``: the ops' schemas
are inferred from the annotations of their functions.
"""

import functools
import hashlib
import logging
import operator
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from ..rmsnorm import NormOperands
from . import compat

logger = logging.getLogger("echo_vllm")

#: The fused ops (namespace ``echo``): real TP's (defined here) and the
#: emulation's reduces followed by the norm (defined with its other ops).
TP_OP = "all_reduce_norm"
ROW_NORM_OP = "emulated_row_parallel_norm"
VOCAB_NORM_OP = "emulated_vocab_embedding_norm"
#: The outcome of a site the pass fused.
FUSED = "fused"
#: ``compilation_config.inductor_compile_config`` key vLLM adds to its post-grad pass manager.
PASS_KEY = "post_grad_custom_post_pass"

_LIB: Any = None


# ---------------------------------------------------------------------------
# The fused op of real tensor parallelism
# ---------------------------------------------------------------------------


def outputs_like(shape: "tuple[int, ...]", dtype: torch.dtype, device: Any, residual: Optional[torch.Tensor],
                 keep_output: bool) -> "tuple[torch.Tensor, torch.Tensor]":
    """New (contiguous) tensors for the output and the new residual: the
    residual's shape; without one, the output's where ``keep_output`` (it
    gets the reduced output itself), else empty (an op returns tensors, not None)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if residual is not None:
        return out, torch.empty(residual.shape, dtype=dtype, device=device)
    return out, torch.empty_like(out) if keep_output else out.new_empty(0)


def run_norm(reduce_norm: Any, shape: "tuple[int, ...]", dtype: torch.dtype, residual: Optional[torch.Tensor],
             weight: torch.Tensor, epsilon: float, keep_output: bool) -> "tuple[torch.Tensor, torch.Tensor]":
    """What every fused op does: the norm's operands with new output tensors
    (the reduced message's ``shape`` and ``dtype``), then ``reduce_norm(norm)``,
    which reduces and writes them (:func:`outputs_like`'s pair; ``keep_output``
    without a residual: the second holds the reduced output, ``NormOperands``)."""
    out, res = outputs_like(shape, dtype, weight.device, residual, keep_output)
    reduce_norm(NormOperands(weight, epsilon, residual=residual.contiguous() if residual is not None else None,
                             out=out, residual_out=res if residual is not None or keep_output else None))
    return out, res


def _tp_impl(input: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, epsilon: float,
             keep_output: bool, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    group = compat.group_by_name(group_name)
    comm = group.__dict__.get("_echo_comm")
    if comm is None or comm.disabled:  # Echo is not on this group (any more): vLLM's sum, then the norm
        def reduce_norm(norm):
            return norm.apply(group._all_reduce_out_place(input))
    else:
        def reduce_norm(norm):
            return comm.all_reduce_norm(input.contiguous(), norm)
    return run_norm(reduce_norm, tuple(input.shape), input.dtype, residual, weight, epsilon, keep_output)


def _tp_fake(input: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, epsilon: float,
             keep_output: bool, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return outputs_like(tuple(input.shape), input.dtype, input.device, residual, keep_output)


def register_ops() -> None:
    """Define ``torch.ops.echo.all_reduce_norm`` once per process (the
    emulation defines its two with its own ops)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("echo", "FRAGMENT")
    compat.register_custom_op(lib, TP_OP, _tp_impl, _tp_fake)
    _LIB = lib


# ---------------------------------------------------------------------------
# Which pairs fuse (pure)
# ---------------------------------------------------------------------------


class SiteFacts(NamedTuple):
    """One reduce of a compiled graph, as the pass sees it."""

    reduce: str
    """``"tp"`` (``vllm.all_reduce``), ``"row"`` or ``"vocab"`` (the emulation's ops)."""
    echo_group: bool
    """The all-reduce is the group Echo runs on (always, for the emulation)."""
    norm: Optional[str]
    """``"fused_add_rms_norm"`` or ``"rms_norm"`` when the reduced output
    is the first argument of one, else None."""
    other_uses: int
    """Uses of the reduced output besides that norm's input."""
    uses_after_norm: int
    """Those of :attr:`other_uses` that are nodes after the norm (they can
    take the reduced output from the fused op)."""
    partial_variance: bool
    """The norm's variance covers part of the row (``variance_size``)."""
    weight: bool
    """The norm has a weight."""


def site_reason(f: SiteFacts) -> Optional[str]:
    """Why the pair cannot become one of Echo's fused ops (None: it can)."""
    if not f.echo_group:
        return "an all-reduce of another group"
    if f.norm is None:
        return "not followed by vLLM's RMSNorm"
    if f.other_uses and f.norm != "rms_norm":  # the fused op's second output is the new residual, not y
        return "the reduced output is used beyond the norm"
    if f.uses_after_norm < f.other_uses:  # y is kept by the fused op, which runs where the norm did
        return "the reduced output is used before its norm"
    if f.partial_variance:
        return "the norm's variance covers part of the row"
    if not f.weight:
        return "the norm has no weight"
    return None


def pass_decision(tp_comm: str, fuse_norm: bool, postnorm: bool, existing: Any) -> "tuple[bool, str]":
    """``(register, reason)`` for the pass on an engine: ``tp_comm``,
    ``echo_fuse_norm``, whether the model is post-norm, and
    what ``post_grad_custom_post_pass`` already holds."""
    if tp_comm != "echo":
        return False, f"tp_comm={tp_comm}: no Echo to fuse the norm into"
    if not fuse_norm:
        return False, "echo_fuse_norm is off"
    if postnorm:
        return False, "a post-norm model: its norm does not follow the all-reduce"
    if existing is not None and not getattr(existing, "echo_norm_fusion", False):
        return False, f"{PASS_KEY} already holds {type(existing).__name__}"
    return True, "under compilation (not --enforce-eager)"


# ---------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------


def _reduce_kinds() -> dict:
    """Graph targets of the reduces -> kind (those this process defines)."""
    kinds = {}
    if hasattr(torch.ops.vllm, "all_reduce"):
        kinds[torch.ops.vllm.all_reduce.default] = "tp"
    for name, kind in (("emulated_row_parallel", "row"), ("emulated_vocab_embedding", "vocab")):
        if hasattr(torch.ops.echo, name):
            kinds[getattr(torch.ops.echo, name).default] = kind
    return kinds


def arguments(node: torch.fx.Node) -> dict:
    """A call of an op overload's arguments by its schema's names, defaults filled in."""
    out = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def facts_of(node: torch.fx.Node, kind: str, echo_group: Optional[str], norms: dict) -> "tuple[SiteFacts, Any]":
    """:class:`SiteFacts` of the reduce ``node`` and its norm node (or None)."""
    norm_node = next((u for u in node.users if u.op == "call_function" and u.target in norms
                      and next(iter(arguments(u).values())) is node), None)
    args = arguments(norm_node) if norm_node is not None else {}
    # another user, or the norm taking it twice (its residual too)
    others = [u for u in node.users if u is not norm_node]
    twice = norm_node is not None and any(a is node for a in list(args.values())[1:])
    facts = SiteFacts(
        reduce=kind,
        echo_group=kind != "tp" or (echo_group is not None and arguments(node).get("group_name") == echo_group),
        norm=norms[norm_node.target] if norm_node is not None else None,
        other_uses=len(others) + int(twice),
        uses_after_norm=sum(1 for u in others if norm_node is not None and _after(u, norm_node)),
        partial_variance=args.get("variance_size") is not None,
        weight=args.get("weight") is not None,
    )
    return facts, norm_node


def _after(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether node ``a`` comes after node ``b`` in their graph's order."""
    n = b.next
    while n.op != "root":
        if n is a:
            return True
        n = n.next
    return False


def _fused_target(kind: str) -> Any:
    return getattr(torch.ops.echo, {"tp": TP_OP, "row": ROW_NORM_OP, "vocab": VOCAB_NORM_OP}[kind]).default


def _fake_val(node: torch.fx.Node) -> None:
    """``node.meta["val"]``: its op's fake implementation on its arguments'
    fake values (what the graph's other nodes carry), when they have them."""
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    fake = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake is None or any(isinstance(a, torch.fx.Node) and "val" not in a.meta for a in node.args):
        return
    with fake:
        node.meta["val"] = node.target(*vals)


def fuse_graph(graph: torch.fx.Graph, echo_group: Optional[str]) -> Counter:
    """Replace every fusable reduce + norm pair of ``graph`` (module
    docstring); returns the sites by outcome (:data:`FUSED` or the reason)."""
    kinds, norms = _reduce_kinds(), compat.ir_norm_ops()
    outcomes: Counter = Counter()
    for node in list(graph.nodes):
        kind = kinds.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        facts, norm_node = facts_of(node, kind, echo_group, norms)
        if not facts.echo_group:
            continue  # not Echo's: not one of its all-reduces
        reason = site_reason(facts)
        if reason is not None:
            outcomes[reason] += 1
            continue
        args, inputs = arguments(norm_node), list(arguments(node).values())
        group = (inputs.pop(),) if kind == "tp" else ()  # vllm.all_reduce(tensor, group_name): the name goes last
        keep = facts.other_uses > 0  # rms_norm's input used later too (site_reason): the op keeps it
        with graph.inserting_before(norm_node):
            fused = graph.call_function(_fused_target(kind), (*inputs, args.get("x_residual"), args["weight"],
                                                              float(args["epsilon"]), keep, *group))
            _fake_val(fused)
            if facts.norm == "rms_norm":  # the first of the op's two outputs; the second is y where kept
                first = graph.call_function(operator.getitem, (fused, 0))
                first.meta.update(norm_node.meta)
                norm_node.replace_all_uses_with(first)
                if keep:
                    kept = graph.call_function(operator.getitem, (fused, 1))
                    kept.meta.update(node.meta)
            else:
                fused.meta.setdefault("val", norm_node.meta.get("val"))
                norm_node.replace_all_uses_with(fused)
        graph.erase_node(norm_node)
        if keep:
            node.replace_all_uses_with(kept)
        graph.erase_node(node)
        outcomes[FUSED] += 1
    return outcomes


def report(outcomes: Counter) -> str:
    """The line logged for one compiled graph: fused N of M, and the rest's reasons."""
    total = sum(outcomes.values())
    rest = ", ".join(f"{n} {reason}" for reason, n in sorted(outcomes.items()) if reason != FUSED)
    return f"fused the norm into {outcomes[FUSED]} of {total} Echo all-reduces" + (f" (not: {rest})" if rest else "")


@functools.lru_cache(maxsize=None)
def pass_class() -> type:
    """:class:`EchoNormFusionPass`'s class, built on vLLM's ``InductorPass``
    when first asked for (vLLM's compilation modules are imported then)."""

    class EchoNormFusionPass(compat.inductor_pass_base()):
        """The post-grad pass (module docstring) for the engine whose Echo
        group is ``echo_group`` (None: the emulation, whose reduces are
        Echo's ops). Holds only names, so vLLM's deep copy of its Inductor
        config copies it."""

        echo_norm_fusion = True

        def __init__(self, echo_group: Optional[str]):
            self.echo_group = echo_group

        def __call__(self, graph: torch.fx.Graph) -> None:
            from . import session

            try:
                outcomes = fuse_graph(graph, self.echo_group)
            except Exception as e:  # a pass that fails leaves the graph as vLLM built it, loudly
                logger.error("echo: the norm fusion pass failed (%s: %s); this graph keeps the unfused path",
                             type(e).__name__, e, exc_info=True)
                outcomes = Counter({f"the pass failed ({type(e).__name__})": 1})
            if not outcomes:
                return
            logger.info("echo: %s", report(outcomes))
            active = session.current()
            if active is not None:
                active.stats.add_norm_sites(outcomes)

        def uuid(self) -> str:
            """This module's source and the group (Inductor's cache key)."""
            source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
            return self.hash_dict({"source": source, "echo_group": self.echo_group})

    return EchoNormFusionPass


def EchoNormFusionPass(echo_group: Optional[str]) -> Any:
    """The pass for the engine whose Echo group is ``echo_group`` (:func:`pass_class`)."""
    return pass_class()(echo_group)


def install(vllm_config: Any, tp_comm: str, fuse_norm: bool, postnorm: bool, echo_group: Optional[str]) -> str:
    """Register the pass for this engine if :func:`pass_decision` says so
    (and the fused ops); returns what was done, for the start-up log."""
    inductor = compat.inductor_compile_config(vllm_config)
    if inductor is None:
        return "the norm after each all-reduce stays unfused (the engine has no Inductor config)"
    register, reason = pass_decision(tp_comm, fuse_norm, postnorm, inductor.get(PASS_KEY))
    if not register:
        return f"the norm after each all-reduce stays unfused ({reason})"
    register_ops()
    inductor[PASS_KEY] = EchoNormFusionPass(echo_group)
    return f"the norm after each residual all-reduce is fused into Echo {reason}"


__all__ = ["EchoNormFusionPass", "FUSED", "pass_class", "SiteFacts", "arguments", "facts_of", "fuse_graph", "install",
           "outputs_like", "pass_decision", "register_ops", "report", "run_norm", "site_reason"]
