"""The fused kernel against its memory roofline, on one GPU.

``echo-vllm bench fused [--world-sizes 2,4,8] [--sizes 64M,1G] [--encoders absmax,signed_mse] [--out DIR]``

For each P and message size (bf16 rows of ``--hidden`` values per rank):

* **roofline**: the bytes each phase must move through HBM (every input
  read once, every output written once: :func:`phase_bytes`) over the copy
  bandwidth measured in the same run (a device-to-device copy; read +
  write). ``%roof`` = that time / the measured time.
* **speed of light**: a plain Triton kernel that moves the same bytes in
  the same read:write mix with trivial arithmetic (:func:`_sol_kernel`), the
  yardstick of what this HBM gives for the mix.
* **phases alone**: phase 1, 2 and 3 of one rank, each launched alone (no
  barriers) with every peer's buffer local, on ``--buffer-sets`` rotating
  sets of inputs and buffers (so that L2 does not flatter them), timed by
  CUDA-graph replay.
* **emulated ranks**: all P ranks of the whole kernel (barriers on) in one
  launch on the one GPU (``fused_all_reduce`` with ``x [P, numel]``); the
  time per rank is the launch's time over P. It measures the kernel's own
  costs -- barriers, the interleaving of phases across programs, P ranks'
  HBM pressure -- but not NVLink: every "remote" store lands in local HBM,
  so it cannot predict the latency or bandwidth of real peer stores, nor
  the skew between GPUs.
* **composed stage kernels** on the same layout, with their roofline.
* **encoders** (``--encoders absmax,signed_mse``): phases 1 and 2 and
  stages 1 and 2 again with each further ``EchoConfig.encoder``, in a
  table beside the first's (the cost of signed_mse's search).

Before timing, every kernel is checked against the references bit for bit
(the emulated whole kernel over a chain of calls, the phases, the stage
kernels); a mismatch stops the run. Prints tables, writes ``fused.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..cli_args import MAX_RANKS, RANKS_WHY, choice_list, count, counts, out_dir
from ..config import ENCODERS, EchoConfig
from ..outputs import check_names, write_json
from ..quant import FEEDBACK_STORAGE, WireLayout, feedback_row_len
from . import report, timing
from .kernels_bench import random_feedback


# -- bytes each kernel must move (per rank) ----------------------------------------


def phase_bytes(layout: WireLayout, fb_dtype: torch.dtype = torch.bfloat16,
                elem_bytes: int = 2) -> dict[str, tuple[int, int]]:
    """``(read, written)`` bytes one rank's phases and stage kernels must
    move through its HBM: inputs read once, outputs written once; the 4-bit
    wire counts where it is written (stores into the peers' buffers) and
    where it is read. The feedback buffer in ``fb_dtype``'s format (int8:
    codes and scales, ``quant.feedback_row_len``). Stage 2 writes its chunk
    once (the all-gather copies it), phase 2 once per peer."""
    p, n = layout.world_size, layout.numel
    fb = feedback_row_len(layout.padded_numel, fb_dtype, layout.group_size) * fb_dtype.itemsize
    own_fb = feedback_row_len(layout.chunk_numel, fb_dtype, layout.group_size) * fb_dtype.itemsize
    chunk = layout.chunk_bytes
    return {
        "phase1": (n * elem_bytes + fb, fb + p * chunk),  # x, fb -> fb, P chunks
        "phase2": (p * chunk + own_fb, own_fb + p * chunk),  # P chunks, own fb -> own fb, P copies
        "phase3": (p * chunk, n * elem_bytes),  # P gathered chunks -> y
        "stage1": (n * elem_bytes + fb, fb + p * chunk),
        "stage2": (p * chunk + own_fb, own_fb + chunk),
        "output": (p * chunk, n * elem_bytes),
    }


# -- speed of light: the same bytes, trivial arithmetic -----------------------------


def _sol_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sol(src_ptr, dst_ptr, r_words, w_words, RB: tl.constexpr, WB: tl.constexpr):
        # program b reads its block of r_words words and writes its block of
        # w_words words (uint32, 16-byte vectors) in the same pass: one
        # phase's read:write mix, with a sum for arithmetic
        b = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, RB)
        v = tl.load(src_ptr + b * r_words + r, mask=r < r_words, other=0)
        w = tl.arange(0, WB)
        tl.store(dst_ptr + b * w_words + w, tl.sum(v, axis=0) + w.to(tl.uint32), mask=w < w_words)

    return sol


def sol_seconds(read_bytes: int, write_bytes: int, sets: int = 3, block_words: int = 2048) -> float:
    """Seconds per launch of the speed-of-light kernel reading ``read_bytes``
    and writing ``write_bytes`` (blocks of ``block_words`` words on the
    larger side, rotating ``sets`` buffer pairs)."""
    import triton

    sol = _sol_kernel()
    blocks = -(-max(read_bytes, write_bytes) // (4 * block_words))
    r_words, w_words = -(-read_bytes // (4 * blocks)), -(-write_bytes // (4 * blocks))
    bufs = [(torch.ones(blocks * r_words, dtype=torch.int32, device="cuda"),
             torch.empty(blocks * w_words, dtype=torch.int32, device="cuda")) for _ in range(sets)]

    def run(i):
        s, d = bufs[i % sets]
        sol[(blocks,)](s, d, r_words, w_words, RB=triton.next_power_of_2(r_words), WB=triton.next_power_of_2(w_words),
                       num_warps=8)

    return timing.cuda_graph_time(run, iters=10, calls_per_graph=sets).median_s


def copy_gbps(nbytes: int, sets: int = 3) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) of
    ``nbytes`` copies, timed eagerly: captured into a CUDA graph, a 1 GiB
    copy runs on the copy engines (~2.7 TB/s on the H200), eagerly on the
    SMs, which is the ceiling a kernel competes with."""
    bufs = [(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8,
                                                                                 device="cuda")) for _ in range(sets)]
    t = timing.cuda_time(lambda i: bufs[i % sets][1].copy_(bufs[i % sets][0]), iters=10).median_s
    return 2 * nbytes / t / 1e9


