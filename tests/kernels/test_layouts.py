"""What the compiler makes of the kernels, compiled for sm_90 on the CPU (no GPU).

Every tensor of a tile stays in the lane layout of ``echo_vllm.kernels.tile``
from its loads to its stores, so the compiler converts nothing through
shared memory (``LDS``/``STS`` and a barrier per tile) and the lane shuffles
of the butterflies are valid; with int8 feedback a lane's 8 codes are one
64-bit access. The fused kernel's phases fit its register cap unspilled.
All of it holds under a rotation seed's sign flips too.
(float32 feedback gives a lane 4 values per 16 bytes: converted through
shared memory, shuffles off; not checked here.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_kernels import _compiler_pool, _reporting

#: Shared-memory and local-memory (spill) instructions.
FORBIDDEN = ("LDS", "STS", "LDSM", "STSM", "LDL", "STL")


#: A rotation seed whose sign flips the kernels are compiled with beside none.
ROTATION_SEED = 1


def _reports(fb_dtype: torch.dtype, flips: int = 0, encoder: str = "absmax") -> dict[str, dict]:
    from echo_vllm.bench import sass_report

    return {r["kernel"]: r for r in sass_report.report(fb_dtype, flips, encoder)}


def _flips(group: int = 32) -> int:
    from echo_vllm.rotation import sign_flips

    return sign_flips(ROTATION_SEED, group)


def _whole_fused_kernel_spills(fb_dtype: torch.dtype, encoder: str = "absmax") -> tuple[dict, int]:
    """The whole fused kernel's report (every phase, barriers) and its register cap."""
    from echo_vllm.bench import sass_report
    from echo_vllm.bench.host_overhead import compile_only
    from echo_vllm.kernels import fused_kernel as fk

    with compile_only():
        k = sass_report._fused_phase(fk.ALL_PHASES, fb_dtype=fb_dtype, encoder=encoder)
    return sass_report.kernel_report(k), k.metadata.maxnreg


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, dict]]:
    pool = _compiler_pool()
    cases = (("bf16", torch.bfloat16, 0, "absmax"), ("int8", torch.int8, 0, "absmax"),
             ("bf16 flips", torch.bfloat16, _flips(), "absmax"), ("int8 flips", torch.int8, _flips(), "absmax"),
             ("bf16 signed_mse", torch.bfloat16, 0, "signed_mse"))
    return {name: pool.submit(_reporting, _reports, dt, flips, enc).result(timeout=600)
            for name, dt, flips, enc in cases}


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
@pytest.mark.parametrize("fb", ["bf16", "int8", "bf16 flips", "int8 flips", "bf16 signed_mse"])
def test_no_tile_goes_through_shared_memory(reports, fb):
    for kernel, r in reports[fb].items():
        bad = {op: n for op, n in r["memory"].items() if op.startswith(FORBIDDEN)}
        assert not bad and r["barriers"] == 0 and r["shared_bytes"] == 0, (fb, kernel, r)


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
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


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
def test_fused_kernel_fits_its_register_cap_and_int8_spills_no_more():
    """The whole fused kernel (every phase and the barriers in one body) at
    its cap: with int8 feedback no more spill instructions than with bf16
    (whose whole kernel spills a few at the 80 registers of the 2048:8:3
    plan; the phases alone spill none, checked above, signed_mse's too).
    Quantizing with signed_mse it spills a few more 64-bit values (4
    against 2, on the 2026-12 compiler); like absmax's, every one is stored
    before the first global load -- loop invariants, reloaded, never a
    store inside the work (``sass_report``'s ``late_spill_stores``)."""
    pool = _compiler_pool()
    (bf16, cap), (int8, cap8), (signed, cap_s) = (
        pool.submit(_reporting, _whole_fused_kernel_spills, dt, enc).result(timeout=600)
        for dt, enc in ((torch.bfloat16, "absmax"), (torch.int8, "absmax"), (torch.bfloat16, "signed_mse")))
    assert bf16["registers"] <= cap and int8["registers"] <= cap8 == cap == cap_s >= signed["registers"], (
        cap, bf16, int8, signed)
    assert _spills(int8) <= _spills(bf16), (_spills(int8), _spills(bf16))
    assert signed["late_spill_stores"] == bf16["late_spill_stores"] == 0, (signed, bf16)


