"""EchoAllReduce: one Echo all-reduce call over any backend, with the chain rule.

The algorithm itself (the two-shot stages around an all-to-all and an
all-gather, or one fused kernel) lives in a backend (:mod:`echo_vllm.backends`).
This class holds what every backend shares: the message's layout, the
ranks' agreement on it, and the feedback chain's rule -- absorb the error
the previous call of the chain left, leave this call's error for the next.
Each Echo call returns ``S + E_in - E_out`` (exact sum, plus the error
carried in, minus the error carried out), so a residual stream fed by a
chain of calls holds the error of one call, not of all of them
(:mod:`echo_vllm.feedback`).

This class always runs Echo; :class:`echo_vllm.communicator.EchoCommunicator`
adds the policy (which calls take the exact path) and the call records.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import envs
from .backends import EchoBackend, make_backend
from .capture import capturing
from .config import EchoConfig, EchoConfigError
from .envs import EchoEnv
from .feedback import FeedbackChain
from .norm import NormOperands
from .norm_plan import norm_tiling
from .quant import WireLayout
from .transport import Transport

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class EchoAllReduce:
    """Echo over one transport. Holds no feedback state itself: callers pass
    the :class:`FeedbackChain` of the stream the call belongs to.

    ``backend``: a built :class:`~echo_vllm.backends.EchoBackend`, or None to
    build the one ``config.backend`` names (``auto``: per device type of the
    tensors, on first use) with ``env`` (default: :func:`echo_vllm.envs.read`
    now)."""

    def __init__(self, config: EchoConfig, transport: Transport, *, backend: EchoBackend | None = None,
                 env: EchoEnv | None = None):
        if transport.world_size < 2:
            raise EchoConfigError(
                f"Echo needs a group of at least 2 ranks, got world_size={transport.world_size}"
            )
        self.config = config
        self.transport = transport
        self.world_size = transport.world_size
        self.env = env if env is not None else envs.read()
        self._backend = backend
        self._backends: dict[str, EchoBackend] = {}
        self._layouts: dict[tuple[int, int], WireLayout] = {}
        self._checked: set[tuple] = set()

    def backend(self, device: torch.device) -> EchoBackend:
        """The backend that reduces tensors on ``device`` (built once per device type)."""
        if self._backend is not None:
            return self._backend
        b = self._backends.get(device.type)
        if b is None:
            b, _ = make_backend(self.config, self.transport, device_type=device.type, env=self.env)
            self._backends[device.type] = b
        return b

    def close(self) -> None:
        """Close the backend(s): the given one, or those built per device type."""
        for b in [self._backend] if self._backend is not None else self._backends.values():
            b.close()
        self._backends.clear()

    # -- helpers ---------------------------------------------------------------

    def layout(self, numel: int, cols: int = 0) -> WireLayout:
        """Layout of a message of ``numel`` values in rows of ``cols`` (0: one row)."""
        lay = self._layouts.get((numel, cols))
        if lay is None:
            lay = self._layouts[(numel, cols)] = WireLayout(
                numel, self.world_size, self.config.group_size, cols
            )
        return lay

    def message_layout(self, shape: tuple[int, ...]) -> WireLayout:
        """Layout of a message of ``shape`` (one rank's): rows along the last dim."""
        return self.layout(math.prod(shape), shape[-1] if shape else 0)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs as [R, ...]: a virtual transport takes stacked inputs."""
        if not x.is_floating_point():
            raise TypeError(f"Echo all-reduce needs a floating-point tensor, got {x.dtype}")
        if self.transport.is_virtual:
            if x.dim() < 2 or x.shape[0] != len(self.transport.local_ranks):
                raise ValueError(
                    f"virtual transport of {self.world_size} ranks expects inputs stacked "
                    f"as [{self.world_size}, ...], got shape {tuple(x.shape)}"
                )
            return x
        return x.unsqueeze(0)

    def chain_key(self, x_local: torch.Tensor) -> tuple:
        shape = tuple(x_local.shape[1:])
        return (shape, x_local.dtype, self.message_layout(shape).padded_numel)

    def _check(self, key: tuple) -> None:
        """Ranks must agree on the message: checked once per new shape with a
        tiny all-gather (one extra latency-bound collective per distinct
        shape, none afterwards), never under graph capture. Catches a rank
        that enters with a different size before the all-to-all could hang
        or mix garbage."""
        if key in self._checked or self.transport.is_virtual:
            return
        if capturing():
            return
        shape, dtype, _ = key
        cols = shape[-1] if shape else 1
        self.transport.check_same([math.prod(shape), len(shape), cols, _DTYPE_CODES.get(dtype, 99)])
        self._checked.add(key)

    # -- the two paths ---------------------------------------------------------

    def all_reduce(
        self, x: torch.Tensor, chain: FeedbackChain | None = None, call_index: int | None = None
    ) -> torch.Tensor:
        """Echo all-reduce of ``x`` (this rank's tensor, or [P, ...] stacked
        for a virtual transport). With a ``chain``, absorbs the error the
        previous call of the chain left and leaves this call's error."""
        cfg = self.config
        xs = self._local(x)
        key = self.chain_key(xs)
        self._check(key)
        shape = key[0]
        lay = self.message_layout(shape)
        r = xs.shape[0]
        fb, incoming = None, False
        if chain is not None and cfg.feedback:
            incoming = chain.take(call_index, key)
            fb = chain.buffer(lay.padded_numel)
        y = self.backend(xs.device).all_reduce(xs.reshape(r, lay.numel), lay, fb, has_incoming=incoming)
        if chain is not None:
            chain.record(call_index, key, left_error=fb is not None)
        return y.reshape(shape)

    def all_reduce_norm(
        self, x: torch.Tensor, norm: NormOperands, chain: FeedbackChain | None = None, call_index: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        """:meth:`all_reduce` followed by the residual add and RMSNorm of
        ``norm`` (``norm.NormOperands``): ``(out, new residual, how)``,
        ``how`` being ``"fused"`` (in the backend's output phase) or why
        not (``norm_plan.norm_tiling``'s reason); the same bits either way."""
        cfg = self.config
        xs = self._local(x)
        key = self.chain_key(xs)
        self._check(key)
        lay = self.message_layout(key[0])
        r = xs.shape[0]
        fb, incoming = None, False
        if chain is not None and cfg.feedback:
            incoming = chain.take(call_index, key)
            fb = chain.buffer(lay.padded_numel)
        tiling, reason = norm_tiling(lay)
        out, res = self.backend(xs.device).all_reduce_norm(xs.reshape(r, lay.numel), lay, fb, norm, tiling,
                                                           has_incoming=incoming)
        if chain is not None:
            chain.record(call_index, key, left_error=fb is not None)
        return out, res, "fused" if tiling is not None else reason

    def absorb(
        self, xs: torch.Tensor, chain: FeedbackChain | None, call_index: int | None
    ) -> torch.Tensor:
        """Add the chain's pending error to local inputs ``xs`` [R, ...] (rounded
        to their dtype) and mark the chain empty: what an exact call does."""
        if chain is None:
            return xs
        if not self.config.feedback or xs.numel() == 0:
            chain.record(call_index, None, left_error=False)
            return xs
        key = self.chain_key(xs)
        if chain.take(call_index, key):
            lay = self.message_layout(key[0])
            r = xs.shape[0]
            xs = self.backend(xs.device).consume(
                xs.reshape(r, lay.numel), lay, chain.buffer(lay.padded_numel)
            ).reshape(xs.shape)
        chain.record(call_index, key, left_error=False)
        return xs

    def exact_all_reduce(
        self,
        x: torch.Tensor,
        chain: FeedbackChain | None = None,
        call_index: int | None = None,
        exact_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """16-bit all-reduce that absorbs the chain's pending error and leaves
        none. ``exact_fn`` (given this rank's tensor, or the stacked [P, ...]
        for a virtual transport) replaces the transport's own 16-bit
        all-reduce; the vLLM hook passes vLLM's."""
        xs = self.absorb(self._local(x), chain, call_index)
        if exact_fn is not None:
            return exact_fn(xs if self.transport.is_virtual else xs[0])
        return self.backend(xs.device).exact_all_reduce(xs)
