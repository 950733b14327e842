"""Post-norm ("sandwich") decoders: where Echo's error feedback must not run.

Echo's feedback cancels because consecutive all-reduce outputs are *added*
to one residual stream: call k's output carries ``S_k + E_{k-1} - E_k`` and
the sum over calls telescopes. Post-norm decoders (Gemma-2/3/4, OLMo-2/3,
EXAONE-4, ...) normalise each attention / MLP output before the residual add,
so call k's output -- carried error included -- is rescaled by that call's
own per-token RMS: the errors no longer cancel, they are added back at the
wrong scale. Measured on Gemma-3-270M at emulated TP=4 (EVAL.md section 4):
perplexity +19% with feedback off, 1.5e5 (diverged) with it on.

Without feedback 4-bit still costs such a model far more than a pre-norm
one (Gemma-3-270M: +19% perplexity, -0.72 +- 0.42 points on the seven
benchmarks' full validation sets, EVAL.md), which breaks Echo's promise of unchanged accuracy. So in serving
(the vLLM plugin) a post-norm model keeps vLLM's 16-bit all-reduce unless the
user opts in (``"no-feedback"``); the evaluation tools default to
``"no-feedback"`` to measure what Echo can do there. The choice is logged,
never silent. One pure function decides, for the HF
emulation (which sees the modules) and the vLLM glue (which sees the
config's architecture names) alike.
"""

from __future__ import annotations

from typing import Any, Iterable

from .config import EchoConfig, EchoConfigError

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


def is_postnorm_architecture(architectures: Iterable[str] | None, hf_config: Any = None) -> bool:
    """True when any of a model config's ``architectures`` is post-norm
    (for openPangu: when ``hf_config`` turns its sandwich norm on)."""
    archs = list(architectures or ())
    if any(a in POSTNORM_ARCHITECTURES for a in archs):
        return True
    return any(bool(getattr(hf_config, CONDITIONAL_POSTNORM_ARCHITECTURES[a], False))
               for a in archs if a in CONDITIONAL_POSTNORM_ARCHITECTURES)


def postnorm_config(config: EchoConfig, policy: str) -> tuple[str, EchoConfig]:
    """Echo settings for a post-norm model: returns ``(mode, config)`` with
    mode ``"echo"`` or ``"exact"``.

    * ``"no-feedback"``: quantize every call independently (Hadamard, exact
      last call and group size as configured, feedback off).
    * ``"exact"`` (serving default): every call in 16-bit (Echo disabled for
      this model).
    * ``"feedback"``: run Echo as configured anyway (for measurement).
    """
    if policy not in POSTNORM_POLICIES:
        raise EchoConfigError(f"postnorm policy {policy!r}: choose one of {POSTNORM_POLICIES}")
    if policy == "exact":
        return "exact", config
    if policy == "no-feedback":
        return "echo", config.replace(feedback=False)
    return "echo", config