def sm_clock_mhz() -> str:
    """The SM clock as nvidia-smi reports it now (current / max), or why not."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out or "unknown"
    except Exception as e:  # pragma: no cover - depends on the host
        return f"unknown ({type(e).__name__})"


def verified(command: str, bad: list[str], against: str, line: str) -> bool:
    """Refuse to time a kernel with mismatches ``bad`` (printed), else print ``line``."""
    if bad:
        print(f"{command}: the kernel differs from {against}, refusing to time it: " + "; ".join(bad),
              file=sys.stderr)
        return False
    print(f"verified: {line}", flush=True)
    return True


def device_line(sets: int) -> tuple[float, str]:
    """``(copy bandwidth GB/s, device name)``, printed with the SM clock."""
    gbps = copy_gbps(1 << 30, sets)
    name = torch.cuda.get_device_name(0)
    print(f"device: {name}; SM clock (current, max): {sm_clock_mhz()}; copy {gbps:.0f} GB/s (read + write)",
          flush=True)
    return gbps, name


# -- the measured cases --------------------------------------------------------------


@dataclass
class Case:
    world_size: int
    size_bytes: int
    hidden: int
    plan: dict
    bytes: dict
    times_us: dict = field(default_factory=dict)
    sol_us: dict = field(default_factory=dict)

    def roof(self, key: str, gbps: float) -> float:
        """Fraction of the roofline ``key`` reaches (bytes at copy speed / time)."""
        b = self.bytes.get(key)
        return sum(b) / (gbps * 1e3) / self.times_us[key] if b and self.times_us.get(key) else float("nan")


def _buffers(lay: WireLayout, sets: int, fb_dtype: torch.dtype):
    from ..backends.fused import local_buffers
    from ..kernels import fused_kernel as fk

    p = lay.world_size
    out = []
    for s in range(sets):
        x = torch.randn(p, lay.numel, device="cuda").to(torch.bfloat16)
        fb = random_feedback(p, lay, fb_dtype, "cuda")
        y = torch.empty(p, lay.numel, dtype=torch.bfloat16, device="cuda")
        # flags for the largest grid any plan may launch (--plans included)
        slots = fk.signal_slots(torch.cuda.get_device_properties(0).multi_processor_count * fk.SMLimits.max_programs, p)
        table, bufs, pads = local_buffers(p, lay.chunk_bytes, slots, "cuda")
        out.append((x, fb, y, table, bufs, pads))
    return out


def verify(world: int, hidden: int, fb_dtype: torch.dtype, encoder: str = "absmax") -> list[str]:
    """The emulated whole kernel (barriers on), three chained calls, against
    the composed references (quantizing with ``encoder``): output bits on
    every rank, feedback bits, and every flag back at 0. Returns the mismatches."""
    from .. import quant
    from ..kernels import fused_kernel as fk

    lay = WireLayout(37 * hidden, world, 32, hidden)
    (x, fb, y, table, bufs, pads), = _buffers(lay, 1, fb_dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiling = fk.tiling_for(lay, sms // world)
    fb_ref = fb.cpu().clone()
    bad = []
    for call in range(3):
        xs = torch.randn(world, lay.numel, device="cuda").to(torch.bfloat16) * (10.0 ** (call - 1))
        fk.fused_all_reduce(xs, fb, table, lay, rank=0, gathered_offset=world * lay.chunk_bytes, qmax=7,
                            hadamard=True, has_incoming=call > 0, tiling=tiling, timeout_ns=10 * 10**9,
                            encoder=encoder, out=y)
        wire = quant.stage1_reference(xs.cpu(), fb_ref, lay, qmax=7, hadamard=True, has_incoming=call > 0,
                                      encoder=encoder)
        q2 = quant.stage2_reference(wire.transpose(0, 1).contiguous(), fb_ref, list(range(world)), lay, qmax=7,
                                    encoder=encoder)
        want = quant.output_reference(q2, lay, torch.bfloat16, hadamard=True)
        for r in range(world):
            if not torch.equal(y[r].cpu().view(torch.int16), want.view(torch.int16)):
                bad.append(f"P={world} {encoder} call {call} rank {r}: output bits differ")
    if not torch.equal(fb.cpu().view(torch.uint8), fb_ref.view(torch.uint8)):
        bad.append(f"P={world} {encoder}: feedback bits differ")
    if any(int(p.abs().sum()) for p in pads):
        bad.append(f"P={world} {encoder}: flags not back at 0")
    return bad


def parse_plan(spec: str, layout: WireLayout, sms: int):
    """``tile_values:num_warps:per_sm`` -> the ``FusedTiling`` it names for
    ``layout`` on ``sms`` SMs (a tuning override of ``TILE_TABLE``)."""
    from ..kernels import fused_kernel as fk

    tile, warps, per_sm = (int(v) for v in spec.split(":"))
    groups = tile // layout.group_size
    tiles = -(-layout.chunk_groups // groups)
    return fk.FusedTiling(groups, warps, min(tiles, sms * per_sm), fk.register_cap(per_sm, warps))


def plan_specs(text: str) -> list[str]:
    """argparse type of ``--plans``: a comma list of ``tile_values:num_warps:per_sm``
    (a tile of whole groups of 32, 1..32 warps, 1..32 programs per SM)."""
    specs = [t.strip() for t in text.split(",") if t.strip()]
    for spec in specs:
        parts = spec.split(":")
        ok = len(parts) == 3 and all(p.isdigit() for p in parts)
        tile, warps, per_sm = (int(p) for p in parts) if ok else (0, 0, 0)
        if not (ok and tile >= 32 and tile % 32 == 0 and 1 <= warps <= 32 and 1 <= per_sm <= 32):
            raise argparse.ArgumentTypeError(
                f"{spec!r}: expected tile_values:num_warps:per_sm, a tile of whole groups of 32 values, "
                "1 to 32 warps, 1 to 32 programs per SM (e.g. 2048:8:3)")
    if not specs:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of plans")
    return specs


def measure(world: int, size_bytes: int, hidden: int, sets: int, fb_dtype: torch.dtype, gbps: float,
            stages: bool = True, plan: str = "", encoders: tuple[str, ...] = ("absmax",)) -> Case:
    """One case's times: the phases alone, the emulated whole kernel and the
    stage kernels with the first of ``encoders``; phases 1 and 2 and stages
    1 and 2 again with each other one (``report.encoder_key``)."""
    from ..backends.triton_stages import TritonStages
    from ..kernels import fused_kernel as fk

    numel = size_bytes // 2
    lay = WireLayout(numel, world, 32, hidden)
    sets_ = _buffers(lay, sets, fb_dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one = parse_plan(plan, lay, sms) if plan else fk.tiling_for(lay, sms)  # one rank per GPU
    emul = parse_plan(plan, lay, sms // world) if plan else fk.tiling_for(lay, sms // world)  # P ranks share it
    case = Case(world, size_bytes, hidden, plan=one._asdict(), bytes=phase_bytes(lay, fb_dtype))
    kw = dict(gathered_offset=world * lay.chunk_bytes, qmax=7, hadamard=True, has_incoming=True,
              timeout_ns=10 * 10**9, encoder=encoders[0])

    for ph, enc in [(1, e) for e in encoders] + [(2, e) for e in encoders] + [(3, encoders[0])]:
        def run(i, ph=ph, enc=enc):
            x, fb, y, table, _, _ = sets_[i % sets]
            fk.fused_all_reduce(x[:1], fb[:1], table, lay, rank=0, tiling=one, out=y[0], phase=ph,
                                **{**kw, "encoder": enc})
        key = report.encoder_key(f"phase{ph}", enc, encoders)
        case.times_us[key] = timing.cuda_graph_time(run, iters=10, calls_per_graph=sets).median_s * 1e6
    case.times_us["phases"] = sum(case.times_us[f"phase{ph}"] for ph in (1, 2, 3))

    def whole(i):
        x, fb, y, table, _, _ = sets_[i % sets]
        fk.fused_all_reduce(x, fb, table, lay, rank=0, tiling=emul, out=y, **kw)
    case.times_us["emulated_per_rank"] = timing.cuda_graph_time(whole, iters=5, calls_per_graph=sets).median_s * 1e6 / world

    for ph in ("phase1", "phase2", "phase3"):
        case.sol_us[ph] = sol_seconds(*case.bytes[ph], sets) * 1e6

    if stages:
        st = TritonStages()
        x, fb, y, _, _, _ = sets_[0]
        wire = torch.empty(1, world, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
        recv = torch.empty_like(wire)
        q2 = torch.empty(1, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
        gathered = torch.empty(world, lay.chunk_bytes, dtype=torch.uint8, device="cuda")
        def stage1(e):
            return lambda i: st.stage1(sets_[i % sets][0][:1], sets_[i % sets][1][:1], lay, qmax=7, hadamard=True,
                                       has_incoming=True, encoder=e, out=wire)

        def stage2(e):
            return lambda i: st.stage2(recv, sets_[i % sets][1][:1], [0], lay, qmax=7, encoder=e, out=q2)

        runs = {
            **{report.encoder_key("stage1", e, encoders): stage1(e) for e in encoders},
            **{report.encoder_key("stage2", e, encoders): stage2(e) for e in encoders},
            "output": lambda i: st.output(gathered, lay, torch.bfloat16, hadamard=True, out=sets_[i % sets][2][0]),
        }
        for name, run in runs.items():
            case.times_us[name] = timing.cuda_graph_time(run, iters=10, calls_per_graph=sets).median_s * 1e6
    return case


def table(cases: list[Case], gbps: float) -> str:
    keys = ["phase1", "phase2", "phase3", "stage1", "stage2", "output"]
    head = (f"{'P':>2} {'size':>8} | " + " | ".join(f"{k:>15}" for k in keys)
            + f" | {'phases':>7} | {'emul/rank':>9}")
    lines = [head, f"{'':>11} | " + " | ".join(f"{'us (%roof)':>15}" for _ in keys) + f" | {'us':>7} | {'us':>9}",
             "-" * len(head)]
    for c in cases:
        cells = []
        for k in keys:
            t = c.times_us.get(k)
            cells.append(f"{t:8.1f} ({100 * c.roof(k, gbps):3.0f}%)" if t else f"{'-':>15}")
        lines.append(f"{c.world_size:>2} {report.human_bytes(c.size_bytes):>8} | " + " | ".join(cells)
                     + f" | {c.times_us['phases']:7.1f} | {c.times_us['emulated_per_rank']:9.1f}")
    lines.append("")
    lines.append("speed of light (same bytes, same read:write mix, trivial arithmetic), us (%roof):")
    for c in cases:
        sol = "  ".join(f"{k} {c.sol_us[k]:7.1f} ({100 * sum(c.bytes[k]) / (gbps * 1e3) / c.sol_us[k]:3.0f}%)"
                        for k in ("phase1", "phase2", "phase3"))
        lines.append(f"  P={c.world_size} {report.human_bytes(c.size_bytes):>8} {c.plan}: {sol}")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--world-sizes", type=counts(2, MAX_RANKS, RANKS_WHY), default="2,4,8")
    ap.add_argument("--sizes", type=report.message_sizes(), default="64M,1G",
                    help="message bytes per rank (bf16)")
    ap.add_argument("--hidden", type=count(1, 1 << 20), default=8192, help="values per row")
    ap.add_argument("--buffer-sets", type=count(1, 64, "each set is a full copy of the buffers"), default=3,
                    help="rotating input/buffer sets (>= 3: L2 holds 60 MB)")
    ap.add_argument("--feedback-dtype", default="bfloat16", choices=tuple(FEEDBACK_STORAGE),
                    help="the feedback buffer's format (int8: codes + a bf16 scale per group)")
    ap.add_argument("--encoders", type=choice_list(ENCODERS), default=EchoConfig.encoder,
                    help="comma list of encoders (EchoConfig.encoder) to time phases 1 and 2 and stages 1 and 2 "
                         "with, in one run; the first is the whole kernel's, the others are compared with it")
    ap.add_argument("--no-stages", action="store_true", help="skip the composed stage kernels")
    ap.add_argument("--plans", type=plan_specs, default=None,
                    help="tuning: tile_values:num_warps:per_sm plans to time instead of "
                                                "TILE_TABLE's (comma-separated; e.g. 2048:8:3,1024:4:8)")
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--out", type=out_dir, default=None)


def run(args: argparse.Namespace) -> int:
    if args.out:
        check_names(args.out, ("fused.json",))
    if not torch.cuda.is_available():
        print("bench fused: needs a CUDA GPU", file=sys.stderr)
        return 2
    fb_dtype = FEEDBACK_STORAGE[args.feedback_dtype]
    worlds, sizes, encoders = args.world_sizes, args.sizes, tuple(args.encoders)
    if not args.skip_verify:
        bad = [b for p in worlds for e in encoders for b in verify(p, args.hidden, fb_dtype, e)]
        if not verified("bench fused", bad, "the references",
                        f"emulated whole kernel == references bit for bit, flags reset (P={worlds})"):
            return 1
    gbps, name = device_line(args.buffer_sets)
    cases = []
    for p in worlds:
        for z in sizes:
            for plan in args.plans or [""]:
                cases.append(measure(p, z, args.hidden, args.buffer_sets, fb_dtype, gbps, not args.no_stages, plan,
                                     encoders))
                print(json.dumps(asdict(cases[-1])), flush=True)
    print(table(cases, gbps))
    if len(encoders) > 1:
        print(f"\nphases 1, 2 and stages 1, 2 by encoder (x: against {encoders[0]})")
        print(report.encoder_table([(f"P={c.world_size} {report.human_bytes(c.size_bytes)}", c.times_us)
                                    for c in cases], ("phase1", "phase2", "stage1", "stage2"), encoders))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json(Path(args.out) / "fused.json",
                   {"device": name, "copy_gbps": gbps, "sm_clock": sm_clock_mhz(), "feedback_dtype": args.feedback_dtype,
                    "encoders": list(encoders), "cases": [asdict(c) for c in cases]}, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="echo-vllm bench fused", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
