"""EchoAllReduce: the error-compensated 4-bit two-shot all-reduce.

For P ranks, rank r holding x_r (N values) and a carried error e_r:

1. stage 1 (every rank): u_r = rot(x_r) + e_r in fp32; q_r = Q(u_r);
   e_r <- u_r - D(q_r). Chunk j of q_r goes to rank j (all-to-all).
2. stage 2 (rank j): s_j = sum_r D(q_r[j]) in fp32, rank order;
   q2_j = Q(s_j); e_j[chunk j] += s_j - D(q2_j). All-gather q2.
3. output (every rank): y = rot^-1(D(q2)) -- the same bits on every rank.

Each value is quantized at most twice, whatever P. The call returns
``S + E_in - E_out`` (exact sum, plus the error carried in, minus the error
carried out), so a residual stream fed by a chain of calls holds the error of
one call, not of all of them (``echo_vllm.feedback``).

This class always runs Echo; :class:`echo_vllm.communicator.EchoCommunicator`
adds the policy (which calls take the exact path) and the counters.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import ops
from .capture import capturing
from .config import EchoConfig, EchoConfigError
from .feedback import FeedbackChain
from .quant import WireLayout
from .transport import Transport

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class EchoAllReduce:
    """Echo over one transport. Holds no feedback state itself: callers pass
    the :class:`FeedbackChain` of the stream the call belongs to."""

    def __init__(self, config: EchoConfig, transport: Transport):
        if transport.world_size < 2:
            raise EchoConfigError(
                f"Echo needs a group of at least 2 ranks, got world_size={transport.world_size}"
            )
        self.config = config
        self.transport = transport
        self.world_size = transport.world_size
        self._layouts: dict[int, WireLayout] = {}
        self._checked: set[tuple] = set()
        self._generators: list[torch.Generator] | None = None

    # -- helpers ---------------------------------------------------------------

    def layout(self, numel: int) -> WireLayout:
        lay = self._layouts.get(numel)
        if lay is None:
            lay = self._layouts[numel] = WireLayout(numel, self.world_size, self.config.group_size)
        return lay

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
        return (shape, x_local.dtype, self.layout(math.prod(shape)).padded_numel)

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
        self.transport.check_same([math.prod(shape), len(shape), _DTYPE_CODES.get(dtype, 99)])
        self._checked.add(key)

    def _noise(self, numel: int, device: torch.device) -> torch.Tensor | None:
        if self.config.rounding != "stochastic":
            return None
        if capturing():
            # a replay would reuse the captured draw: the same "random" noise
            # every step, biased rounding instead of unbiased
            raise RuntimeError(
                "rounding='stochastic' cannot run inside a CUDA graph (replays would repeat one "
                "noise draw); run eager (vLLM: --enforce-eager) or use rounding='nearest'")
        if self._generators is None:
            self._generators = []
            for r in self.transport.local_ranks:
                g = torch.Generator(device=device)
                g.manual_seed(self.config.seed * 1_000_003 + r)
                self._generators.append(g)
        return torch.stack(
            [torch.rand(numel, generator=g, device=device) for g in self._generators]
        )

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
        lay = self.layout(math.prod(shape))
        r = xs.shape[0]
        fb, incoming = None, False
        if chain is not None and cfg.feedback:
            incoming = chain.incoming(call_index, key)
            fb = chain.buffer(lay.padded_numel)
        wire = ops.stage1(
            xs.reshape(r, lay.numel),
            fb,
            lay,
            qmax=cfg.qmax,
            hadamard=cfg.hadamard,
            has_incoming=incoming,
            noise=self._noise(lay.padded_numel, xs.device),
        )
        recv = self.transport.all_to_all(wire)
        q2 = ops.stage2(
            recv,
            fb,
            list(self.transport.local_ranks),
            lay,
            qmax=cfg.qmax,
            noise=self._noise(lay.chunk_numel, xs.device),
        )
        gathered = self.transport.all_gather(q2)
        y = ops.output(gathered, lay, xs.dtype, hadamard=cfg.hadamard)
        if chain is not None:
            chain.record(call_index, key, left_error=fb is not None)
        return y.reshape(shape)

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
        if chain.incoming(call_index, key):
            lay = self.layout(math.prod(key[0]))
            r = xs.shape[0]
            xs = ops.consume(
                xs.reshape(r, lay.numel),
                chain.buffer(lay.padded_numel),
                lay,
                hadamard=self.config.hadamard,
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
        return self.transport.all_reduce_exact(xs)
