#!/usr/bin/env python3
"""Experiment: does a Hadamard rotation wider than the quantization group help?

Runs ``echo-vllm eval perplexity`` with every emulated all-reduce wrapped in
an orthonormal Walsh-Hadamard rotation over blocks of ``XROT`` values of the
hidden dimension (applied to each rank's partial before Echo, undone after;
the sum commutes with it), for variants whose own per-group Hadamard is off
(``...:hadamard=false``). ``XROT=32`` with g=32 reproduces Echo's own rotation
(up to one bf16 rounding of the rotated input) and is the control.

    XROT=128 python scripts/experiments/wide_hadamard.py --model qwen2.5-coder-1.5b --tp 4 \\
        --dtype float32 --texts hamlet --variants exact default:hadamard=false --out /tmp/x --stem xrot

Result (EVAL.md, "Dropped ideas worth knowing"): no gain from 128 or 512 over 32 on Qwen2.5-1.5B.
"""

import os
import sys

from echo_vllm import emulation
from echo_vllm.rotation import hadamard_orthonormal

BLOCK = int(os.environ.get("XROT", "128"))
_reduce = emulation.EmulatedTP.reduce


def _rotate(x):
    shape = x.shape
    return hadamard_orthonormal(x.float().reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)).reshape(shape)


def _reduce_rotated(self, partials, slot=None):
    if self.mode != "echo" or self.config.hadamard:
        return _reduce(self, partials, slot)
    if partials.shape[-1] % BLOCK:  # never skip silently: the run would measure Echo without rotation
        raise SystemExit(f"XROT={BLOCK} does not divide the hidden size {partials.shape[-1]}")
    y = _reduce(self, _rotate(partials).to(partials.dtype), slot)
    return _rotate(y).to(y.dtype)  # the orthonormal Hadamard is its own inverse


if __name__ == "__main__":
    emulation.EmulatedTP.reduce = _reduce_rotated
    from echo_vllm.eval import perplexity

    sys.exit(perplexity.main(sys.argv[1:]))
