"""Whether the current CUDA stream is capturing a graph.

Work that must not be recorded into a CUDA graph asks here: growing a
buffer (an allocation a replay would not repeat), the once-per-shape rank
handshake (a host sync), counting calls (a replay runs no Python), drawing
stochastic-rounding noise (a replay would reuse the captured draw). One
function, so that the CPU tests' stand-in
(``tests/support/vllm_graphs.py``: ``capture``) reaches every such check.
"""

from __future__ import annotations

import torch


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
