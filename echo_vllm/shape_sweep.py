"""The shape sweep: every backend against the plain-torch reference, bit for bit.

Why a sweep and not a few "awkward" shapes: the compiled kernels specialize
on their integer arguments (Triton treats an argument equal to 1 as a
constant and tracks divisibility by 16), so a width, a row count or a rank
count that is special to the compiler can take code no other shape takes --
a row of width 1 came out about 3x the true sum from the compiled stage
kernels, while Triton's interpreter (which specializes nothing) was right.
So the sweep covers widths below, at and above one group (1-70, 127-129,
and a few large ones), rows 1-9 and odd counts, P = 2, 3, 4, 8, bf16 / fp16 /
fp32 inputs, bf16 and int8 feedback or none, every group size, and values that are
random, zero, huge, tiny (the dtype's subnormals) or non-finite, with and
without a feedback buffer, and every width again quantizing with
signed_mse (``EchoConfig.encoder``), each case a
chain of :data:`CALLS` calls with the error carried.

One case is run by :func:`run_case` through Echo's 4-bit path
(``EchoCommunicator.all_reduce(path=Path.ECHO)`` with a feedback chain) on a chosen
``backend`` (composed Triton stages, fused, numba, reference) and compared with
:func:`reference_outputs` by :func:`differences`; the GPU tests
(``tests/kernels/test_shape_sweep.py``), their interpreter twin in CI and
``scripts/gpu_fused_check.py --sweep`` (the fused kernel over P processes on
one GPU) all take their cases from :func:`cases`.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from .config import ENCODERS, EchoConfig
from .quant import SUPPORTED_GROUP_SIZES

#: Calls per case: the first starts clean, the next two carry the error.
CALLS = 3
WORLD_SIZES = (2, 3, 4, 8)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The carried error's storage (``none``: no feedback, naive 4-bit: no buffer in the kernels).
FEEDBACK_DTYPES = {"bf16": "bfloat16", "int8": "int8", "none": None}
VALUE_KINDS = ("random", "zeros", "huge", "tiny", "nonfinite")
#: Widths below, at and above one group of every size, and a few model-sized rows.
WIDTHS = (*range(1, 71), 127, 128, 129, 1000, 4096, 5123)
#: Widths that get every P x input dtype x feedback dtype (the rest rotate through them).
NARROW_WIDTHS = (1, 2, 3, 31, 32, 33)
#: Widths the fused kernel over P processes runs (it compiles per process and
#: shape class, so it takes the width-1 cases, one group and its neighbours,
#: and every 9th width, not all of them).
FUSED_WIDTHS = (1, 2, 33, 129, 5123)
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 17, 33)


@dataclasses.dataclass(frozen=True)
class SweepCase:
    rows: int
    cols: int
    world_size: int
    dtype: str
    """Input and output dtype, a key of :data:`DTYPES`."""
    feedback_dtype: str
    """A key of :data:`FEEDBACK_DTYPES`."""
    values: str
    """One of :data:`VALUE_KINDS`."""
    group_size: int = 32
    hadamard: bool = True
    seed: int = 0
    encoder: str = "absmax"
    """One of ``config.ENCODERS``."""

    @property
    def label(self) -> str:
        return (f"{self.rows}x{self.cols}-P{self.world_size}-{self.dtype}-fb{self.feedback_dtype}-{self.values}"
                f"-g{self.group_size}{'' if self.hadamard else '-norot'}"
                f"{'' if self.encoder == 'absmax' else '-' + self.encoder}")

    def config(self, backend: str) -> EchoConfig:
        """Every call of the chain takes Echo's 4-bit path (no size gate, no exact calls)."""
        storage = FEEDBACK_DTYPES[self.feedback_dtype]
        return EchoConfig(group_size=self.group_size, hadamard=self.hadamard, min_bytes=0, first_exact_calls=0,
                          exact_last_call=False, feedback=storage is not None, feedback_dtype=storage or "bfloat16",
                          health_every=0, backend=backend, encoder=self.encoder)


