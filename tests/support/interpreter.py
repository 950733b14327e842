"""Triton's interpreter, faster, with the same bits: the kernel tests'
interpreter worker runs with :func:`install` (a ``tl.reduce`` that folds a
slice at a time, and ``triton.language`` patched once per kernel,
:class:`_Patched`).

Triton's interpreter runs a reduction whose combine function it does not
recognise (``ReduceOps.generic_reduce``; here ``tile.group_amax``'s
NaN-propagating max) one element at a time: a Python call of the combine
function per value, most of a kernel test's time. :func:`fold_reduce` folds
the same way -- left to right along the axis, each step's result stored in
the input's dtype before the next step, as ``generic_reduce`` does -- but
one slice of the axis at a time, applying the combine function to all
output positions at once (combine functions are elementwise). Every output
element sees the same operands in the same order, so the results are the
same bits (``tests/kernels/test_interpreter.py`` checks it against
Triton's own loop).
"""

from __future__ import annotations

import numpy as np


def fold_reduce(self, input):
    """``ReduceOps.generic_reduce``, vectorized over the output positions."""
    import triton.language as tl

    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    data = [arg.handle.data for arg in input]
    shape = data[0].shape
    out_shape = shape[:axis] + shape[axis + 1:]
    size = int(np.prod(out_shape))

    def fold_step(values, j):
        # what generic_reduce stores: the step's result in the input's dtype
        v = np.asarray(values.handle.data if isinstance(values, tl.core.tensor) else values)
        v = v.reshape(out_shape) if v.size == size else np.broadcast_to(v, out_shape)  # () arrives as (1,)
        return v.astype(data[j].dtype)

    acc = [np.take(d, 0, axis=axis).astype(d.dtype) for d in data]
    for k in range(1, shape[axis]):
        args = [self.to_tensor(a, input[j].dtype) for j, a in enumerate(acc)]
        args += [self.to_tensor(np.take(d, k, axis=axis), input[j].dtype) for j, d in enumerate(data)]
        ret = self.combine_fn.fn(*args)
        ret = ret if isinstance(ret, tuple) else (ret,)
        acc = [fold_step(r, j) for j, r in enumerate(ret)]
    out = []
    for j, a in enumerate(acc):
        a = np.asarray(a).reshape(out_shape)
        if self.keep_dims:
            if original_axis is not None:
                a = np.expand_dims(a, axis)
            else:
                for _ in range(len(shape)):
                    a = np.expand_dims(a, 0)
        elif original_axis is None:
            a = a.item()
        out.append(self.to_tensor(a, input[j].dtype))
    return out


class _Patched:
    """What the running kernel has patched: ``_patch_lang`` without its
    repeats. Triton's interpreter patches ``triton.language`` (every builtin
    bound to its builder, ``tl.reduce`` and the like) when a kernel starts,
    restores it when the kernel ends, and patches it again -- the same
    modules, with equivalent functions, never restored -- at every call of
    a ``@triton.jit`` function inside the kernel: a scan of each module's
    members per call, ~40% of a kernel test's time. A call whose modules
    the running kernel patched already is left as it is; any other call
    (the kernel's own, a function that sees other modules) patches as
    Triton does."""

    def __init__(self, patch_lang):
        self.patch_lang = patch_lang
        self.running: list[frozenset[int]] = []  # modules the running kernel patched

    def __call__(self, fn):
        from triton.runtime import interpreter

        langs = frozenset(id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core)
        if self.running:  # a call inside the kernel
            return _NOTHING if langs <= self.running[-1] else self.patch_lang(fn)
        scope = self.patch_lang(fn)  # the kernel's: restored when it ends
        self.running.append(langs)
        restore = scope.restore

        def restore_and_end():
            self.running.pop()
            restore()

        scope.restore = restore_and_end
        return scope


class _Nothing:
    def restore(self) -> None:
        pass


_NOTHING = _Nothing()


def install() -> None:
    """Make Triton's interpreter reduce with :func:`fold_reduce` and patch
    the language once per kernel (:class:`_Patched`). Call in the
    interpreter's process; the originals stay at ``ReduceOps.generic_reduce_loop``
    and ``_Patched.patch_lang``."""
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    if ops.generic_reduce is not fold_reduce:
        ops.generic_reduce_loop = ops.generic_reduce
        ops.generic_reduce = fold_reduce
    if not isinstance(interpreter._patch_lang, _Patched):
        interpreter._patch_lang = _Patched(interpreter._patch_lang)
