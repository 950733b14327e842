"""EchoCommunicator: Echo for one group's all-reduces, in vLLM's communicator shape.

Built like vLLM's ``CustomAllreduce`` / ``QuickAllReduce``: one object per
group and stream of calls, ``disabled``, a pure ``should_echo(inp, slot)``,
``all_reduce(inp, *, out=None)``, ``close()``. Its input is always one
rank's tensor; the one-process emulation of P ranks stacks them in its own
subclass (:class:`echo_vllm.emulation.StackedCommunicator`).

One call, start to end (:meth:`EchoCommunicator.all_reduce`):

1. whether it is a residual-stream message (``[tokens, hidden]`` in
   bf16/fp16 when the model's ``hidden_size`` is known); anything else is a
   *side call* (an fp32 norm statistic, a Mamba2 ``[T, 1]`` sum, integers),
   which takes the exact path and leaves the feedback chain alone;
2. its slot: its index among the pass's residual calls and whether it is
   the last (given, or from ``numbering``: the vLLM session's tracker);
3. with a fixed capacity (vLLM), the feedback buffer reserved once at its
   largest size on the first residual call outside graph capture (vLLM's
   profiling run, so vLLM's memory profiler sees it);
4. the policy's path (:func:`echo_vllm.policy.decide`): Echo through the
   backend (:mod:`echo_vllm.backends`) with the chain rule, or the exact
   path, which first absorbs the chain's pending error;
5. one :class:`~echo_vllm.stats.CallRecord` to the sink, saying what the
   chain did and whether the call's health was checked
   (:mod:`echo_vllm.health`), so that a CUDA-graph replay counts the same.

The chain rule: each Echo call returns ``S + E_in - E_out`` (exact sum,
plus the error carried in, minus the error carried out), so a residual
stream fed by a chain of calls holds one call's error at any depth
(:mod:`echo_vllm.feedback`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import crossover, envs
from .backends import EchoBackend, make_backend
from .capture import capturing
from .config import EchoConfig, EchoConfigError
from .envs import EchoEnv
from .feedback import FeedbackChain
from .health import HealthCounters, sampled
from .hosts import HostMap, check_host_map
from .norm import NormOperands
from .norm_plan import norm_tiling
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

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _no_pass(rows: int, residual: bool) -> CallSlot:
    return NO_PASS


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


def argument_refusal(config: object, transport: object, **values: object) -> str:
    """Why :class:`EchoCommunicator` cannot be built with these arguments
    ("" if it can): ``config`` an :class:`EchoConfig`, ``transport`` a
    :class:`Transport`; ``hidden_size``, ``residual_ndim``,
    ``max_num_tokens`` None or an integer from 1, ``capacity_numel`` an
    integer from 0; ``enabled``, ``fast_cpu`` (and ``fixed_capacity`` unless
    None) True or False. A wrong type failed deep inside, or (a string
    flag, a width of 0) ran every call on a path nobody asked for."""
    if not isinstance(config, EchoConfig):
        return f"config={config!r:.60}: must be an EchoConfig"
    if not isinstance(transport, Transport):
        return f"transport={transport!r:.60}: must be a Transport (VirtualTransport, ProcessGroupTransport)"
    for name, value in values.items():
        if name in ("enabled", "fast_cpu", "fixed_capacity"):
            if not isinstance(value, bool) and not (name == "fixed_capacity" and value is None):
                return f"{name}={value!r:.60}: must be True or False"
            continue
        low = 0 if name == "capacity_numel" else 1
        if (value is not None or low == 0) and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            return f"{name}={value!r:.60}: must be an integer from {low}" + ("" if low == 0 else ", or None")
    return ""


class EchoCommunicator:
    """Echo over ``transport`` for one stream of calls (a model's forward
    passes, or one direction of a training step); see the module docstring.

    ``backend``: a built backend, or None to build the one ``config.backend``
    names per device type of the tensors, on first use (with ``env``,
    default :func:`echo_vllm.envs.read` now; ``fast_cpu``: ``auto`` takes
    the fastest CPU backend installed for CPU tensors, the references' bits,
    :func:`echo_vllm.backends.make_backend`). ``exact_all_reduce``: the 16-bit
    all-reduce of one rank's tensor (vLLM's own for a TP group; default the
    backend's). ``numbering``: the slot of a call given none (default: no
    pass, so the exact path). ``hidden_size``: residual messages are
    ``[tokens, hidden_size]`` (None: any width). ``residual_ndim``: residual
    messages have this many dimensions (vLLM's: 2; None: any).
    ``max_num_tokens``: the largest batch (sizes the buffer, step 3).
    ``capacity_numel``: feedback values per rank to allocate now; with
    ``fixed_capacity`` (default: when a capacity is given) the buffer never
    grows: a message that does not fit takes the exact path, counted.
    ``enabled=False``: every call exact (the 16-bit baseline of the
    emulation). ``sink``: where each record goes (default ``stats.record``).
    ``health``: where sampled checks count non-finite values (default: none).
    """

    #: Inputs are one rank's tensor (False) or stacked ``[R, ...]`` over this process's ranks.
    stacked = False

    def __init__(
        self,
        config: EchoConfig,
        transport: Transport,
        *,
        device: torch.device | str = "cpu",
        backend: EchoBackend | None = None,
        env: EchoEnv | None = None,
        fast_cpu: bool = False,
        exact_all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        numbering: Numbering | None = None,
        hidden_size: int | None = None,
        residual_ndim: int | None = None,
        max_num_tokens: int | None = None,
        capacity_numel: int = 0,
        fixed_capacity: bool | None = None,
        enabled: bool = True,
        stats: EchoStats | None = None,
        sink: CallSink | None = None,
        health: HealthCounters | None = None,
    ):
        refusal = argument_refusal(config, transport, hidden_size=hidden_size, residual_ndim=residual_ndim,
                                   max_num_tokens=max_num_tokens, capacity_numel=capacity_numel,
                                   fixed_capacity=fixed_capacity, enabled=enabled, fast_cpu=fast_cpu)
        if refusal:
            raise EchoConfigError(f"{type(self).__name__}: {refusal}")
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
        self.env = env if env is not None else envs.read()
        self.fast_cpu = fast_cpu
        self._exact_all_reduce = exact_all_reduce
        self.numbering = numbering or _no_pass
        self.hidden_size = hidden_size
        self.residual_ndim = residual_ndim
        self.max_num_tokens = max_num_tokens
        self.enabled = enabled
        self.chain = FeedbackChain.of(config, local, device, capacity_numel)
        self.fixed_capacity = capacity_numel > 0 if fixed_capacity is None else fixed_capacity
        self.stats = stats if stats is not None else EchoStats()
        self.sink: CallSink = sink if sink is not None else self.stats.record
        self.health = health
        self._backend = backend
        self._backends: dict[str, EchoBackend] = {}
        self._layouts: dict[tuple[int, int], WireLayout] = {}
        self._checked: set[tuple] = set()
        self._reserved = False

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

    # -- decisions --------------------------------------------------------------

    def is_residual(self, msg: torch.Tensor) -> bool:
        """A residual-stream message (step 1): not empty, bf16/fp16 (an fp32
        message is a norm's statistic, not the stream), of ``residual_ndim``
        dimensions and ``hidden_size`` wide where they are given."""
        return (msg.dtype in ECHO_DTYPES and msg.numel() > 0
                and (self.residual_ndim is None or msg.dim() == self.residual_ndim)
                and (self.hidden_size is None or msg.shape[-1] == self.hidden_size))

    def should_echo(self, inp: torch.Tensor, slot: CallSlot) -> Decision:
        """The policy's path for ``inp`` at ``slot`` (no side effects)."""
        msg = self._message(inp)
        return self._decide(msg, slot, self._layout_of(msg), self.is_residual(msg))

    def _layout_of(self, msg: torch.Tensor) -> WireLayout | None:
        """The message's layout; None for one no Echo call could carry (empty, not floating point)."""
        return self.message_layout(tuple(msg.shape)) if msg.is_floating_point() and msg.numel() else None

    def _decide(self, msg: torch.Tensor, slot: CallSlot, lay: WireLayout | None, residual: bool) -> Decision:
        """:meth:`should_echo` of a message whose layout and residual check
        the call already has (each worked out once per call)."""
        fits = not (self.fixed_capacity and self.config.feedback and lay is not None) or \
            self.chain.fits(self.feedback_numel(lay, msg.device))
        return decide(CallInfo(
            nbytes=msg.numel() * msg.element_size(), dtype=msg.dtype, world_size=self.world_size,
            capturing=capturing(), call_index=slot.index, last_call=slot.last_call,
            residual=residual, fits_buffer=fits, transport_capturable=self.transport.capturable,
        ), self.config, enabled=self.enabled)

    def _slot(self, msg: torch.Tensor, slot: CallSlot | None, residual: bool) -> CallSlot:
        """Steps 2-3: the call's slot, and the buffer reserved once. Every
        call passes here first, and is refused after :meth:`close` (the
        backends are released; rebuilding one would allocate, and a fused
        one rendezvous, behind the caller's back)."""
        if self.disabled:
            raise RuntimeError(f"this {type(self).__name__} is closed: its backends and feedback buffer are released")
        if slot is None:
            slot = self.numbering(msg.shape[0] if msg.dim() else 0, residual)
        elif not isinstance(slot, CallSlot):  # an int failed deep inside the policy
            raise TypeError(f"slot={slot!r:.60}: must be a CallSlot (CallSlot({slot!r:.20}) for a call index)")
        if residual and self.fixed_capacity and not self._reserved and not capturing():
            self.reserve(max(self.max_num_tokens or 0, msg.shape[0]), msg.shape[-1])
            self._reserved = True
        return slot

    # -- the public calls ---------------------------------------------------------

    def all_reduce(self, inp: torch.Tensor, *, out: torch.Tensor | None = None,
                   slot: CallSlot | None = None, exact_reason: Reason | None = None) -> torch.Tensor:
        """Reduce ``inp`` on the path the policy picks (Echo, or the exact path
        after absorbing the pending error); ``out``, if given, receives the
        result. ``slot``: the call's place in its pass (default: ``numbering``'s).
        ``exact_reason``: the exact path, recorded under it, whatever the policy
        says (a :class:`Reason` other than ``ECHO``). ``out`` has the message's
        shape, dtype and device and is contiguous (:func:`out_refusal`)."""
        msg = self._message(inp)
        if out is not None and (refusal := out_refusal(msg, out)):
            raise ValueError(refusal)
        if exact_reason is not None and (not isinstance(exact_reason, Reason) or exact_reason is Reason.ECHO):
            raise ValueError(f"exact_reason={exact_reason!r:.60}: must be a policy.Reason other than ECHO")
        residual = self.is_residual(msg)
        slot = self._slot(msg, slot, residual)
        lay = self._layout_of(msg)
        decision = self._decide(msg, slot, lay, residual) if exact_reason is None else \
            Decision(Path.EXACT, exact_reason)
        if decision.path is not Path.ECHO:
            y = self.exact_all_reduce(inp, None if decision.side else self.chain, slot.index)
            self._record_exact(msg, decision.reason)
            return y if out is None else out.copy_(y)
        # the backend is called from here (not through echo_all_reduce): hook -> here -> backend -> launch
        xs = self._local(inp)
        key, fb, incoming = self._enter(xs, lay, self.chain, slot.index)
        backend = self.backend(xs.device)
        y = backend.all_reduce(xs.reshape(xs.shape[0], lay.numel), lay, fb, has_incoming=incoming,
                               out=None if out is None else out.view(lay.numel))
        y = self._leave(y, key, self.chain, slot.index, fb, out)
        self._record_echo(decision, inp, y, slot, lay, backend)
        return y

    def all_reduce_norm(self, inp: torch.Tensor, norm: NormOperands, *,
                        slot: CallSlot | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`all_reduce` followed by the residual add and RMSNorm of
        ``norm`` (vLLM's ``fused_add_rms_norm``, ``rms_norm`` without a
        residual): ``(out, new residual)``. On Echo's path the norm runs in
        the backend's output phase where the row fits
        (``norm_plan.norm_tiling``), else after it; on the exact path after
        it; the record says which (``CallRecord.norm``)."""
        msg = self._message(inp)
        if not self.is_residual(msg):
            return norm.apply(self.all_reduce(inp, slot=slot))
        slot = self._slot(msg, slot, True)
        lay = self._layout_of(msg)
        decision = self._decide(msg, slot, lay, True)
        if decision.path is not Path.ECHO:
            y = self.exact_all_reduce(inp, None if decision.side else self.chain, slot.index)
            self._record_exact(msg, decision.reason, norm=EXACT_PATH_NORM)
            return norm.apply(y)
        out, res, how = self.echo_all_reduce_norm(inp, norm, self.chain, slot.index)
        self._record_echo(decision, inp, out, slot, lay, self.backend(out.device), norm=how)
        return out, res

    # -- the two paths: Echo with the chain rule, and the exact path ---------------

    def echo_all_reduce(self, inp: torch.Tensor, chain: FeedbackChain | None = None,
                        call_index: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Echo of ``inp``, whatever the policy says (benchmarks, sweeps).
        With a ``chain``, absorbs the error the previous call of the chain
        left and leaves this call's error."""
        if not inp.is_floating_point():
            raise TypeError(f"Echo all-reduce needs a floating-point tensor, got {inp.dtype}")
        xs = self._local(inp)
        lay = self.message_layout(tuple(xs.shape[1:]))
        key, fb, incoming = self._enter(xs, lay, chain, call_index)
        y = self.backend(xs.device).all_reduce(xs.reshape(xs.shape[0], lay.numel), lay, fb, has_incoming=incoming,
                                               out=None if out is None else out.view(lay.numel))
        return self._leave(y, key, chain, call_index, fb, out)

    def compile_echo(self, inp: torch.Tensor, chain: FeedbackChain | None = None) -> None:
        """Compile what :meth:`echo_all_reduce` launches for ``inp``'s shape and
        dtype: a chain's first call, and with feedback its later ones (an
        incoming error). Launches nothing and leaves ``chain``'s error as it
        is (its buffer may grow). No peer takes part, so each rank may
        compile other messages' kernels ahead of the calls
        (``scripts/gpu_fused_check.py``'s sweep shares its cases'
        compilations out over the ranks)."""
        xs = self._local(inp)
        lay = self.message_layout(tuple(xs.shape[1:]))
        fb = (self._feedback(chain, self.feedback_numel(lay, xs.device), xs.device)
              if chain is not None and self.config.feedback else None)
        backend = self.backend(xs.device)
        for incoming in (False, True) if fb is not None else (False,):
            backend.compile(xs.reshape(xs.shape[0], lay.numel), lay, fb, has_incoming=incoming)

    def echo_all_reduce_norm(self, inp: torch.Tensor, norm: NormOperands, chain: FeedbackChain | None = None,
                             call_index: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        """:meth:`echo_all_reduce` followed by the residual add and RMSNorm of
        ``norm``: ``(out, new residual, how)``, ``how`` being ``"fused"`` (in
        the backend's output phase) or why not (``norm_plan.norm_tiling``'s
        reason); the same bits either way."""
        xs = self._local(inp)
        lay = self.message_layout(tuple(xs.shape[1:]))
        key, fb, incoming = self._enter(xs, lay, chain, call_index)
        tiling, reason = norm_tiling(lay)
        out, res = self.backend(xs.device).all_reduce_norm(xs.reshape(xs.shape[0], lay.numel), lay, fb, norm, tiling,
                                                           has_incoming=incoming)
        if chain is not None:
            chain.record(call_index, key, left_error=fb is not None)
        return out, res, "fused" if tiling is not None else reason

    def exact_all_reduce(self, inp: torch.Tensor, chain: FeedbackChain | None = None,
                         call_index: int | None = None) -> torch.Tensor:
        """The 16-bit all-reduce (the one given, else the backend's), after adding
        the chain's pending error to the input; it leaves none. Without a
        chain (a side call) the chain is left as it is."""
        xs = self._local(inp)
        if chain is not None and xs.is_floating_point():
            xs = self.absorb(xs, chain, call_index)
        if self._exact_all_reduce is not None:
            return self._exact_all_reduce(self._unlocal(xs))
        return self.backend(xs.device).exact_all_reduce(xs)

    def _enter(self, xs: torch.Tensor, lay: WireLayout, chain: FeedbackChain | None, call_index: int | None):
        """An Echo call's chain key, feedback buffer and whether it takes an
        error, for local inputs ``xs`` of message layout ``lay``."""
        key = self.chain_key(xs, lay)
        self._check(key)
        fb, incoming = None, False
        if chain is not None and self.config.feedback:
            incoming = chain.take(call_index, key)
            fb = self._feedback(chain, self.feedback_numel(lay, xs.device), xs.device)
        return key, fb, incoming

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

    def _leave(self, y: torch.Tensor, key: tuple, chain: FeedbackChain | None, call_index: int | None,
               fb: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        """After an Echo call: the chain told whether it left an error; the output shaped as the message."""
        if chain is not None:
            chain.record(call_index, key, left_error=fb is not None)
        return y.reshape(key[0]) if out is None else out

    def absorb(self, xs: torch.Tensor, chain: FeedbackChain, call_index: int | None) -> torch.Tensor:
        """``xs [R, ...]`` plus the chain's pending error (rounded to their
        dtype), the chain marked empty: what an exact call does."""
        if not self.config.feedback or xs.numel() == 0:
            chain.record(call_index, None, left_error=False)
            return xs
        key = self.chain_key(xs)
        if chain.take(call_index, key):
            lay = self.message_layout(key[0])
            xs = self.backend(xs.device).consume(xs.reshape(xs.shape[0], lay.numel), lay,
                                                 self._feedback(chain, self.feedback_numel(lay, xs.device), xs.device)
                                                 ).reshape(xs.shape)
        chain.record(call_index, key, left_error=False)
        return xs

    # -- records ----------------------------------------------------------------

    def _record_echo(self, decision: Decision, inp: torch.Tensor, y: torch.Tensor, slot: CallSlot,
                     lay: WireLayout, backend: EchoBackend, norm: str = "") -> None:
        checked = (self.health is not None and sampled(slot.index, self.config.health_every)
                   and self.health.observe(inp, y))
        # the backend's own kernels may not take the message: its fallback ran it
        reason = decision.reason if backend.fits(lay) else Reason.EXCEEDS_FUSED_BUFFERS
        hosts = backend.hosts or HostMap((0,) * self.world_size)  # not asked: counted as one host's
        sent = echo_bytes(lay, hosts, self.transport.local_ranks[0], backend.topology, y.element_size())
        self.sink(CallRecord("echo", reason.value, wire_bytes=sent.total, in_host_bytes=sent.in_host,
                             cross_host_bytes=sent.cross_host, equiv_bytes=lay.ring_bytes_per_rank(y.element_size()),
                             checked=checked, norm=norm, **self._chain_outcome()))

    def _record_exact(self, msg: torch.Tensor, reason: Reason, norm: str = "") -> None:
        self.sink(CallRecord("exact", reason.value, nbytes=msg.numel() * msg.element_size(), norm=norm,
                             **self._chain_outcome()))

    def _chain_outcome(self) -> dict:
        """The record fields of what the chain did in the call just run."""
        take = self.chain.pop_take()
        if take is None:
            return {}
        return {"carried": take.incoming, "dropped": take.dropped.value if take.dropped else ""}

    # -- layouts, agreement, backends ---------------------------------------------

    def layout(self, numel: int, cols: int = 0) -> WireLayout:
        """Layout of a message of ``numel`` values in rows of ``cols`` (0: one row)."""
        lay = self._layouts.get((numel, cols))
        if lay is None:
            lay = self._layouts[(numel, cols)] = WireLayout(numel, self.world_size, self.config.group_size, cols)
        return lay

    def message_layout(self, shape: tuple[int, ...]) -> WireLayout:
        """Layout of a message of ``shape`` (one rank's): rows along the last dim."""
        return self.layout(math.prod(shape), shape[-1] if shape else 0)

    def feedback_numel(self, lay: WireLayout, device: torch.device | None = None) -> int:
        """Carried-error values per rank a message of ``lay`` on ``device``
        (default the buffer's) needs: its backend's (two-level keeps its
        shard's only)."""
        return self.backend(self.chain.device if device is None else device).feedback_numel(lay)

    def chain_key(self, xs: torch.Tensor, lay: WireLayout | None = None) -> tuple:
        """The chain's key of local inputs ``xs [R, ...]``: shape, dtype, padded
        size (``lay``: their message's layout, where the caller has it)."""
        shape = tuple(xs.shape[1:])
        if lay is None:
            lay = self.message_layout(shape)
        return (shape, xs.dtype, lay.padded_numel)

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

    def backend(self, device: torch.device) -> EchoBackend:
        """The backend that reduces tensors on ``device`` (built once per device type)."""
        if self._backend is not None:
            return self._backend
        b = self._backends.get(device.type)
        if b is None:
            b, _ = make_backend(self.config, self.transport, device_type=device.type, env=self.env,
                                fast_cpu=self.fast_cpu)
            self._backends[device.type] = b
        return b

    # -- sizing and thresholds ------------------------------------------------------

    def reserve(self, rows: int, cols: int) -> None:
        """Size the feedback buffer for messages of up to ``rows`` rows of
        ``cols`` (and allocate the health counter: both before any capture)."""
        if self.config.feedback:
            self.chain.reserve(self.feedback_numel(self.layout(rows * cols, cols)))
        if self.health is not None:
            self.health.allocate()

    def set_thresholds(self, min_bytes: int, max_bytes: int) -> None:
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
        cols, max_tokens = self.hidden_size, self.max_num_tokens
        if self.disabled or not cfg.min_bytes_auto or cfg.batch_invariant or not cols or not max_tokens:
            return None
        dtype = dtype if dtype in ECHO_DTYPES else torch.bfloat16
        row_bytes = cols * torch.finfo(dtype).bits // 8
        chain = FeedbackChain.of(cfg, 1, self.chain.device)

        def run_echo(x: torch.Tensor) -> None:
            # the steady state of a forward pass: call 1 absorbs call 0's error
            chain.record(0, self.chain_key(x.unsqueeze(0)), left_error=True)
            self.echo_all_reduce(x, chain, 1)

        def run_exact(x: torch.Tensor) -> torch.Tensor:
            return self.exact_all_reduce(x)

        points = crossover.calibrate(run_exact, run_echo, crossover.ladder(max_tokens * row_bytes, row_bytes),
                                     cols=cols, dtype=dtype, device=self.chain.device,
                                     slowest=self.transport.max_over_ranks)
        chain.release()
        result = crossover.decide(points)
        self.set_thresholds(result.min_bytes, result.max_bytes)
        return result

    def close(self) -> None:
        """Release the backend(s) and the feedback buffer; later calls go to vLLM."""
        for b in [self._backend] if self._backend is not None else self._backends.values():
            b.close()
        self._backends.clear()
        self.chain.release()
        self.disabled = True


__all__ = ["EXACT_PATH_NORM", "EchoCommunicator", "Numbering", "argument_refusal", "out_refusal"]
