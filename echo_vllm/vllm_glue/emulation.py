"""One-device emulation of tensor parallelism P inside stock vLLM.

With ``--tensor-parallel-size 1 --additional-config '{"tp_comm": "echo",
"tp_comm_emulate": 4}'`` every ``RowParallelLinear`` (o_proj, down_proj, ...)
and the ``VocabParallelEmbedding`` compute the P partial outputs real TP=P
ranks would compute (input features / vocabulary split the same way; see
:mod:`echo_vllm.emulation`) and reduce them with Echo over in-process
virtual ranks -- the bits a real P-GPU run produces on those inputs. With
``"tp_comm": "nccl"`` the same partials are summed exactly (fp32, one
rounding): the baseline with the same split.

Why custom ops: in vLLM's default mode the model forward is compiled by
torch.compile and replayed from CUDA graphs. The emulated reduce keeps
Python state (call index, feedback buffer), so it must be opaque to Dynamo:
``torch.ops.echo.emulated_row_parallel`` and
``torch.ops.echo.emulated_vocab_embedding`` are registered custom ops with
fake (shape-only) implementations. Their Python runs on eager calls and once
per graph capture, never at replay -- exactly like the real hook below
vLLM's ``all_reduce`` op. The patched ``forward`` methods branch only on
static layer attributes.

Layers the emulation cannot split (quantized weights, LoRA-extended
vocabularies, ``reduce_results=False``, sizes not divisible by P) keep their
TP=1 math; each is logged once and counted in ``skipped_layers``.

This module deliberately has no ``from __future__ import annotations``:
``infer_schema`` reads the op functions' annotations.
"""

import dataclasses
import logging
from collections import Counter
from typing import Any, Optional

import torch

from ..capture import capturing
from ..communicator import ResidualStream
from ..config import EchoConfigError
from ..emulation import StackedCommunicator, row_parallel_partials, vocab_parallel_partials, vocab_shard_bounds
from ..health import HealthCounters
from ..rmsnorm import NormOperands
from ..numbering import CallSlot
from ..policy import Path
from ..transport import VirtualTransport
from . import compat
from . import session as sessions
from .rmsnorm_fusion import ROW_NORM_OP, VOCAB_NORM_OP, outputs_like, run_norm
from .session import EchoSession
from .settings import TpCommSettings

logger = logging.getLogger("echo_vllm")

_STARTED: "Optional[EmulationSession]" = None
"""The session layers built from now on are emulated for (None: none)."""
_LIB: Any = None
_PATCHED = False

#: Skip reason of layers real TP does not reduce either (the LM head gathers).
NOT_APPLICABLE = "not reduced in real tensor parallelism"

ROW_OP = "emulated_row_parallel"
VOCAB_OP = "emulated_vocab_embedding"


