"""Emulated tensor parallelism inside a transformers model (the HF backend).

Real TP=P ends every attention block (``o_proj``) and every MLP
(``down_proj``) with an all-reduce of P partial outputs, and builds the token
embedding from P vocabulary shards with one more all-reduce. This module
patches those three kinds of module in a transformers Llama / Qwen2 / Qwen3 /
Gemma-3 model so that each computes its P partials exactly as the ranks
would (``echo_vllm.emulation``) and reduces them through one
:class:`~echo_vllm.emulation.EmulatedTP` -- exact 16-bit sum, naive 4-bit or
Echo -- with the call counter restarted at every forward of the backbone.
Everything else in the model (norms, attention, LM head) is untouched: the
LM head of vLLM gathers logits and has no all-reduce.

Post-norm ("sandwich") architectures (Gemma-2/3) normalise each all-reduce
output before it enters the residual stream, so Echo's telescoping
``S + E_in - E_out`` does not survive: the carried error is rescaled by a
different per-token RMS at every call. :func:`postnorm_config` decides what
Echo does there (see its docstring); the choice is reported, never silent.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn as nn

from ..config import EchoConfig, EchoConfigError
from ..emulation import EmulatedTP, row_parallel_partials, vocab_parallel_partials
from ..policy import Path
from ..postnorm_policy import PostnormDecision, decide_postnorm, postnorm_config

log = logging.getLogger(__name__)

#: Names of row-parallel linears (their output is all-reduced) per block.
ROW_PARALLEL_NAMES = ("o_proj", "down_proj")

def find_backbone(model: nn.Module) -> nn.Module:
    """The decoder stack: the module holding ``embed_tokens`` and ``layers``
    (``model.model`` for causal LMs, ``model.model.language_model`` for
    multimodal wrappers)."""
    for _, module in model.named_modules():
        if hasattr(module, "embed_tokens") and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return module
    raise EchoConfigError(
        f"{type(model).__name__}: no submodule with `embed_tokens` and `layers`; "
        "the HF emulation supports Llama/Qwen2/Qwen3/Gemma-3-style decoders"
    )


def postnorm_decision(model: nn.Module) -> PostnormDecision:
    """:func:`~echo_vllm.postnorm_policy.decide_postnorm` for a transformers model:
    its config's architectures, then its decoder's structure."""
    config = getattr(model, "config", None)
    return decide_postnorm(getattr(config, "architectures", None), config, find_backbone(model))


@dataclass
class SiteCall:
    """One all-reduce at an emulated site, its partials and output (for probes and tests)."""

    index: int
    site: str
    partials: torch.Tensor | None
    output: torch.Tensor | None


@dataclass
class HFEmulation:
    """Patch a transformers model for emulated TP=``world_size``.

    Use as a context manager or call :meth:`install` / :meth:`remove`.
    ``exact_calls`` forces chosen call indices onto the 16-bit path (an
    ablation tool: which calls hurt); ``trace`` keeps every call's partials
    and output in :attr:`traced` (memory grows with it; tests and probes only).
    """

    model: nn.Module
    world_size: int
    mode: str = "echo"
    config: EchoConfig = field(default_factory=EchoConfig)
    comm_dtype: torch.dtype | None = None
    """Dtype the partials travel in. None: the model's own (bf16/fp16 for
    Echo). Setting bf16 on an fp32 model rounds each rank's partial output
    to bf16 as a bf16 TP rank would, and casts the sum back."""
    postnorm_policy: str = "no-feedback"
    exact_calls: frozenset[int] = frozenset()
    trace: bool = False

    def __post_init__(self) -> None:
        self.backbone = find_backbone(self.model)
        self.layers = self.backbone.layers
        self.num_layers = len(self.layers)
        decision = postnorm_decision(self.model)
        self.postnorm = decision.postnorm
        mode, config = self.mode, self.config
        if self.postnorm and mode != "exact":
            mode, config = postnorm_config(config, self.postnorm_policy)
            log.warning(
                "post-norm model (%s: %s): Echo policy %r -> mode=%s feedback=%s",
                type(self.model).__name__, decision.reason, self.postnorm_policy, mode, config.feedback,
            )
        self.effective_mode, self.effective_config = mode, config
        self.tp = EmulatedTP(
            self.world_size,
            config,
            mode=mode,
            calls_per_forward=self.calls_per_forward,
            device=next(self.model.parameters()).device,
        )
        self.traced: list[SiteCall] = []
        self._saved: list[tuple[nn.Module, object]] = []
        self._handles: list = []
        self._check_shapes()

    # -- geometry ---------------------------------------------------------------

    @property
    def calls_per_forward(self) -> int:
        """Embedding + one o_proj and one down_proj per layer."""
        return 1 + 2 * self.num_layers

    def sites(self) -> Iterator[tuple[str, nn.Module]]:
        """(name, module) of every all-reduce site, in call order."""
        yield "embed", self.backbone.embed_tokens
        for i, layer in enumerate(self.layers):
            yield f"{i}.o_proj", layer.self_attn.o_proj
            yield f"{i}.down_proj", layer.mlp.down_proj

    def _check_shapes(self) -> None:
        """Fail early, as vLLM would, if a dimension does not split P ways."""
        from ..emulation import shard_bounds

        for name, module in self.sites():
            if name == "embed":
                continue
            if not isinstance(module, nn.Linear):
                raise EchoConfigError(f"{name}: expected nn.Linear, got {type(module).__name__}")
            shard_bounds(module.in_features, self.world_size)

    # -- the reduce -------------------------------------------------------------

    def _reduce(self, site: str, partials: torch.Tensor) -> torch.Tensor:
        out_dtype = partials.dtype
        if self.comm_dtype is not None:
            partials = partials.to(self.comm_dtype)
        elif self.effective_mode != "exact" and partials.dtype not in (torch.bfloat16, torch.float16):
            raise EchoConfigError(
                f"Echo quantizes bf16/fp16 all-reduces; this model runs in {partials.dtype} "
                "(load it in bfloat16, or pass comm_dtype=torch.bfloat16)"
            )
        tp = self.tp
        slot = tp.next_call()
        # a forced call is counted like every other, so bits/value includes it
        y = tp.reduce(partials, slot, path=Path.EXACT if slot.index in self.exact_calls else None)
        if self.trace:
            self.traced.append(SiteCall(slot.index, site, partials.detach().clone(), y.detach().clone()))
        return y.to(out_dtype)

    # -- patched forwards ---------------------------------------------------------

    def _row_parallel_forward(self, site: str) -> Callable:
        emu = self

        def forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            parts = row_parallel_partials(x, module.weight, emu.world_size, module.bias)
            return emu._reduce(site, parts)

        return forward

    def _embedding_forward(self) -> Callable:
        emu = self

        def forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
            parts = vocab_parallel_partials(ids, module.weight, emu.world_size)
            y = emu._reduce("embed", parts)
            # Gemma's scaled embedding multiplies after the lookup (vLLM:
            # after the all-reduce), in the weight dtype.
            scale = getattr(module, "embed_scale", None)
            if scale is not None:
                y = y * scale.to(module.weight.dtype)
            return y

        return forward

    # -- install / remove ---------------------------------------------------------

    def install(self) -> "HFEmulation":
        if self._saved:
            return self
        for site, module in self.sites():
            fn = self._embedding_forward() if site == "embed" else self._row_parallel_forward(site)
            self._saved.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(fn, module)
        self._handles.append(self.backbone.register_forward_pre_hook(self._begin))
        self._handles.append(self.backbone.register_forward_hook(self._end))
        return self

    def remove(self) -> None:
        for module, previous in self._saved:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        for h in self._handles:
            h.remove()
        self._saved, self._handles = [], []

    def _begin(self, module, args) -> None:
        self.tp.begin_forward()

    def _end(self, module, args, output) -> None:
        self.tp.end_forward()

    def __enter__(self) -> "HFEmulation":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- reporting ----------------------------------------------------------------

    def describe(self) -> dict:
        return {
            "world_size": self.world_size,
            "mode": self.effective_mode,
            "config": self.effective_config.to_dict(),
            "postnorm": self.postnorm,
            "postnorm_policy": self.postnorm_policy if self.postnorm else None,
            "calls_per_forward": self.calls_per_forward,
            "stats": self.tp.comm.stats.snapshot(),
        }