# -- every lane shuffle in the lane layout, for every shape the compiler tells apart ------------------
#
# Triton specializes integer arguments (``== 1``, divisibility by 16) and lays a
# load out from what it can prove about its offsets; where a load's layout is
# not the lane layout, its layout pass may re-materialize the butterflies' lane
# shuffles (inline assembly it must treat as elementwise) in the load's layout,
# where ``lane ^ m`` holds another value. That is how rows of width 1 came out
# ~g/8 times the true sum on the H200. So every kernel is compiled here for the
# shapes the compiler tells apart, and every shuffle's operand layout is read
# from the TTGIR: lane bit ``log2 m`` must flip the group's lane index by ``m``
# and nothing else; the packed bf16x2 decode (8 values a lane at once) must
# also see a lane's 8 values in order in its first 8 registers.

import re  # noqa: E402

#: (rows, cols): width 1, odd widths below / above one group, a wide lanes row.
SHAPES = [(2, 1), (1, 1), (3, 3), (2, 33), (2, 4096)]


def _layout_bases(defn: str, rank: int) -> dict[str, list[tuple[int, ...]]]:
    """``{"register": [...], "lane": [...]}`` basis vectors of a TTGIR
    ``#ttg.blocked`` or ``#ttg.linear`` layout of a rank-``rank`` tensor."""
    if defn.startswith("#ttg.linear"):
        out = {}
        for key in ("register", "lane"):
            body = re.search(key + r" = \[(.*?)\]\]", defn)
            vecs = re.findall(r"\[([-\d, ]+)\]", body.group(1) + "]") if body else []
            out[key] = [tuple(int(v) for v in vec.split(",")) for vec in vecs]
        return out
    assert defn.startswith("#ttg.blocked"), defn
    size, threads, order = (list(map(int, re.search(k + r" = \[([\d, ]+)\]", defn).group(1).split(",")))
                            for k in ("sizePerThread", "threadsPerWarp", "order"))
    unit = lambda d, n: tuple(n if i == d else 0 for i in range(rank))  # noqa: E731
    regs = [unit(d, 1 << k) for d in order for k in range(size[d].bit_length() - 1)]
    lanes = [unit(d, size[d] << k) for d in order for k in range(threads[d].bit_length() - 1)]
    return {"register": regs, "lane": lanes}


def shuffle_layout_problems(ttgir: str) -> list[str]:
    """Shuffles (and packed decodes) in ``ttgir`` whose operand is not in the lane layout."""
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<\{.*\}>)", ttgir, re.M))
    problems = []
    for asm, operands in re.findall(r'tt\.elementwise_inline_asm "([^"]*)".*? : (tensor<[^:]*?) ->', ttgir):
        masks = [int(m) for m in re.findall(r"shfl\.sync\.bfly\.b32 \S+ \S+ (\d+),", asm)]
        packed = "prmt.b32" in asm
        if not masks:
            continue
        shape, layout = re.match(r"tensor<([\dx]+)x\w+, (#\w+)>", operands).groups()
        dims = [int(d) for d in shape.split("x")]
        if len(dims) not in (2, 3) or (packed and len(dims) != 3):
            problems.append(f"shuffle on a rank-{len(dims)} tensor {operands}")
            continue
        bases = _layout_bases(defs[layout], len(dims))
        for m in masks:  # a group's lane index is dimension 1 ([BG, L, V] values, [BG, L] lane sums)
            k = m.bit_length() - 1
            if k >= len(bases["lane"]) or bases["lane"][k] != (0, m, 0)[:len(dims)]:
                problems.append(f"shfl mask {m} on {layout} = {defs[layout]}")
        if packed and bases["register"][:3] != [(0, 0, 1), (0, 0, 2), (0, 0, 4)]:
            problems.append(f"packed decode on {layout} = {defs[layout]}")
    return problems