class EmulationSession(EchoSession):
    """P virtual ranks for every emulated layer of this process's model."""

    def __init__(self, settings: TpCommSettings, vllm_config: Any):
        super().__init__(settings, vllm_config, rank=0)
        self.world_size = settings.emulate_world_size
        self.comm: Optional[StackedCommunicator] = None
        """Echo over P virtual ranks (built on the first call, on the partials'
        device; again after :meth:`set_variant`)."""
        self.skipped_layers: Counter = Counter()
        self.captured = False
        self._acc: Optional[list] = None  # [err_sum, ref_sum, worst, last]

    # -- the reduce every emulated layer calls ----------------------------------

    def reduce(self, partials: torch.Tensor) -> torch.Tensor:
        """Sum partials [P, tokens, hidden] as the configured all-reduce would."""
        if capturing():
            self.captured = True
        comm = self._communicator(partials.device)
        residual = comm.stream.holds(partials[0])
        slot = self.tracker.number(partials.shape[1] if partials.dim() > 1 else 0, residual)
        y = comm.all_reduce(partials, slot=slot, path=self._path)
        if self.settings.emulate_measure:
            self._measure(partials, y, slot, residual)
        return y

    def reduce_norm(self, partials: torch.Tensor, norm: NormOperands) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
        """:meth:`reduce`, then the residual add and RMSNorm of ``norm`` (in
        Echo's output phase where it can: the compiled graph's fused op).
        With ``emulate_measure`` the reduce and the norm run one after the
        other (the measurement needs the reduced output)."""
        if self.settings.emulate_measure:
            return norm.apply(self.reduce(partials))
        if capturing():
            self.captured = True
        return self._communicator(partials.device).all_reduce_norm(partials, norm, path=self._path)

    @property
    def _path(self) -> Optional[Path]:
        """The path every call takes: the policy's with ``tp_comm=echo``, the
        exact one (the baseline of the same partials) otherwise."""
        return None if self.settings.tp_comm == "echo" else Path.EXACT

    def _communicator(self, device: torch.device) -> StackedCommunicator:
        if self.comm is None or self.comm.chain.device != device:
            # the buffer is sized once, by the first residual call, never under capture
            self.stats.health = HealthCounters(device) if self.settings.echo.health_every else None
            stream = ResidualStream(self.hidden_size, ndim=2, max_num_tokens=self.max_num_tokens, fixed_capacity=True)
            self.comm = StackedCommunicator(
                self.settings.echo, VirtualTransport(self.world_size), device=device, stream=stream,
                numbering=self.tracker.number, stats=self.stats, sink=self.tracker.on_record)
        return self.comm

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    # -- residual-error measurement (tp_comm_emulate_measure) --------------------

    def _measure(self, partials: torch.Tensor, y: torch.Tensor, slot: CallSlot, residual: bool) -> None:
        """Accumulate sum_t (y_t - S_t) and sum_t S_t over the pass: in a
        pre-norm model every all-reduce output is added to the residual
        stream, so their ratio is the stream's relative communication error
        after each call (S_t: fp32 sum of this run's partials)."""
        if slot.index is None or not residual or capturing():
            return
        if slot.first_of_forward:
            self._close_measurement()
        exact = partials.float().sum(dim=0)
        if self._acc is None or self._acc[0].shape != exact.shape:
            self._close_measurement()
            self._acc = [torch.zeros_like(exact), torch.zeros_like(exact), 0.0, 0.0]
        acc = self._acc
        err = y.float() - exact
        acc[0] += err
        acc[1] += exact
        rel = float(acc[0].norm() / acc[1].norm().clamp_min(1e-30))
        acc[2] = max(acc[2], rel)
        acc[3] = rel
        self.stats.add_error_sample(float(err.norm() / exact.norm().clamp_min(1e-30)))

    def _close_measurement(self) -> None:
        """Record the measured pass (end-of-pass and worst residual error)."""
        if self._acc is not None:
            self.stats.add_residual_sample(self._acc[3], self._acc[2])
        self._acc = None

    def flush(self) -> None:
        """Account the passes that have ended, the measured one included:
        call before reading the counters."""
        super().flush()
        self._close_measurement()

    # -- switching variants in one eager engine -----------------------------------

    def set_variant(self, tp_comm: Optional[str] = None, **echo_changes: Any) -> None:
        """Change the reduce (``tp_comm`` "echo"/"nccl", EchoConfig fields) between
        requests. Eager engines only: a captured CUDA graph keeps the
        decisions it was captured with."""
        if self.captured:
            raise RuntimeError(
                "emulation variants can change only in eager engines (enforce_eager=True): "
                "CUDA graphs were captured with the current one"
            )
        self.flush()
        self.settings = dataclasses.replace(
            self.settings,
            tp_comm=tp_comm or self.settings.tp_comm,
            echo=self.settings.echo.replace(**echo_changes),
        )
        self.close()

    def note_skipped(self, layer: torch.nn.Module, reason: str) -> None:
        self.skipped_layers[reason] += 1
        if self.skipped_layers[reason] == 1:
            logger.warning(
                "echo: emulation leaves %s layers with TP=1 math (%s); counted in skipped_layers",
                type(layer).__name__,
                reason,
            )


def current_session() -> "Optional[EmulationSession]":
    """The current session if it is an emulation (None otherwise)."""
    s = sessions.current()
    return s if isinstance(s, EmulationSession) else None


def _session() -> EmulationSession:
    s = current_session()
    if s is None:
        raise RuntimeError("echo emulation op called without an emulation session")
    return s


# ---------------------------------------------------------------------------
# Custom ops (opaque to Dynamo; Python runs eagerly and at capture only)
# ---------------------------------------------------------------------------


def _row_parallel_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    s = _session()
    return s.reduce(row_parallel_partials(x, weight, s.world_size, bias))


