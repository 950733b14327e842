"""vLLM plugin entry point (``vllm.general_plugins`` -> ``register``).

vLLM calls ``register()`` in the API server, the engine core and every
worker, before any tensor-parallel group exists. It must be cheap, touch no
CUDA, and be safe to call many times. It only patches two methods of
``GroupCoordinator`` (:mod:`echo_vllm.vllm_glue.hook`); whether Echo runs is
decided later, per engine, from ``--additional-config`` (``tp_comm: echo``).
Installing echo-vllm therefore never changes a run that does not ask for it.

If the hook cannot be installed (vLLM out of range, a method missing, an
exception), a run that asks for Echo must not quietly run vLLM's own
all-reduce instead: ``register()`` then wraps
``EngineArgs.create_engine_config`` so that such an engine fails where its
config is built, naming the reason, while other engines start as usual.
Launchers ask :func:`launch_problem` before starting vLLM.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import threading
from typing import Any

logger = logging.getLogger("echo_vllm")

#: The entry point vLLM loads this plugin by (pyproject.toml), and its group.
ENTRY_POINT = "echo_vllm"
ENTRY_POINT_GROUP = "vllm.general_plugins"

_lock = threading.Lock()
_status: str | None = None
_problem: str | None = None
"""Why the hook is not installed in this process (None: installed, or not tried yet)."""


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


def problem() -> str | None:
    """Why Echo cannot run in this process (None: the hook is installed)."""
    register()
    return _problem


def launch_problem() -> str | None:
    """Why the engine processes vLLM starts from here (engine core,
    workers) would not run Echo: the hook cannot be installed, vLLM would
    not find the plugin's entry point, or ``VLLM_PLUGINS`` leaves it out.
    None: they will. For launchers such as ``echo-vllm serve``."""
    reason = problem()
    if reason is not None:
        return f"the echo-vllm plugin cannot install its hook: {reason}"
    found = [e for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == ENTRY_POINT]
    if not found:
        return (
            f"no {ENTRY_POINT!r} entry point in {ENTRY_POINT_GROUP}, so vLLM's engine and worker "
            "processes would not load the plugin: install the package (pip install 'echo-vllm[vllm]'), "
            "not only its source on PYTHONPATH"
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT not in allowed.split(","):  # vLLM's own parsing
        return f"VLLM_PLUGINS={allowed!r} does not list {ENTRY_POINT!r}, so vLLM would not load the plugin"
    return None


def _install() -> str:
    from . import compat

    version = compat.vllm_version()
    reason = compat.check_version(version)
    if reason is not None:
        return _not_installed(reason)
    try:
        from . import hook

        done = hook.install()
    except Exception as e:  # a broken hook must not stop vLLM runs that do not use Echo
        return _not_installed(f"{type(e).__name__}: {e}", exc_info=True)
    note = " (newer than the versions read; feature checks passed)" if compat.is_untested(version) else ""
    status = f"installed on vLLM {version}{note}: {done}"
    logger.info(
        "echo-vllm plugin %s; Echo runs only with --additional-config '{\"tp_comm\": \"echo\"}'",
        status,
    )
    return status


def _not_installed(reason: str, exc_info: bool = False) -> str:
    global _problem
    _problem = reason
    status = f"not installed: {reason}; {_refuse_echo_engines(reason)}"
    logger.error("echo-vllm plugin %s", status, exc_info=exc_info)
    return status


def _refuse_echo_engines(reason: str) -> str:
    """Wrap ``EngineArgs.create_engine_config`` (where ``LLM``, ``vllm
    serve`` and ``AsyncLLM`` build an engine's config, before any worker
    starts) so that an engine asking for Echo fails there with ``reason``.
    Returns what was done, for the status line."""
    try:
        from . import compat, guards

        cls = compat.engine_args_cls()
    except Exception as e:
        return f"runs asking for tp_comm=echo cannot be refused either ({type(e).__name__}: {e})"
    original = cls.create_engine_config
    if not getattr(original, "_echo_refusal", False):

        @functools.wraps(original)
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            config = original(self, *args, **kwargs)
            guards.check_hook_installed(config, reason)
            return config

        create_engine_config._echo_refusal = True
        cls.create_engine_config = create_engine_config
    return "engines that ask for tp_comm=echo fail at start-up; others run stock vLLM"
