"""The kernel tests' interpreter (``support.interpreter``, installed in the
interpreter worker).

``fold_reduce``, which runs instead of Triton's element-by-element
``ReduceOps.generic_reduce``, gives that loop's bits.

Each reduction runs both ways in the interpreter worker, on values that
tell folds apart (NaN, infinities, signed zeros, subnormals, magnitudes
from 1e-42 to 3e38; fp16 sums that round at every step; a tuple combine
that keeps the first of equal maxima), over every axis and the whole
tensor, with and without ``keep_dims``; the results are compared as
integers (NaN payloads included). The kernels' one such reduction is
``tile.group_amax`` (its NaN-propagating max, over axes 2 and 1).

``triton.language`` is patched once per kernel: the calls inside it leave
it as it is, and it is back to Triton's own when the kernel ends.
"""

from __future__ import annotations

import pytest
from test_kernels import CUDA, in_kernel_process

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(CUDA, reason="the interpreter's reduction; a CUDA host compiles the kernels")


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _first_max(a, ia, b, ib):
    later = b > a
    return tl.where(later, b, a), tl.where(later, ib, ia)


@triton.jit
def _twice(x):
    return _add(x, x)


@triton.jit
def _nested_kernel(x_ptr, y_ptr, N: tl.constexpr):
    """``y[0] = sum(4 * x[:N])`` (``y`` holds one value: one store)."""
    total = tl.reduce(_twice(_twice(tl.load(x_ptr + tl.arange(0, N)))), 0, _add, keep_dims=True)
    tl.store(y_ptr + tl.arange(0, 1), total)


def _reduce(impl, combine, inputs, axis, keep_dims):
    """``tl.reduce`` of ``inputs`` (numpy arrays with their Triton dtypes)
    through ``impl`` as the interpreter's generic reduction: numpy arrays."""
    from triton.runtime import interpreter

    tensors = tuple(tl.core.tensor(interpreter.TensorHandle(a, dt), tl.block_type(dt, list(a.shape)))
                    for a, dt in inputs)
    ops = interpreter.ReduceOps
    saved = ops.generic_reduce
    ops.generic_reduce = impl
    scope = interpreter._patch_lang(combine.fn)  # the combine's tl calls, on the interpreter's builder
    try:
        out = ops(axis, combine, keep_dims).apply(tensors)
    finally:
        scope.restore()
        ops.generic_reduce = saved
    return [o.handle.data for o in out]


def _fold_against_loop() -> int:
    import numpy as np
    from triton.runtime import interpreter

    from echo_vllm.kernels import tile
    from support.interpreter import fold_reduce

    assert interpreter.ReduceOps.generic_reduce is fold_reduce  # the worker runs with it installed

    rng = np.random.default_rng(7)
    shape = (4, 2, 8)  # block shapes are powers of 2
    x = (rng.standard_normal(shape) * np.exp(8 * rng.standard_normal(shape))).astype(np.float32)
    x.flat[[0, 5, 17, 30, 40, 41, 42, 43, 60]] = [np.nan, np.inf, -np.inf, -0.0, 1e-42, -1e-40, 0.0, 3e38, -np.nan]
    x.flat[50:53] = 3.0e38  # equal maxima: the first one's index must win
    h = (300 * rng.standard_normal(shape)).astype(np.float16)  # fp16 sums round at every step
    h.flat[[3, 33]] = [np.nan, -0.0]
    idx = np.arange(x.size, dtype=np.int32).reshape(shape)
    cases = [
        (tile.nan_max, [(np.abs(x), tl.float32)]),  # tile.group_amax's combine
        (_add, [(h, tl.float16)]),
        (_first_max, [(x, tl.float32), (idx, tl.int32)]),
    ]
    checked = 0
    for combine, inputs in cases:
        # (Triton's loop cannot reduce a tuple over the whole tensor: its
        # ``unravel`` flattens the first operand only. No kernel does that.)
        for axis in (0, 1, 2, None) if len(inputs) == 1 else (0, 1, 2):
            for keep_dims in (False, True):
                want = _reduce(interpreter.ReduceOps.generic_reduce_loop, combine, inputs, axis, keep_dims)
                got = _reduce(fold_reduce, combine, inputs, axis, keep_dims)
                for w, g in zip(want, got):
                    assert g.dtype == w.dtype and g.shape == w.shape, (combine, axis, keep_dims, g.shape, w.shape)
                    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[w.dtype.itemsize]
                    assert np.array_equal(g.view(bits), w.view(bits)), (combine, axis, keep_dims, g, w)
                checked += 1
    return checked


def test_fold_reduce_gives_the_bits_of_tritons_loop():
    assert in_kernel_process(_fold_against_loop) == (4 + 4 + 3) * 2


def _patched_once_per_kernel() -> tuple[int, float]:
    import torch
    from triton.runtime import interpreter

    from support.interpreter import _Patched

    patch = interpreter._patch_lang
    assert isinstance(patch, _Patched)
    names = ("load", "store", "reduce", "arange", "where", "maximum")
    before = {n: getattr(tl, n) for n in names}
    calls = []
    original = patch.patch_lang
    patch.patch_lang = lambda fn: calls.append(fn.__name__) or original(fn)
    try:
        x, y = torch.arange(8, dtype=torch.float32), torch.zeros(2)
        _nested_kernel[(1,)](x, y, N=8)
        assert float(y[1]) == 0.0  # nothing written past y[0]
    finally:
        patch.patch_lang = original
    assert {n: getattr(tl, n) for n in names} == before and not patch.running  # Triton's own again
    return len(calls), float(y[0])


def test_the_language_is_patched_once_per_kernel_and_restored():
    """Four calls of ``@triton.jit`` functions inside the kernel (two
    ``_twice``, two ``_add``; Triton alone patches five times), one patch;
    the kernel computes what it says (4 * (0 + ... + 7))."""
    assert in_kernel_process(_patched_once_per_kernel) == (1, 4 * 28.0)
