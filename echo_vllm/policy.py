"""Which path one all-reduce takes, and why: one pure function.

Everything that routes a call away from Echo is decided here, from plain
values, so that it is testable on CPU without a GPU, a process group or vLLM.
The caller counts and logs the returned reason (``echo_vllm.stats``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .config import EchoConfig, EchoConfigError

#: Which all-reduce a run uses, one vocabulary wherever Echo's code names it
#: (training's ``TPCommConfig.mode``, the emulation's ``EmulatedTP.mode``, the
#: evaluation's variants): ``exact``, the 16-bit all-reduce on every call (what
#: vLLM users call ``--tp-comm nccl``); ``naive``, Echo's 4-bit path without
#: error feedback; ``echo``, Echo. One call is put on the exact path with
#: ``EchoCommunicator.all_reduce(path=Path.EXACT)``.
MODES = ("exact", "naive", "echo")

#: Input dtypes Echo quantizes. fp32 messages are rare in inference (and
#: would need a different exact path); they take the exact path.
ECHO_DTYPES = (torch.bfloat16, torch.float16)


class Path(str, enum.Enum):
    ECHO = "echo"
    EXACT = "exact"


class Reason(str, enum.Enum):
    """Why a call took its path (the label of the fallback counter)."""

    ECHO = "echo"
    DISABLED = "disabled"
    WORLD_SIZE_1 = "world_size_1"
    DTYPE = "unsupported_dtype"
    NO_FORWARD_CONTEXT = "no_forward_context"
    NOT_RESIDUAL = "not_residual_shape"
    BELOW_MIN_BYTES = "below_min_bytes"
    ABOVE_MAX_BYTES = "above_max_bytes"
    EXCEEDS_BUFFER = "exceeds_feedback_buffer"
    CAPTURE_UNSUPPORTED = "capture_unsupported"
    FIRST_EXACT_CALLS = "first_exact_calls"
    LAST_CALL = "exact_last_call"
    FORCED_EXACT = "forced_exact_calls"
    """The caller put this call on the exact path
    (``EchoCommunicator.all_reduce(path=Path.EXACT)``: a 16-bit baseline,
    the evaluation's ``exact_calls``)."""
    EXCEEDS_FUSED_BUFFERS = "exceeds_fused_buffers"
    """Echo's path, but the chunks exceed the fused backend's buffers: its
    fallback (the Triton stage kernels) ran the call (``EchoBackend.fits``)."""


#: Calls outside the residual stream ("side calls": another dtype or shape,
#: e.g. a norm's fp32 variance, or no forward pass at all). They take the
#: exact path and leave the feedback chain alone: the pending error is
#: neither consumed nor cleared, and the stream's next call takes it.
SIDE_REASONS = frozenset({Reason.DTYPE, Reason.NO_FORWARD_CONTEXT, Reason.NOT_RESIDUAL})


@dataclass(frozen=True)
class CallInfo:
    """What the policy may look at for one all-reduce call."""

    nbytes: int
    """Input message size in bytes (numel x element size)."""
    dtype: torch.dtype
    world_size: int
    capturing: bool = False
    """A CUDA graph is being captured right now."""
    call_index: int | None = 0
    """Position in the forward pass's chain of all-reduces; None outside any
    forward pass (no chain to carry error along)."""
    last_call: bool = False
    """This is the last all-reduce of the forward pass."""
    residual: bool = True
    """The output is added to the residual stream (shape [tokens, hidden])."""
    fits_buffer: bool = True
    """The padded message fits the pre-allocated feedback buffer."""
    transport_capturable: bool = True
    """The transport's collectives can be recorded into a CUDA graph."""



@dataclass(frozen=True)
class Decision:
    path: Path
    reason: Reason

    @property
    def echo(self) -> bool:
        return self.path is Path.ECHO

    @property
    def side(self) -> bool:
        """A side call (:data:`SIDE_REASONS`): exact, the chain untouched."""
        return self.reason in SIDE_REASONS


def mode_config(mode: str, config: EchoConfig) -> EchoConfig | None:
    """The Echo configuration a run in ``mode`` (:data:`MODES`) uses: None
    for ``exact`` (no call takes Echo's path), ``config`` without error
    feedback for ``naive``, ``config`` itself for ``echo``."""
    if mode not in MODES:
        raise EchoConfigError(f"mode={mode!r:.60}: choose one of {MODES}")
    if mode == "exact":
        return None
    return config.replace(feedback=False) if mode == "naive" else config


def _exact(reason: Reason) -> Decision:
    return Decision(Path.EXACT, reason)


def decide(call: CallInfo, config: EchoConfig | None) -> Decision:
    """Route one all-reduce (``config`` None: Echo is off). Order matters only
    for which reason is reported when several apply: structural reasons
    first, then size, then chain position."""
    if config is None:
        return _exact(Reason.DISABLED)
    if call.world_size < 2:
        return _exact(Reason.WORLD_SIZE_1)
    if call.dtype not in ECHO_DTYPES:
        return _exact(Reason.DTYPE)
    if call.call_index is None:
        return _exact(Reason.NO_FORWARD_CONTEXT)
    if not call.residual:
        return _exact(Reason.NOT_RESIDUAL)
    # batch-invariant: a message's size depends on its batch, so it decides nothing
    if not config.batch_invariant:
        if call.nbytes < config.effective_min_bytes:
            return _exact(Reason.BELOW_MIN_BYTES)
        if config.max_bytes and call.nbytes > config.max_bytes:
            return _exact(Reason.ABOVE_MAX_BYTES)
    if call.capturing and not call.transport_capturable:
        return _exact(Reason.CAPTURE_UNSUPPORTED)
    if config.feedback and not call.fits_buffer:
        return _exact(Reason.EXCEEDS_BUFFER)
    if call.call_index < config.first_exact_calls:
        return _exact(Reason.FIRST_EXACT_CALLS)
    if call.last_call and config.exact_last_call:
        return _exact(Reason.LAST_CALL)
    return Decision(Path.ECHO, Reason.ECHO)
