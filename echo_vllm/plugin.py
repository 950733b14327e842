"""vLLM plugin entry point (``vllm.general_plugins`` -> ``register``).

vLLM calls ``register()`` in the API server, the engine core and every
worker, before any tensor-parallel group exists. It must be cheap, touch no
CUDA, and be safe to call many times. It only patches two methods of
``GroupCoordinator`` (:mod:`echo_vllm.vllm_glue.hook`); whether Echo runs is
decided later, per engine, from ``--additional-config`` (``tp_comm: echo``).
Installing echo-vllm therefore never changes a run that does not ask for it.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("echo_vllm")

_lock = threading.Lock()
_status: str | None = None


def _ensure_log_handler() -> None:
    """vLLM configures only its own ``vllm`` loggers; give ours a handler so
    that what the plugin did (and every fallback reason) shows in its logs."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [echo_vllm] %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def register() -> str:
    """Install the Echo hook once per process; return (and log once) what was done."""
    global _status
    with _lock:
        if _status is not None:
            return _status
        _ensure_log_handler()
        _status = _install()
        return _status


def _install() -> str:
    from .vllm_glue import compat

    version = compat.vllm_version()
    problem = compat.check_version(version)
    if problem is not None:
        status = f"not installed: {problem}; tp_comm=echo would be ignored"
        logger.error("echo-vllm plugin %s", status)
        return status
    try:
        from .vllm_glue import hook

        done = hook.install()
    except Exception as e:  # a broken hook must not stop vLLM runs that do not use Echo
        status = f"not installed: {type(e).__name__}: {e}; tp_comm=echo would be ignored"
        logger.exception("echo-vllm plugin %s", status)
        return status
    note = " (newer than the versions read; feature checks passed)" if compat.is_untested(version) else ""
    status = f"installed on vLLM {version}{note}: {done}"
    logger.info(
        "echo-vllm plugin %s; Echo runs only with --additional-config '{\"tp_comm\": \"echo\"}'",
        status,
    )
    return status
