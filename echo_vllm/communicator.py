"""EchoCommunicator: Echo for one group's all-reduces, in vLLM's communicator shape.

Built like vLLM's ``CustomAllreduce`` / ``QuickAllReduce``: one object per
group and stream of calls, ``disabled``, a pure ``should_echo(inp, slot)``,
``all_reduce(inp, *, out=None)``, ``close()``; besides, ``all_reduce_norm``
(the all-reduce with the residual add and RMSNorm after it), ``compile``
(a warm-up that launches nothing) and ``calibrate`` (vLLM's start-up). Its
input is always one rank's tensor; the one-process emulation of P ranks
stacks them in its own subclass (:class:`echo_vllm.emulation.StackedCommunicator`).

One call, start to end (:meth:`EchoCommunicator.all_reduce`):

1. whether it is a residual-stream message (:meth:`ResidualStream.holds`);
   anything else is a *side call* (an fp32 norm statistic, a Mamba2
   ``[T, 1]`` sum, integers), which takes the exact path and leaves the
   feedback chain alone;
2. its slot: its index among the pass's residual calls and whether it is
   the last (given, or from ``numbering``: the vLLM session's tracker);
3. with a fixed capacity (vLLM), the feedback buffer reserved once at its
   largest size on the first residual call outside graph capture (vLLM's
   profiling run, so vLLM's memory profiler sees it);
4. the path: the policy's (:func:`echo_vllm.policy.decide`), or the one the
   caller forces (``path=``); Echo runs :meth:`EchoCommunicator._echo`, the
   one Echo path (the chain rule around the backend, :mod:`echo_vllm.backends`);
   the exact path first absorbs the chain's pending error;
5. one :class:`~echo_vllm.stats.CallRecord` to the sink, saying what the
   chain did and whether the call's health was checked
   (:mod:`echo_vllm.health`), so that a CUDA-graph replay counts the same.

The route from vLLM's hook to the kernel launch is four calls:
``all_reduce`` -> ``_echo`` -> the backend's ``all_reduce`` -> the kernel's
host function, which launches (the fused backend:
:func:`echo_vllm.kernels.fused_kernel.fused_all_reduce`).

The chain rule: each Echo call returns ``S + E_in - E_out`` (exact sum,
plus the error carried in, minus the error carried out), so a residual
stream fed by a chain of calls holds one call's error at any depth
(:mod:`echo_vllm.feedback`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import crossover, envs
from .backends import EchoBackend, make_backend
from .capture import capturing
from .config import EchoConfig, EchoConfigError
from .feedback import FeedbackChain
from .health import sampled
from .hosts import HostMap, check_host_map
from .rmsnorm import NormOperands
from .rmsnorm_plan import norm_tiling
from .numbering import NO_PASS, CallSlot
from .policy import ECHO_DTYPES, CallInfo, Decision, Path, Reason, decide
from .quant import WireLayout
from .stats import CallRecord, CallSink, EchoStats
from .transport import Transport
from .wire_bytes import echo_bytes

#: ``CallRecord.norm`` of a call on the exact path: the norm runs after the 16-bit all-reduce.
EXACT_PATH_NORM = "exact path"

#: ``numbering(rows, residual) -> CallSlot``: the slot of the next call (the vLLM tracker's).
Numbering = Callable[[int, bool], CallSlot]

#: The decision of a call whose caller forces its path (``all_reduce(path=...)``).
FORCED = {Path.ECHO: Decision(Path.ECHO, Reason.ECHO), Path.EXACT: Decision(Path.EXACT, Reason.FORCED_EXACT)}

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _no_pass(rows: int, residual: bool) -> CallSlot:
    return NO_PASS


@dataclass(frozen=True)
class ResidualStream:
    """The model's residual-stream messages: which calls Echo may quantize and
    chain, and how large the largest is (the feedback buffer's size)."""

    hidden_size: int | None = None
    """Residual messages are ``[tokens, hidden_size]`` (None: any width)."""
    ndim: int | None = None
    """Residual messages have this many dimensions (vLLM's: 2; None: any)."""
    max_num_tokens: int | None = None
    """The largest batch: the buffer reserved on the first residual call
    holds this many rows (and :meth:`EchoCommunicator.calibrate` measures up
    to it)."""
    capacity_numel: int = 0
    """Feedback values per rank to allocate at construction."""
    fixed_capacity: bool | None = None
    """The buffer never grows: a message that does not fit takes the exact
    path, counted (default: when ``capacity_numel`` is given)."""

    def __post_init__(self) -> None:
        # a wrong type failed deep inside, or (a string flag, a width of 0) ran every call on a path nobody asked for
        for name in ("hidden_size", "ndim", "max_num_tokens", "capacity_numel"):
            value, low = getattr(self, name), 0 if name == "capacity_numel" else 1
            if (value is not None or low == 0) and (not isinstance(value, int) or isinstance(value, bool)
                                                   or value < low):
                raise EchoConfigError(f"ResidualStream: {name}={value!r:.60}: must be an integer from {low}"
                                      + ("" if low == 0 else ", or None"))
        if self.fixed_capacity is not None and not isinstance(self.fixed_capacity, bool):
            raise EchoConfigError(f"ResidualStream: fixed_capacity={self.fixed_capacity!r:.60}: must be True or False")

    @property
    def fixed(self) -> bool:
        """Whether the feedback buffer keeps the size reserved for it."""
        return self.capacity_numel > 0 if self.fixed_capacity is None else self.fixed_capacity

    def holds(self, msg: torch.Tensor) -> bool:
        """``msg`` (one rank's) is a residual-stream message: not empty,
        bf16/fp16 (an fp32 message is a norm's statistic, not the stream), of
        ``ndim`` dimensions and ``hidden_size`` wide where they are given."""
        return (msg.dtype in ECHO_DTYPES and msg.numel() > 0
                and (self.ndim is None or msg.dim() == self.ndim)
                and (self.hidden_size is None or msg.shape[-1] == self.hidden_size))


@functools.lru_cache(maxsize=1024)
def message_layout(shape: tuple[int, ...], world_size: int, group_size: int) -> WireLayout:
    """The wire layout of a message of ``shape`` (one rank's): rows along its last dimension."""
    return WireLayout(math.prod(shape), world_size, group_size, shape[-1] if shape else 0)


def chain_key(msg: torch.Tensor, layout: WireLayout) -> tuple:
    """The feedback chain's key of one rank's message ``msg`` of ``layout``:
    an error carries only into a call of the same key."""
    return (tuple(msg.shape), msg.dtype, layout.padded_numel)


def out_refusal(msg: torch.Tensor, out: torch.Tensor) -> str:
    """Why ``out`` cannot receive the reduction of the message ``msg`` ("" if
    it can): it must have its shape, dtype and device and be contiguous. The
    Echo path writes ``out`` as one flat view and the exact path copied into
    it, so anything else failed on one path and not the other, or (another
    dtype or device) converted the result silently."""
    if not isinstance(out, torch.Tensor):
        return f"out={type(out).__name__}: must be a tensor"
    if out.shape != msg.shape or out.dtype != msg.dtype or out.device != msg.device:
        return (f"out is {tuple(out.shape)} {out.dtype} on {out.device}: must be the message's "
                f"{tuple(msg.shape)} {msg.dtype} on {msg.device}")
    if not out.is_contiguous():
        return f"out {tuple(out.shape)} with strides {out.stride()}: must be contiguous"
    return ""


class EchoCommunicator:
    """Echo over ``transport`` for one stream of calls (a model's forward
    passes, or one direction of a training step); see the module docstring.

    ``device``: where the feedback buffer lives (the inputs' device).
    ``stream``: the residual-stream messages (:class:`ResidualStream`).
    ``backend``: a built backend, or None to build the one
    ``config.backend`` names per device type of the inputs, on first use
    (:func:`echo_vllm.backends.make_backend`; ``fast_cpu``: ``auto`` takes
    the fastest CPU backend installed for CPU tensors, the references' bits).
    ``exact_all_reduce``: the 16-bit all-reduce of one rank's tensor (vLLM's
    own for a TP group; default: the backend's). ``numbering``: the slot of
    a call given none (default: no pass, so the policy's exact path).
    ``stats``: the counters (default: new ones); their ``health`` is where
    sampled checks count non-finite values (None: no checks). ``sink``:
    where each call's record goes (default ``stats.record``).
    """

    #: Inputs are one rank's tensor (False) or stacked ``[R, ...]`` over this process's ranks.
    stacked = False

    def __init__(
        self,
        config: EchoConfig,
        transport: Transport,
        *,
        device: torch.device | str = "cpu",
        stream: ResidualStream = ResidualStream(),
        backend: EchoBackend | None = None,
        fast_cpu: bool = False,
        exact_all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        numbering: Numbering | None = None,
        stats: EchoStats | None = None,
        sink: CallSink | None = None,
    ):
        if not isinstance(config, EchoConfig):
            raise EchoConfigError(f"{type(self).__name__}: config={config!r:.60}: must be an EchoConfig")
        if not isinstance(transport, Transport):
            raise EchoConfigError(f"{type(self).__name__}: transport={transport!r:.60}: must be a Transport "
                                  "(VirtualTransport, ProcessGroupTransport)")
        if not isinstance(stream, ResidualStream):
            raise EchoConfigError(f"{type(self).__name__}: stream={stream!r:.60}: must be a ResidualStream")
        if not isinstance(fast_cpu, bool):
            raise EchoConfigError(f"{type(self).__name__}: fast_cpu={fast_cpu!r:.60}: must be True or False")
        if transport.world_size < 2:
            raise EchoConfigError(f"Echo needs a group of at least 2 ranks, got world_size={transport.world_size}")
        check_host_map(config.host_map, transport.world_size)
        local = len(transport.local_ranks)
        if local != 1 and not self.stacked:
            raise EchoConfigError(
                f"EchoCommunicator takes one rank's tensor, but this transport holds {local} ranks of "
                f"{transport.world_size}: use echo_vllm.emulation.StackedCommunicator (inputs stacked [R, ...])")
        self.config = config
        self.transport = transport
        self.world_size = transport.world_size
        self.disabled = False
        self.stream = stream
        self._fixed = stream.fixed
        self.fast_cpu = fast_cpu
        self._exact_all_reduce = exact_all_reduce
        self.numbering = numbering or _no_pass
        self.chain = FeedbackChain.of(config, local, device, stream.capacity_numel)
        self.stats = stats if stats is not None else EchoStats()
        self.sink: CallSink = sink if sink is not None else self.stats.record
        self._backend = backend
        self._backends: dict[str, EchoBackend] = {}
        self._checked: set[tuple] = set()
        self._reserved = False
        # per (layout, element size, backend): the bytes a record counts, worked out once
        self._counts: dict[tuple, tuple] = {}
        self._last_counts: tuple = (None, None, 0, None)

    # -- the one rank's message and the local stack the backends take ---------

    def _message(self, inp: torch.Tensor) -> torch.Tensor:
        """One rank's message (the stacked subclass: rank 0's)."""
        return inp

    def _local(self, inp: torch.Tensor) -> torch.Tensor:
        """The backends' input ``[R, ...]`` over this process's ranks."""
        return inp.unsqueeze(0)

    def _unlocal(self, xs: torch.Tensor) -> torch.Tensor:
        """What the caller's ``exact_all_reduce`` takes: one rank's tensor."""
        return xs[0]

    # -- the public calls ---------------------------------------------------------

    def should_echo(self, inp: torch.Tensor, slot: CallSlot) -> Decision:
        """The policy's path for ``inp`` at ``slot`` (no side effects)."""
        msg = self._message(inp)
        return self._decide(msg, slot, self._layout_of(msg), self.stream.holds(msg))

    def all_reduce(self, inp: torch.Tensor, *, out: torch.Tensor | None = None, slot: CallSlot | None = None,
                   path: Path | None = None, chain: FeedbackChain | None = None) -> torch.Tensor:
        """Reduce ``inp`` on the path the policy picks (Echo, or the exact path
        after absorbing the pending error); ``out``, if given, receives the
        result. ``slot``: the call's place in its pass (default:
        ``numbering``'s). ``path``: the path the caller forces, recorded as
        forced (``Path.EXACT``: the 16-bit baseline, or calls a rule keeps
        16-bit; ``Path.ECHO``: benchmarks and sweeps, whatever the message).
        ``chain``: the feedback chain the call continues (default: this
        communicator's). ``out`` has the message's shape, dtype and device and
        is contiguous (:func:`out_refusal`)."""
        msg = self._message(inp)
        if out is not None:
            refusal = out_refusal(msg, out)
            if refusal:
                raise ValueError(refusal)
        slot, lay, decision = self._route(msg, slot, self.stream.holds(msg), path)
        chain = self.chain if chain is None else chain
        if decision.path is not Path.ECHO:
            y = self._exact(inp, None if decision.side else chain, slot.index)
            self._record_exact(msg, decision.reason, chain)
            return y if out is None else out.copy_(y)
        y = self._echo(inp, lay, chain, slot.index, out=out)
        self._record_echo(decision, inp, y, slot, lay, chain)
        return y

    def all_reduce_norm(self, inp: torch.Tensor, norm: NormOperands, *, slot: CallSlot | None = None,
                        path: Path | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`all_reduce` followed by the residual add and RMSNorm of
        ``norm`` (vLLM's ``fused_add_rms_norm``, ``rms_norm`` without a
        residual): ``(out, new residual)``. On Echo's path the norm runs in
        the backend's output phase where the row fits
        (``rmsnorm_plan.norm_tiling``), else after it; on the exact path after
        it; the record says which (``CallRecord.norm``)."""
        msg = self._message(inp)
        if not self.stream.holds(msg):
            return norm.apply(self.all_reduce(inp, slot=slot, path=path))
        slot, lay, decision = self._route(msg, slot, True, path)
        if decision.path is not Path.ECHO:
            y = self._exact(inp, None if decision.side else self.chain, slot.index)
            self._record_exact(msg, decision.reason, self.chain, norm=EXACT_PATH_NORM)
            return norm.apply(y)
        tiling, reason = norm_tiling(lay)
        out, res = self._echo(inp, lay, self.chain, slot.index, norm=norm, tiling=tiling)
        self._record_echo(decision, inp, out, slot, lay, self.chain, norm="fused" if tiling is not None else reason)
        return out, res

    def compile(self, inp: torch.Tensor, chain: FeedbackChain | None = None) -> None:
        """Compile what an Echo call of ``inp``'s shape and dtype launches: a
        chain's first call, and with feedback its later ones (an incoming
        error). Launches nothing and leaves ``chain``'s error as it is (its
        buffer may grow). No peer takes part, so each rank may compile other
        messages' kernels ahead of the calls (``scripts/gpu_fused_check.py``'s
        sweep shares its cases' compilations out over the ranks)."""
        self._echo(inp, self._layout(tuple(self._message(inp).shape)), chain, None, compile_only=True)

    def close(self) -> None:
        """Release the backend(s) and the feedback buffer; later calls go to vLLM."""
        for b in [self._backend] if self._backend is not None else self._backends.values():
            b.close()
        self._backends.clear()
        self.chain.release()
        self.disabled = True

    # -- steps 2-4: slot, buffer, layout, decision ------------------------------------

    def _route(self, msg: torch.Tensor, slot: CallSlot | None, residual: bool,
               path: Path | None) -> tuple[CallSlot, WireLayout | None, Decision]:
        """The call's slot (the buffer reserved once), its layout and its
        path. Every call passes here first, and is refused after
        :meth:`close` (the backends are released; rebuilding one would
        allocate, and a fused one rendezvous, behind the caller's back)."""
        if self.disabled:
            raise RuntimeError(f"this {type(self).__name__} is closed: its backends and feedback buffer are released")
        if slot is None:
            slot = self.numbering(msg.shape[0] if msg.dim() else 0, residual)
        elif not isinstance(slot, CallSlot):  # an int failed deep inside the policy
            raise TypeError(f"slot={slot!r:.60}: must be a CallSlot (CallSlot({slot!r:.20}) for a call index)")
        if residual and self._fixed and not self._reserved and not capturing():
            self._reserve(max(self.stream.max_num_tokens or 0, msg.shape[0]), msg.shape[-1])
            self._reserved = True
        lay = self._layout_of(msg)
        if path is None:
            return slot, lay, self._decide(msg, slot, lay, residual)
        decision = FORCED.get(path) if isinstance(path, str) else None
        if decision is None:
            raise ValueError(f"path={path!r:.60}: must be a policy.Path (or None: the policy's)")
        if decision.path is Path.ECHO and lay is None:
            raise TypeError(f"Echo all-reduce needs a non-empty floating-point tensor, got {msg.dtype} "
                            f"{tuple(msg.shape)}")
        return slot, lay, decision

    def _layout(self, shape: tuple[int, ...]) -> WireLayout:
        return message_layout(shape, self.world_size, self.config.group_size)

    def _layout_of(self, msg: torch.Tensor) -> WireLayout | None:
        """The message's layout; None for one no Echo call could carry (empty, not floating point)."""
        if not (msg.is_floating_point() and msg.numel()):
            return None
        return message_layout(tuple(msg.shape), self.world_size, self.config.group_size)

    def _decide(self, msg: torch.Tensor, slot: CallSlot, lay: WireLayout | None, residual: bool) -> Decision:
        """:meth:`should_echo` of a message whose layout and residual check
        the call already has (each worked out once per call)."""
        fits = (not (self._fixed and self.config.feedback and lay is not None)
                or self.chain.fits(self._bytes_of(self._backend or self._backends.get(msg.device.type)
                                                  or self.backend(msg.device), lay, msg.element_size())[4]))
        return decide(CallInfo(
            nbytes=msg.numel() * msg.element_size(), dtype=msg.dtype, world_size=self.world_size,
            capturing=capturing(), call_index=slot.index, last_call=slot.last_call,
            residual=residual, fits_buffer=fits, transport_capturable=self.transport.capturable,
        ), self.config)

    # -- the two paths: Echo with the chain rule, and the exact path ---------------

    def _echo(self, inp: torch.Tensor, lay: WireLayout, chain: FeedbackChain | None, call_index: int | None, *,
              out: torch.Tensor | None = None, norm: NormOperands | None = None, tiling=None,
              compile_only: bool = False):
        """The Echo path: ``inp`` (layout ``lay``) reduced by the backend as
        call ``call_index`` of ``chain`` (None: no feedback): it absorbs
        the error the chain's previous call left and leaves its own (none
        outside a pass, ``call_index`` None). Returns the output shaped as the message
        (``out`` when given); with ``norm``, the backend's
        ``all_reduce_norm`` under ``tiling``: ``(out, new residual)``;
        ``compile_only``: compiles what the call would launch and returns
        None (no peer takes part: the ranks' agreement and the chain are
        left alone)."""
        xs = self._local(inp)
        flat = xs.reshape(xs.shape[0], lay.numel)
        backend = self._backend or self.backend(xs.device)
        feedback = chain is not None and self.config.feedback
        if compile_only:
            fb = self._feedback(chain, backend.feedback_numel(lay), xs.device) if feedback else None
            for incoming in (False, True) if feedback else (False,):
                backend.compile(flat, lay, fb, has_incoming=incoming)
            return None
        key = (tuple(xs.shape[1:]), xs.dtype, lay.padded_numel)
        self._check(key)
        incoming = feedback and chain.take(call_index, key)
        # outside a pass no error carries: none is written (the output's bits are the same)
        fb = (self._feedback(chain, self._bytes_of(backend, lay, xs.element_size())[4], xs.device)
              if feedback and call_index is not None else None)
        if norm is not None:
            y = backend.all_reduce_norm(flat, lay, fb, norm, tiling, has_incoming=incoming)
        else:
            y = backend.all_reduce(flat, lay, fb, has_incoming=incoming,
                                   out=None if out is None else out.view(lay.numel))
            y = y.reshape(key[0]) if out is None else out
        if chain is not None:
            chain.record(call_index, key, left_error=fb is not None)
        return y

    def _exact(self, inp: torch.Tensor, chain: FeedbackChain | None, call_index: int | None) -> torch.Tensor:
        """The 16-bit all-reduce (the one given, else the backend's), after
        adding the chain's pending error to the input (rounded to its dtype);
        it leaves none. Without a chain (a side call) the chain is left as
        it is."""
        xs = self._local(inp)
        if chain is not None and xs.is_floating_point():
            if not self.config.feedback or xs.numel() == 0:
                chain.record(call_index, None, left_error=False)
            else:
                lay = self._layout(tuple(xs.shape[1:]))
                key = (tuple(xs.shape[1:]), xs.dtype, lay.padded_numel)
                if chain.take(call_index, key):
                    backend = self.backend(xs.device)
                    fb = self._feedback(chain, backend.feedback_numel(lay), xs.device)
                    xs = backend.consume(xs.reshape(xs.shape[0], lay.numel), lay, fb).reshape(xs.shape)
                chain.record(call_index, key, left_error=False)
        if self._exact_all_reduce is not None:
            return self._exact_all_reduce(self._unlocal(xs))
        return self.backend(xs.device).exact_all_reduce(xs)

    @staticmethod
    def _feedback(chain: FeedbackChain, numel: int, device: torch.device) -> torch.Tensor:
        """The chain's buffer for ``numel`` values of a message on ``device``,
        which must be the buffer's (the communicator's ``device``): a kernel
        handed both failed deep inside, or read one as the other's memory."""
        fb = chain.buffer(numel)
        if fb.device != device:
            raise ValueError(f"the input is on {device}, but this communicator's feedback buffer is on {fb.device}: "
                             f"build it with device={str(device)!r}")
        return fb

    def _check(self, key: tuple) -> None:
        """Ranks must agree on the message: checked once per new shape with a
        tiny all-gather (none afterwards), never under graph capture. Catches
        a rank that enters with another size before the all-to-all could hang
        or mix garbage (ranks in one process share the call: a no-op)."""
        if key in self._checked or capturing():
            return
        shape, dtype, _ = key
        self.transport.check_same([math.prod(shape), len(shape), shape[-1] if shape else 1,
                                   _DTYPE_CODES.get(dtype, 99)])
        self._checked.add(key)

    # -- records ----------------------------------------------------------------

    def _record_echo(self, decision: Decision, inp: torch.Tensor, y: torch.Tensor, slot: CallSlot,
                     lay: WireLayout, chain: FeedbackChain, norm: str = "") -> None:
        health = self.stats.health
        checked = health is not None and sampled(slot.index, self.config.health_every) and health.observe(inp, y)
        # the backend's own kernels may not take the message: its fallback ran it
        backend = self._backend or self.backend(y.device)
        reason = decision.reason if backend.fits(lay) else Reason.EXCEEDS_FUSED_BUFFERS
        total, in_host, cross_host, equiv, _ = self._bytes_of(backend, lay, y.element_size())
        self.sink(CallRecord("echo", reason.value, wire_bytes=total, in_host_bytes=in_host,
                             cross_host_bytes=cross_host, equiv_bytes=equiv, checked=checked, norm=norm,
                             **_chain_outcome(chain)))

    def _bytes_of(self, backend: EchoBackend, lay: WireLayout, elem_size: int) -> tuple:
        """``(bytes this rank sends: in all, inside its host, across hosts;
        the 16-bit ring's bytes; the carried-error values it keeps)`` for an
        Echo call of ``lay`` on ``backend`` (:mod:`echo_vllm.wire_bytes`):
        pure functions of the layout, asked on every call and worked out
        once per layout."""
        last = self._last_counts  # the same layout object call after call (message_layout is cached)
        if last[0] is lay and last[1] is backend and last[2] == elem_size:
            return last[3]
        key = (lay, elem_size, id(backend))
        counts = self._counts.get(key)
        if counts is None:
            hosts = backend.hosts or HostMap((0,) * self.world_size)  # not asked: counted as one host's
            sent = echo_bytes(lay, hosts, self.transport.local_ranks[0], backend.topology, elem_size)
            counts = self._counts[key] = (sent.total, sent.in_host, sent.cross_host,
                                          lay.ring_bytes_per_rank(elem_size), backend.feedback_numel(lay))
        self._last_counts = (lay, backend, elem_size, counts)
        return counts

    def _record_exact(self, msg: torch.Tensor, reason: Reason, chain: FeedbackChain, norm: str = "") -> None:
        self.sink(CallRecord("exact", reason.value, nbytes=msg.numel() * msg.element_size(), norm=norm,
                             **_chain_outcome(chain)))

    # -- backends, sizing, thresholds ---------------------------------------------

    def backend(self, device: torch.device) -> EchoBackend:
        """The backend that reduces tensors on ``device`` (built once per device type)."""
        if self._backend is not None:
            return self._backend
        b = self._backends.get(device.type)
        if b is None:
            b, _ = make_backend(self.config, self.transport, device_type=device.type, env=envs.read(),
                                fast_cpu=self.fast_cpu)
            self._backends[device.type] = b
        return b

    def _feedback_numel(self, lay: WireLayout, device: torch.device | None = None) -> int:
        """Carried-error values per rank a message of ``lay`` on ``device``
        (default the buffer's) needs: its backend's (two-level keeps its
        shard's only)."""
        return self.backend(self.chain.device if device is None else device).feedback_numel(lay)

    def _reserve(self, rows: int, cols: int) -> None:
        """Size the feedback buffer for messages of up to ``rows`` rows of
        ``cols`` (and allocate the health counter: both before any capture)."""
        if self.config.feedback:
            self.chain.reserve(self._feedback_numel(self._layout((rows, cols))))
        if self.stats.health is not None:
            self.stats.health.allocate()

    def _set_thresholds(self, min_bytes: int, max_bytes: int) -> None:
        """Replace the size thresholds (a measured crossover, ``echo_vllm.crossover``)."""
        self.config = self.config.replace(min_bytes=min_bytes, max_bytes=max_bytes)
        self.stats.set_thresholds(min_bytes, max_bytes)

    def calibrate(self, dtype: torch.dtype) -> crossover.Crossover | None:
        """Measure where Echo beats the exact all-reduce on this group and set
        the thresholds (``min_bytes="auto"`` only; every rank must call it at
        the same point: it runs collectives). Messages are rows of the
        model's width in ``dtype``, up to its largest batch. None when
        nothing was measured (thresholds as configured)."""
        cfg = self.config
        cols, max_tokens = self.stream.hidden_size, self.stream.max_num_tokens
        if self.disabled or not cfg.min_bytes_auto or cfg.batch_invariant or not cols or not max_tokens:
            return None
        dtype = dtype if dtype in ECHO_DTYPES else torch.bfloat16
        row_bytes = cols * torch.finfo(dtype).bits // 8
        chain = FeedbackChain.of(cfg, 1, self.chain.device)

        def run_echo(x: torch.Tensor) -> None:
            # the steady state of a forward pass: call 1 absorbs call 0's error
            lay = self._layout(tuple(x.shape))
            chain.record(0, chain_key(x, lay), left_error=True)
            self._echo(x, lay, chain, 1)

        def run_exact(x: torch.Tensor) -> torch.Tensor:
            return self._exact(x, None, None)

        points = crossover.calibrate(run_exact, run_echo, crossover.ladder(max_tokens * row_bytes, row_bytes),
                                     cols=cols, dtype=dtype, device=self.chain.device,
                                     slowest=self.transport.max_over_ranks)
        chain.release()
        result = crossover.decide(points)
        self._set_thresholds(result.min_bytes, result.max_bytes)
        return result


def _chain_outcome(chain: FeedbackChain) -> dict:
    """The record fields of what ``chain`` did in the call just run."""
    take = chain.pop_take()
    if take is None:
        return {}
    return {"carried": take.incoming, "dropped": take.dropped.value if take.dropped else ""}


__all__ = ["EXACT_PATH_NORM", "EchoCommunicator", "FORCED", "Numbering", "ResidualStream", "chain_key",
           "message_layout", "out_refusal"]