def _row_parallel_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _vocab_embedding_impl(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    s = _session()
    return s.reduce(vocab_parallel_partials(ids.long(), weight, s.world_size))


def _vocab_embedding_fake(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.new_empty((*ids.shape, weight.shape[1]))


def _row_parallel_norm_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor, epsilon: float, keep_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _session()
    partials = row_parallel_partials(x, weight, s.world_size, bias)
    return run_norm(lambda norm: s.reduce_norm(partials, norm), tuple(partials.shape[1:]), partials.dtype,
                    residual, norm_weight, epsilon, keep_output)


def _row_parallel_norm_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor, epsilon: float, keep_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return outputs_like((*x.shape[:-1], weight.shape[0]), x.dtype, x.device, residual, keep_output)


def _vocab_embedding_norm_impl(
    ids: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
    epsilon: float, keep_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _session()
    partials = vocab_parallel_partials(ids.long(), weight, s.world_size)
    return run_norm(lambda norm: s.reduce_norm(partials, norm), tuple(partials.shape[1:]), partials.dtype,
                    residual, norm_weight, epsilon, keep_output)


def _vocab_embedding_norm_fake(
    ids: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
    epsilon: float, keep_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return outputs_like((*ids.shape, weight.shape[1]), weight.dtype, weight.device, residual,
                        keep_output)


def register_ops() -> None:
    """Define ``torch.ops.echo.emulated_*`` once per process."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("echo", "FRAGMENT")
    for name, impl, fake in (
        (ROW_OP, _row_parallel_impl, _row_parallel_fake),
        (VOCAB_OP, _vocab_embedding_impl, _vocab_embedding_fake),
        (ROW_NORM_OP, _row_parallel_norm_impl, _row_parallel_norm_fake),
        (VOCAB_NORM_OP, _vocab_embedding_norm_impl, _vocab_embedding_norm_fake),
    ):
        compat.register_custom_op(lib, name, impl, fake)
    _LIB = lib


# ---------------------------------------------------------------------------
# Layer patches
# ---------------------------------------------------------------------------


def row_parallel_skip_reason(layer: Any, world_size: int) -> Optional[str]:
    _, UnquantizedLinearMethod = compat.linear_classes()
    if getattr(layer, "tp_size", 1) != 1:
        return "layer is already tensor-parallel"
    if not getattr(layer, "reduce_results", True):
        return "reduce_results=False (the caller reduces)"
    if not isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod):
        return f"quantized weights ({type(getattr(layer, 'quant_method', None)).__name__})"
    if layer.input_size % world_size:
        return f"input size {layer.input_size} not divisible by {world_size}"
    return None


def vocab_embedding_skip_reason(layer: Any, world_size: int) -> Optional[str]:
    _, ParallelLMHead, UnquantizedEmbeddingMethod = compat.vocab_embedding_classes()
    if isinstance(layer, ParallelLMHead):
        return NOT_APPLICABLE
    if getattr(layer, "tp_size", 1) != 1:
        return "layer is already tensor-parallel"
    if getattr(layer, "num_added_embeddings", 0):
        return "LoRA-extended vocabulary"
    if not isinstance(getattr(layer, "quant_method", None), UnquantizedEmbeddingMethod):
        return f"quantized embedding ({type(getattr(layer, 'quant_method', None)).__name__})"
    try:
        vocab_shard_bounds(layer.num_embeddings_padded, world_size)
    except EchoConfigError as e:
        return str(e)
    return None


def _mark(layer: Any, reason_fn: Any) -> None:
    """Decide once, at construction, whether ``layer`` is emulated."""
    s = _STARTED
    if s is None:
        layer._echo_emulated = False
        return
    reason = reason_fn(layer, s.world_size)
    layer._echo_emulated = reason is None
    if reason is not None and reason is not NOT_APPLICABLE:
        s.note_skipped(layer, reason)


def patch_layers() -> None:
    """Patch RowParallelLinear / VocabParallelEmbedding (once per process).
    Layers built while no emulation session exists keep vLLM's forward."""
    global _PATCHED
    if _PATCHED:
        return
    RowParallelLinear, UnquantizedLinearMethod = compat.linear_classes()
    VocabParallelEmbedding, _, _ = compat.vocab_embedding_classes()
    row_init, row_forward = RowParallelLinear.__init__, RowParallelLinear.forward
    emb_init, emb_forward = VocabParallelEmbedding.__init__, VocabParallelEmbedding.forward
    pwal = UnquantizedLinearMethod.process_weights_after_loading

    def row_parallel_init(self, *args, **kwargs):
        row_init(self, *args, **kwargs)
        _mark(self, row_parallel_skip_reason)

    def row_parallel_forward(self, input_):
        if not getattr(self, "_echo_emulated", False):
            return row_forward(self, input_)
        bias = None if self.skip_bias_add else self.bias
        output = torch.ops.echo.emulated_row_parallel(input_, self.weight, bias)
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)

    def vocab_embedding_init(self, *args, **kwargs):
        emb_init(self, *args, **kwargs)
        _mark(self, vocab_embedding_skip_reason)

    def vocab_embedding_forward(self, input_):
        if not getattr(self, "_echo_emulated", False):
            return emb_forward(self, input_)
        return torch.ops.echo.emulated_vocab_embedding(input_, self.weight)

    def process_weights_after_loading(self, layer):
        # The CPU platform repacks (and drops) linear weights for its GEMM;
        # emulated layers read layer.weight directly, so keep it.
        if getattr(layer, "_echo_emulated", False):
            return None
        return pwal(self, layer)

    RowParallelLinear.__init__ = row_parallel_init
    RowParallelLinear.forward = row_parallel_forward
    VocabParallelEmbedding.__init__ = vocab_embedding_init
    VocabParallelEmbedding.forward = vocab_embedding_forward
    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading
    _PATCHED = True


def stop() -> None:
    """Stop emulating for layers built from now on (a new engine without it)."""
    global _STARTED
    _STARTED = None


def start(settings: TpCommSettings, vllm_config: Any) -> EmulationSession:
    """Start emulating (called when the TP group of size 1 is created, before
    the model is built); the caller activates the returned session."""
    global _STARTED
    _STARTED = EmulationSession(settings, vllm_config)
    register_ops()
    patch_layers()
    return _STARTED


__all__ = [
    "EmulationSession",
    "current_session",
    "start",
    "stop",
]
