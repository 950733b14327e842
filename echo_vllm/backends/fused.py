"""The fused backend: Echo as one Triton kernel over symmetric memory.

Where the composed backends run stage kernels around a transport's
all-to-all and all-gather, :class:`FusedSymmMemBackend` runs one kernel
(:mod:`echo_vllm.kernels.fused_kernel`) that stores the 4-bit chunks
straight into the peers' memory, synchronises with them through
self-resetting flags and decodes the result: the same bits as the composed
pipeline, no host work per call beyond one launch, capturable into a CUDA
graph.

It needs peer-mapped memory: CUDA tensors, ranks in a ``torch.distributed``
process group on one host whose GPUs can all reach each other (P2P) with
native atomics over the link (the barriers are system-scope atomics on
peer memory), no more than two GPUs unless every pair is on NVLink (the
rule of vLLM's custom all-reduce: more than two PCIe-only GPUs are
refused), and ``torch.distributed._symmetric_memory``.
:func:`fused_availability` decides from :class:`FusedFacts` (a pure
function, with its reason, which the vLLM glue logs); :func:`fused_support`
gathers the facts (a collective over the group; links read by
:mod:`.topology`) and asks it.

Buffers (per rank: P ``recv`` and P ``gathered`` chunk slots, plus the
flags in the signal pad) are allocated and rendezvoused when the backend is
built -- a collective, so every rank builds it at the same point and before
any CUDA-graph capture -- sized for messages of up to ``max_numel`` values,
and shared per (group, device, size) by the backends that use them; the
last one's :meth:`~FusedSymmMemBackend.close` frees them. They serve one
CUDA stream at a time: a call from a second stream while the first still
has work queued is refused (:class:`FusedStreamError`; calls under graph
capture are not checked: their replays run no host code). A message whose
chunks do not fit is never cut or overflowed: it goes to the ``fallback``
backend (same bits) when one was given, else raises
:class:`MessageTooLarge`.

A peer that never reaches a barrier makes the kernel trap after
``EchoConfig.timeout_s`` (``--echo-timeout-s``): the host sees CUDA's
"unspecified launch failure" at its next synchronisation, wherever that
is, and the process's CUDA context is lost. Before trapping, the kernel
writes why into the backend's status word (pinned host memory:
:class:`~echo_vllm.kernels.fused_kernel.TrapStatus`, rank, barrier and
the late peer), which a watcher thread logs as an error naming Echo, the
phase and the peer within :data:`TRAP_POLL_S`, and which every later
call of the backend raises (:class:`FusedTimeoutError`).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..capture import capturing
from ..config import EchoConfig
from ..kernels.fused_kernel import (SMLimits, buffer_bytes, decode_trap, fused_all_reduce, fused_all_reduce_norm,
                                    max_per_sm, signal_slots, sm_limits, tiling_for, tiling_for_norm, trap_word)
from . import topology
from ..quant import WIRE_DTYPE, WireLayout
from ..transport import ProcessGroupTransport, Transport
from .base import EchoBackend
from .triton_stages import TritonStages

#: torch's switch for symmetric memory on ranks that share a GPU (tests on
#: one GPU); read here only, by :func:`probe`.
OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"

#: Largest message (values per rank) the buffers are sized for when neither
#: ``max_numel`` nor ``EchoConfig.max_bytes`` says: about 1.1 bytes of
#: symmetric memory per value per rank (4-bit codes + scales, twice).
DEFAULT_MAX_NUMEL = 1 << 25

#: Seconds between the trap watcher's looks at the live backends' status words.
TRAP_POLL_S = 0.5

logger = logging.getLogger(__name__)


class MessageTooLarge(ValueError):
    """A message whose chunks do not fit the fused backend's buffers."""


class FusedStreamError(RuntimeError):
    """A call from a second CUDA stream on buffers another stream still uses."""


class FusedTimeoutError(RuntimeError):
    """A fused kernel of this backend trapped: a peer missed a barrier."""


