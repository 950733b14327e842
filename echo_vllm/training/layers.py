"""Tensor-parallel layers for a Qwen3-style decoder, in plain PyTorch.

Each layer holds the shards of its local ranks stacked on a leading
dimension R (``echo_vllm.training.collectives``): P shards when one process
emulates TP=P, one in a real process group. Weights are built from the full
(unsharded) matrix, so a model has the same parameters at any P and in
either setting.

* :class:`ColumnParallelLinear` -- weight split by output features; input
  per-rank [R, ..., in] (after f), output per-rank [R, ..., out/P].
* :class:`RowParallelLinear` -- weight split by input features; output
  per-rank *partial sums* [R, ..., out] for g to reduce.
* :class:`VocabParallelEmbedding` -- rows split by token id; a rank's
  partial is zero for tokens outside its range, g sums them.
* :func:`vocab_parallel_cross_entropy` -- the loss over vocab-sharded
  logits without gathering them (exact fp32 max/sum over ranks).
* :class:`RMSNorm` -- on replicated or per-rank input; per-rank use makes its
  weight gradient a partial sum per rank, which the model sums
  (``TPQwen3.sync_replicated_grads``).

Matmuls run in ``compute_dtype`` (weights are cast on the fly, as autocast
would: fp32 master weights for the optimizer); norms, RoPE and the loss in
fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import TPGroup


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, computed in fp32,
    returned in x's dtype.

    ``ranked``: the input carries the rank dimension [R, ..., D]. The
    weight is then applied through a per-rank view, so that autograd sums
    its gradient over each rank's tokens first (what a real rank computes)
    and over ranks second; in a process group that second sum is
    ``TPQwen3.sync_replicated_grads``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, ranked: bool = False, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.ranked = ranked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 in tests
        x32 = x.to(ct)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(ct)
        if self.ranked:
            w = w.view((1,) * (x.dim() - 1) + (-1,)).expand((x.shape[0],) + (1,) * (x.dim() - 2) + (-1,))
        return (y * w).to(x.dtype)


def _rank_matmul(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per rank r: ``x[r] @ weight[r]^T`` in ``dtype``; x [R, ..., in], weight
    [R, out, in] -> [R, ..., out]. One batched matmul over the ranks (each
    rank's product is the one a real rank computes alone)."""
    r, k = x.shape[0], x.shape[-1]
    flat = x.to(dtype).reshape(r, -1, k)
    out = torch.bmm(flat, weight.to(dtype).transpose(1, 2))
    return out.view(x.shape[:-1] + (weight.shape[1],))


