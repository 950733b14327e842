"""echo_vllm.testing_models: the tiny Qwen3 folder loads with transformers (what vLLM reads it with):
config, weights with the exact parameter names, a byte-level tokenizer that
round-trips any text, and a ChatML chat template."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from echo_vllm.testing_models import IM_END, IM_START, make_tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "qwen3", num_layers=2, vocab_size=512)


def test_same_seed_same_files(model_dir, tmp_path):
    again = make_tiny_qwen3(tmp_path / "again", num_layers=2, vocab_size=512)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (model_dir / name).read_bytes() == (again / name).read_bytes()


def test_tokenizer_round_trips_and_has_a_chat_template(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "Hello there, ünïcode ✓ 漢字 \t\n end"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == f"{IM_START}user\nHi{IM_END}\n{IM_START}assistant\n"
    ids = tok.encode(chat)
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 2
    assert tok.eos_token == IM_END
    assert len(tok) <= 512


def test_hf_qwen3_loads_every_weight_and_runs(model_dir):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "qwen3" and config.num_hidden_layers == 2
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