def _lane_bases(enc: str, shape: list[int], defs: dict[str, str]) -> list[tuple[int, ...]]:
    """Lane basis vectors of a tensor of ``shape`` in TTGIR encoding ``enc``
    (a name, ``#ttg.blocked``, ``#ttg.linear``, or a ``#ttg.slice`` of one);
    a lane past the shape broadcasts (0)."""
    enc = defs.get(enc, enc)
    m = re.match(r"#ttg\.slice<\{dim = (\d+), parent = (.*)\}>$", enc)
    if m:
        d = int(m.group(1))
        return [b[:d] + b[d + 1:] for b in _lane_bases(m.group(2), shape[:d] + [1] + shape[d:], defs)]
    lanes = _layout_bases(enc, len(shape))["lane"]
    return [tuple(v if v < n else 0 for v, n in zip(b, shape)) for b in lanes]


def reduce_layout_problems(ttgir: str) -> list[str]:
    """``tt.reduce`` ops of ``ttgir`` whose axis is spread over lanes that
    are not consecutive lane-id bits, each moving along that axis alone.
    Triton 3.6 reduces across lanes with butterfly shuffles of masks 1, 2,
    4, ... times the first such bit, which is right only then: on the H200
    a step's per-row statistics, reduced over lane bits 0, 1,
    2 and 4 (bit 3 carried the row), took the other row's values."""
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<\{.*\}>)", ttgir, re.M))
    problems = []
    for axis, types in re.findall(r'"tt\.reduce"\([^)]*\) <\{axis = (\d+) : i32\}>.*?\n\s*\}\) : \((.*?)\) ->', ttgir,
                                  re.S):
        shape, enc = re.match(r"tensor<([\dx]+)x\w+, (#[^,]*?(?:<\{.*?\}>+)?)(?:, tensor<.*)?>$", types).groups()
        dims, a = [int(d) for d in shape.split("x")], int(axis)
        lanes = _lane_bases(enc, dims, defs)
        along = [k for k, b in enumerate(lanes) if b[a]]
        alone = all(not v for k in along for i, v in enumerate(lanes[k]) if i != a)
        if along and (along != list(range(along[0], along[0] + len(along))) or not alone):
            problems.append(f"reduce along axis {a} of {dims} over lane bits {along} of {defs.get(enc, enc)}")
    return problems