def cases(scale: str = "gpu") -> list[SweepCase]:
    """The sweep's cases. ``gpu``: every width of :data:`WIDTHS` with the other
    axes rotating through their values (every group size and rotation on),
    plus the full product P x input x feedback (bf16, int8) for
    :data:`NARROW_WIDTHS`, every value kind for width 1 and narrow rows
    without a feedback buffer; then every width and every value kind of
    width 1 again with the other encoders (the axes rotating from another
    point). ``fused``: the part of ``gpu`` the fused kernel
    runs over P processes (:data:`FUSED_WIDTHS`, every 9th width).
    ``interpreter``: the few that Triton's
    interpreter can afford on CI's two cores (width 1 and neighbours of one
    group, each axis value at least once)."""
    out = []
    if scale == "gpu":
        kinds = itertools.cycle(VALUE_KINDS)
        for i, cols in enumerate(WIDTHS):
            out.append(SweepCase(
                rows=ROW_COUNTS[i % len(ROW_COUNTS)] if cols < 1000 else 1 + i % 3, cols=cols,
                world_size=WORLD_SIZES[i % 4], dtype=tuple(DTYPES)[i % 3],
                feedback_dtype=tuple(FEEDBACK_DTYPES)[(i // 4) % 3], values=next(kinds),
                group_size=SUPPORTED_GROUP_SIZES[(i // 2) % len(SUPPORTED_GROUP_SIZES)],
                hadamard=i % 7 != 6, seed=i))
        for j, (cols, p, dt, fb) in enumerate(itertools.product(NARROW_WIDTHS, WORLD_SIZES, DTYPES, ("bf16", "int8"))):
            out.append(SweepCase(rows=(1, 2, 4, 5)[j % 4], cols=cols, world_size=p, dtype=dt, feedback_dtype=fb,
                                 values=VALUE_KINDS[j % len(VALUE_KINDS)], seed=1000 + j))
        for k, kind in enumerate(VALUE_KINDS):
            out.append(SweepCase(rows=3, cols=1, world_size=4, dtype="bf16", feedback_dtype="bf16", values=kind,
                                 seed=2000 + k))
        for k, (p, dt) in enumerate(zip(WORLD_SIZES, ("bf16", "fp16", "bf16", "fp16"))):  # no feedback buffer
            out.append(SweepCase(rows=2, cols=(1, 3, 33, 70)[k], world_size=p, dtype=dt, feedback_dtype="none",
                                 values="random", seed=2100 + k))
        for e, encoder in enumerate(ENCODERS[1:], 1):
            kinds = itertools.cycle(VALUE_KINDS[e:] + VALUE_KINDS[:e])
            for i, cols in enumerate(WIDTHS):
                out.append(SweepCase(
                    rows=ROW_COUNTS[(i + 5) % len(ROW_COUNTS)] if cols < 1000 else 1 + i % 3, cols=cols,
                    world_size=WORLD_SIZES[(i + 1) % 4], dtype=tuple(DTYPES)[(i + 2) % 3],
                    feedback_dtype=tuple(FEEDBACK_DTYPES)[(i // 4 + 1) % 3], values=next(kinds),
                    group_size=SUPPORTED_GROUP_SIZES[(i // 2 + 1) % len(SUPPORTED_GROUP_SIZES)],
                    hadamard=i % 7 != 3, seed=4000 * e + i, encoder=encoder))
            for k, kind in enumerate(VALUE_KINDS):
                out.append(SweepCase(rows=3, cols=1, world_size=(3, 8)[k % 2], dtype=tuple(DTYPES)[k % 3],
                                     feedback_dtype=("int8", "bf16")[k % 2], values=kind, seed=4000 * e + 900 + k,
                                     encoder=encoder))
    elif scale == "fused":
        out = [c for c in cases("gpu") if c.cols in FUSED_WIDTHS or (c.cols <= 70 and c.cols % 9 == 0)]
    elif scale == "interpreter":
        for j, (rows, cols, p, kind) in enumerate([(2, 1, 2, "random"), (3, 1, 3, "nonfinite"),
                                                   (1, 33, 4, "huge"), (2, 129, 2, "tiny")]):
            out.append(SweepCase(rows=rows, cols=cols, world_size=p, dtype=tuple(DTYPES)[j % 3],
                                 feedback_dtype=tuple(FEEDBACK_DTYPES)[j % 3], values=kind, seed=3000 + j))
        out.append(SweepCase(rows=3, cols=1, world_size=3, dtype="bf16", feedback_dtype="int8", values="huge",
                             seed=3100, encoder="signed_mse"))
        out.append(SweepCase(rows=2, cols=33, world_size=2, dtype="fp16", feedback_dtype="bf16", values="random",
                             seed=3101, encoder="signed_mse"))
    else:
        raise ValueError(f"scale={scale!r}: 'gpu', 'fused' or 'interpreter'")
    return out


def inputs(case: SweepCase, call: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input of call ``call``: ``[rows, cols]`` of ``case.dtype``
    on the CPU, a function of (case, call, rank) only, so any process can
    rebuild every rank's inputs."""
    dtype = DTYPES[case.dtype]
    fmax = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(((case.seed * 31 + call) * 17 + rank) & 0x7FFFFFFF)
    shape = (case.rows, case.cols)
    base = torch.randn(shape, generator=gen)
    if case.values == "random":  # wide dynamic range, an outlier channel
        x = base * torch.exp(2 * torch.randn(shape, generator=gen))
        x[:, ::13] *= 50.0
    elif case.values == "zeros":
        x = torch.zeros(shape) * torch.sign(base)  # signed zeros
    elif case.values == "huge":
        # as large as the unnormalized rotation and a P-rank sum stay finite in
        # fp32 and the output dtype: each group's rotated values grow by up to g
        x = base.clamp(-1, 1) * (fmax / (4 * case.world_size * case.group_size))
    elif case.values == "tiny":  # the dtype's subnormals
        x = base * torch.finfo(dtype).smallest_normal / 4
    elif case.values == "nonfinite":
        x = base * torch.exp(torch.randn(shape, generator=gen))
        flat = x.view(-1)
        for i, v in enumerate((float("nan"), float("inf"), float("-inf"))):
            flat[(7 * i + rank + call) % flat.numel()] = v
    else:
        raise ValueError(f"values={case.values!r}: not in {VALUE_KINDS}")
    return x.to(dtype)


def stacked_inputs(case: SweepCase, call: int) -> torch.Tensor:
    """Every rank's input of call ``call``, ``[P, rows, cols]`` (a virtual group's input)."""
    return torch.stack([inputs(case, call, r) for r in range(case.world_size)])


def run_case(case: SweepCase, backend: str, *, device: str = "cpu", transport=None, rank: int | None = None,
             echo=None) -> list[torch.Tensor]:
    """The chain's outputs (CPU tensors), one per call, from ``backend``:
    Echo's 4-bit path itself (``EchoCommunicator.all_reduce`` with
    ``path=Path.ECHO`` and a :class:`~echo_vllm.feedback.FeedbackChain`: the
    policy is not asked, so fp32 inputs are quantized too rather than sent
    down the exact path). Without
    ``transport`` the case's P ranks are virtual (one process, inputs
    stacked); with a process-group ``transport`` this process is ``rank``.
    ``echo``: an ``EchoCommunicator`` of the case's :meth:`SweepCase.config` to
    reuse (its backend's buffers are built once; the caller closes it)."""
    from .communicator import EchoCommunicator
    from .emulation import StackedCommunicator
    from .feedback import FeedbackChain
    from .numbering import CallSlot
    from .policy import Path
    from .transport import VirtualTransport

    virtual = transport is None
    transport = VirtualTransport(case.world_size) if virtual else transport
    config = case.config(backend)
    own = echo is None
    echo = (StackedCommunicator if virtual else EchoCommunicator)(config, transport) if own else echo
    chain = FeedbackChain.of(config, len(transport.local_ranks), device)
    try:
        outs = []
        for call in range(CALLS):
            x = stacked_inputs(case, call) if virtual else inputs(case, call, rank)
            outs.append(echo.all_reduce(x.to(device), slot=CallSlot(call), path=Path.ECHO, chain=chain).cpu())
        return outs
    finally:
        if own:
            echo.close()
        chain.release()


def reference_outputs(case: SweepCase) -> list[torch.Tensor]:
    """The plain-torch reference's outputs of the case's chain (on the CPU)."""
    return run_case(case, "reference")


def differences(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[str]:
    """Where the bits differ (any NaN equal to any NaN: compiled casts write
    the hardware's NaN payload), per call; empty if they are equal."""
    out = []
    for call, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            out.append(f"call {call}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}")
            continue
        ints = {2: torch.int16, 4: torch.int32}[g.element_size()]
        bad = (g.contiguous().view(ints) != w.contiguous().view(ints)) & ~(g.float().isnan() & w.float().isnan())
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            out.append(f"call {call}: {int(bad.sum())}/{bad.numel()} differ, first at {list(i)}: "
                       f"{g[i].item()!r} vs reference {w[i].item()!r}")
    if len(got) != len(want):
        out.append(f"{len(got)} outputs vs {len(want)}")
    return out


def check_case(case: SweepCase, backend: str, *, device: str = "cpu") -> list[str]:
    """:func:`differences` of ``backend`` (virtual ranks) against the reference."""
    return differences(run_case(case, backend, device=device), reference_outputs(case))


__all__ = ["CALLS", "SweepCase", "cases", "check_case", "differences", "inputs", "reference_outputs", "run_case",
           "stacked_inputs"]
