"""A faster ``tl.reduce`` for Triton's interpreter, with the same bits.

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


def install() -> None:
    """Make Triton's interpreter reduce with :func:`fold_reduce` (call in the
    interpreter's process; the original stays at ``generic_reduce_loop``)."""
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    if ops.generic_reduce is not fold_reduce:
        ops.generic_reduce_loop = ops.generic_reduce
        ops.generic_reduce = fold_reduce
