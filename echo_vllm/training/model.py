"""A Qwen3-architecture decoder with Megatron tensor parallelism and Echo.

Qwen3's layer: pre-norm (RMSNorm), grouped-query attention with RoPE and
per-head RMSNorm on queries and keys (q/k-norm), SwiGLU MLP, no biases,
final RMSNorm, LM head tied to the embedding or not. Split over P ranks:
query and key/value heads, and the MLP's intermediate features, by rank
(column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj); the
vocabulary by rank (embedding, LM head, loss).

One forward pass makes ``1 + 2 L`` residual all-reduces (embedding, then
o_proj and down_proj per layer: the forward chain) and its backward
``2 L + 1`` (the input gradients of the LM head, then of each layer's MLP
and attention from the last layer to the first: the backward chain).

The model was checked against ``transformers``' ``Qwen3ForCausalLM`` with the
same (unsharded) weights: the same loss to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import TPComm, TPGroup, copy_to_tp, reduce_from_tp
from .layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rope,
    init_normal,
    rope_tables,
    scaled_std,
    vocab_parallel_cross_entropy,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model (a small Qwen3) and how it is computed."""

    vocab_size: int = 256
    """Token ids [0, vocab_size); must divide by P (byte-level: 256)."""
    hidden_size: int = 512
    """Residual-stream width; a multiple of Echo's group size keeps
    quantization groups inside one token."""
    num_layers: int = 8
    num_heads: int = 8
    """Query heads; must divide by P."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide by P."""
    head_dim: int = 64
    intermediate_size: int = 1536
    """SwiGLU width; must divide by P."""
    tie_embeddings: bool = True
    """LM head = embedding matrix (Qwen3's small models tie them)."""
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    """Std of the normal init; residual projections get std / sqrt(2 L)."""
    compute_dtype: str = "float32"
    """Dtype of the matmuls and attention ("bfloat16" on GPU). Master weights,
    the residual stream, norms, RoPE and the loss stay fp32."""
    norm_in_tp_region: bool = True
    """Apply each block's RMSNorm after f (on every rank's copy) instead of
    before it (Megatron's placement). The model is the same function; what
    changes is what the backward all-reduce sums: with the norm inside, the
    per-rank gradients are taken back through the norm before the reduce,
    so the reduced gradient is added to the residual stream's gradient
    directly -- the condition for the backward chain's errors to telescope.
    Outside, each call's error passes through a different norm Jacobian
    first. Costs one small fp32 sum of the norm weights' gradients over
    ranks per step."""

    def validate(self, world_size: int) -> None:
        for name in ("vocab_size", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % world_size:
                raise ValueError(f"{name}={getattr(self, name)} must be divisible by P={world_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE)")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.compute_dtype]

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * d
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup, gen: torch.Generator):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        p = group.world_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads // p, cfg.num_kv_heads // p, d
        std = cfg.init_std
        self.qkv = ColumnParallelLinear(
            group,
            [init_normal((cfg.num_heads * d, h), std, gen),
             init_normal((cfg.num_kv_heads * d, h), std, gen),
             init_normal((cfg.num_kv_heads * d, h), std, gen)],
            cfg.dtype,
        )
        # q/k-norm weights are shared by all heads, hence by all ranks
        self.q_norm = RMSNorm(d, cfg.norm_eps, ranked=True)
        self.k_norm = RMSNorm(d, cfg.norm_eps, ranked=True)
        self.o_proj = RowParallelLinear(
            group, init_normal((h, cfg.num_heads * d), scaled_std(std, cfg.num_layers), gen), cfg.dtype
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [R, B, S, H] (per-rank copy) -> o_proj partials [R, B, S, H]."""
        r, b, s, _ = x.shape
        q, k, v = self.qkv(x).split([n * self.head_dim for n in (self.heads, self.kv_heads, self.kv_heads)], -1)
        q = apply_rope(self.q_norm(q.view(r, b, s, self.heads, -1)), cos, sin)
        k = apply_rope(self.k_norm(k.view(r, b, s, self.kv_heads, -1)), cos, sin)
        v = v.view(r, b, s, self.kv_heads, -1)
        # ranks become batch entries: [R B, heads, S, D]
        q, k, v = (t.transpose(2, 3).reshape(r * b, t.shape[3], s, self.head_dim) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        o = o.view(r, b, self.heads, s, self.head_dim).transpose(2, 3).reshape(r, b, s, -1)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup, gen: torch.Generator):
        super().__init__()
        h, i, std = cfg.hidden_size, cfg.intermediate_size, cfg.init_std
        self.gate_up = ColumnParallelLinear(
            group, [init_normal((i, h), std, gen), init_normal((i, h), std, gen)], cfg.dtype
        )
        self.down = RowParallelLinear(group, init_normal((h, i), scaled_std(std, cfg.num_layers), gen), cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup, gen: torch.Generator):
        super().__init__()
        self.cfg = cfg
        ranked = cfg.norm_in_tp_region
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ranked=ranked)
        self.attn = Attention(cfg, group, gen)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ranked=ranked)
        self.mlp = MLP(cfg, group, gen)

    def _enter(self, x: torch.Tensor, norm: RMSNorm, comm: TPComm) -> torch.Tensor:
        """Replicated residual [B, S, H] -> normed per-rank input [R, B, S, H]."""
        if self.cfg.norm_in_tp_region:
            return norm(copy_to_tp(x, comm))
        return copy_to_tp(norm(x), comm)

    def forward(self, x, comm: TPComm, cos, sin):
        x = x + reduce_from_tp(self.attn(self._enter(x, self.input_norm, comm), cos, sin), comm, x.dtype)
        x = x + reduce_from_tp(self.mlp(self._enter(x, self.post_attn_norm, comm)), comm, x.dtype)
        return x


class TPQwen3(nn.Module):
    """The whole model on this process's R ranks. ``forward(ids, targets)``
    returns the mean next-token loss (the same value on every rank)."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, comm: TPComm, seed: int = 0):
        super().__init__()
        cfg.validate(group.world_size)
        self.cfg, self.group, self.comm = cfg, group, comm
        # every weight is drawn in full, in a fixed order, from one CPU
        # generator: identical models at any P, in one process or many
        gen = torch.Generator().manual_seed(seed)
        self.embed = VocabParallelEmbedding(group, init_normal((cfg.vocab_size, cfg.hidden_size), cfg.init_std, gen))
        self.layers = nn.ModuleList(DecoderLayer(cfg, group, gen) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ranked=cfg.norm_in_tp_region)
        self.lm_head = None
        if not cfg.tie_embeddings:
            self.lm_head = ColumnParallelLinear(
                group, [init_normal((cfg.vocab_size, cfg.hidden_size), cfg.init_std, gen)], cfg.dtype
            )
        self.to(group.device)
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def forward_calls(self) -> int:
        return 1 + 2 * self.cfg.num_layers

    def _rope_tables(self, seq_len: int):
        if seq_len not in self._rope:
            self._rope[seq_len] = rope_tables(seq_len, self.cfg.head_dim, self.cfg.rope_theta, self.group.device)
        return self._rope[seq_len]

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``ids``, ``targets`` [B, S] token ids -> mean loss (fp32 scalar)."""
        b, s = ids.shape
        cos, sin = self._rope_tables(s)
        self.comm.begin_forward(self.forward_calls)
        # [B, S, H] like every other residual message: one chain key (shape)
        x = reduce_from_tp(self.embed(ids), self.comm, torch.float32)
        for layer in self.layers:
            x = layer(x, self.comm, cos, sin)
        self.comm.end_forward()
        if self.cfg.norm_in_tp_region:
            h = self.final_norm(copy_to_tp(x, self.comm))
        else:
            h = copy_to_tp(self.final_norm(x), self.comm)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        h = h.reshape(h.shape[0], b * s, -1).to(self.cfg.dtype)
        logits = torch.matmul(h, head.to(self.cfg.dtype).transpose(1, 2))  # [R, N, V/P]
        return vocab_parallel_cross_entropy(logits, targets.reshape(-1), self.embed, self.group)

    # -- what training needs besides forward/backward -----------------------------

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds whole but applies to its own copy of
        the input (RMSNorm with ``ranked``): each rank's gradient is a
        partial sum."""
        return [m.weight for m in self.modules() if isinstance(m, RMSNorm) and m.ranked]

    def full_replicas(self) -> list[nn.Parameter]:
        """Parameters held whole on every rank (not sharded)."""
        return [m.weight for m in self.modules() if isinstance(m, RMSNorm)]

    def sync_replicated_grads(self) -> None:
        """Sum the partial gradients of :meth:`replicated_parameters` over
        ranks (exact fp32). In one process autograd already summed them over
        the R local ranks; in a process group each rank holds its own part."""
        if self.group.emulated:
            return
        for p in self.replicated_parameters():
            if p.grad is not None:
                p.grad.copy_(self.group.sum(p.grad.unsqueeze(0)))

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient over every rank's shards, replicas
        counted once. Each (parameter, rank) contributes its own sum of
        squares, combined in a fixed order in fp64 -- the same bits in one
        process and in a process group."""
        sharded, replicas = [], set(id(p) for p in self.full_replicas())
        for p in self.parameters():
            if p.grad is None or id(p) in replicas:
                continue
            sharded.append(p.grad.float().pow(2).flatten(1).sum(1))  # [R]
        per_rank = self.group.gather(torch.stack(sharded, dim=1))  # [P, n_sharded]
        total = per_rank.double().sum()
        for p in self.full_replicas():
            if p.grad is not None:
                total = total + p.grad.double().pow(2).sum()
        return total.sqrt()

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so their global norm is at most ``max_norm``;
        returns the norm before clipping."""
        norm = self.grad_norm()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter with all P shards (gathered in a process group):
        for comparing runs across settings."""
        out = {}
        replicas = set(id(p) for p in self.full_replicas())
        for name, p in self.named_parameters():
            t = p.detach()
            out[name] = t.clone() if id(p) in replicas else self.group.gather(t).clone()
        return out


def is_main_rank(group: TPGroup) -> bool:
    return group.emulated or not dist.is_initialized() or dist.get_rank() == 0


__all__ = ["Attention", "DecoderLayer", "MLP", "ModelConfig", "TPQwen3", "is_main_rank"]
