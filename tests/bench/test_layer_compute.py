"""``echo_vllm.bench.layer_compute``: the shard sizes and FLOPs of one decoder
layer at TP (exact arithmetic), and the layer run on the CPU against a
plain-torch decoder layer's math (the timing itself is only meaningful on the GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from echo_vllm.bench.layer_compute import QWEN3_8B, DecoderShape, layer_ops, measure_us


def test_qwen3_8b_shards_as_vllm_splits_them():
    assert QWEN3_8B.shard(8) == {"heads": 4, "kv_heads": 1, "intermediate": 1536}
    assert QWEN3_8B.shard(2) == {"heads": 16, "kv_heads": 4, "intermediate": 6144}
    # fewer KV heads than ranks: each rank keeps one (vLLM replicates them)
    assert DecoderShape(heads=32, kv_heads=4).shard(8)["kv_heads"] == 1
    with pytest.raises(ValueError, match="tp=3 must divide heads=32"):
        QWEN3_8B.shard(3)


def test_flops_are_the_gemms_and_the_causal_attention():
    t, tp = 8192, 8
    gemm = 2 * t * 4096 * ((4 + 2) * 128 + 4 * 128 + 3 * 1536)
    attn = 4 * 4 * 128 * t * (t + 1) / 2
    assert QWEN3_8B.flops(tp, t) == gemm + attn
    # TP halves the work of each rank (KV heads aside)
    assert QWEN3_8B.flops(2, t) > 3.5 * QWEN3_8B.flops(8, t)


def test_the_layer_runs_the_decoder_math_on_cpu():
    """The partial sum it returns is a decoder layer's down_proj partial,
    recomputed here in fp32 from the same seeded operands with explicit
    softmax attention. Both sides are fp32 with other summation orders: four
    chained dot products of at most 128 terms, each within 128 unit
    roundoffs (2^-24) of the exact value, relative to the output's scale."""
    shape = DecoderShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16)
    y = layer_ops(shape, 2, 5, device="cpu", dtype=torch.float32)()
    assert y.shape == (5, 64) and torch.isfinite(y).all()
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731 - the same draws, in order
    x, w_qkv, w_o = rand(5, 64), rand((2 + 2) * 16, 64), rand(64, 2 * 16)
    w_gu, w_down = rand(128, 64), rand(64, 64)
    q, k, v = (x @ w_qkv.t()).split([32, 16, 16], dim=-1)
    q, k, v = (t.view(5, -1, 16).transpose(0, 1) for t in (q, k, v))
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    a = torch.softmax((q @ k.transpose(1, 2) / 4.0).masked_fill(~mask, float("-inf")), -1) @ v
    h = a.transpose(0, 1).reshape(5, 32) @ w_o.t()
    gate, up = (h @ w_gu.t()).chunk(2, -1)
    want = (F.silu(gate) * up) @ w_down.t()
    bound = 4 * 128 * 2.0**-24
    torch.testing.assert_close(y, want, rtol=bound, atol=bound * float(want.abs().max()))


def test_measure_us_on_cpu_is_a_positive_median():
    shape = DecoderShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16)
    assert measure_us(shape, 2, 8, device="cpu", iters=3) > 0


@pytest.mark.parametrize("argv,message", [
    (["--tp", "3"], "--tp 3: tp=3 must divide heads=32"),
    (["--tp", "2,x"], "argument --tp: not an integer: 'x'"),
    (["--tokens", "1024,1024"], "argument --tokens: '1024,1024': 1024 is given twice"),
])
def test_the_command_refuses_its_sizes_before_any_gpu_work(argv, message, capsys):
    """A TP that does not divide the heads, or a size that is no integer,
    was a traceback on the GPU host after the sizes before it were timed;
    a repeated size was timed twice."""
    from echo_vllm.bench import layer_compute

    with pytest.raises(SystemExit) as info:
        layer_compute.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