class ColumnParallelLinear(nn.Module):
    """``y_r = x_r @ W_r^T`` with W split by output features.

    ``parts``: the full weight as one or more matrices [out_i, in] stacked by
    output (e.g. q, k, v): each is split into P and rank r's weight is the
    concatenation of its pieces, so its output is [part_0 shard, part_1
    shard, ...] -- a fused projection per rank.
    """

    def __init__(self, group: TPGroup, parts: list[torch.Tensor], compute_dtype: torch.dtype):
        super().__init__()
        for w in parts:
            if w.shape[0] % group.world_size:
                raise ValueError(f"output features {w.shape[0]} not divisible by P={group.world_size}")
        self.split = [w.shape[0] // group.world_size for w in parts]
        shards = torch.cat([group.shard(w, 0) for w in parts], dim=1)  # [R, sum(out_i)/P, in]
        self.weight = nn.Parameter(shards)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [R, ..., in] -> [R, ..., out/P]."""
        return _rank_matmul(x, self.weight, self.compute_dtype)


class RowParallelLinear(nn.Module):
    """``p_r = x_r @ W_r^T`` with W split by input features: the per-rank
    partial sums of the full output."""

    def __init__(self, group: TPGroup, full: torch.Tensor, compute_dtype: torch.dtype):
        super().__init__()
        if full.shape[1] % group.world_size:
            raise ValueError(f"input features {full.shape[1]} not divisible by P={group.world_size}")
        self.weight = nn.Parameter(group.shard(full, 1))  # [R, out, in/P]
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [R, ..., in/P] -> partials [R, ..., out]."""
        return _rank_matmul(x, self.weight, self.compute_dtype)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by token id: rank r holds ids [r V/P, (r+1) V/P)."""

    def __init__(self, group: TPGroup, full: torch.Tensor):
        super().__init__()
        vocab = full.shape[0]
        if vocab % group.world_size:
            raise ValueError(f"vocab {vocab} not divisible by P={group.world_size}")
        self.rows = vocab // group.world_size
        self.weight = nn.Parameter(group.shard(full, 0))  # [R, V/P, H]
        starts = [r * self.rows for r in group.local_ranks]
        self.register_buffer("starts", torch.tensor(starts, dtype=torch.long), persistent=False)

    def local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-rank row index (clamped) and in-range mask, both [R, *ids.shape]."""
        local = ids.unsqueeze(0) - self.starts.view((-1,) + (1,) * ids.dim())
        inside = (local >= 0) & (local < self.rows)
        return local.clamp(0, self.rows - 1), inside

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` [...] -> partials [R, ..., H]: the row on its owner rank,
        zeros elsewhere."""
        local, inside = self.local_ids(ids)
        out = torch.stack([F.embedding(local[r], self.weight[r]) for r in range(local.shape[0])])
        return out * inside.unsqueeze(-1).to(out.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over N tokens of logits split by vocab [R, N, V/P]
    (Megatron's formulation: the softmax never needs the whole row on one
    rank). Forward: exact fp32 max, sum-exp and target-logit sums over ranks;
    backward is local: (softmax - onehot) / N on each rank's shard."""

    @staticmethod
    def forward(ctx, logits, local, inside, group: TPGroup):
        z = logits.float()
        z = z - group.max(z.amax(-1)).unsqueeze(0).unsqueeze(-1)
        e = z.exp()
        sumexp = group.sum(e.sum(-1))  # [N]
        target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        target = group.sum(target)  # [N]: one rank holds it, the others add 0
        loss = sumexp.log() - target
        softmax = e / sumexp.unsqueeze(0).unsqueeze(-1)
        ctx.save_for_backward(softmax, local, inside)
        ctx.dtype = logits.dtype
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        n = softmax.shape[1]
        g = softmax.scatter_add(-1, local.unsqueeze(-1), -inside.to(softmax.dtype).unsqueeze(-1))
        return (g * (grad / n)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, embedding: VocabParallelEmbedding, group: TPGroup
) -> torch.Tensor:
    """Mean loss (replicated scalar) of ``logits`` [R, N, V/P] against
    ``targets`` [N]; ``embedding`` gives the vocab split."""
    local, inside = embedding.local_ids(targets)
    return _VocabParallelCrossEntropy.apply(logits, local, inside.float(), group)


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, head_dim] (fp32) of rotary embeddings, in the
    rotate-half layout Qwen uses (frequencies repeated over both halves)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(seq_len, dtype=torch.float64).unsqueeze(1) * inv.unsqueeze(0)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., S, heads, D] by position (fp32), in x's dtype."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [S, 1, D]
    return (x32 * c + rot * s).to(x.dtype)


def init_normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """A full fp32 weight drawn on the CPU from ``generator``: the same values
    whatever the device, the TP degree or the process."""
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def scaled_std(std: float, layers: int) -> float:
    """GPT-2's residual-projection init: std / sqrt(2 L), so the residual's
    variance does not grow with depth at initialisation."""
    return std / math.sqrt(2 * layers)


__all__ = [
    "ColumnParallelLinear",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_rope",
    "init_normal",
    "rope_tables",
    "scaled_std",
    "vocab_parallel_cross_entropy",
]
