"""Post-norm ("sandwich") decoders: where Echo's error feedback must not run.

Echo's feedback cancels because consecutive all-reduce outputs are *added*
to one residual stream: call k's output carries ``S_k + E_{k-1} - E_k`` and
the sum over calls telescopes. Post-norm decoders (Gemma-2/3/4, OLMo-2/3,
EXAONE-4, ...) normalise each attention / MLP output before the residual add,
so call k's output -- carried error included -- is rescaled by that call's
own per-token RMS: the errors no longer cancel, they are added back at the
wrong scale. Measured on Gemma-3-270M at emulated TP=4 (EVAL.md, "Post-norm models"):
perplexity +19% with feedback off, 1.5e5 (diverged) with it on.

Without feedback 4-bit still costs such a model far more than a pre-norm
one (Gemma-3-270M: +19% perplexity, -0.72 +- 0.42 points on the seven
benchmarks' full validation sets, EVAL.md), which breaks Echo's promise of unchanged accuracy. So in serving
(the vLLM plugin) a post-norm model keeps vLLM's 16-bit all-reduce unless the
user opts in (``"no-feedback"``); the evaluation tools default to
``"no-feedback"`` to measure what Echo can do there. The choice is logged,
never silent. One pure function, :func:`decide_postnorm`, decides for the
HF emulation and the vLLM glue alike, from the architecture names (the list
below) and, where there is one, the model's module tree (the structure: an
out-of-tree or remote-code model with sandwich norms is caught under any
name). The vLLM glue has no model yet when it decides; it passes the
decoder transformers builds from the HF config on the meta device
(:func:`module_tree`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, NamedTuple

from .config import EchoConfig, EchoConfigError

logger = logging.getLogger("echo_vllm")

#: Decoder-layer attributes that mark a post-norm block: the norm applied to
#: the MLP's output before the residual add (Gemma/OLMo/EXAONE spell it
#: ``post_feedforward_layernorm``, GLM-4/AFMoE/AXK1 ``post_mlp_layernorm``,
#: PLaMo ``post_mlp_norm``).
POSTNORM_MARKERS = ("post_feedforward_layernorm", "post_mlp_layernorm", "post_mlp_norm")

#: ``architectures`` of post-norm models: every vLLM 0.26 architecture whose
#: model file's decoder layer always has one of :data:`POSTNORM_MARKERS`
#: (generative, pooling and MTP-draft alike; checked against vLLM's model
#: registry by tests/vllm/test_postnorm_registry.py), plus OLMo-2
#: (served through vLLM's transformers backend, post-norm in transformers).
POSTNORM_ARCHITECTURES = frozenset({
    "AXK1ForCausalLM",
    "AfmoeForCausalLM",
    "Glm4ForCausalLM",
    "Plamo2ForCausalLM",
    "Plamo3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma2Model",
    "Gemma3ForCausalLM",
    "Gemma3TextModel",
    "Gemma3ForConditionalGeneration",
    "Gemma3nForCausalLM",
    "Gemma3nForConditionalGeneration",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "Gemma4MTPModel",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "OlmoHybridForCausalLM",
    "FlexOlmoForCausalLM",
    "Exaone4ForCausalLM",
    "Rnj1ForCausalLM",
})

#: ``architectures`` whose decoder is post-norm only when a config flag is
#: true: openPangu's layers (``OpenPanguDecoderLayer``, shared by all three)
#: add ``post_mlp_layernorm`` when ``config.sandwich_norm`` is set.
CONDITIONAL_POSTNORM_ARCHITECTURES = {
    "PanguEmbeddedForCausalLM": "sandwich_norm",
    "PanguUltraMoEForCausalLM": "sandwich_norm",
    "PanguProMoEV2ForCausalLM": "sandwich_norm",
}

#: What Echo does on a post-norm model (see :func:`postnorm_config`).
POSTNORM_POLICIES = ("no-feedback", "exact", "feedback")

#: The serving policy when none is asked for: accuracy first (see above).
DEFAULT_POSTNORM_POLICY = "exact"


#: Words of a norm's attribute name (split at ``_``) that name the sublayer
#: it belongs to.
_MLP_WORDS = frozenset({"mlp", "feedforward", "ffn", "ff", "moe"})
_ATTENTION_WORDS = frozenset({"attn", "attention"})


class PostnormDecision(NamedTuple):
    """Whether a model is post-norm, and why (for the log line)."""

    postnorm: bool
    reason: str


def is_postnorm_architecture(architectures: Iterable[str] | None, hf_config: Any = None) -> bool:
    """The name list alone (:func:`decide_postnorm` is the decision): True
    when any of a model config's ``architectures`` is post-norm (for
    openPangu: when ``hf_config`` turns its sandwich norm on)."""
    return _listed(list(architectures or ()), hf_config) is not None


def _listed(archs: list[str], hf_config: Any) -> str | None:
    """Why the name list makes ``archs`` post-norm; None when it does not."""
    for a in archs:
        if a in POSTNORM_ARCHITECTURES:
            return f"architecture {a} is in the post-norm list"
        flag = CONDITIONAL_POSTNORM_ARCHITECTURES.get(a)
        if flag and bool(getattr(hf_config, flag, False)):
            return f"architecture {a} with {flag}=true is in the post-norm list"
    return None


def _is_norm(module: Any) -> bool:
    # by class name (LayerNorm, RMSNorm, Gemma3RMSNorm, ...: torch's and every
    # model's own), so deciding needs no torch import
    return any(cls.__name__.lower().endswith("norm") for cls in type(module).__mro__)


def _post_sublayer_norm(norms: list[str]) -> tuple[str, str] | None:
    """Of one layer's norm attribute names, the one that normalises a
    sublayer's output before the residual add, and what it normalises;
    None when none does.

    ``post_*`` names of the MLP (``post_feedforward_layernorm``,
    ``post_mlp_layernorm``) always do. ``post_attention_layernorm`` does
    only where the layer has a pre-MLP norm of its own
    (``pre_feedforward_layernorm``: Gemma-2/3) or no norm that is not
    ``post_*`` (OLMo-2): in the Llama convention (``input_layernorm`` +
    ``post_attention_layernorm``) it is the norm of the residual stream
    before the MLP, a pre-norm.
    """
    words = {name: set(name.lower().split("_")) for name in norms}
    post = [n for n in norms if "post" in words[n]]
    for name in post:
        if words[name] & _MLP_WORDS:
            return name, "the MLP's output"
    pre_mlp = [n for n in norms if "pre" in words[n] and words[n] & _MLP_WORDS]
    only_post = len(post) == len(norms)
    for name in post:
        if words[name] & _ATTENTION_WORDS and (pre_mlp or only_post):
            why = f"the MLP has its own pre-norm {pre_mlp[0]}" if pre_mlp else "the layer has no pre-norm"
            return name, f"the attention output ({why})"
    return None


def decide_postnorm(architectures: Iterable[str] | None, hf_config: Any = None,
                    modules: Any = None) -> PostnormDecision:
    """Is this model post-norm, and why: the name list, then the structure.

    ``architectures`` (and ``hf_config``, for openPangu's flag) are looked
    up in :data:`POSTNORM_ARCHITECTURES`: a listed model is post-norm
    whatever its module tree (the list is checked against vLLM's model
    files, which are what vLLM runs). Otherwise ``modules`` (a
    ``torch.nn.Module``: the model, or :func:`module_tree`'s meta-device
    skeleton; None when there is none) decides by structure: post-norm when
    some module (a decoder layer) has a norm child that normalises a
    sublayer's output before the residual add (:func:`_post_sublayer_norm`
    says which names do). Without ``modules`` an unlisted model counts as
    pre-norm, and the reason says the structure was not checked. Reads its
    arguments only.
    """
    archs = list(architectures or ())
    listed = _listed(archs, hf_config)
    if listed:
        return PostnormDecision(True, listed)
    if modules is None:
        return PostnormDecision(False, f"{archs} not in the post-norm list; structure not checked (no module tree)")
    seen: set[str] = set()
    for path, module in modules.named_modules():
        norms = {name: child for name, child in module.named_children() if _is_norm(child)}
        found = _post_sublayer_norm(list(norms))
        if found:
            name, what = found
            where = f"{path}.{name}" if path else name
            return PostnormDecision(True, f"by structure: {where} ({type(norms[name]).__name__}) "
                                          f"normalises {what} before the residual add")
        seen.update(norms)
    return PostnormDecision(False, f"{archs} not in the post-norm list, and no layer of {type(modules).__name__} "
                                   f"normalises a sublayer's output (its norms: {', '.join(sorted(seen)) or 'none'})")


def module_tree(hf_config: Any, *, trust_remote_code: bool = False) -> Any:
    """The decoder transformers builds from ``hf_config`` (its text config,
    for a multimodal model), on the meta device: the module tree without
    memory or weights, for :func:`decide_postnorm` before the model is
    loaded. None (logged) where transformers cannot build it: a config
    class of vLLM's own, remote code not trusted, a model transformers
    does not know. Builds code from ``hf_config`` (remote code only with
    ``trust_remote_code``); leaves nothing behind but imported modules."""
    if hf_config is None:
        return None
    try:
        import torch
        from transformers import AutoModel

        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        with torch.device("meta"):
            return AutoModel.from_config(text, trust_remote_code=trust_remote_code)
    except Exception as e:  # any failure leaves the name list to decide
        logger.info("echo: post-norm check by structure skipped: transformers cannot build %s from its "
                    "config (%s)", type(hf_config).__name__, " ".join(str(e).split())[:300])
        return None


def postnorm_config(config: EchoConfig, policy: str) -> tuple[str, EchoConfig]:
    """Echo settings for a post-norm model: returns ``(mode, config)``, the
    mode one of :data:`echo_vllm.policy.MODES`.

    * ``"no-feedback"``: naive, every call quantized independently (Hadamard,
      exact last call and group size as configured, feedback off).
    * ``"exact"`` (serving default): every call in 16-bit (Echo disabled for
      this model).
    * ``"feedback"``: run Echo as configured anyway (for measurement).
    """
    if policy not in POSTNORM_POLICIES:
        raise EchoConfigError(f"postnorm policy {policy!r}: choose one of {POSTNORM_POLICIES}")
    if policy == "exact":
        return "exact", config
    if policy == "no-feedback":
        return "naive", config.replace(feedback=False)
    return "echo", config
