"""Whether the current CUDA stream is capturing a graph.

Work that must not be recorded into a CUDA graph asks here: growing a
buffer (an allocation a replay would not repeat), the once-per-shape rank
handshake (a host sync), counting calls (a replay runs no Python), drawing
stochastic-rounding noise (a replay would reuse the captured draw). One
function, so that the CPU tests' stand-in
(``tests/support/vllm_graphs.py``: ``capture``) reaches every such check.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once per process: it reads the
    environment and the driver on each call (about a tenth of a call's host
    time above the backend), and its answer does not change while a process
    lives. A forked child inherits the answer with the parent's devices; a
    spawned one asks again."""
    return torch.cuda.is_available()


def capturing() -> bool:
    return cuda_available() and torch.cuda.is_current_stream_capturing()
