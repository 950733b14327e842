"""Post-norm by structure (echo_vllm.postnorm_policy.decide_postnorm): a model whose
architecture name is in no list is still recognised by its module tree --
tiny transformers models on CPU with random weights, and the meta-device
skeleton the vLLM glue builds from a config alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from echo_vllm.postnorm_policy import decide_postnorm, is_postnorm_architecture, module_tree  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)


class SandwichLM(transformers.Gemma3ForCausalLM):
    """An out-of-tree model: Gemma-3's layers under a name no list knows."""


def _renamed(config, name: str):
    config.architectures = [name]
    assert not is_postnorm_architecture(config.architectures, config)  # the name list alone misses it
    return config


def test_renamed_gemma3_is_post_norm_by_structure():
    config = _renamed(transformers.Gemma3TextConfig(**SMALL, sliding_window=16), "SandwichLMForCausalLM")
    torch.manual_seed(0)
    model = SandwichLM(config).eval()
    decision = decide_postnorm(config.architectures, config, model)
    assert decision.postnorm
    assert decision.reason == ("by structure: model.layers.0.post_feedforward_layernorm (Gemma3RMSNorm) "
                               "normalises the MLP's output before the residual add")


def test_renamed_gemma3_config_alone_is_post_norm_by_structure():
    """The vLLM glue's case: no model yet, the skeleton from the config."""
    config = _renamed(transformers.Gemma3TextConfig(**SMALL, sliding_window=16), "SandwichLMForCausalLM")
    tree = module_tree(config)
    assert next(tree.parameters()).device.type == "meta"  # no memory, no weights
    decision = decide_postnorm(config.architectures, config, tree)
    assert decision.postnorm and decision.reason.startswith("by structure: layers.0.post_feedforward_layernorm")


def test_renamed_olmo2_is_post_norm_by_structure():
    """OLMo-2: no pre-norm at all, both sublayers' outputs normalised."""
    config = _renamed(transformers.Olmo2Config(**{k: v for k, v in SMALL.items() if k != "head_dim"}),
                      "MyOlmoForCausalLM")
    decision = decide_postnorm(config.architectures, config, module_tree(config))
    assert decision.postnorm and "post_feedforward_layernorm" in decision.reason


@pytest.mark.parametrize("make", [
    lambda: transformers.Qwen3Config(**SMALL),
    lambda: transformers.LlamaConfig(**SMALL),
], ids=["qwen3", "llama"])
def test_qwen3_and_llama_are_not_post_norm_by_structure(make):
    """Their ``post_attention_layernorm`` is the MLP's pre-norm (Llama's
    naming), not a norm on the attention output."""
    config = make()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for tree in (model, module_tree(config)):
        decision = decide_postnorm(config.architectures, config, tree)
        assert not decision.postnorm
        assert "post_attention_layernorm" in decision.reason and "not in the post-norm list" in decision.reason


class _Layer(nn.Module):
    def __init__(self, *norms: str):
        super().__init__()
        self.self_attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)
        for name in norms:
            setattr(self, name, nn.RMSNorm(4))


def test_post_attention_norm_counts_where_the_mlp_has_its_own_pre_norm():
    gemma_like = nn.ModuleList([_Layer("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")])
    decision = decide_postnorm(["X"], None, gemma_like)
    assert decision.postnorm and decision.reason == (
        "by structure: 0.post_attention_layernorm (RMSNorm) normalises the attention output "
        "(the MLP has its own pre-norm pre_feedforward_layernorm) before the residual add")
    llama_like = nn.ModuleList([_Layer("input_layernorm", "post_attention_layernorm")])
    assert not decide_postnorm(["X"], None, llama_like).postnorm


def test_every_layer_is_looked_at():
    """Hybrids (OLMo-hybrid) put the sandwich norms on some layers only."""
    layers = nn.ModuleList([_Layer("input_layernorm", "post_attention_layernorm"),
                            _Layer("post_attention_layernorm", "post_feedforward_layernorm")])
    decision = decide_postnorm(["X"], None, layers)
    assert decision.postnorm and "1.post_feedforward_layernorm" in decision.reason


def test_the_name_list_wins_and_no_tree_means_unchecked():
    llama = _Layer("input_layernorm", "post_attention_layernorm")
    listed = decide_postnorm(["Gemma3ForCausalLM"], None, llama)
    assert listed == (True, "architecture Gemma3ForCausalLM is in the post-norm list")
    unchecked = decide_postnorm(["SandwichLMForCausalLM"])
    assert not unchecked.postnorm and "structure not checked" in unchecked.reason


def test_module_tree_is_none_where_transformers_cannot_build_the_model():
    assert module_tree(None) is None
    assert module_tree(transformers.PretrainedConfig(model_type="no-such-model")) is None
