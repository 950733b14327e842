"""What the compiler makes of the kernels, compiled for sm_90 on the CPU (no GPU).

Every tensor of a tile stays in the lane layout of ``echo_vllm.kernels.tile``
from its loads to its stores, so the compiler converts nothing through
shared memory (``LDS``/``STS`` and a barrier per tile) and the lane shuffles
of the butterflies are valid; with int8 feedback a lane's 8 codes are one
64-bit access. The fused kernel's phases fit its register cap unspilled.
(float32 feedback gives a lane 4 values per 16 bytes: converted through
shared memory, shuffles off; not checked here.)
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import _compiler_pool, _reporting

#: Shared-memory and local-memory (spill) instructions.
FORBIDDEN = ("LDS", "STS", "LDSM", "STSM", "LDL", "STL")


def _reports(fb_dtype: torch.dtype) -> dict[str, dict]:
    from echo_vllm.bench import sass_report

    return {r["kernel"]: r for r in sass_report.report(fb_dtype)}


def _whole_fused_kernel_spills(fb_dtype: torch.dtype) -> tuple[dict, int]:
    """The whole fused kernel's report (every phase, barriers) and its register cap."""
    from echo_vllm.bench import sass_report
    from echo_vllm.bench.host_overhead import compile_only
    from echo_vllm.kernels import fused_kernel as fk

    with compile_only():
        k = sass_report._fused_phase(fk.ALL_PHASES, fb_dtype=fb_dtype)
    return sass_report.kernel_report(k), k.metadata.maxnreg


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, dict]]:
    pool = _compiler_pool()
    return {name: pool.submit(_reporting, _reports, dt).result(timeout=600)
            for name, dt in (("bf16", torch.bfloat16), ("int8", torch.int8))}


@pytest.mark.parametrize("fb", ["bf16", "int8"])
def test_no_tile_goes_through_shared_memory(reports, fb):
    for kernel, r in reports[fb].items():
        bad = {op: n for op, n in r["memory"].items() if op.startswith(FORBIDDEN)}
        assert not bad and r["barriers"] == 0 and r["shared_bytes"] == 0, (fb, kernel, r)


def test_int8_feedback_is_accessed_a_lane_word_at_a_time(reports):
    """The codes move as 64-bit words, never byte by byte, and the
    butterflies keep their shuffles (the amax of the new error adds its own)."""
    for kernel in ("stage1", "stage2", "consume", "fused phase 1", "fused phase 2"):
        r, bf16 = reports["int8"][kernel], reports["bf16"][kernel]
        assert r["memory"].get("LDG.E.64", 0) > bf16["memory"].get("LDG.E.64", 0), (kernel, r)
        assert not any(".U8" in op or ".S8" in op for op in r["memory"]), (kernel, r)
        assert r["shuffles"] >= bf16["shuffles"], (kernel, r, bf16)
    for kernel in ("stage1", "stage2", "fused phase 1", "fused phase 2"):
        assert reports["int8"][kernel]["memory"].get("STG.E.64", 0) > reports["bf16"][kernel]["memory"].get(
            "STG.E.64", 0), kernel


def _spills(report: dict) -> int:
    return sum(n for op, n in report["memory"].items() if op.startswith(("LDL", "STL")))


def test_fused_kernel_fits_its_register_cap_and_int8_spills_no_more():
    """The whole fused kernel (every phase and the barriers in one body) at
    its cap: with int8 feedback no more spill instructions than with bf16
    (whose whole kernel spills a few at the 80 registers of the 2048:8:3
    plan; the phases alone spill none, checked above)."""
    pool = _compiler_pool()
    (bf16, cap), (int8, cap8) = (pool.submit(_reporting, _whole_fused_kernel_spills, dt).result(timeout=600)
                                 for dt in (torch.bfloat16, torch.int8))
    assert bf16["registers"] <= cap and int8["registers"] <= cap8 == cap, (cap, bf16, int8)
    assert _spills(int8) <= _spills(bf16), (_spills(int8), _spills(bf16))