# -- availability ----------------------------------------------------------------


@dataclass(frozen=True)
class FusedFacts:
    """What decides whether the fused backend can run, as gathered by
    :func:`probe` (one entry per rank of the group where per-rank)."""

    device_type: str
    transport: str
    """``process_group`` (a ``ProcessGroupTransport``), ``virtual``
    (in-process ranks) or the transport's class name."""
    symm_mem: bool
    """``torch.distributed._symmetric_memory`` imports."""
    hosts: tuple[str, ...] = ()
    devices: tuple[int, ...] = ()
    """CUDA device index of each rank."""
    peer_access: tuple[tuple[bool, ...], ...] = ()
    """``peer_access[a][b]``: rank a's GPU can access rank b's memory
    (``torch.cuda.can_device_access_peer``; True on the diagonal)."""
    sm_counts: tuple[int, ...] = ()
    allow_overlap: bool = False
    """``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``: ranks may share a GPU."""
    native_atomics: tuple[tuple[bool | None, ...], ...] = ()
    """``native_atomics[a][b]``: rank a's GPU performs native atomics on rank
    b's over the link (CUDA's P2P attribute; None: unknown; True on the
    diagonal and between ranks that share a GPU)."""
    nvlink: tuple[tuple[bool | None, ...], ...] = ()
    """``nvlink[a][b]``: NVML reports an NVLink path between the two ranks'
    GPUs (None: unknown; True on the diagonal and on a shared GPU)."""


def fused_availability(facts: FusedFacts) -> tuple[bool, str]:
    """``(can run, reason)`` for the fused backend, from ``facts`` alone."""
    if facts.device_type != "cuda":
        return False, f"{facts.device_type} tensors (the fused kernel needs CUDA)"
    if facts.transport == "virtual":
        return False, "in-process virtual ranks have no peer memory"
    if facts.transport != "process_group":
        return False, f"transport {facts.transport} is not a torch.distributed process group"
    if not facts.symm_mem:
        return False, "torch.distributed._symmetric_memory is not importable"
    if len(set(facts.hosts)) > 1:
        return False, f"ranks on {len(set(facts.hosts))} hosts (peer memory needs one host)"
    devs = facts.devices
    if len(set(devs)) < len(devs) and not facts.allow_overlap:
        shared = sorted({d for d in devs if devs.count(d) > 1})
        return False, f"ranks share GPU(s) {shared} (allowed only with {OVERLAP_ENV}=1)"
    pairs = [(a, b) for a, da in enumerate(devs) for b, db in enumerate(devs) if da != db]
    for a, b in pairs:
        if not facts.peer_access[a][b]:
            return False, f"GPU {devs[a]} (rank {a}) cannot access GPU {devs[b]} (rank {b}): no P2P"
    for a, b in pairs:
        atomics = facts.native_atomics[a][b] if facts.native_atomics else None
        if not atomics:
            state = "unknown (the CUDA driver did not say)" if atomics is None else "not supported"
            return False, (f"native P2P atomics from GPU {devs[a]} (rank {a}) to GPU {devs[b]} (rank {b}) "
                           f"{state}: the kernel's barriers are atomics on peer memory")
    gpus = len(set(devs))
    unlinked = [(a, b) for a, b in pairs if not (facts.nvlink[a][b] if facts.nvlink else None)]
    if gpus > 2 and unlinked:
        a, b = unlinked[0]
        return False, (f"{gpus} GPUs not all on NVLink (GPU {devs[a]} and GPU {devs[b]}: "
                       f"{'unknown' if not facts.nvlink or facts.nvlink[a][b] is None else 'PCIe only'}): "
                       "more than two PCIe-only GPUs are refused, as vLLM's custom all-reduce does")
    links = "NVLink" if pairs and not unlinked else "peer access"
    return True, f"{len(devs)} ranks on GPU(s) {list(devs)} with {links} and native atomics"


