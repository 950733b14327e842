"""Model folders for tests and GPU checks: a tiny Qwen3, built locally (no hub access).

vLLM, transformers and the OpenAI-compatible server need a real model
folder: ``config.json``, safetensors weights, and a tokenizer with a chat
template. :func:`make_tiny_qwen3` writes one with random bf16 weights and a
byte-level BPE tokenizer trained (with the ``tokenizers`` library) on a
small built-in text, so any string encodes (no unknown tokens) and
``/v1/chat/completions`` works. Same arguments and seed -> same files.
The test suite and the GPU scripts (``scripts/gpu_vllm_check.py``,
``server/gpu_serve_check.sh``) build their models here. Needs
``tokenizers`` and ``safetensors`` (both come with vLLM and transformers).

    path = make_tiny_qwen3("/tmp/tiny-qwen3", num_layers=4)
    LLM(model=str(path))
"""

from __future__ import annotations

import pathlib

import torch

from .outputs import write_json

#: Qwen's special tokens; <|im_end|> ends a chat turn (the EOS for chat).
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

#: ChatML, as Qwen models use it (without tool calls or thinking blocks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
Tensor parallelism splits every weight matrix of a transformer across several
devices. Each device computes a partial result, and an all-reduce sums the
partials before the next layer can start. The all-reduce sits between two
dependent matrix multiplications, so its latency cannot be hidden.
Echo sends four-bit values instead of sixteen-bit ones but sums in high
precision. The quantization error of one call is carried into the next call
of the same forward pass, so old errors cancel new ones and the error of the
residual stream does not grow with the depth of the model.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles
begins with a single step. To be or not to be, that is the question.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -1 +1 = * / % < >
Hello! How are you today? I am fine, thank you. What is the capital of France?
The capital of France is Paris. Water boils at one hundred degrees Celsius.
def add(a, b):
    return a + b
{"role": "user", "content": "Write a short poem about the sea."}
"""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def _weights(
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    seed: int,
    init_std: float,
) -> dict[str, torch.Tensor]:
    """HF Qwen3 parameter names and shapes; linears and embeddings ~ N(0,
    init_std), norms 1."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * init_std).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    h, q, kv = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    w = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "self_attn.q_norm.weight": ones(head_dim),
            p + "self_attn.k_norm.weight": ones(head_dim),
            p + "post_attention_layernorm.weight": ones(h),
            p + "mlp.gate_proj.weight": normal(intermediate_size, h),
            p + "mlp.up_proj.weight": normal(intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, intermediate_size),
        })
    w["model.norm.weight"] = ones(h)
    w["lm_head.weight"] = normal(vocab_size, h)
    return w


def make_tiny_qwen3(
    out_dir: str | pathlib.Path,
    *,
    num_layers: int = 4,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 2048,
    seed: int = 0,
    init_std: float = 0.02,
    max_position_embeddings: int = 4096,
) -> pathlib.Path:
    """Write a random-weight Qwen3 model folder to ``out_dir``; return its path.

    ``vocab_size`` is the model's (embedding rows); the tokenizer is trained
    to at most that many tokens (fewer if the built-in text has fewer merges),
    like real checkpoints whose embedding is padded past the tokenizer.
    """
    from safetensors.torch import save_file

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size}: needs at least {256 + len(SPECIAL_TOKENS)}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden_size // num_heads

    tok = _train_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(out / "special_tokens_map.json", {
        "eos_token": IM_END, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START, IM_END],
    })
    _write_json(out / "config.json", {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "tie_word_embeddings": False,
        "initializer_range": init_std,
        "use_cache": True,
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[PAD_TOKEN],
        "torch_dtype": "bfloat16",
    })
    _write_json(out / "generation_config.json", {
        "eos_token_id": [ids[IM_END], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
    })
    weights = _weights(
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim,
        vocab_size, seed, init_std,
    )
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_json(path: pathlib.Path, obj: dict) -> None:
    write_json(path, obj, indent=2)


__all__ = ["CHAT_TEMPLATE", "IM_END", "IM_START", "PAD_TOKEN", "SPECIAL_TOKENS", "make_tiny_qwen3"]
