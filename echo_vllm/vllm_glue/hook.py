"""The patches: Echo inside ``GroupCoordinator._all_reduce_out_place``.

Why there: ``tensor_model_parallel_all_reduce`` -> ``GroupCoordinator.all_reduce``
-> (CUDA) the opaque custom op ``torch.ops.vllm.all_reduce`` -> module-level
``all_reduce(tensor, group_name)`` -> ``group._all_reduce_out_place(tensor)``;
on CPU ``all_reduce`` calls ``_all_reduce_out_place`` directly. The method is
the same in vLLM 0.26 and 0.33, is never traced by Dynamo (it sits below the
custom op), runs on every eager call and once per CUDA-graph capture.

This module only installs patches (idempotent); each is a thin adapter:

* ``GroupCoordinator.__init__`` -> :func:`.startup.on_group_created` (the TP
  group of an engine that asks for Echo gets a
  :class:`~echo_vllm.communicator.EchoCommunicator`, or the emulation starts);
* ``GroupCoordinator._all_reduce_out_place`` -> the group's
  ``EchoCommunicator.all_reduce`` when it has one, vLLM's method otherwise;
* the platform's ``set_additional_forward_context`` (every forward pass) and
  Model Runner V2's ``run_fullgraph`` (FULL-graph replays outside any
  forward context) -> the current session's tracker, which keeps the
  counters right under CUDA graphs (:mod:`.tracking`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from . import compat, session, startup
from .tracking import tag_forward

logger = logging.getLogger("echo_vllm")


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
        startup.on_group_created(self, original_ar)
        if session.current() is not None:
            install_forward_hook()

    @functools.wraps(original_ar)
    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        comm = self.__dict__.get("_echo_comm")
        if comm is None or comm.disabled:
            return original_ar(self, input_)
        return comm.all_reduce(input_)

    cls._echo_originals = (original_init, original_ar)
    cls.__init__ = __init__
    cls._all_reduce_out_place = _all_reduce_out_place
    return f"hooked {cls.__name__}._all_reduce_out_place and __init__"


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
        active = session.current()
        if active is not None:
            tokens, graph = tag_forward(kwargs)
            active.tracker.on_forward_start(out, num_tokens=tokens, cudagraph=graph)
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
        active = session.current()
        if active is not None:
            active.tracker.on_graph_replay(compat.graph_num_tokens(desc))
        return out

    run_fullgraph._echo_wrapped = True
    cls.run_fullgraph = run_fullgraph
    return True