def _compiled_ttgirs(rows: int, cols: int, dtype: torch.dtype, fb_dtype, group: int, flips: int = 0,
                     encoder: str = "absmax") -> dict[str, str]:
    """TTGIR of every kernel for one message shape: the composed stage kernels
    (stage 1 with and without a carried error) and the whole fused kernel,
    with the rotation's sign flips ``flips``, quantizing with ``encoder``."""
    from echo_vllm import kernels
    from echo_vllm.bench.host_overhead import compile_only
    from echo_vllm.kernels import consume_kernel, fused_kernel, output_kernel, stage1_kernel, stage2_kernel
    from echo_vllm.quant import WireLayout, feedback_row_len

    world = 4
    lay = WireLayout(rows * cols, world, group, cols)
    x = torch.zeros(2, lay.numel, dtype=dtype)
    fb = None if fb_dtype is None else torch.zeros(2, feedback_row_len(lay.padded_numel, fb_dtype, group),
                                                   dtype=fb_dtype)
    wire = torch.zeros(2, world, lay.chunk_bytes, dtype=torch.uint8)
    calls = {
        "stage1": (stage1_kernel, lambda: kernels.stage1(x, fb, lay, qmax=7, hadamard=True, has_incoming=fb is not None,
                                                         flips=flips, encoder=encoder)),
        "stage1 fresh": (stage1_kernel, lambda: kernels.stage1(x, fb, lay, qmax=7, hadamard=True, has_incoming=False,
                                                               flips=flips, encoder=encoder)),
        "stage2": (stage2_kernel, lambda: kernels.stage2(wire, fb, [0, 1], lay, qmax=7, encoder=encoder)),
        "output": (output_kernel, lambda: kernels.output(wire[0], lay, dtype, hadamard=True, flips=flips)),
    }
    if fb is not None:
        calls["consume"] = (consume_kernel, lambda: kernels.consume(x, fb, lay, hadamard=True, flips=flips))
    out = {}
    with compile_only():
        for name, (module, call) in calls.items():
            call()
            out[name] = list(module._LAUNCH.fn.device_caches[-1][0].values())[-1].asm["ttgir"]
        if fb is not None:
            tiling = fused_kernel.tiling_for(lay, 132)
            y = torch.empty(1, lay.numel, dtype=dtype)
            for incoming in (True, False):
                lp = fused_kernel._launch_plan(lay, tiling, 1, world * lay.chunk_bytes, 7, True, True, incoming,
                                               fused_kernel.ALL_PHASES, fused_kernel.tiling_lanes(tiling, lay, x[:1], y),
                                               flips, encoder)
                k = lp.launcher.compile(lp.grid, (x[:1], fb[:1], y, torch.zeros(2, world, dtype=torch.int64)),
                                        fused_kernel.launch_ints(lp, x[:1], fb[:1], lay, rank=0, timeout_ns=10**9),
                                        lp.constexprs)
                out[f"fused{'' if incoming else ' fresh'}"] = k.asm["ttgir"]
    return out


def _shuffle_problems(rows, cols, dtype, fb_dtype, group, flips=0, encoder="absmax") -> dict[str, list[str]]:
    return {k: p for k, t in _compiled_ttgirs(rows, cols, dtype, fb_dtype, group, flips, encoder).items()
            if (p := layout_problems(t))}


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype,fb,group,flipped,encoder", [(torch.bfloat16, torch.bfloat16, 32, False, "absmax"),
                                                            (torch.float16, torch.int8, 16, False, "absmax"),
                                                            (torch.bfloat16, None, 32, False, "absmax"),
                                                            (torch.bfloat16, torch.bfloat16, 32, True, "absmax"),
                                                            (torch.float16, torch.int8, 16, True, "absmax"),
                                                            (torch.bfloat16, torch.bfloat16, 32, False, "signed_mse"),
                                                            (torch.float16, torch.int8, 16, True, "signed_mse")])
def test_every_lane_shuffle_is_in_the_lane_layout(rows, cols, dtype, fb, group, flipped, encoder):
    """``flipped``: under a rotation seed's sign flips (built from the lane
    index, in the lane layout); signed_mse adds the lane sums of its squared
    errors (shuffles of ``[BG, L]`` tensors, in stage 2 and phase 2 too)."""
    flips = _flips(group) if flipped else 0
    problems = _compiler_pool().submit(_reporting, _shuffle_problems, rows, cols, dtype, fb, group, flips,
                                       encoder).result(timeout=600)
    assert problems == {}, problems


