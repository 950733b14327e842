"""The hook: Echo inside ``GroupCoordinator._all_reduce_out_place``.

Why there: ``tensor_model_parallel_all_reduce`` -> ``GroupCoordinator.all_reduce``
-> (CUDA) the opaque custom op ``torch.ops.vllm.all_reduce`` -> module-level
``all_reduce(tensor, group_name)`` -> ``group._all_reduce_out_place(tensor)``;
on CPU ``all_reduce`` calls ``_all_reduce_out_place`` directly. The method is
the same in vLLM 0.26 and 0.33, is never traced by Dynamo (it sits below the
custom op), runs on every eager call and once per CUDA-graph capture.

Two class-level patches, installed once per process by the plugin:

* ``GroupCoordinator.__init__``: when the group named ``tp`` is created (in
  the worker, inside ``set_current_vllm_config``), read
  ``additional_config``, refuse conflicting engine settings
  (:mod:`.guards`), and attach a :class:`TpEchoSession` to that coordinator
  (or, with ``tp_comm_emulate``, install the one-device emulation);
* ``GroupCoordinator._all_reduce_out_place``: coordinators without a session
  (every other group, and every group when Echo is off) go straight to
  vLLM's method; the TP group's calls go through the session.

Once Echo is active in a process, two more wrappers keep its counters right
under CUDA graphs (:mod:`.tracking` explains why): a per-forward host hook
around the platform's ``set_additional_forward_context``, and one around
Model Runner V2's ``run_fullgraph``, which replays FULL graphs outside any
forward context.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

import torch

from ..capture import capturing
from ..communicator import EchoCommunicator
from ..policy import ECHO_DTYPES, Reason
from ..transport import ProcessGroupTransport, Transport
from . import compat
from .guards import check_engine_config
from .settings import TpCommSettings
from .tracking import ForwardTracker, StepStats, metrics_publisher, tag_forward

logger = logging.getLogger("echo_vllm")

#: The session that ``current_stats`` reports (the last one created).
_ACTIVE: "SessionBase | None" = None

#: Name vLLM gives the tensor-parallel group ("tp:0", "tp:1", ...).
TP_GROUP_NAME = "tp"


class SessionBase:
    """What every Echo session in a process shares: counters and call numbering."""

    comm: EchoCommunicator | None = None
    """The session's communicator (its counters follow reset_stats)."""

    model_note: str | None = None
    """Why the engine's Echo settings were adjusted for this model (e.g.
    16-bit kept on a post-norm model), or None; also logged at start."""

    def __init__(self, settings: TpCommSettings, vllm_config: Any, rank: int):
        self.settings = settings
        self.stats = StepStats()
        self.tracker = ForwardTracker(self.stats, rank=rank, publish=metrics_publisher())
        self.hidden_size = compat.hidden_size(vllm_config)
        """Model hidden size: residual-stream messages are [tokens, hidden]."""
        self.max_num_tokens = compat.max_num_batched_tokens(vllm_config)
        """Largest batch a forward pass carries: sizes the feedback buffer."""
        self._reserved = False

    def flush(self) -> None:
        """Account the passes that have ended (the one-pass lag of replay
        counting): call before reading the counters."""
        self.tracker.settle(running=compat.forward_kwargs())

    def reset_stats(self) -> StepStats:
        """Start fresh counters (keeping the learned call count and the
        captured plans); returns the old ones, settled."""
        self.flush()
        old = self.stats
        self.stats = StepStats(calls_per_forward=old.calls_per_forward)
        self.tracker.stats = self.stats
        if self.comm is not None:
            self.comm.stats = self.stats
        return old

    def is_residual(self, per_rank: torch.Tensor) -> bool:
        return per_rank.dim() == 2 and (
            self.hidden_size is None or per_rank.shape[-1] == self.hidden_size
        )

    def reserve_once(self, comm: EchoCommunicator, per_rank: torch.Tensor) -> None:
        """Allocate the feedback buffer at its largest size -- the largest
        batch times the hidden size -- on the first residual call outside
        graph capture (vLLM's profiling run, so its memory profiler sees the
        buffer). Until then Echo falls back (counted): the communicator never
        grows the buffer on demand."""
        if self._reserved or per_rank.dtype not in ECHO_DTYPES or capturing():
            return
        tokens = max(self.max_num_tokens or 0, per_rank.shape[0])
        comm.reserve(tokens * per_rank.shape[-1])
        self._reserved = True


