"""The compiled bf16x2 output decode (``tile._packed_output_asm``) against
``quant.output_reference``, bit for bit.

Triton's interpreter cannot run inline assembly, so on CPU the PTX that the
compiled kernels run is executed here by a small emulator of its seven
instructions (bf16 arithmetic rounded once, to nearest even, subnormals
kept: what ``fma.rn.bf16x2`` does; the saturating ``min.NaN.xorsign.abs``) on crafted gathered bytes: every bf16
scale pattern (subnormal, 2**-126 and its small multiples, huge, inf, NaN,
negative) under random codes, and code patterns that reach the transform's
extremes under edge scales. On a CUDA host the output kernel and the fused
kernel's phase 3 decode the same bytes compiled (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import re

import pytest
import torch
from test_kernels import CUDA, DEVICE, assert_same_bits, in_kernel_process

from echo_vllm import quant
from echo_vllm.kernels import tile
from echo_vllm.quant import WireLayout

#: Scales met by the structured code patterns: 2**-126 (zero groups' clamp)
#: and its multiples below 2**-118, the smallest subnormal, 1, bf16 max, NaN, inf, -2.
EDGE_SCALE_BITS = [0x0080 << k for k in range(8)] + [0x0001, 0x3F80, 0x7F7F, 0x7FC0, 0x7F80, 0xC000]


def _patterns(g: int) -> torch.Tensor:
    """uint8 codes ``[n, g]``: every constant group (``q = -8 .. 7``), the
    Hadamard rows at -8 / 7 and at 7 / -8 (largest transform values), and
    alternating extremes."""
    h = torch.ones(1, 1)
    while h.shape[0] < g:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    rows = [torch.full((16, g), 0) + torch.arange(16)[:, None], torch.where(h > 0, 0, 15), torch.where(h > 0, 15, 0),
            (torch.arange(g) % 2 * 15).repeat(2, 1)]
    return torch.cat(rows).to(torch.uint8)


def crafted_gathered(g: int, world: int = 2, seed: int = 0, every: int = 1) -> tuple[torch.Tensor, WireLayout]:
    """``(gathered [world, chunk_bytes], layout)``: every ``every``-th bf16
    scale pattern with random codes, then the code patterns under each edge scale, then
    zero groups (codes 8, scale 2**-126) and non-finite groups (codes 8,
    NaN scale) as quantize writes them."""
    gen = torch.Generator().manual_seed(seed)
    pat = _patterns(g)
    scales = torch.arange(0, 1 << 16, every)
    codes = [torch.randint(0, 16, (len(scales), g), generator=gen, dtype=torch.uint8),
             pat.repeat(len(EDGE_SCALE_BITS), 1), torch.full((2, g), 8, dtype=torch.uint8)]
    bits = [scales, torch.tensor(EDGE_SCALE_BITS).repeat_interleave(pat.shape[0]),
            torch.tensor([0x0080, 0x7FC0])]
    codes, bits = torch.cat(codes), torch.cat(bits)
    lay = WireLayout(codes.numel(), world, g)
    pad = world * lay.chunk_groups - codes.shape[0]
    codes = torch.cat((codes, torch.full((pad, g), 8, dtype=torch.uint8))).reshape(1, -1)
    bits = torch.cat((bits, torch.full((pad,), 0x0080))).to(torch.int16).view(torch.bfloat16).reshape(1, -1)
    return quant.encode_chunks(codes, bits, lay)[0], lay


# -- the emulator --------------------------------------------------------------


def _halves(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 words -> fp64 values of their (low, high) bf16 halves."""
    return tuple(((r >> s & 0xFFFF) << 16).to(torch.int32).view(torch.float32).double() for s in (0, 16))


def _round_bf16(v: torch.Tensor) -> torch.Tensor:
    """fp64 -> bf16 bits (int64), one rounding to nearest even: the values
    emulated here are exact in fp32 (at most 17 significant bits, none below
    2**-149) or beyond bf16's range, so fp32 -> bf16 rounds them once."""
    f = v.float()
    assert ((f.double() == v) | v.isnan() | (v.abs() > 3.39e38)).all(), "not exact in fp32"
    return f.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _fma(a, b, c):
    (a0, a1), (b0, b1), (c0, c1) = _halves(a), _halves(b), _halves(c)
    return _round_bf16(a0 * b0 + c0) | _round_bf16(a1 * b1 + c1) << 16


def _min_xorsign_abs(a, b):
    """``min.NaN.xorsign.abs.bf16x2``: per half, the smaller magnitude with
    the sign of ``a`` xor ``b``'s; NaN (canonical) if either is NaN."""
    out = torch.zeros_like(a)
    for shift, (x, y) in zip((0, 16), zip(_halves(a), _halves(b))):
        sign = ((a >> shift) ^ (b >> shift)) & 0x8000
        half = torch.where(x.isnan() | y.isnan(), 0x7FFF, _round_bf16(torch.minimum(x.abs(), y.abs())) | sign)
        out |= half << shift
    return out


def _prmt(a, b, sel):
    both = a | b << 32
    return sum((both >> (8 * ((sel >> (4 * i)) & 7)) & 0xFF) << (8 * i) for i in range(4))


def _lop3(a, b, c, lut):
    ones = 0xFFFFFFFF
    out = torch.zeros_like(a)
    for i in range(8):  # LUT bit i: a = bit 2, b = bit 1, c = bit 0 of i
        if lut >> i & 1:
            out |= (a if i & 4 else ones ^ a) & (b if i & 2 else ones ^ b) & (c if i & 1 else ones ^ c)
    return out


