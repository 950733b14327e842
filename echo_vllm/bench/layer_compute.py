"""One decoder layer's compute at tensor-parallel shard sizes: what a TTFT projection adds Echo's times to.

A pre-norm decoder layer of a TP rank does, per prompt of ``tokens`` tokens,
the GEMMs of its shards (column-parallel ``qkv_proj`` and ``gate_up_proj``,
row-parallel ``o_proj`` and ``down_proj``), causal attention over its
``heads / tp`` query heads (grouped over ``kv_heads / tp`` key/value heads),
and the SiLU-and-multiply of its MLP shard. The two all-reduces and the
norms after them are left out: the projection counts those itself
(:func:`echo_vllm.bench.norm_bench.ttft_projection`). Rotary embeddings and
the q/k norms are left out too (elementwise, a few µs at these sizes).

:func:`layer_ops` builds the shard operands of one (``tp``, ``tokens``);
:func:`measure_us` times them on the GPU (CUDA-graph replay, bf16, a fused
attention kernel through ``scaled_dot_product_attention``, never its math
fallback), or on the CPU with a host clock (for tests: the numbers mean
nothing there). ``python -m echo_vllm.bench.layer_compute --tp 2,4,8
--tokens 1024,4096,8192`` prints them, with the ``--layer-us`` argument of
``echo-vllm bench norm`` that gives them to its projection.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cli_args import MAX_RANKS, RANKS_WHY, counts, out_file
from ..outputs import write_json

#: Attention kernels a serving engine runs (flash-style, no [T, T] scores in memory): on a GPU
#: the layer refuses to fall back to the math kernel, which would time a different algorithm.
_FUSED_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


@dataclass(frozen=True)
class DecoderShape:
    """A dense decoder layer's sizes (defaults: Qwen3-8B)."""

    hidden: int = 4096
    """Residual width."""
    intermediate: int = 12288
    """MLP width (gate and up each)."""
    heads: int = 32
    """Query heads."""
    kv_heads: int = 8
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 128
    """Values per head."""

    def shard(self, tp: int) -> dict[str, int]:
        """Per-rank sizes at tensor parallelism ``tp`` (vLLM's split: heads
        and MLP columns divided; ``kv_heads`` replicated below one per rank)."""
        if self.heads % tp or self.intermediate % tp:
            raise ValueError(f"tp={tp} must divide heads={self.heads} and intermediate={self.intermediate}")
        return {"heads": self.heads // tp, "kv_heads": max(1, self.kv_heads // tp),
                "intermediate": self.intermediate // tp}

    def flops(self, tp: int, tokens: int) -> float:
        """Multiply-adds x 2 of one rank's GEMMs and causal attention."""
        s = self.shard(tp)
        qkv = (s["heads"] + 2 * s["kv_heads"]) * self.head_dim
        gemm = 2 * tokens * self.hidden * (qkv + s["heads"] * self.head_dim + 3 * s["intermediate"])
        attn = 2 * 2 * s["heads"] * self.head_dim * tokens * (tokens + 1) / 2  # QK^T and PV, causal half
        return gemm + attn


QWEN3_8B = DecoderShape()


def layer_ops(shape: DecoderShape, tp: int, tokens: int, *, device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A function running one rank's layer compute once (operands allocated
    here, random; returns the down_proj partial sum)."""
    s = shape.shard(tp)
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).to(device=device, dtype=dtype)

    d, hq, hkv = shape.head_dim, s["heads"], s["kv_heads"]
    x = rand(tokens, shape.hidden)
    w_qkv, w_o = rand((hq + 2 * hkv) * d, shape.hidden), rand(shape.hidden, hq * d)
    w_gate_up, w_down = rand(2 * s["intermediate"], shape.hidden), rand(shape.hidden, s["intermediate"])

    def run() -> torch.Tensor:
        qkv = x @ w_qkv.t()
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(1, tokens, hq, d).transpose(1, 2)
        # each query head's key/value head, materialized: every fused attention kernel takes it
        k, v = (t.view(1, tokens, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1) for t in (k, v))
        with sdpa_kernel(_FUSED_ATTENTION if q.is_cuda else [SDPBackend.MATH]):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = a.transpose(1, 2).reshape(tokens, hq * d) @ w_o.t()  # o_proj's partial (then the all-reduce)
        gate, up = (h @ w_gate_up.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w_down.t()  # down_proj's partial (then the all-reduce)

    return run


def measure_us(shape: DecoderShape, tp: int, tokens: int, *, device: str = "cuda", iters: int = 10) -> float:
    """Median µs of one rank's layer compute (:func:`layer_ops`): CUDA-graph
    replays on a GPU, a host clock elsewhere."""
    run = layer_ops(shape, tp, tokens, device=device)
    if device == "cuda":
        from .timing import cuda_graph_time

        return cuda_graph_time(lambda i: run(), iters=iters, calls_per_graph=3).median_s * 1e6
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2] * 1e6


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m echo_vllm.bench.layer_compute", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # checked before the GPU work: a TP that does not divide the heads failed after the first sizes' timings
    ap.add_argument("--tp", type=counts(1, MAX_RANKS, RANKS_WHY), default="2,4,8", help="tensor-parallel sizes")
    ap.add_argument("--tokens", type=counts(1, 1 << 20), default="1024,4096,8192", help="prompt lengths")
    ap.add_argument("--json", type=out_file, default=None, help="also write the times here")
    args = ap.parse_args(argv)
    for tp in args.tp:
        try:
            QWEN3_8B.shard(tp)
        except ValueError as e:
            ap.error(f"--tp {tp}: {e}")
    if not torch.cuda.is_available():
        print("layer_compute: needs a CUDA GPU (CPU times mean nothing)", file=sys.stderr)
        return 2
    times = {}
    for tp in args.tp:
        for t in args.tokens:
            us = times[f"{tp}:{t}"] = measure_us(QWEN3_8B, tp, t)
            print(f"TP={tp} T={t}: {us:.1f} us ({QWEN3_8B.flops(tp, t) / us / 1e6:.0f} TFLOP/s)", flush=True)
    print("--layer-us " + ",".join(f"{k}:{v:.1f}" for k, v in times.items()))
    if args.json:
        write_json(args.json, {"device": torch.cuda.get_device_name(0), "shape": "Qwen3-8B",
                               "layer_compute_us": times}, indent=1)
    return 0


__all__ = ["DecoderShape", "QWEN3_8B", "layer_ops", "measure_us"]


if __name__ == "__main__":
    raise SystemExit(main())