def test_the_layout_reader_tells_the_lane_layout_apart():
    """The reader on the layouts the compiler produced: the lane layout
    (blocked or linear, registers in any order) passes; the layout whose
    lanes run along the values (what broke width 1) fails."""
    lane = "#ttg.blocked<{sizePerThread = [1, 1, 8], threadsPerWarp = [8, 4, 1], warpsPerCTA = [4, 1, 1], order = [2, 1, 0]}>"
    along_values = ("#ttg.blocked<{sizePerThread = [1, 1, 1], threadsPerWarp = [1, 4, 8], warpsPerCTA = [4, 1, 1], "
                    "order = [2, 1, 0]}>")
    linear = ("#ttg.linear<{register = [[0, 0, 4], [0, 0, 2], [0, 0, 1], [32, 0, 0]], lane = [[0, 1, 0], [0, 2, 0], "
              "[1, 0, 0], [2, 0, 0], [4, 0, 0]], warp = [[8, 0, 0], [16, 0, 0]], block = []}>")

    def ir(defn, asm="shfl.sync.bfly.b32 $0, $1, 2, 0x1f, -1;"):
        return (f'#blocked = {defn}\n    %p = tt.elementwise_inline_asm "{asm}" {{constraints = "=r,r"}} %b : '
                f"tensor<64x4x8xi32, #blocked> -> tensor<64x4x8xi32, #blocked> loc(#loc1)")

    assert shuffle_layout_problems(ir(lane)) == []
    assert shuffle_layout_problems(ir(linear)) == []
    assert len(shuffle_layout_problems(ir(along_values))) == 1
    packed = "{ prmt.b32 m0, a0, a1, 0x5410; shfl.sync.bfly.b32 p, a0, 1, 0x1f, -1; }"
    assert shuffle_layout_problems(ir(lane, packed)) == []
    assert len(shuffle_layout_problems(ir(linear, packed))) == 1  # registers reversed: pairs would mix


def test_the_reduce_reader_tells_consecutive_lanes_apart():
    """The reader on layouts the compiler produced: the step statistics'
    layout of the H200 defect (the row on lane bit 3, the reduced axis on
    bits 0, 1, 2 and 4) fails; the axis on consecutive bits passes, a slice
    of a blocked layout read through its parent, and lanes past the shape
    (broadcasts) count for neither."""
    def ir(shape, enc, axis, defn=""):
        head = f"#blocked = {defn}\n" if defn else ""
        return (f'{head}    %r = "tt.reduce"(%x) <{{axis = {axis} : i32}}> ({{\n    ^bb0(%a: f32, %b: f32):\n'
                f"      tt.reduce.return %a : f32\n    }}) : (tensor<{shape}xf32, {enc}>) -> tensor<2xf32, #x>\n")

    h200 = "#ttg.linear<{register = [], lane = [[0, 1], [0, 2], [0, 4], [1, 0], [0, 8]], warp = [], block = []}>"
    fixed = "#ttg.linear<{register = [], lane = [[0, 1], [0, 2], [0, 4], [0, 8], [1, 0]], warp = [], block = []}>"
    assert reduce_layout_problems(ir("2x16", h200, 1)) == [
        f"reduce along axis 1 of [2, 16] over lane bits [0, 1, 2, 4] of {h200}"]
    assert reduce_layout_problems(ir("2x16", fixed, 1)) == reduce_layout_problems(ir("2x16", fixed, 0)) == []
    assert len(reduce_layout_problems(ir("2x16", h200, 0))) == 0  # the row alone on bit 3: one shuffle, right
    mixed = "#ttg.linear<{register = [], lane = [[0, 1], [1, 2]], warp = [], block = []}>"
    assert len(reduce_layout_problems(ir("2x4", mixed, 1))) == 1  # a lane moving the row and the axis
    blocked = "#ttg.blocked<{sizePerThread = [1, 1, 8], threadsPerWarp = [4, 8, 1], warpsPerCTA = [1, 1, 1], order = [2, 1, 0]}>"
    sliced = "#ttg.slice<{dim = 2, parent = #blocked}>"
    assert reduce_layout_problems(ir("4x8", sliced, 1, blocked)) == []  # lanes 0-2 along axis 1
    assert reduce_layout_problems(ir("4x8", sliced, 0, blocked)) == []  # lanes 3-4 along axis 0
    assert reduce_layout_problems(ir("2x8", sliced, 0, blocked)) == []  # lane 4 past the 2 rows: a broadcast
    across = "#ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [4, 8], warpsPerCTA = [1, 1], order = [0, 1]}>"
    assert reduce_layout_problems(ir("4x8", "#blocked", 1, across)) == []  # bits 2-4 along axis 1, consecutive


# -- every small-shape test case, as the GPU compiles it -----------------------------------