def _symm_mem_importable() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception:
        return False
    return dist.is_available()


def _transport_kind(transport: Transport) -> str:
    if isinstance(transport, ProcessGroupTransport):
        return "process_group"
    return "virtual" if len(transport.local_ranks) > 1 else type(transport).__name__


def _group(transport: ProcessGroupTransport) -> dist.ProcessGroup:
    return transport.group if transport.group is not None else dist.group.WORLD


#: Facts probed per transport (a probe is a collective: once is enough).
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def probe(transport: Transport, device_type: str = "cuda") -> FusedFacts:
    """The facts of this rank's group. For a process group on CUDA, an
    ``all_gather_object`` of (host, device, SM count) over the group --
    every rank must call it, and not under CUDA-graph capture -- done once
    per transport."""
    kind = _transport_kind(transport)
    facts = FusedFacts(device_type, kind, _symm_mem_importable())
    if device_type != "cuda" or kind != "process_group" or not facts.symm_mem or not torch.cuda.is_available():
        return facts
    known = _PROBED.get(transport)
    if known is not None:
        return known
    dev = torch.cuda.current_device()
    mine = (socket.gethostname(), dev, torch.cuda.get_device_properties(dev).multi_processor_count,
            topology.pci_bus_id(dev))
    every: list = [None] * transport.world_size
    dist.all_gather_object(every, mine, group=transport.group)
    devices = tuple(e[1] for e in every)
    buses = [e[3] for e in every]

    def matrix(query):  # every pair of ranks; a shared GPU is linked to itself
        return tuple(tuple(a == b or query(i, j) for j, b in enumerate(devices)) for i, a in enumerate(devices))

    facts = FusedFacts(
        device_type, kind, True, hosts=tuple(e[0] for e in every), devices=devices,
        peer_access=matrix(lambda i, j: torch.cuda.can_device_access_peer(devices[i], devices[j])),
        sm_counts=tuple(e[2] for e in every), allow_overlap=os.environ.get(OVERLAP_ENV) == "1",
        native_atomics=matrix(lambda i, j: topology.native_atomics(devices[i], devices[j])),
        nvlink=matrix(lambda i, j: topology.nvlink(buses[i], buses[j])),
    )
    _PROBED[transport] = facts
    return facts


def fused_support(transport: Transport, device_type: str = "cuda") -> tuple[bool, str]:
    """:func:`fused_availability` of this group (probing it: a collective for
    a process group on CUDA). Under CUDA-graph capture nothing is probed
    (no collective may run there) and the answer is no."""
    if capturing() and transport not in _PROBED:
        return False, "not probed under CUDA-graph capture"
    return fused_availability(probe(transport, device_type))


