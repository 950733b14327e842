"""Launching a compiled Triton kernel without Triton's per-call dispatch.

Why: ``kernel[grid](*args)`` re-derives on every call what only changes
when the arguments' *specialization* changes: it binds the arguments into a
dict, specializes each one, builds and hashes a cache key from them and the
options, builds a launch-metadata dict and calls two (empty) launch-hook
chains. That host time can exceed the kernels' device time on small
messages (BENCHMARKS.md, "Host time of one call"), and vLLM runs prefill batches above its
CUDA-graph sizes eagerly.

How: a :class:`Launcher` wraps one ``@triton.jit`` function. A call it has
not seen goes through Triton's own path, which compiles (or finds) the
kernel and launches it; the launcher keeps the compiled kernel Triton
returns under a key that determines Triton's choice: the current device,
the constexpr values, each pointer's dtype and 16-byte alignment, and the
integer arguments' *values* (Triton specializes integers on ``== 1``,
divisibility by 16 and i32/i64 range, all functions of the value). Equal
keys therefore mean the same compiled kernel. Later calls with that key
call the compiled kernel's launcher directly, with the grid, stream,
function handle, metadata and arguments Triton would pass (pointers as
integers, no hooks). Nothing about the launch itself changes, so the bits,
CUDA-graph capture and stream semantics are Triton's. A new message size
costs one call through Triton's path (no recompilation: Triton finds the
kernel in its own cache); the table is cleared past :data:`MAX_ENTRIES`.

Triton's path is kept whenever the shortcut could differ from it: under
the interpreter (``TRITON_INTERPRET=1``), when a launch hook is installed
(profilers), when a tensor is not on the current device, on Triton
versions whose launch convention was not checked here
(:data:`CHECKED_TRITON`; ``pyproject.toml`` allows older ones, which then
take Triton's path, and CI tests the checked one), and when
``ECHO_KERNEL_DIRECT_LAUNCH=0`` (:mod:`echo_vllm.envs`, read when the
launcher is built).
Compile-time knobs read from the environment (``TRITON_DEBUG``,
instrumentation) are part of Triton's key but not of this one: set them
before the first launch.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, Sequence

import torch

from .. import envs

#: Triton minor versions whose ``CompiledKernel.run`` calling convention
#: (grid, stream, function, packed metadata, launch metadata, enter hook,
#: exit hook, *all kernel arguments) this module was checked against.
CHECKED_TRITON = ("3.6",)

#: Keys kept per kernel before the table is cleared (each distinct message
#: size and buffer set adds one; an entry is three references).
MAX_ENTRIES = 4096


def _triton_support(allowed: bool = True):
    """``(JITFunction, knobs)`` when direct launches are ``allowed`` and
    possible with the installed Triton, else None."""
    if not allowed:
        return None
    try:
        import triton
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except Exception:  # pragma: no cover - depends on the installation
        return None
    if ".".join(triton.__version__.split(".")[:2]) not in CHECKED_TRITON:
        return None
    return JITFunction, knobs


def current_device() -> int:
    """The device Triton launches on (``driver.active.get_current_device``)."""
    return torch.cuda.current_device()


def _public_current_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


#: The raw current stream of a device: the function Triton's CUDA driver
#: uses (~10x cheaper than the public API, which builds a Stream object).
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _public_current_stream)


class Launcher:
    """Launches one ``@triton.jit`` function; see the module docstring.

    The kernel's parameters must be ordered pointers, then integers, then
    constexprs (every Echo kernel is); :meth:`constexprs` orders constexpr
    values by name once per plan, so call sites cannot mix them up.
    """

    def __init__(self, fn: Any, options: dict, *, direct: bool | None = None):
        self.fn = fn
        self.options = dict(options)
        support = _triton_support(envs.read().direct_launch if direct is None else direct)
        self.direct = support is not None and isinstance(fn, support[0])
        if self.direct:
            self._hooks = support[1].runtime
        params = inspect.signature(fn.fn).parameters.values()
        is_constexpr = ["constexpr" in str(p.annotation) for p in params]
        n_const = sum(is_constexpr)
        if is_constexpr != [False] * (len(is_constexpr) - n_const) + [True] * n_const:
            raise TypeError(f"{fn}: constexpr parameters must come last")
        self._constexpr_names = [p.name for p, c in zip(params, is_constexpr) if c]
        self._n_params = len(is_constexpr)
        self._compiled: dict[tuple, tuple] = {}

    def constexprs(self, **values) -> tuple:
        """The constexpr values in the kernel's parameter order."""
        if set(values) != set(self._constexpr_names):
            raise TypeError(f"{self.fn}: constexprs {sorted(values)} != {sorted(self._constexpr_names)}")
        return tuple(values[n] for n in self._constexpr_names)

    @property
    def compiled_variants(self) -> int:
        """Specializations launched directly so far (for tests and reports)."""
        return len(self._compiled)

    def compile(self, grid: Sequence[int], tensors: Sequence[torch.Tensor], ints: Sequence[int],
                constexprs: tuple) -> Any:
        """The compiled kernel (a ``CompiledKernel``, loaded: ``n_regs``,
        ``n_spills``, ``metadata.shared``) that these arguments launch, compiled
        if needed and cached where the launch will find it; launches nothing."""
        kernel = self.fn.warmup(*tensors, *ints, *constexprs, grid=tuple(grid), **self.options)
        if hasattr(kernel, "result"):  # asynchronous compilation
            kernel = kernel.result()
        kernel._init_handles()
        return kernel

    def __call__(
        self, grid: Sequence[int], tensors: Sequence[torch.Tensor], ints: Sequence[int], constexprs: tuple
    ) -> None:
        """Launch on the current stream: ``fn[grid](*tensors, *ints, *constexprs)``."""
        key = None
        hooks = self._hooks if self.direct else None
        if hooks is not None and not (hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls):
            device = current_device()
            ptrs, facts = [], [device, constexprs]
            for t in tensors:
                if t.get_device() != device:
                    break
                ptrs.append(t.data_ptr())
                facts += (t.dtype, ptrs[-1] & 15 == 0)
            else:
                key = (*facts, *ints)
                hit = self._compiled.get(key)
                if hit is not None:
                    run, function, metadata = hit
                    run(grid[0], grid[1], grid[2], current_stream(device), function, metadata, None, None, None,
                        *ptrs, *ints, *constexprs)
                    return
        if len(tensors) + len(ints) + len(constexprs) != self._n_params:
            raise TypeError(f"{self.fn}: {len(tensors)} + {len(ints)} + {len(constexprs)} arguments "
                            f"for {self._n_params} parameters")
        kernel = self.fn[tuple(grid)](*tensors, *ints, *constexprs, **self.options)
        if key is not None and kernel is not None:
            if hasattr(kernel, "result"):  # asynchronous compilation
                kernel = kernel.result()
            if len(self._compiled) >= MAX_ENTRIES:
                self._compiled.clear()
            self._compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata)


class LaunchPlan(NamedTuple):
    """What one launch needs that depends only on the shapes and the static
    options, computed once per distinct call (each kernel's wrapper caches
    its plans with ``functools.lru_cache``) so that an eager call does no
    arithmetic on the layout and builds no dicts."""

    launcher: Launcher
    grid: tuple[int, int, int]
    ints: tuple[int, ...]
    """Layout-derived integer arguments (which ones: see each wrapper)."""
    constexprs: tuple
    """The kernel's constexpr values, in parameter order."""
    wire_shape: tuple[int, ...] = ()
    """Shape of the wire buffer the kernel writes (stages 1, 2) or reads
    (output kernels); ``()`` for the others."""
