"""vLLM 0.26's CUDA-graph capture and replay, as Echo's glue sees them, on CPU.

A replayed graph runs no Python, so Echo's counters learn what it did only
from the calls vLLM makes around the replay. These helpers make exactly
those calls on a machine without CUDA, for tests of the accounting:

* :func:`capture` -- inside it ``torch.cuda.is_current_stream_capturing()``
  is true (every capture check in echo_vllm reads it), as in
  ``torch.cuda.graph``: the model's Python runs, nothing counts as executed;
* :func:`forward` -- ``set_forward_context`` as a model runner opens it: an
  eager or compiled pass (``NONE``), a ``PIECEWISE`` graph, or the V1
  runner's ``FULL`` graph (batch descriptor of the padded size); ``run``
  executes the model inside, or is None for a replay (no Python ran);
* :func:`replay_full_v2` -- Model Runner V2 (the default for dense models
  in 0.26) replays a FULL graph through ``ModelCudaGraphManager.run_fullgraph``
  with no forward context at all.

Call them inside ``set_current_vllm_config`` of the engine's config.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator
from unittest import mock

import torch

#: Runtime modes :func:`forward` accepts (``CUDAGraphMode`` member names).
MODES = ("NONE", "PIECEWISE", "FULL")


@contextmanager
def capture() -> Iterator[None]:
    """Pretend the current stream is capturing a CUDA graph."""
    with mock.patch("echo_vllm.capture.cuda_available", return_value=True), mock.patch(
        "torch.cuda.is_current_stream_capturing", return_value=True
    ):
        yield


def forward(cfg: Any, num_tokens: int, mode: str = "NONE", run: Callable[[], Any] | None = None) -> Any:
    """One forward pass of ``num_tokens`` (padded) tokens in runtime ``mode``."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, set_forward_context

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    cg_mode = CUDAGraphMode[mode]
    desc = None
    if mode == "PIECEWISE":
        desc = BatchDescriptor(num_tokens=num_tokens)
    elif mode == "FULL":  # uniform decode batch, one token per request
        desc = BatchDescriptor(num_tokens=num_tokens, num_reqs=num_tokens, uniform=True)
    with set_forward_context(
        None, cfg, num_tokens=num_tokens, cudagraph_runtime_mode=cg_mode, batch_descriptor=desc
    ):
        return run() if run is not None else None


class _Graph:
    """Stands in for a captured ``torch.cuda.CUDAGraph``."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def replay_full_v2(num_tokens: int, hidden_size: int = 1) -> None:
    """Replay the FULL graph of ``num_tokens`` the way Model Runner V2 does:
    vLLM's own ``run_fullgraph`` on a manager holding that one graph."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, ModelCudaGraphManager

    desc = BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL, num_tokens=num_tokens, num_reqs=num_tokens, uniform_token_count=1
    )
    graph = _Graph()
    manager = ModelCudaGraphManager.__new__(ModelCudaGraphManager)  # only what run_fullgraph reads
    manager.graphs = {desc: graph}
    manager.is_last_pp_rank = True
    manager.use_aux_hidden_state_outputs = False
    manager.hidden_states = torch.zeros(num_tokens, hidden_size)
    manager.run_fullgraph(desc)
    if graph.replays != 1:
        raise AssertionError("run_fullgraph did not replay the graph")


#: A serving window after start-up: (padded tokens, how the pass runs).
#: "eager" executes the model; the others replay a captured graph.
SERVING = (
    (5, "eager"),
    (4, "full_v2"), (4, "full_v2"), (4, "full_v2"),
    (8, "piecewise"), (8, "piecewise"),
    (2, "full_v1"),
    (4, "full_v2"),
    (8, "piecewise"),  # the last pass: only flush() accounts it
)


def capture_like_vllm(cfg: Any, run: Callable[[int], Any]) -> None:
    """Start-up of a FULL_AND_PIECEWISE engine with capture sizes 2, 4, 8:
    the profiling run, then per size a warm-up pass and the captured one --
    a PIECEWISE graph (8), a V2 FULL graph (4: captured inside a context of
    mode NONE), a V1 FULL graph (2). ``run(n)`` runs the model on n tokens."""
    forward(cfg, 8, "NONE", lambda: run(8))  # profiling run
    for tokens, mode in ((8, "PIECEWISE"), (4, "NONE"), (2, "FULL")):
        forward(cfg, tokens, "NONE", lambda: run(tokens))  # warm-up
        with capture():
            forward(cfg, tokens, mode, lambda: run(tokens))


def serve_window(cfg: Any, run: Callable[[int], Any], *, replay: bool = True) -> None:
    """The :data:`SERVING` passes: replayed as vLLM does (``replay=True``),
    or all executed eagerly (the reference their counters must equal)."""
    for tokens, how in SERVING:
        if how == "eager" or not replay:
            forward(cfg, tokens, "NONE", lambda: run(tokens))
        elif how == "full_v2":
            replay_full_v2(tokens)
        else:
            forward(cfg, tokens, "PIECEWISE" if how == "piecewise" else "FULL")


def replay_accounting(session: Any, cfg: Any, run: Callable[[int], Any]) -> dict:
    """Capture, then the serving window replayed and executed, each between
    ``session.reset_stats()`` and ``session.flush()``; the two snapshots."""
    capture_like_vllm(cfg, run)
    out = {}
    for label, replay in (("replayed", True), ("executed", False)):
        session.reset_stats()
        serve_window(cfg, run, replay=replay)
        session.flush()
        out[label] = session.stats.snapshot()
    return out


def accounting_problems(snapshots: dict, calls_per_forward: int) -> list[str]:
    """What is wrong with :func:`replay_accounting`'s snapshots (empty: the
    replayed window counts exactly what executing it counted)."""
    replayed, executed = snapshots["replayed"], snapshots["executed"]
    n_replays = sum(how != "eager" for _, how in SERVING)
    want = {
        ("replayed", "forwards_replayed"): n_replays,
        ("replayed", "forwards_observed"): len(SERVING) - n_replays,
        ("executed", "forwards_replayed"): 0,
        ("executed", "forwards_observed"): len(SERVING),
    }
    for label, snap in snapshots.items():
        want[(label, "calls_per_forward")] = calls_per_forward
        want[(label, "forwards_mismatched")] = 0
        want[(label, "total calls")] = len(SERVING) * calls_per_forward
    problems = []
    for (label, key), value in want.items():
        snap = snapshots[label]
        got = sum(snap["calls"].values()) if key == "total calls" else snap.get(key)
        if got != value:
            problems.append(f"{label} {key}: {got}, expected {value}")
    for key in ("calls", "wire_bytes", "equiv_16bit_bytes", "exact_bytes"):
        if replayed[key] != executed[key]:
            problems.append(f"{key}: replayed {replayed[key]} != executed {executed[key]}")
    return problems
