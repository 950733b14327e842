"""The output phase with the residual add + RMSNorm, compiled for sm_90 on
the CPU (no GPU): the composed kernel and the fused kernel's phase 3 at
Qwen3-8B's 8192 x 4096, P = 8, 4 and 2, compile without spilling
(``bench.sass_report.norm_report``; the fused one under the register cap
its plan gives, ``rmsnorm_plan.registers``: 3 programs per SM), and the whole
fused norm kernel spills no more than Echo's own whole fused kernel on the
same rows (whole-row tiles in phases 1-2 once spilled 30 loads at P = 8),
and every lane shuffle of theirs is in the lane layout and every
reduction over lanes runs over consecutive lane bits (``test_layouts``:
the one-pass step holds every chunk of a row on 8 warps). Without a
residual, keeping Echo's output (a decoder's first norm), at P = 8 too.
Under a rotation seed's sign flips, at P = 8: no spill in the output
phases, every shuffle in the lane layout."""

from __future__ import annotations

import pytest

from test_kernels import _compiler_pool, _reporting


def _norm_rows():
    from echo_vllm.bench import sass_report

    # the residual added at every P; without one, Echo's output kept (a decoder's first norm) at P = 8
    return sass_report.norm_report((8, 4, 2)) + sass_report.norm_report((8,), keep_output=True)


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
def test_norm_kernels_compile_for_sm90_without_spills():
    rows = {r["kernel"]: r for r in _compiler_pool().submit(_reporting, _norm_rows).result(timeout=900)}
    kinds = ("output_norm", "fused phase 3 norm", "fused norm whole", "fused whole")
    kept = {f"{k} P=8 kept" for k in kinds[:3]}
    assert set(rows) == {f"{k} P={p}" for k in kinds for p in (8, 4, 2)} | kept
    for name, r in rows.items():
        assert r["maxnreg"] is None or r["registers"] <= r["maxnreg"], r
        if name.startswith(("output_norm", "fused phase 3 norm")):
            assert not _spills(r, "LDL") and not _spills(r, "STL"), r
    for p, kept in ((8, ""), (4, ""), (2, ""), (8, " kept")):
        norm, echo = rows[f"fused norm whole P={p}{kept}"], rows[f"fused whole P={p}"]
        for op in ("LDL", "STL"):
            assert _spills(norm, op) <= _spills(echo, op), (p, kept, op, norm["memory"], echo["memory"])


def _spills(row, op):
    """Local-memory instructions (spills) of ``op`` (LDL or STL, every width) in a report row."""
    return sum(n for name, n in row["memory"].items() if name.startswith(op))


def _shuffle_problems():
    from test_layouts import layout_problems

    from echo_vllm.bench import sass_report
    from echo_vllm.bench.host_overhead import compile_only

    out = {}
    with compile_only():
        for p in (8, 4, 2):
            kernels = sass_report._norm_kernels(p)
            kernels.pop("values_per_thread")
            out.update({name: (layout_problems(k.asm["ttgir"]), k.asm["ttgir"].count("shfl.sync.bfly"))
                        for name, k in kernels.items()})
    return out


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
def test_norm_kernels_shuffle_in_the_lane_layout():
    got = _compiler_pool().submit(_reporting, _shuffle_problems).result(timeout=900)
    assert len(got) == 12 and all(shuffles > 0 for _, shuffles in got.values()), got  # the decodes shuffle
    assert {name: problems for name, (problems, _) in got.items() if problems} == {}


def _flipped_norm_rows():
    from test_layouts import layout_problems

    from echo_vllm.bench import sass_report
    from echo_vllm.bench.host_overhead import compile_only
    from echo_vllm.rotation import sign_flips

    flips = sign_flips(1, 32)
    with compile_only():
        kernels = sass_report._norm_kernels(8, flips=flips)
    kernels.pop("values_per_thread")
    return ({name: layout_problems(k.asm["ttgir"]) for name, k in kernels.items()},
            {r["kernel"]: r for r in sass_report.norm_report((8,), flips=flips)})


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
def test_norm_kernels_under_a_rotation_seed_shuffle_in_the_lane_layout_without_spills():
    problems, rows = _compiler_pool().submit(_reporting, _flipped_norm_rows).result(timeout=900)
    assert {name: p for name, p in problems.items() if p} == {} and len(problems) == 4
    for name in ("output_norm P=8", "fused phase 3 norm P=8"):
        r = rows[name]
        assert (r["maxnreg"] is None or r["registers"] <= r["maxnreg"]) and not _spills(r, "LDL") \
            and not _spills(r, "STL"), r
