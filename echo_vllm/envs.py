"""Environment variables Echo reads: one table, read when an object is built.

As vLLM's ``vllm.envs``: every variable is listed here with its meaning and
default, and :func:`read` turns the environment into one frozen
:class:`EchoEnv`. Objects read it once, when they are built (a backend, a
kernel launcher), never per call; tools and tests pass their choices as
arguments instead of writing ``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

from .cli_args import UsageError, did_you_mean, env_path_problem, folder_problem

#: ``TRITON_INTERPRET`` values Triton reads as on (3.x ``getenv_bool``: any
#: case, no spaces stripped); every other value is off, for Triton and here.
TRITON_TRUE = frozenset({"1", "true", "on", "yes", "y"})

#: Values of ``ECHO_KERNELS`` (see :attr:`EchoEnv.kernels`).
KERNEL_CHOICES = ("auto", "reference", "triton", "numba")


class EchoEnvError(UsageError):
    """An ``ECHO_*`` environment variable holds a value Echo does not know."""


@dataclass(frozen=True)
class EchoEnv:
    """Echo's environment, parsed."""

    kernels: str = "auto"
    """``ECHO_KERNELS``: which implementation runs a call when the
    configuration says ``backend="auto"`` (in vLLM too): ``auto`` (for CUDA
    tensors the ``fused`` kernel where the group's GPUs are P2P on one host,
    else the Triton stage kernels; torch references elsewhere),
    ``reference``, ``triton`` (also on CPU tensors under
    ``TRITON_INTERPRET=1``) or ``numba`` (fused CPU loops, CPU tensors only;
    ``cpu`` is read as ``numba``). ``fused`` is not a value here: it is
    ``auto``'s choice, or ``EchoConfig.backend``'s."""

    direct_launch: bool = True
    """``ECHO_KERNEL_DIRECT_LAUNCH``: ``0`` launches every kernel through
    Triton's own ``kernel[grid](...)`` path instead of the cached launcher."""

    cache_dir: str | None = None
    """``ECHO_VLLM_CACHE``: where the evaluation keeps models, data and
    downloaded packages (default ``~/.cache/echo-vllm``)."""

    triton_interpret: bool = False
    """``TRITON_INTERPRET`` (Triton's own): ``1`` runs Triton kernels in its
    interpreter, the only way the ``triton`` backend takes CPU tensors;
    read here, as Triton reads it (:data:`TRITON_TRUE`), so that a CPU
    request without it is refused by name."""


#: Environment variable -> field of :class:`EchoEnv`.
VARIABLES = {
    "ECHO_KERNELS": "kernels",
    "ECHO_KERNEL_DIRECT_LAUNCH": "direct_launch",
    "ECHO_VLLM_CACHE": "cache_dir",
    "TRITON_INTERPRET": "triton_interpret",
}


def read(environ: Mapping[str, str] | None = None) -> EchoEnv:
    """Parse the ``ECHO_*`` variables of ``environ`` (default ``os.environ``);
    a value outside its choices, or an ``ECHO_VLLM_CACHE`` that is not a
    folder and cannot be made one, raises :class:`EchoEnvError` naming it."""
    env = os.environ if environ is None else environ
    kernels = env.get("ECHO_KERNELS", "auto").strip().lower() or "auto"
    kernels = "numba" if kernels == "cpu" else kernels
    if kernels not in KERNEL_CHOICES:
        extra = " (fused is EchoConfig.backend's choice, not a value here)" if kernels == "fused" else ""
        raise EchoEnvError(f"ECHO_KERNELS={env['ECHO_KERNELS']!r:.60}: choose one of {', '.join(KERNEL_CHOICES)}"
                           + (extra or did_you_mean(kernels, KERNEL_CHOICES)))
    direct = env.get("ECHO_KERNEL_DIRECT_LAUNCH", "1").strip()
    if direct not in ("0", "1"):
        raise EchoEnvError(f"ECHO_KERNEL_DIRECT_LAUNCH={direct!r:.60}: 0 or 1")
    # the folder checked and used: a quoted ~ (an env file's) would else be a folder named ~ in the cwd
    cache = os.path.expanduser(env["ECHO_VLLM_CACHE"]) if env.get("ECHO_VLLM_CACHE") else None
    # made on first use, mid-run: refuse now what makedirs would fail on (an existing folder is
    # taken as it is, so a read-only prepared cache still serves)
    problem = cache and (env_path_problem(cache) or (folder_problem(cache) if not os.path.isdir(cache) else None))
    if problem:
        raise EchoEnvError(f"ECHO_VLLM_CACHE={cache!r:.60}: {problem}")
    return EchoEnv(kernels=kernels, direct_launch=direct == "1", cache_dir=cache,
                   triton_interpret=env.get("TRITON_INTERPRET", "0").lower() in TRITON_TRUE)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per ``ECHO_*`` variable of ``environ`` that Echo does not
    read, with the closest known name: a typo (``ECHO_KERNEL``) would
    otherwise leave the setting at its default without a word. Warnings,
    not errors: other software may use the prefix too."""
    env = os.environ if environ is None else environ
    return [f"{name} is not a variable echo-vllm reads{did_you_mean(name, VARIABLES) or ''} "
            f"(known: {', '.join(VARIABLES)})"
            for name in sorted(env) if name.startswith("ECHO_") and name not in VARIABLES]


assert set(VARIABLES.values()) == {f.name for f in fields(EchoEnv)}

__all__ = ["EchoEnv", "EchoEnvError", "KERNEL_CHOICES", "VARIABLES", "read", "unknown_variables"]