def _jit_functions() -> list:
    from echo_vllm.kernels import (consume_kernel, fused_kernel, output_kernel, output_norm_kernel, stage1_kernel,
                                   stage2_kernel)

    fns = [fused_kernel._fused_kernel, fused_kernel._fused_norm_kernel]
    fns += [m._LAUNCH.fn for m in (stage1_kernel, stage2_kernel, output_kernel, consume_kernel)]
    return fns + [f for f in vars(output_norm_kernel).values() if hasattr(f, "device_caches")]


def _compiled() -> dict:
    return {(f.__name__, key): k for f in _jit_functions() for cache in f.device_caches.values()
            for key, k in cache[0].items()}


def _case_ttgir(module: str, fn: str, args: tuple, kwargs: dict) -> dict[str, str]:
    """Run a kernel test's body with launches compiled for sm_90 but not run
    (``compile_only``; its comparisons skipped: nothing ran) and return the
    TTGIR of every kernel it launched, by name: Triton's in-process caches
    are emptied and a launch hook set (so ``direct_launch`` takes Triton's
    own dispatch), so a kernel an earlier test of this pool compiled is
    compiled again (from Triton's disk cache) and counted. A compilation
    error propagates."""
    import importlib
    from unittest import mock

    from triton import knobs

    from echo_vllm.bench.host_overhead import compile_only

    for f in _jit_functions():
        for cache in f.device_caches.values():
            cache[0].clear()
    mods = [importlib.import_module(m) for m in ("test_kernels", "test_fused", "test_fused_norm", "test_output_norm")]

    def hook(*_):
        pass

    with compile_only(), contextlib.ExitStack() as stack:
        for m in mods:  # the bodies compare results; no result exists here
            stack.enter_context(mock.patch.object(m, "assert_same_bits", lambda *a, **k: None))
        knobs.runtime.launch_enter_hook.add(hook)
        stack.callback(knobs.runtime.launch_enter_hook.remove, hook)
        getattr(importlib.import_module(module), fn)(*args, **kwargs)
    return {name: k.asm["ttgir"] for (name, _), k in _compiled().items()}


def layout_problems(ttgir: str) -> list[str]:
    """Shuffles outside the lane layout and reductions over lanes that are not consecutive bits."""
    return shuffle_layout_problems(ttgir) + reduce_layout_problems(ttgir)


def _case_problems(module: str, fn: str, args: tuple, kwargs: dict) -> dict[str, list[str]]:
    """The layout problems (:func:`layout_problems`) of every kernel :func:`_case_ttgir` compiles."""
    return {name: p for name, ir in _case_ttgir(module, fn, args, kwargs).items() if (p := layout_problems(ir))}


