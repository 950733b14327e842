"""Tensor-parallel training collectives: Megatron's f and g, reduced with Echo.

Megatron-style tensor parallelism splits each attention and MLP block into a
column-parallel matmul (weights split by output features) and a
row-parallel one (split by input features). Two conjugate operators make
the split exact:

* **g** (``reduce_from_tp``), at the end of a block: forward, the all-reduce
  of the row-parallel partial outputs; backward, identity (every rank needs
  the whole output gradient).
* **f** (``copy_to_tp``), at the start of a block: forward, identity (every
  rank reads the whole input); backward, the all-reduce of the per-rank
  partial input gradients.

In a pre-norm decoder both sums land in a residual stream: g's outputs are
added to the activations in forward order, f's outputs to the activation
gradient in backward order (when the block's norm sits inside the TP region,
see ``ModelConfig.norm_in_tp_region``). That is the condition for Echo's
telescoping, so each direction keeps its own feedback chain: forward calls
are indexed in forward order, backward calls in backward order (0 = the
first all-reduce autograd runs), and both chains restart with every forward
pass.

Tensor convention (used by every module of ``echo_vllm.training``): a
per-rank tensor has a leading dimension R of *local* ranks -- all P ranks
when one process emulates TP=P over :class:`~echo_vllm.VirtualTransport`, 1
in a real process group over :class:`~echo_vllm.ProcessGroupTransport`. A
replicated tensor (the residual stream, the loss) has no rank dimension.
The same layer code runs both ways, and Echo's numerics are identical
(every stage is elementwise per rank; the stage-2 sum runs in rank order).
What can differ in the last bit between the two settings are sums whose
order a backend chooses: the 16-bit exact path (the emulation adds in fp32
in rank order and rounds once; NCCL rounds its bf16 partial sums as it goes;
gloo with 2 ranks rounds once, the same bits) and the fp32 sums of
:class:`TPGroup` for P > 2 (tests/training/test_tp_gloo.py checks P = 2 bit
for bit).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..emulation import StackedCommunicator
from ..config import EchoConfig
from ..numbering import CallCounter
from ..policy import MODES, Path, mode_config
from ..transport import ProcessGroupTransport, Transport, VirtualTransport

#: Forward chain defaults. Training messages (tokens x hidden, 16-bit) are
#: far above Echo's serving size gate, and the comparison is about
#: numerics, so every size goes through the policy (min_bytes=0); the
#: other fields keep EchoConfig's serving defaults.
FORWARD_DEFAULT = EchoConfig(min_bytes=0)

#: Backward chain defaults, chosen by measurement (``train-demo --fidelity``:
#: gradient error against the exact backward at fixed weights, over every
#: combination; then training runs): the first call -- the LM head's input
#: gradient -- is the one that needs 16 bits (more first calls in 16-bit did
#: not lower the error further, so one keeps the most calls 4-bit); the last
#: call in 16-bit matters (its error would land whole in the embedding's
#: gradient; a backward chain with both ends 4-bit trained visibly worse);
#: the rotation made no measurable difference and stays on, as in the
#: forward chain.
BACKWARD_DEFAULT = EchoConfig(min_bytes=0, first_exact_calls=1)


class TPGroup:
    """The R local ranks of a tensor-parallel group of P ranks, over one
    Echo transport, plus the exact fp32 collectives training needs besides
    the residual all-reduces (vocab-parallel cross-entropy, gradients of
    replicated parameters, the global gradient norm)."""

    def __init__(self, transport: Transport, device: torch.device | str = "cpu"):
        self.transport = transport
        self.world_size = transport.world_size
        self.local_ranks = tuple(transport.local_ranks)
        self.device = torch.device(device)

    @classmethod
    def virtual(cls, world_size: int, device: torch.device | str = "cpu") -> "TPGroup":
        """All P ranks in this process (emulated TP=P)."""
        return cls(VirtualTransport(world_size), device)

    @classmethod
    def from_process_group(
        cls, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
    ) -> "TPGroup":
        """This process's rank of an initialised torch.distributed group."""
        return cls(ProcessGroupTransport(group), device)

    @property
    def emulated(self) -> bool:
        """All P ranks are in this process (tensors stacked ``[P, ...]``)."""
        return len(self.local_ranks) == self.world_size

    @property
    def local_size(self) -> int:
        """R: how many ranks this process holds."""
        return len(self.local_ranks)

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This process's shards of ``full`` split into P equal parts along
        ``dim``, stacked as [R, ...] (a copy)."""
        parts = full.chunk(self.world_size, dim)
        return torch.stack([parts[r] for r in self.local_ranks]).contiguous()

    # -- exact fp32 collectives over the rank dimension ------------------------

    def _reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if self.emulated:
            if op == "max":
                return x.amax(0)
            # rank order, one add per rank: what gloo does for P=2 too
            acc = x[0].clone()
            for r in range(1, x.shape[0]):
                acc = acc + x[r]
            return acc
        out = x[0].clone()
        dist.all_reduce(
            out,
            op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
            group=getattr(self.transport, "group", None),
        )
        return out

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over all P ranks of per-rank ``x`` [R, ...] -> [...] (exact
        path, x's dtype)."""
        return self._reduce(x, "sum")

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Max over all P ranks of ``x`` [R, ...] -> [...]."""
        return self._reduce(x, "max")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` [R, ...] -> [P, ...], in rank order."""
        if self.emulated:
            return x
        out = torch.empty((self.world_size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=getattr(self.transport, "group", None))
        return out


@dataclass(frozen=True)
class TPCommConfig:
    """How the residual all-reduces of a TP training step are done."""

    mode: str = "echo"
    """:data:`echo_vllm.policy.MODES`: "exact", every call 16-bit (the
    baseline); "naive", the Echo configs below with ``feedback=False``
    (plain 4-bit, same calls 16-bit as Echo); "echo", the configs as given."""

    forward: EchoConfig = FORWARD_DEFAULT
    """Echo options of the forward chain (g: embedding and row-parallel
    output all-reduces, in forward order)."""

    backward: EchoConfig = BACKWARD_DEFAULT
    """Echo options of the backward chain (f: column-parallel input-gradient
    all-reduces, in backward order)."""

    comm_dtype: torch.dtype = torch.bfloat16
    """Dtype of every residual all-reduce message, in all three modes: the
    partial sums are cast to it before the reduce, so the exact baseline
    has the same 16-bit boundary and the comparison isolates the 4-bit
    error. Echo quantizes only bf16/fp16 messages (fp32 takes the exact
    path)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: choose one of {MODES}")
        if self.comm_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"comm_dtype={self.comm_dtype}: Echo quantizes bfloat16/float16 only")

    def echo_config(self, direction: str) -> EchoConfig | None:
        """The EchoConfig of ``direction`` ("forward"/"backward") in this
        mode; None for exact."""
        return mode_config(self.mode, self.forward if direction == "forward" else self.backward)

    def replace(self, **changes) -> "TPCommConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class ChainCall:
    """One residual all-reduce of a direction's chain, its message and output,
    as :attr:`ChainedAllReduce.trace` keeps it."""

    direction: str
    index: int
    last: bool
    path: str
    """"echo" or "exact" (the policy's choice; always "exact" in exact mode)."""
    x: torch.Tensor
    """The message: per-rank partials [R, ...] in the comm dtype."""
    y: torch.Tensor
    """The reduced output [...]."""


@dataclass
class CommTime:
    """Time spent in one direction's all-reduces since the last ``collect``."""

    seconds: float = 0.0
    calls: int = 0
    _events: list = field(default_factory=list, repr=False)


class ChainedAllReduce:
    """The residual all-reduces of one direction: a StackedCommunicator (and its
    feedback chain) plus the call counter that gives each call its index in
    the pass and tells the policy which call is the last (each pass declares
    its count: :meth:`start_pass`)."""

    def __init__(self, direction: str, config: TPCommConfig, group: TPGroup):
        self.direction = direction
        self.group = group
        self.comm_dtype = config.comm_dtype
        echo_cfg = config.echo_config(direction)
        # exact mode still owns a communicator and forces its exact path: the one
        # the Echo modes fall back to, so the three modes share the 16-bit numerics
        self.path = Path.EXACT if echo_cfg is None else None
        """The path every call is forced onto (None: the policy's)."""
        self.comm = StackedCommunicator(echo_cfg or EchoConfig(min_bytes=0), group.transport, device=group.device,
                                        fast_cpu=True)
        self.counter = CallCounter()
        """Numbers this direction's calls; ``calls_per_pass`` is declared per
        pass (known before the pass's last call)."""
        self.counter.start()
        self.trace: list[ChainCall] | None = None
        """Set to a list to keep every call's message and output (tests)."""
        self.time = CommTime()

    @property
    def chain(self):
        return self.comm.chain

    def start_pass(self, calls: int) -> None:
        """A new pass of ``calls`` calls: indices restart at 0 and the chain
        forgets any error."""
        self.counter.start(calls)
        self.comm.chain.reset()

    def __call__(self, partials: torch.Tensor) -> torch.Tensor:
        """Sum per-rank ``partials`` [R, ...] over the group; returns [...] in
        the comm dtype."""
        xs = partials.to(self.comm_dtype)
        slot = self.counter.next()
        start = self._tick()
        y = self.comm.all_reduce(xs, slot=slot, path=self.path)
        self._tock(start)
        if self.trace is not None:
            path = (self.path or self.comm.should_echo(xs, slot).path).value
            self.trace.append(ChainCall(self.direction, slot.index, slot.last_call, path, xs.detach().clone(),
                                            y.detach().clone()))
        return y

    # -- timing: CUDA events on GPU (no sync per call), wall clock on CPU -------

    def _tick(self):
        if self.group.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _tock(self, start) -> None:
        self.time.calls += 1
        if isinstance(start, float):
            self.time.seconds += time.perf_counter() - start
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.time._events.append((start, end))

    def collect_time(self) -> CommTime:
        """Seconds and calls since the last collect (synchronises on GPU)."""
        t = self.time
        if t._events:
            torch.cuda.synchronize(self.group.device)
            t.seconds += sum(a.elapsed_time(b) for a, b in t._events) / 1000.0
        self.time = CommTime()
        return t


class TPComm:
    """The forward (g) and backward (f) chains of one model."""

    def __init__(self, config: TPCommConfig, group: TPGroup):
        self.config = config
        self.group = group
        self.forward = ChainedAllReduce("forward", config, group)
        self.backward = ChainedAllReduce("backward", config, group)

    def begin_forward(self, forward_calls: int) -> None:
        """Called by the model at the start of every forward pass: both chains
        restart (so does the backward one: its pass mirrors this forward),
        and the backward pass's length is counted as f is applied."""
        self.forward.start_pass(forward_calls)
        self.backward.start_pass(0)

    def end_forward(self) -> None:
        counter = self.forward.counter
        if counter.count != counter.calls_per_pass:
            raise RuntimeError(
                f"the forward pass made {counter.count} residual all-reduces, "
                f"the model declared {counter.calls_per_pass}"
            )

    def set_trace(self, trace: list[ChainCall] | None) -> None:
        """Keep every call's :class:`ChainCall` in ``trace`` (None: stop)."""
        self.forward.trace = trace
        self.backward.trace = trace

    def stats(self) -> dict:
        """Calls by path/reason per direction, and chain counters."""
        out = {}
        for ar in (self.forward, self.backward):
            snap = ar.comm.stats.snapshot()
            ch = ar.chain.stats
            out[ar.direction] = {
                "calls": snap["calls"],
                "wire_bytes": snap["wire_bytes"],
                "equiv_16bit_bytes": snap["equiv_16bit_bytes"],
                "chain": {"carried": ch.carried, "started_clean": ch.started_clean, "dropped": ch.dropped},
            }
        return out


# -- f and g as autograd functions ------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """f: identity forward (replicated [...] -> per-rank [R, ...]), all-reduce
    of the per-rank gradients backward (the next call of the backward chain)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        ctx.dtype = x.dtype
        comm.backward.counter.calls_per_pass += 1
        return x.unsqueeze(0).expand((comm.group.local_size,) + tuple(x.shape))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.backward(grad).to(ctx.dtype), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce of per-rank partials forward (the next call of the forward
    chain), identity backward (every rank gets the whole gradient)."""

    @staticmethod
    def forward(ctx, partials: torch.Tensor, comm: TPComm, out_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.shape = partials.shape
        ctx.dtype = partials.dtype
        y = comm.forward(partials)
        return y if out_dtype is None else y.to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the gradient goes back in the partials' (compute) dtype: the message
        # dtype is a property of the forward all-reduce, not of this gradient
        return grad.to(ctx.dtype).unsqueeze(0).expand(ctx.shape), None, None


def copy_to_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's f: replicated ``x`` [...] -> per-rank view [R, ...]; its
    backward is a call of the backward chain."""
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(partials: torch.Tensor, comm: TPComm, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Megatron's g: per-rank ``partials`` [R, ...] -> their sum [...], a call
    of the forward chain. The sum comes back in the comm dtype, cast to
    ``out_dtype`` (the residual stream's) when given."""
    return _ReduceFromTP.apply(partials, comm, out_dtype)


__all__ = [
    "BACKWARD_DEFAULT",
    "FORWARD_DEFAULT",
    "ChainCall",
    "ChainedAllReduce",
    "CommTime",
    "TPComm",
    "TPCommConfig",
    "TPGroup",
    "copy_to_tp",
    "reduce_from_tp",
]