class TpEchoSession(SessionBase):
    """Echo for one process's tensor-parallel group."""

    def __init__(self, coordinator: Any, settings: TpCommSettings, vllm_config: Any):
        super().__init__(settings, vllm_config, rank=int(getattr(coordinator, "rank_in_group", 0)))
        self.group_name = coordinator.unique_name
        self.transport = make_transport(coordinator)
        self.comm = EchoCommunicator(
            settings.echo, self.transport, device=coordinator.device, stats=self.stats
        )
        self.comm.fixed_capacity = True  # sized once by reserve_once

    def all_reduce(
        self, coordinator: Any, x: torch.Tensor, original: Callable[[Any, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        slot = self.tracker.next_call(compat.forward_kwargs(), x.shape[0] if x.dim() else 0)
        if not x.is_floating_point():  # Echo's exact path adds float errors: not for ints
            self.stats.count("exact", Reason.DTYPE.value, nbytes=x.numel() * x.element_size())
            return original(coordinator, x)
        residual = self.is_residual(x)
        if residual:
            self.reserve_once(self.comm, x)
        return self.comm.all_reduce(
            x,
            slot.index,
            last_call=slot.last_call,
            residual=residual,
            exact_fn=functools.partial(original, coordinator),
        )


def make_transport(coordinator: Any) -> Transport:
    """vLLM's pynccl communicator on CUDA; the group's own process group
    (gloo on CPU) elsewhere."""
    device_comm = getattr(coordinator, "device_communicator", None)
    pynccl = getattr(device_comm, "pynccl_comm", None)
    if pynccl is not None and not getattr(pynccl, "disabled", True):
        from .pynccl_transport import PyncclTransport

        return PyncclTransport(pynccl, coordinator.cpu_group)
    return ProcessGroupTransport(coordinator.device_group)


# ---------------------------------------------------------------------------
# Patches
# ---------------------------------------------------------------------------


def install() -> str:
    """Patch ``GroupCoordinator`` (idempotent). Returns what was done."""
    cls = compat.group_coordinator_cls()
    if getattr(cls, "_echo_originals", None) is not None:
        return "already installed"
    original_init = cls.__init__
    original_ar = cls._all_reduce_out_place

    @functools.wraps(original_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _on_group_created(self)

    @functools.wraps(original_ar)
    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        session = self.__dict__.get("_echo_session")
        if session is None:
            return original_ar(self, input_)
        return session.all_reduce(self, input_, original_ar)

    cls._echo_originals = (original_init, original_ar)
    cls.__init__ = __init__
    cls._all_reduce_out_place = _all_reduce_out_place
    return f"hooked {cls.__name__}._all_reduce_out_place and __init__"


def _on_group_created(coordinator: Any) -> None:
    """Set Echo up for the tensor-parallel group if the engine asks for it."""
    global _ACTIVE
    if str(getattr(coordinator, "unique_name", "")).split(":")[0] != TP_GROUP_NAME:
        return
    # a new TP group starts a new engine in this process: forget the last one
    _ACTIVE = None
    emulation = sys.modules.get(__package__ + ".emulation")
    if emulation is not None:
        emulation.uninstall()
    vllm_config = compat.current_vllm_config()
    if vllm_config is None:
        return
    settings = TpCommSettings.from_vllm_config(vllm_config)
    if not settings.active:
        return
    # the model first: a post-norm model that keeps vLLM's 16-bit all-reduce
    # needs none of Echo's guard rails
    settings, note = settings.for_model(compat.model_architectures(vllm_config),
                                        compat.model_hf_config(vllm_config))
    if note:
        logger.warning("echo: %s", note)
    if not settings.active:
        return
    check_engine_config(vllm_config, settings)
    world = int(coordinator.world_size)
    if settings.emulated:
        from . import emulation

        _ACTIVE = emulation.install(settings, vllm_config)
        logger.info(
            "echo: emulating tensor parallelism %d on one device (%s reduce) %s",
            settings.emulate_world_size,
            settings.mode,
            settings.echo,
        )
    elif world > 1:
        session = TpEchoSession(coordinator, settings, vllm_config)
        coordinator._echo_session = session
        _ACTIVE = session
        logger.info(
            "echo: Echo all-reduce on group %s (world size %d, transport %s) %s",
            coordinator.unique_name,
            world,
            type(session.transport).__name__,
            settings.echo,
        )
    else:
        # nothing to reduce: vLLM runs unchanged; said loudly, since a
        # comparison against it would otherwise look like a perfect result
        logger.warning("echo: tp_comm=echo at tensor-parallel size 1 has no all-reduce to replace: "
                       "vLLM runs unchanged (tp_comm_emulate=P emulates TP=P on one device)")
        return
    _ACTIVE.model_note = note
    install_forward_hook()


def current_session() -> "SessionBase | None":
    return _ACTIVE


def current_stats() -> StepStats | None:
    """This process's Echo counters (None when Echo is not active here)."""
    return _ACTIVE.stats if _ACTIVE is not None else None


# ---------------------------------------------------------------------------
# The per-forward host hook
# ---------------------------------------------------------------------------


def install_forward_hook() -> bool:
    """Wrap ``set_additional_forward_context`` of the platform object
    ``vllm.forward_context`` uses, and Model Runner V2's FULL-graph replay
    (idempotent). False where vLLM lacks the first: counters then miss
    CUDA-graph replays (logged once)."""
    _wrap_fullgraph_replay()
    platform = compat.forward_context_platform()
    original = getattr(platform, "set_additional_forward_context", None)
    if original is None:
        logger.warning(
            "echo: this vLLM has no set_additional_forward_context; Echo still runs, but its "
            "counters do not include CUDA-graph replays"
        )
        return False
    if getattr(original, "_echo_wrapped", False):
        return True

    @functools.wraps(original)
    def set_additional_forward_context(*args: Any, **kwargs: Any) -> dict:
        out = dict(original(*args, **kwargs) or {})
        session = _ACTIVE
        if session is not None:
            tokens, graph = tag_forward(kwargs)
            session.tracker.on_forward_start(out, num_tokens=tokens, cudagraph=graph)
        return out

    set_additional_forward_context._echo_wrapped = True
    # an instance attribute shadows the classmethod for this object only
    platform.set_additional_forward_context = set_additional_forward_context
    return True


def _wrap_fullgraph_replay() -> bool:
    """Model Runner V2 replays FULL graphs (every decode step) with
    ``run_fullgraph`` and no forward context: count each replay there. False
    where this vLLM has no such method (its replays all happen inside
    ``set_forward_context``)."""
    try:
        cls = compat.fullgraph_replay_cls()
    except Exception as e:  # an import error must not stop Echo itself
        logger.warning("echo: counters miss Model Runner V2's FULL-graph replays (%s: %s)",
                       type(e).__name__, e)
        return False
    if cls is None:
        return False
    original = cls.run_fullgraph
    if getattr(original, "_echo_wrapped", False):
        return True

    @functools.wraps(original)
    def run_fullgraph(self: Any, desc: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, desc, *args, **kwargs)
        session = _ACTIVE
        if session is not None:
            session.tracker.on_graph_replay(compat.graph_num_tokens(desc))
        return out

    run_fullgraph._echo_wrapped = True
    cls.run_fullgraph = run_fullgraph
    return True
