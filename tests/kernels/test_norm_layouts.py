"""The output phase with the residual add + RMSNorm, compiled for sm_90 on
the CPU (no GPU): the composed kernel and the fused kernel's phase 3 at
Qwen3-8B's 8192 x 4096, P = 8, 4 and 2, compile without spilling
(``bench.sass_report.norm_report``; the fused one under the register cap
its plan gives, ``norm_plan.registers``: 3 programs per SM)."""

from __future__ import annotations

from test_kernels import _compiler_pool, _reporting


def _norm_rows():
    from echo_vllm.bench import sass_report

    return sass_report.norm_report((8, 4, 2))


def test_norm_kernels_compile_for_sm90_without_spills():
    rows = _compiler_pool().submit(_reporting, _norm_rows).result(timeout=900)
    assert {r["kernel"] for r in rows} == {f"{k} P={p}" for k in ("output_norm", "fused phase 3 norm") for p in (8, 4, 2)}
    for r in rows:
        spills = {op: n for op, n in r["memory"].items() if op.startswith(("LDL", "STL"))}
        assert not spills, r
        assert r["maxnreg"] is None or r["registers"] <= r["maxnreg"], r