def sms_for(facts: FusedFacts) -> int:
    """SMs one rank's programs may fill at once: its share of the smallest
    GPU's SMs (ranks sharing a GPU split it: their spinning programs must
    all be resident), at least 1."""
    share = min(sm // facts.devices.count(d) for d, sm in zip(facts.devices, facts.sm_counts))
    return max(1, share)


# -- buffers ----------------------------------------------------------------------


class StreamOwner:
    """The one CUDA stream a set of buffers serves.

    The first call (outside graph capture) claims it; a call from another
    stream takes it over only once every call queued on the old one has
    finished (vLLM switches once to its own stream after start-up, when
    nothing is in flight), and otherwise is refused: two streams with calls
    in flight would interleave two calls' barriers and slots."""

    def __init__(self) -> None:
        self.stream = None

    def claim(self, stream) -> None:
        """Make ``stream`` the owner, or raise :class:`FusedStreamError`."""
        if stream == self.stream:
            return
        if self.stream is not None and not _stream_idle(self.stream):
            raise FusedStreamError(
                f"echo fused all-reduce: a call on CUDA stream {stream} while stream {self.stream} still has "
                "calls in flight on the same symmetric buffers; they serve one stream at a time (each call's "
                "barriers pair program p of every rank). Run every Echo call of a group on one stream, or "
                "synchronize the old stream before switching")
        self.stream = stream


def _current_stream(device: torch.device):
    """The stream a call on ``device`` is queued on (a seam for CPU tests)."""
    return torch.cuda.current_stream(device)


def _stream_idle(stream) -> bool:
    """Every call queued on ``stream`` has finished (a seam for CPU tests)."""
    return stream.query()


@dataclass(frozen=True)
class SymmBuffers:
    """One rank's symmetric buffer and the address table the kernel reads."""

    buffer: torch.Tensor
    """uint8: ``recv`` slots (P of ``chunk_bytes``), ``gathered`` slots, then
    ``signal_slots`` int32 flags (zeroed once; they reset themselves)."""
    handle: object
    """The ``_SymmetricMemory`` handle (keeps the peers' mappings alive)."""
    table: torch.Tensor
    """int64 ``[2, P]`` on the device: every rank's buffer and flag-area address."""
    rank: int
    chunk_bytes: int
    """Largest chunk a slot holds."""
    signal_slots: int
    """int32 flags in each rank's flag area."""
    owner: StreamOwner = field(default_factory=StreamOwner, compare=False)
    """The stream the buffers serve (shared by every backend using them)."""

    @property
    def gathered_offset(self) -> int:
        return self.buffer.numel() // 2 - 2 * self.signal_slots


@dataclass
class _Shared:
    buffers: SymmBuffers
    users: int = 0


_BUFFERS: dict[tuple, _Shared] = {}


def symm_buffers(group: dist.ProcessGroup, device: torch.device, chunk_bytes: int, signal_slots: int) -> SymmBuffers:
    """The shared buffers of ``group`` on ``device`` (one more user), or new
    ones (:func:`_allocate`, a collective on first use). Give them back with
    :func:`drop_buffers`."""
    key = (group.group_name, device, chunk_bytes, signal_slots)
    shared = _BUFFERS.get(key)
    if shared is None:
        shared = _BUFFERS[key] = _Shared(_allocate(group, device, chunk_bytes, signal_slots))
    shared.users += 1
    return shared.buffers


def _allocate(group: dist.ProcessGroup, device: torch.device, chunk_bytes: int, signal_slots: int) -> SymmBuffers:
    """Allocate, rendezvous, zero this rank's flags, and wait on the group
    until every rank has (so no flag is raised before its owner cleared it)."""
    from torch.distributed import _symmetric_memory as symm_mem

    world = dist.get_world_size(group)
    data = buffer_bytes(chunk_bytes, world)
    # the flags live in the buffer itself: torch's signal pad (9 KiB) holds
    # too few for several programs per SM
    buf = symm_mem.empty(data + 4 * signal_slots, dtype=WIRE_DTYPE, device=device)
    hdl = symm_mem.rendezvous(buf, group)
    buf[data:].zero_()
    table = torch.tensor([list(hdl.buffer_ptrs), [p + data for p in hdl.buffer_ptrs]], dtype=torch.int64,
                         device=device)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return SymmBuffers(buf, hdl, table, hdl.rank, chunk_bytes, signal_slots)


def drop_buffers(buffers: SymmBuffers) -> bool:
    """One user fewer of shared ``buffers``; the last one frees them, once
    this device's queued work is done (peers write into a rank's buffer only
    before the barriers its own calls pass, so no peer touches it after its
    last call; their mappings keep the memory until they free theirs).
    True if they were freed; buffers that were not shared are left alone."""
    for key, shared in _BUFFERS.items():
        if shared.buffers is buffers:
            shared.users -= 1
            if shared.users > 0:
                return False
            del _BUFFERS[key]
            if buffers.buffer.is_cuda:
                torch.cuda.synchronize(buffers.buffer.device)
            return True
    return False


def local_buffers(world_size: int, chunk_bytes: int, signal_slots: int,
                  device: torch.device | str) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's buffer and signal pad in this process (one address
    space), for driving the ranks' phases one at a time (``phase=`` 1, 2, 3
    of ``fused_all_reduce``: tests, per-phase timing): ``(table, buffers,
    pads)``; ``table`` is the one every emulated rank passes (it keeps the
    buffers and pads alive: a caller may drop the other two)."""
    bufs = [torch.zeros(buffer_bytes(chunk_bytes, world_size), dtype=WIRE_DTYPE, device=device)
            for _ in range(world_size)]  # flags in separate tensors: every byte of a buffer is data
    pads = [torch.zeros(signal_slots, dtype=torch.int32, device=device) for _ in range(world_size)]
    table = torch.tensor([[b.data_ptr() for b in bufs], [p.data_ptr() for p in pads]], dtype=torch.int64,
                         device=device)
    table.owned = (bufs, pads)  # the table holds raw addresses: it keeps what they point to alive
    return table, bufs, pads


def release_buffers() -> None:
    """Forget every shared buffer (benchmarks, tests): backends built later
    allocate anew; those alive keep theirs until they close."""
    _BUFFERS.clear()


# -- trapped kernels -----------------------------------------------------------------


class TrapWatch:
    """Reports trapped fused kernels as soon as their status word is set.

    The host learns of a trap only as a CUDA error at some later
    synchronisation, often outside Echo; a daemon thread (started with the
    first backend watched) looks at every live backend's status word each
    :data:`TRAP_POLL_S` seconds -- host memory, no CUDA call -- and logs
    each trap once, as an error naming Echo, the phase and the peer."""

    def __init__(self) -> None:
        self._backends: weakref.WeakSet = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, backend: "FusedSymmMemBackend") -> None:
        with self._lock:
            self._backends.add(backend)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="echo-trap-watch", daemon=True)
                self._thread.start()

    def poll(self) -> list[str]:
        """Log (once each) and return the reports of newly trapped backends."""
        with self._lock:
            backends = list(self._backends)
        return [r for r in (b.report_trap() for b in backends) if r is not None]

    def _run(self) -> None:
        while True:
            time.sleep(TRAP_POLL_S)
            self.poll()


#: The process's one watcher.
TRAPS = TrapWatch()


# -- the backend ---------------------------------------------------------------------


class FusedSymmMemBackend(EchoBackend):
    """Echo as one kernel over symmetric memory (see the module docstring).

    ``max_numel``: values per rank of the largest message the buffers hold
    (default: ``config.max_bytes // 2`` when set, else
    :data:`DEFAULT_MAX_NUMEL`); a message fits if its chunks are no larger
    than a one-row message of ``max_numel`` values. ``timeout_s``: how long
    a program waits for a peer before the kernel traps (default
    ``config.timeout_s``, ``--echo-timeout-s``; a value given here replaces
    it in the backend's config, so :class:`EchoConfig` checks it). ``sms``: the SMs
    one rank's persistent grid may fill (default and most: its share of
    the GPU, :func:`sms_for`).
    ``fallback``: runs the messages that do not fit. ``facts``: the
    group's :class:`FusedFacts` (default :func:`probe`, cached per
    transport: built by :func:`~echo_vllm.backends.make_backend`, the facts
    its choice read, with no second collective; built directly, probed
    now); facts :func:`fused_availability` refuses raise ``RuntimeError``
    with its reason. ``buffers``: what the kernel reduces
    through (default: :func:`symm_buffers` of the group, a collective;
    given back by :meth:`close`).
    """

    name = "fused"

    def __init__(
        self,
        config: EchoConfig,
        transport: Transport,
        *,
        max_numel: int | None = None,
        timeout_s: float | None = None,
        sms: int | None = None,
        fallback: EchoBackend | None = None,
        facts: FusedFacts | None = None,
        buffers: SymmBuffers | None = None,
    ):
        if timeout_s is not None:  # an explicit wait wins, checked by EchoConfig's own rule
            config = config.replace(timeout_s=timeout_s)
        super().__init__(config, transport)
        if config.rounding != "nearest":
            raise ValueError("the fused backend rounds to nearest; stochastic rounding runs on 'reference'")
        facts = facts if facts is not None else probe(transport)
        ok, reason = fused_availability(facts)
        if not ok:
            raise RuntimeError(f"the fused backend cannot run here: {reason}")
        self._stages = TritonStages()
        self.fallback = fallback
        self.rank = transport.rank
        self.timeout_ns = config.timeout_ns
        if max_numel is None:
            max_numel = config.max_bytes // 2 if config.max_bytes else DEFAULT_MAX_NUMEL
        p = self.world_size
        self.sms = min(sms or sms_for(facts), sms_for(facts))
        self.sm = sm_limits() if torch.cuda.is_available() else SMLimits()
        slots = signal_slots(self.sms * max_per_sm(), p)
        if buffers is None:
            buffers = symm_buffers(_group(transport), _local_device(),
                                   WireLayout(max_numel, p, config.group_size).chunk_bytes, slots)
        if buffers.signal_slots < slots:
            raise ValueError(f"buffers: {buffers.signal_slots} flags for {self.sms} SMs of programs of {p} ranks")
        self.buffers = buffers
        if self.buffers.rank != self.rank:
            raise RuntimeError(f"symmetric memory says rank {self.buffers.rank}, the transport {self.rank}")
        self._options = functools.lru_cache(maxsize=1024)(self._kernel_options)
        self._norm_tilings = functools.lru_cache(maxsize=1024)(self._norm_tiling)
        self.status = trap_word()
        self._status_word = self.status.numpy()  # read per call: a numpy element costs no torch dispatch
        self._trap_reported = False
        TRAPS.watch(self)

    def trap(self):
        """The :class:`~echo_vllm.kernels.fused_kernel.TrapStatus` a trapped
        kernel of this backend left, or None."""
        word = int(self._status_word[0])
        return decode_trap(word) if word else None

    def trap_error(self) -> str | None:
        """The error text of this backend's trap (Echo, the phase, the peer),
        or None if none of its kernels trapped."""
        if not self._status_word[0]:
            return None
        got = self.trap()
        if got is None:  # a word not written by the kernel
            return f"echo fused all-reduce: unknown status word {int(self._status_word[0]):#x}"
        return got.describe(self.timeout_ns / 1e9)

    def report_trap(self) -> str | None:
        """Log this backend's trap as an error the first time it is seen;
        return its text then (None otherwise)."""
        if self._trap_reported or not self._status_word[0]:
            return None
        self._trap_reported = True
        text = self.trap_error()
        logger.error(text)
        return text

    @property
    def capturable(self) -> bool:
        """Every fitting message is one kernel launch: capturable. Others take
        the fallback, capturable as it is."""
        return self.fallback is None or self.fallback.capturable

    def fits(self, layout: WireLayout) -> bool:
        """Whether ``layout``'s chunks fit the buffers' slots (else the
        fallback runs the message, or :class:`MessageTooLarge`)."""
        return layout.world_size == self.world_size and layout.chunk_bytes <= self.buffers.chunk_bytes

    def _kernel_options(self, layout: WireLayout) -> dict:
        """The keywords of :func:`fused_all_reduce` that a message's layout
        and this backend fix (worked out once per layout)."""
        cfg, b = self.config, self.buffers
        return dict(rank=self.rank, gathered_offset=b.gathered_offset, qmax=cfg.qmax, hadamard=cfg.hadamard,
                    tiling=tiling_for(layout, self.sms, self.sm), timeout_ns=self.timeout_ns, flips=self.flips,
                    sms=self.sms, status=self.status)

    def _norm_tiling(self, layout: WireLayout, norm):
        return tiling_for_norm(layout, norm, self.sms, self.sm)

    def _too_large(self, layout: WireLayout) -> MessageTooLarge:
        return MessageTooLarge(
            f"message of {layout.numel} values ({layout.rows} rows of {layout.cols}, P={layout.world_size}): "
            f"chunks of {layout.chunk_bytes} bytes, the fused buffers hold {self.buffers.chunk_bytes}")

    def _ready(self) -> tuple[EchoConfig, SymmBuffers]:
        """Before a launch: refuse after a trap, claim the buffers' stream."""
        cfg, b = self.config, self.buffers
        if self._status_word[0]:  # an earlier call trapped: the CUDA context is gone
            self.report_trap()
            raise FusedTimeoutError(self.trap_error())
        if not capturing():  # a captured launch runs where its graph is replayed: no host code there
            b.owner.claim(_current_stream(b.buffer.device))
        return cfg, b

    def all_reduce(self, xs, layout, feedback, *, has_incoming, out=None):
        if not self.fits(layout):
            if self.fallback is not None:
                return self.fallback.all_reduce(xs, layout, feedback, has_incoming=has_incoming, out=out)
            raise self._too_large(layout)
        self._ready()
        return fused_all_reduce(xs, feedback, self.buffers.table, layout, has_incoming=has_incoming, out=out,
                                **self._options(layout))

    def compile(self, xs, layout, feedback, *, has_incoming):
        """The fused kernel of this message compiled (a message that does not
        fit: its fallback's business, nothing here)."""
        if self.fits(layout):
            fused_all_reduce(xs, feedback, self.buffers.table, layout, has_incoming=has_incoming, compile_only=True,
                             **self._options(layout))

    def all_reduce_norm(self, xs, layout, feedback, norm, tiling, *, has_incoming):
        """The norm in the kernel's phase 3 (``fused_kernel.fused_all_reduce_norm``)
        when ``tiling`` allows; a message that does not fit goes to the fallback."""
        if tiling is None:
            return super().all_reduce_norm(xs, layout, feedback, norm, tiling, has_incoming=has_incoming)
        if not self.fits(layout):
            if self.fallback is not None:
                return self.fallback.all_reduce_norm(xs, layout, feedback, norm, tiling, has_incoming=has_incoming)
            raise self._too_large(layout)
        cfg, b = self._ready()
        out, res = fused_all_reduce_norm(
            xs, feedback, b.table, layout, norm.weight, norm.eps, residual=norm.residual, rank=self.rank,
            gathered_offset=b.gathered_offset, qmax=cfg.qmax, hadamard=cfg.hadamard, has_incoming=has_incoming,
            tiling=self._norm_tilings(layout, tiling), timeout_ns=self.timeout_ns, flips=self.flips,
            encoder=cfg.encoder, out=norm.out,
            residual_out=norm.residual_out, sms=self.sms, status=self.status,
        )
        shape = norm.residual.shape if norm.residual is not None else (layout.rows, layout.cols)
        return out.view(shape), res.view(shape) if res is not None else None

    def consume(self, xs, layout, feedback):
        return self._stages.consume(xs, feedback, layout, hadamard=self.config.hadamard, flips=self.flips)

    def close(self) -> None:
        """Give the buffers back (the last user of shared ones frees them)
        and close the fallback; the backend cannot run afterwards."""
        if self.buffers is not None:
            drop_buffers(self.buffers)
            self.buffers = None
        if self.fallback is not None:
            self.fallback.close()


def _local_device() -> torch.device:
    """This rank's GPU (a seam for CPU tests)."""
    return torch.device("cuda", torch.cuda.current_device())


__all__ = [
    "DEFAULT_MAX_NUMEL", "FusedFacts", "FusedStreamError", "FusedSymmMemBackend",
    "FusedTimeoutError", "MessageTooLarge", "OVERLAP_ENV", "StreamOwner", "SymmBuffers", "TRAPS", "TRAP_POLL_S",
    "TrapWatch", "drop_buffers", "fused_availability", "fused_support", "probe", "release_buffers", "sms_for",
    "symm_buffers",
]
