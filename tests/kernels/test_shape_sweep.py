"""The shape sweep (``echo_vllm.shape_sweep``): every backend against the reference, bit for bit.

On a GPU (``-m gpu``) every case of ``cases("gpu")`` runs through the composed
Triton backend and, stage by stage, through the stage kernels; the fused
kernel runs the same cases over P processes in ``scripts/gpu_fused_check.py
--sweep``. On the CPU the interpreter twin runs ``cases("interpreter")``
through the Triton backend, and numba runs every width-1 case.

Why the interpreter alone is not enough: it runs each ``tl`` operation on
whole numpy arrays, with no integer specialization (an argument equal to 1
stays a runtime value), no register layouts and no lane shuffles, so a
defect that lives in what the compiler derives from a shape -- the width-1
rows that came out about 3x the true sum -- cannot show there. The twin
keeps the sweep's code path and the reference honest in CI; the compiled
kernels are proven only by the GPU run (``scripts/gpu_accept.sh``).
"""

from __future__ import annotations

import pytest
from test_kernels import CUDA, DTYPES, FB_DTYPES, in_kernel_process, needs_numba, run_and_compare

from echo_vllm import shape_sweep
from echo_vllm.config import ENCODERS

GPU_CASES = shape_sweep.cases("gpu")
INTERPRETER_CASES = shape_sweep.cases("interpreter")


def _check(case, backend: str, device: str) -> list[str]:
    return shape_sweep.check_case(case, backend, device=device)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.label)
def test_triton_backend_matches_reference_on_gpu(case):
    assert _check(case, "triton", "cuda") == [], case.label


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.label)
def test_stage_kernels_match_their_references_on_gpu(case):
    """Each stage kernel fed the reference's previous stage: names the stage that differs."""
    run_and_compare(case.rows * case.cols, case.world_size, case.group_size, DTYPES[case.dtype],
                    hadamard=case.hadamard, incoming=True, fb_dtype=FB_DTYPES.get(case.feedback_dtype), seed=case.seed,
                    special=case.values == "nonfinite", cols=case.cols, encoder=case.encoder)


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: c.label)
def test_triton_backend_matches_reference_in_the_interpreter(case):
    device = "cuda" if CUDA else "cpu"
    assert in_kernel_process(_check, case, "triton", device) == [], case.label


@needs_numba
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.cols == 1], ids=lambda c: c.label)
def test_numba_matches_reference_on_width_one_rows(case):
    assert _check(case, "numba", "cpu") == [], case.label


def test_the_sweep_covers_every_axis():
    """Every P, input dtype, feedback dtype, value kind and group size meets
    width 1, and the widths around one group of each size are there."""
    ones = [c for c in GPU_CASES if c.cols == 1]
    assert {c.world_size for c in ones} == set(shape_sweep.WORLD_SIZES)
    assert {c.dtype for c in ones} == set(shape_sweep.DTYPES)
    assert {c.feedback_dtype for c in ones} == set(shape_sweep.FEEDBACK_DTYPES)
    assert {c.values for c in ones} == set(shape_sweep.VALUE_KINDS)
    assert {c.group_size for c in GPU_CASES} == {16, 32, 64, 128}
    widths = {c.cols for c in GPU_CASES}
    assert set(range(1, 71)) | {127, 128, 129} <= widths
    assert {c.rows for c in GPU_CASES} >= set(range(1, 10))
    assert any(c.cols == 1 for c in INTERPRETER_CASES)
    for encoder in ENCODERS:  # every width and value kind of width 1 with each encoder
        assert {c.cols for c in GPU_CASES if c.encoder == encoder} == widths
        assert {c.values for c in ones if c.encoder == encoder} == set(shape_sweep.VALUE_KINDS)
        assert any(c.encoder == encoder and c.cols == 1 for c in INTERPRETER_CASES)
