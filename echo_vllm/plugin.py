"""vLLM plugin entry point (``vllm.general_plugins``).

Placeholder until the vLLM backend lands: registering does nothing, so that
installing echo-vllm never changes a stock vLLM run by accident.
"""


def register() -> None:
    """Called by vLLM in every process; must stay cheap and touch no CUDA."""