def _small_cases() -> list:
    from test_fused import PHASE_CASES, SIGNED_PHASE_CASES
    from test_fused_norm import NORM_PHASE_CASES
    from test_output_norm import CASES

    from test_fused import FLIP_PHASE_CASES

    cases = [pytest.param("test_fused", "_phases_match_reference", c, {}, id=f"phases{c}") for c in PHASE_CASES]
    cases += [pytest.param("test_fused", "_phases_match_reference", c, {"rotation_seed": s}, id=f"phases{c} seed {s}")
              for c, s in FLIP_PHASE_CASES]
    cases += [pytest.param("test_fused", "_phases_match_reference", c, {"encoder": "signed_mse"},
                           id=f"phases signed_mse{c}") for c in SIGNED_PHASE_CASES]
    cases += [pytest.param("test_fused_norm", "_norm_phases_match", c, {}, id=f"norm{c}") for c in NORM_PHASE_CASES]
    cases += [pytest.param("test_fused_norm", "_norm_phases_match", c, {"one_pass_rows": max(1, c[8] // 2)},
                           id=f"norm one pass{c}") for c in NORM_PHASE_CASES]
    cases.append(pytest.param("test_fused_norm", "_norm_phases_match", (6, 96, 3, 32, "bf16", "bf16", True, True, 2, 2),
                              {"residual": False, "w_dt": "fp32"}, id="norm without residual"))
    return cases + [pytest.param("test_output_norm", "_output_norm_matches", c, {"one_pass": one},
                                 id=f"output_norm{'' if one else ' two passes'}{c}") for c in CASES for one in (True, False)]


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
@pytest.mark.parametrize("module,fn,args,kwargs", _small_cases())
def test_small_test_cases_compile_with_every_shuffle_in_the_lane_layout(module, fn, args, kwargs):
    """The GPU runs these small cases compiled. Defects only the H200
    showed: a tile smaller than its threads (8 groups of 32 on 2 warps)
    spread the threads along a lane's values and the shuffles paired wrong
    values (``contract.lane_layout`` now turns them off there); a width of 1
    came into the norm kernels as a constant int and failed to compile; a
    one-pass step's rows reduced over lanes that were not consecutive bits
    (:func:`reduce_layout_problems`)."""
    problems = _compiler_pool().submit(_reporting, _case_problems, module, fn, args, kwargs).result(timeout=600)
    assert problems == {}, problems


def _several_row_steps() -> list:
    from test_fused_norm import NORM_PHASE_CASES

    return [pytest.param(c, id=str(c)) for c in NORM_PHASE_CASES if c[8] // 2 > 1]


@pytest.mark.slow  # compiles for sm_90 on CPU: CI's second tier
@pytest.mark.parametrize("case", _several_row_steps())
def test_one_pass_steps_of_several_rows_reduce_without_a_permute(case):
    """The fused kernel's one pass in steps of several rows (half a tile's,
    as ``test_fused_norm`` runs it) reduces the rows' statistics along the
    step's own axes: reduced across a permuted view of the step
    (``tt.trans``), it gave other rows' bits on the H200 while the
    interpreter agreed with the reference."""
    irs = _compiler_pool().submit(_reporting, _case_ttgir, "test_fused_norm", "_norm_phases_match", case,
                                  {"one_pass_rows": case[8] // 2}).result(timeout=600)
    assert "_fused_norm_kernel" in irs, sorted(irs)
    assert {name: ir.count("tt.trans") for name, ir in irs.items() if "tt.trans" in ir} == {}
    # what went wrong through the permute: lanes of the reduced axis not consecutive (reviewed on the IR)
    assert {name: p for name, ir in irs.items() if (p := reduce_layout_problems(ir))} == {}


def test_lane_layout_needs_a_lane_per_thread_and_aligned_rows():
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.kernels import contract
    from echo_vllm.quant import WireLayout

    x = torch.zeros(2, 4096, dtype=torch.bfloat16)
    assert contract.lane_layout(4096, 2048, 4, x) and contract.lane_layout(4096, 256, 1, x)
    assert not contract.lane_layout(4096, 255, 1, x) and not contract.lane_layout(4096, 256, 2, x)  # threads > lanes
    assert not contract.lane_layout(4088, 2048, 4, torch.zeros(2, 4088, dtype=torch.bfloat16))  # rows 8 bytes apart
    assert contract.lane_layout(4096, 2048, 4, x.view(-1)[8:4104])  # a row starting 16 bytes in
    assert not contract.lane_layout(4096, 2048, 4, x.view(-1)[4:4100])  # a row starting 8 bytes in
    lay = WireLayout(3 * 96, 4, 32, 96)
    assert not fk.tiling_lanes(fk.FusedTiling(8, 2, 1), lay, x)  # the test plan the H200 showed wrong
    assert fk.tiling_lanes(fk.FusedTiling(8, 1, 1), lay, x)
    for numel, world, cols in [(4096 * 8192, 8, 8192), (1 << 20, 2, 4096), (4096, 8, 4096)]:
        lay = WireLayout(numel, world, 32, cols)  # every plan the table makes fits its lanes
        assert fk.tiling_lanes(fk.tiling_for(lay, 132), lay, torch.zeros(1, numel, dtype=torch.bfloat16))
