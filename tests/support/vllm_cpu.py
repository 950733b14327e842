"""Run real vLLM tensor-parallel layers on CPU, for tests and experiments.

vLLM's CUDA wheel imports and runs its distributed layer on a CPU-only
machine once ``current_platform`` is set to ``CpuPlatform`` *before* any vLLM
module binds it. Each process (e.g. one of ``echo_vllm.spawn.run_processes``'
gloo ranks, whose default process group vLLM reuses) then:

    use_cpu_platform()
    cfg = vllm_config(tp=2, additional_config={"tp_comm": "echo"})
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        layer = row_parallel(full_weight)  # vLLM's own RowParallelLinear, sharded
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def use_cpu_platform() -> Any:
    """Make vLLM see a CPU platform (call before importing other vLLM modules)."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if not isinstance(getattr(platforms, "_current_platform", None), CpuPlatform):
        platforms.current_platform = CpuPlatform()
    return platforms.current_platform


@functools.lru_cache(maxsize=1)
def _start_fork_server() -> None:
    """Start this process's fork server, which imports ``support.vllm_preload``
    (found through ``PYTHONPATH``: the server is a fresh interpreter)."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(["support.vllm_preload"])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), *filter(None, [old])])
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def run_vllm_processes(fn, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``echo_vllm.spawn.run_processes`` for ranks that use vLLM: forked from
    a server that imported vLLM on the CPU platform once (``vllm_preload``),
    each rank a fresh copy of it, instead of a fresh interpreter that imports
    vLLM again (~10 s of CPU a rank; ~13 s more where a rank compiles with
    Inductor, whose CPU check the server ran too)."""
    from echo_vllm.spawn import run_processes

    _start_fork_server()
    return run_processes(fn, world_size, *args, start_method="forkserver", **kwargs)


def vllm_config(
    *,
    tp: int = 1,
    additional_config: dict | None = None,
    pass_config: dict | None = None,
    **parallel: Any,
) -> Any:
    """A model-less ``VllmConfig`` with the given parallel and pass settings."""
    from vllm.config import CompilationConfig, ParallelConfig, VllmConfig
    from vllm.config.compilation import PassConfig

    kwargs: dict[str, Any] = dict(
        parallel_config=ParallelConfig(tensor_parallel_size=tp, **parallel),
        additional_config=dict(additional_config or {}),
    )
    if pass_config:
        kwargs["compilation_config"] = CompilationConfig(pass_config=PassConfig(**pass_config))
    return VllmConfig(**kwargs)


def init_model_parallel(cfg: Any) -> None:
    """vLLM's world group on the existing torch.distributed group, then its
    model-parallel groups (TP size from ``cfg``); call inside
    ``set_current_vllm_config(cfg)``."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    ps.init_distributed_environment(
        world_size=dist.get_world_size(), rank=dist.get_rank(), local_rank=dist.get_rank(),
        backend="gloo",
    )
    ps.initialize_model_parallel(cfg.parallel_config.tensor_parallel_size, backend="gloo")


def _cpu_gemm(layer: torch.nn.Module) -> torch.nn.Module:
    # What vLLM's CPU path installs for weights it cannot prepack
    # (process_weights_after_loading would try the CPU build's kernels).
    layer.cpu_linear = F.linear
    return layer


def row_parallel(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Module:
    """vLLM ``RowParallelLinear`` holding this rank's shard of ``weight``
    [out, in] (and ``bias``, added by rank 0 only)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    out_features, in_features = weight.shape
    layer = RowParallelLinear(
        in_features,
        out_features,
        bias=bias is not None,
        input_is_parallel=False,
        params_dtype=weight.dtype,
        return_bias=False,
    )
    layer.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.weight_loader(layer.bias, bias)
    return _cpu_gemm(layer)


def vocab_parallel_embedding(weight: torch.Tensor) -> torch.nn.Module:
    """vLLM ``VocabParallelEmbedding`` holding this rank's vocabulary shard of
    ``weight`` [vocab, hidden]."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    vocab, hidden = weight.shape
    layer = VocabParallelEmbedding(vocab, hidden, params_dtype=weight.dtype)
    layer.weight_loader(layer.weight, weight)
    return layer


def toy_norm(h: torch.Tensor) -> torch.Tensor:
    """The toy stack's RMS norm (no weight) before each layer's o_proj."""
    return (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def toy_mlp_in(h: torch.Tensor) -> torch.Tensor:
    """The toy stack's down_proj input: [H] -> [2H] after the norm."""
    x = toy_norm(h)
    return F.silu(torch.cat([x, -x], dim=-1))


@dataclass
class ToyStack:
    """Weights of a pre-norm-like residual stack whose forward pass makes
    1 + 2L all-reduces, like a decoder: a vocabulary-parallel embedding, then
    per layer an o_proj-like row-parallel linear (with bias, [H, H]) and a
    down_proj-like one ([H, 2H]); plus token ids of a few batches."""

    embed: torch.Tensor
    o: list[torch.Tensor]
    o_bias: list[torch.Tensor]
    down: list[torch.Tensor]
    ids: list[torch.Tensor]

    @classmethod
    def random(
        cls, *, layers: int, hidden: int, vocab: int, tokens: tuple[int, ...], seed: int
    ) -> "ToyStack":
        g = torch.Generator().manual_seed(seed)

        def linear(out_f: int, in_f: int) -> torch.Tensor:
            return (torch.randn(out_f, in_f, generator=g) / in_f**0.5).bfloat16()

        return cls(
            embed=torch.randn(vocab, hidden, generator=g).bfloat16(),
            o=[linear(hidden, hidden) for _ in range(layers)],
            o_bias=[(torch.randn(hidden, generator=g) * 0.1).bfloat16() for _ in range(layers)],
            down=[linear(hidden, 2 * hidden) for _ in range(layers)],
            ids=[torch.randint(0, vocab, (t,), generator=g) for t in tokens],
        )

    def vllm_layers(self) -> tuple[torch.nn.Module, list, list]:
        """vLLM's layers holding this rank's shards (build them inside
        ``set_current_vllm_config`` after the groups exist)."""
        return (
            vocab_parallel_embedding(self.embed),
            [row_parallel(w, b) for w, b in zip(self.o, self.o_bias)],
            [row_parallel(w) for w in self.down],
        )