def emulate(asm: str, operands: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Run the PTX block on int64 words ``[groups, L]`` (a group's lanes
    along the last axis, as on the warp): ``operands`` the inputs by number;
    returns ``$0..$3``."""
    regs = {f"${n}": v for n, v in operands.items()}

    def val(x: str):
        return regs[x] if x in regs else int(x, 0)

    for stmt in asm.strip("{} ").split(";"):
        op, _, rest = stmt.strip().partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if not op or op == ".reg":
            continue
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "mov.b32":
            regs[d] = src[0] + torch.zeros_like(regs["$4"])
        elif op == "lop3.b32":
            regs[d] = _lop3(*src)
        elif op == "fma.rn.bf16x2":
            regs[d] = _fma(*src)
        elif op == "min.NaN.xorsign.abs.bf16x2":
            regs[d] = _min_xorsign_abs(*src)
        elif op == "prmt.b32":
            regs[d] = _prmt(*src)
        elif op == "shfl.sync.bfly.b32":
            a, m = src[0], src[1]
            regs[d] = a[:, torch.arange(a.shape[1]) ^ m]
        else:
            raise AssertionError(f"no emulation of {op!r}")
    return [regs[f"${i}"] for i in range(4)]


def emulated_output(gathered: torch.Tensor, lay: WireLayout, hadamard: bool) -> torch.Tensor:
    """The packed path's bf16 output ``[numel]`` of ``gathered``, its
    operands built as ``tile._decode_output_bf16`` builds them."""
    g = lay.group_size
    lanes = g // tile.V.value
    words = gathered[:, :lay.payload_bytes].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(-1, lanes)
    s = gathered[:, lay.payload_bytes:].contiguous().view(torch.int16).to(torch.int64).reshape(-1, 1) & 0xFFFF
    lane = torch.arange(lanes).expand_as(words)
    ops = {4 + k: words >> (4 * k) for k in range(4)} | {12: (s | s << 16).expand_as(words)}
    for i in range(2):
        ops[16 + 8 * i] = torch.where(lane & (1 << i) == 0, 0x3F803F80, 0xBF80BF80)
    out = emulate(tile._packed_output_asm(g, hadamard), ops)
    halves = torch.stack([torch.stack((r & 0xFFFF, r >> 16), -1) for r in out], -2)  # value 2k + h
    v = halves.reshape(1, -1).to(torch.int16).view(torch.bfloat16)
    return quant.from_wire_order(v, lay)[0]


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("group", [16, 32])
def test_packed_asm_gives_the_reference_bits(group, hadamard):
    gathered, lay = crafted_gathered(group, seed=group)
    y = emulated_output(gathered, lay, hadamard)
    assert_same_bits(y, quant.output_reference(gathered, lay, torch.bfloat16, hadamard=hadamard),
                     f"emulated packed output (g={group}, had={hadamard})", nan_any=True)


def test_packed_path_is_taken_where_exact():
    """bf16 of groups up to 32 only: larger groups' transforms leave bf16's
    8 significant bits (|n| up to 8 * 64)."""
    assert tile._packed_output_asm(32, True).count("shfl.sync.bfly") == 8
    assert tile._packed_output_asm(16, True).count("shfl.sync.bfly") == 4
    assert "shfl" not in tile._packed_output_asm(32, False)
    assert [int(x) for x in re.findall(r"\$(\d+)", tile._packed_output_asm(32, True))].count(24) == 4


# -- the compiled kernels on the same bytes ---------------------------------------


def _kernels_decode_crafted_bytes(group, hadamard, dtype, every):
    from echo_vllm.backends import fused as fused_mod
    from echo_vllm.kernels import fused_kernel as fk
    from echo_vllm.kernels import output

    gathered, lay = crafted_gathered(group, seed=group + 1, every=every)
    want = quant.output_reference(gathered, lay, dtype, hadamard=hadamard)
    tag = f"g={group} had={hadamard} {dtype}"
    q2 = gathered.to(DEVICE)
    assert_same_bits(output(q2, lay, dtype, hadamard=hadamard), want, f"output kernel [{tag}]", nan_any=True)
    world, n = lay.world_size, q2.numel()
    tiling = fk.tiling_for(lay, 4)  # fewer programs than tiles: the persistent loop
    table, bufs, _ = fused_mod.local_buffers(world, lay.chunk_bytes, fk.signal_slots(tiling.programs, world), DEVICE)
    x = torch.zeros(1, lay.numel, dtype=dtype, device=DEVICE)
    for r in range(world):
        bufs[r][world * lay.chunk_bytes:world * lay.chunk_bytes + n] = q2.reshape(-1)
        y = torch.empty(lay.numel, dtype=dtype, device=DEVICE)
        fk.fused_all_reduce(x, None, table, lay, rank=r, gathered_offset=world * lay.chunk_bytes, qmax=7,
                            hadamard=hadamard, has_incoming=False, tiling=tiling, timeout_ns=0, out=y,
                            phase=3)
        assert_same_bits(y, want, f"fused phase 3 of rank {r} [{tag}]", nan_any=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_compiled_kernels_decode_crafted_bytes_on_gpu(group, hadamard, dtype):
    """Every bf16 scale pattern and the extreme code patterns through the
    compiled output kernel and fused phase 3 (bf16 of g <= 32: the packed
    path; fp16 and g = 64: the fp32 path, for contrast)."""
    in_kernel_process(_kernels_decode_crafted_bytes, group, hadamard, dtype, 1)


def test_kernels_decode_crafted_bytes():
    """The same through Triton's interpreter (the fp32 path; the packed one
    compiled, on a CUDA host), on every 4096th scale pattern."""
    in_kernel_process(_kernels_decode_crafted_bytes, 32, True, torch.bfloat16, 4096)
