"""Echo with the residual add and RMSNorm fused into its output phase, against Echo then the norm, on one GPU.

``echo-vllm bench norm [--world-sizes 8,4,2] [--tokens 1024,4096,8192] [--hidden 4096] [--out DIR]``

For each P and prompt length T (bf16 rows of ``--hidden`` values, Qwen3-8B's
4096 by default), the per-rank time of:

* **(a) Echo, then the norm**: the fused kernel (every rank of P emulated
  in one launch, time over P) plus one rank's ``fused_add_rms_norm`` of the
  ``[T, hidden]`` output: vLLM's op as it serves it under compilation
  (its IR op's ``native`` code compiled by Inductor: ``rmsnorm.add_rms_norm``
  under ``torch.compile``), and vLLM's eager CUDA kernel
  (``torch.ops._C.fused_add_rms_norm``) where vLLM is importable -- the
  same bytes (two reads, two writes) with the sum rounded before the
  variance; the table says which ran;
* **(b) the fused Echo + add + norm** (``fused_all_reduce_norm``, every
  rank in one launch, time over P), and Echo alone, the same way (the
  goal: (b) within 10% of Echo alone); where the plan reads a tile's rows
  in one pass (``rmsnorm_plan.one_pass_rows``), (b) in two passes too ("2
  passes": what the one pass buys, measured in the same run);
* **(c) the phases of (b)** alone (one rank, no barriers), each against its
  memory roofline: the bytes it must move (:func:`norm_phase_bytes`) at the
  copy bandwidth measured in the same run.

The emulation measures the kernels' HBM traffic, not NVLink: every "remote"
store lands in local memory. Before timing, the emulated norm kernel is
checked bit for bit against the composed stage kernels (``output_norm``),
under each plan it times, and the run stops on a mismatch.

``--measure-layer`` times the layer's compute (GEMMs and attention at the
TP shard sizes, :mod:`.layer_compute`) on this GPU for every measured
(P, T), or ``--layer-us TP:T:us,...`` gives it; either adds a
**projection** of Qwen3-8B's time to first token (:func:`ttft_projection`,
labelled as one) at each measured P with NCCL at 370 and 480 GB/s bus
bandwidth. Prints tables; with ``--out DIR`` writes ``norm.json`` and, with
matplotlib, ``norm.png`` (and ``ttft_projection.png``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..cli_args import MAX_RANKS, RANKS_WHY, count, counts, existing_file, out_dir
from ..outputs import check_names, save_figure, write_json
from ..quant import WireLayout
from . import report, timing
from .fused_bench import device_line, phase_bytes, sm_clock_mhz, verified
from .layer_compute import QWEN3_8B
from .layer_compute import measure_us as layer_us_measured
from .projection import echo_time_s, nccl_time_s

#: Qwen3-8B: decoder layers, hidden size, all-reduces per layer (attention and MLP outputs).
QWEN3_8B_LAYERS = 36
QWEN3_8B_HIDDEN = 4096
ALLREDUCES_PER_LAYER = 2
#: NCCL bus bandwidths the projection assumes (GB/s): measured-like and best case on 8 x H200 NVLink.
NCCL_BUSBW_GBPS = (370.0, 480.0)
EPS = 1e-6


def norm_phase_bytes(layout: WireLayout, fb_dtype: torch.dtype = torch.bfloat16,
                     elem_bytes: int = 2) -> dict[str, tuple[int, int]]:
    """``(read, written)`` bytes per rank: ``fused_bench.phase_bytes``' phases
    1-2, phase 3 with the norm (the gathered chunks, the residual and the
    weight in; the new residual and the normalised rows out), and the
    unfused norm after Echo (``y`` and the residual in, both out)."""
    b = phase_bytes(layout, fb_dtype, elem_bytes)
    n, w = layout.numel * elem_bytes, layout.cols * elem_bytes
    return {
        "phase1": b["phase1"], "phase2": b["phase2"], "phase3": b["phase3"],
        "phase3_norm": (b["phase3"][0] + n + w, 2 * n),
        "norm": (2 * n + w, 2 * n),
    }


@dataclass(frozen=True)
class LayerTimes:
    """What one decoder layer of a TP rank spends, per prompt (seconds)."""

    compute_s: float
    """GEMMs and attention at the shard sizes (measured; an input)."""
    allreduce_s: float
    """All-reduce time, each of :data:`ALLREDUCES_PER_LAYER`."""
    norm_s: float
    """The add + norm after each all-reduce, when it is not fused (else 0)."""

    def total_s(self) -> float:
        return self.compute_s + ALLREDUCES_PER_LAYER * (self.allreduce_s + self.norm_s)


def ttft_projection(tp: int, tokens: int, layer_compute_us: float, *, echo_us: float, echo_norm_us: float,
                    norm_us: float, busbw_gbps: float, hidden: int = QWEN3_8B_HIDDEN,
                    layers: int = QWEN3_8B_LAYERS, overlapped: bool = False) -> dict:
    """A **projection** of the prefill time (time to first token, less the
    embedding, lm_head and scheduling) of a ``layers``-layer model at
    tensor parallelism ``tp`` for a ``tokens``-token prompt: ``layers *
    (compute + 2 * (all-reduce + norm))`` with

    * NCCL: ``fused_bench``'s bus-bandwidth model of a 16-bit all-reduce of
      ``tokens x hidden`` bf16, then the norm (``norm_us``, measured);
    * Echo: its kernel (``echo_us``, measured per rank) plus the 4-bit wire
      at the same bus bandwidth (serial, or ``overlapped``), then the norm;
    * Echo + norm: the fused kernel (``echo_norm_us``) plus the wire, no norm.

    Returns the three times (us) and the speedups over NCCL."""
    lay = WireLayout(tokens * hidden, tp, 32, hidden)
    wire = lay.wire_bytes_per_rank
    per = {
        "nccl": LayerTimes(layer_compute_us * 1e-6, nccl_time_s(tokens * hidden * 2, tp, busbw_gbps), norm_us * 1e-6),
        "echo": LayerTimes(layer_compute_us * 1e-6, echo_time_s(echo_us * 1e-6, wire, busbw_gbps,
                                                                 overlapped=overlapped), norm_us * 1e-6),
        "echo_norm": LayerTimes(layer_compute_us * 1e-6, echo_time_s(echo_norm_us * 1e-6, wire, busbw_gbps,
                                                                      overlapped=overlapped), 0.0),
    }
    us = {k: layers * v.total_s() * 1e6 for k, v in per.items()}
    return {"projection": True, "tp": tp, "tokens": tokens, "busbw_gbps": busbw_gbps, "overlapped": overlapped,
            "layer_compute_us": layer_compute_us, "ttft_us": us,
            "speedup_echo": us["nccl"] / us["echo"], "speedup_echo_norm": us["nccl"] / us["echo_norm"]}


def parse_layer_us(spec: str) -> dict[tuple[int, int], float]:
    """``"TP:T:us,..."`` -> ``{(tp, tokens): us}`` (the layer compute the lead measures)."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            tp_s, tokens_s, us_s = item.split(":")
            tp, tokens, us = int(tp_s), int(tokens_s), float(us_s)
        except ValueError:
            raise ValueError(f"--layer-us {item!r}: expected TP:TOKENS:MICROSECONDS") from None
        if not (2 <= tp <= MAX_RANKS and tokens >= 1 and 0 < us < math.inf):  # NaN fails too
            raise ValueError(f"--layer-us {item!r}: TP from 2 to {MAX_RANKS}, TOKENS >= 1 and a positive, "
                             "finite time")
        if (tp, tokens) in out:
            raise ValueError(f"--layer-us {item!r}: TP={tp} T={tokens} is given twice")
        out[(tp, tokens)] = us
    return out


# -- measured on the GPU ---------------------------------------------------------------


@dataclass
class NormCase:
    world_size: int
    tokens: int
    hidden: int
    plan: dict
    bytes: dict
    times_us: dict = field(default_factory=dict)
    norm_impls: dict = field(default_factory=dict)
    """The unfused norm's time by implementation (us)."""

    def roof(self, key: str, gbps: float) -> float:
        b = self.bytes.get(key)
        return sum(b) / (gbps * 1e3) / self.times_us[key] if b and self.times_us.get(key) else float("nan")


def _norm_impls(w: torch.Tensor) -> dict:
    """The unfused norms to time: ``name -> fn(y, residual)`` (in place or not: the same bytes)."""
    from .. import rmsnorm

    impls = {"inductor": torch.compile(lambda y, r: rmsnorm.add_rms_norm(y, r, w, EPS), dynamic=False)}
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

        impls["vllm_c"] = lambda y, r: torch.ops._C.fused_add_rms_norm(y, r, w, EPS)
    except Exception:  # pragma: no cover - depends on the host
        pass
    return impls


def verify_norm(world: int, hidden: int) -> list[str]:
    """Every rank of the norm kernel in one launch (barriers on) against
    the composed stage kernels and ``output_norm``: bits of the output, the
    new residual and the feedback, under each plan :func:`_plans` times."""
    from ..rmsnorm_plan import norm_tiling

    lay = WireLayout(37 * hidden, world, 32, hidden)
    tiling, reason = norm_tiling(lay)
    if tiling is None:
        return [f"P={world} hidden={hidden}: {reason}"]
    return [b for plan in _plans(lay).values() for b in _verify_plan(world, lay, plan)]


def _plans(lay: WireLayout) -> dict:
    """The output phase's plans to time: the plan's own, and two passes where
    the plan takes one (so each run measures what one pass buys)."""
    from ..rmsnorm_plan import norm_tiling

    plans = {"plan": norm_tiling(lay)[0]}
    if plans["plan"].one_pass_rows:
        plans["two_pass"] = norm_tiling(lay, one_pass=False)[0]
    return plans


def _verify_plan(world: int, lay: WireLayout, tiling) -> list[str]:
    from .. import kernels
    from ..backends.fused import local_buffers
    from ..kernels import fused_kernel as fk

    hidden = lay.cols
    sms = torch.cuda.get_device_properties(0).multi_processor_count // world
    fused_tiling = fk.tiling_for_norm(lay, tiling, sms)
    table, bufs, _ = local_buffers(world, lay.chunk_bytes, fk.signal_slots(fused_tiling.programs, world), "cuda")
    x = torch.randn(world, lay.numel, device="cuda").to(torch.bfloat16)
    fb = torch.zeros(world, lay.padded_numel, dtype=torch.bfloat16, device="cuda")
    fb_c = fb.clone()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    res = torch.randn(lay.numel, device="cuda").to(torch.bfloat16)
    ress = res.repeat(world, 1)
    out, _ = fk.fused_all_reduce_norm(x, fb, table, lay, w, EPS, residual=ress, rank=0,
                                      gathered_offset=bufs[0].numel() // 2, qmax=7, hadamard=True,
                                      has_incoming=False, tiling=fused_tiling, timeout_ns=10 * 10**9)
    wire = kernels.stage1(x, fb_c, lay, qmax=7, hadamard=True, has_incoming=False)
    q2 = kernels.stage2(wire.transpose(0, 1).contiguous(), fb_c, list(range(world)), lay, qmax=7)
    want, want_res = kernels.output_norm(q2, lay, torch.bfloat16, w, EPS, hadamard=True, residual=res)
    bad, what = [], "one pass" if tiling.one_pass_rows else "two passes"
    for r in range(world):
        if not torch.equal(out[r].view(torch.int16), want.view(torch.int16)):
            bad.append(f"P={world} rank {r} ({what}): normed output bits differ")
        if not torch.equal(ress[r].view(torch.int16), want_res.view(torch.int16)):
            bad.append(f"P={world} rank {r} ({what}): new residual bits differ")
    if not torch.equal(fb.view(torch.int16), fb_c.view(torch.int16)):
        bad.append(f"P={world} ({what}): feedback bits differ")
    return bad


def measure_norm(world: int, tokens: int, hidden: int, sets: int) -> NormCase:
    from ..backends.fused import local_buffers
    from ..kernels import fused_kernel as fk
    from ..rmsnorm_plan import norm_tiling

    lay = WireLayout(tokens * hidden, world, 32, hidden)
    tiling, reason = norm_tiling(lay)
    if tiling is None:
        raise ValueError(f"P={world} hidden={hidden}: {reason}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    emul, emul_norm = fk.tiling_for(lay, sms // world), fk.tiling_for_norm(lay, tiling, sms // world)
    one_norm = fk.tiling_for_norm(lay, tiling, sms)
    case = NormCase(world, tokens, hidden, plan=emul_norm._asdict(), bytes=norm_phase_bytes(lay))
    slots = fk.signal_slots(sms * fk.max_per_sm(), world)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    bufs = []
    for _ in range(sets):
        x = torch.randn(world, lay.numel, device="cuda").to(torch.bfloat16)
        table, peer, _ = local_buffers(world, lay.chunk_bytes, slots, "cuda")
        bufs.append(dict(x=x, fb=torch.zeros(world, lay.padded_numel, dtype=torch.bfloat16, device="cuda"),
                         y=torch.empty_like(x), res=torch.randn_like(x), out=torch.empty_like(x), table=table,
                         peer=peer))
    kw = dict(gathered_offset=world * lay.chunk_bytes, qmax=7, hadamard=True, has_incoming=True,
              timeout_ns=10 * 10**9)

    def echo(i):
        b = bufs[i % sets]
        fk.fused_all_reduce(b["x"], b["fb"], b["table"], lay, rank=0, tiling=emul, out=b["y"], **kw)

    def echo_norm(i):
        b = bufs[i % sets]
        fk.fused_all_reduce_norm(b["x"], b["fb"], b["table"], lay, w, EPS, residual=b["res"], rank=0,
                                 tiling=emul_norm, out=b["out"], **kw)

    case.times_us["echo"] = timing.cuda_graph_time(echo, iters=5, calls_per_graph=sets).median_s * 1e6 / world
    case.times_us["echo_norm"] = timing.cuda_graph_time(echo_norm, iters=5, calls_per_graph=sets).median_s * 1e6 / world
    if "two_pass" in (plans := _plans(lay)):
        two = fk.tiling_for_norm(lay, plans["two_pass"], sms // world)

        def echo_norm_two_pass(i):
            b = bufs[i % sets]
            fk.fused_all_reduce_norm(b["x"], b["fb"], b["table"], lay, w, EPS, residual=b["res"], rank=0,
                                     tiling=two, out=b["out"], **kw)
        case.times_us["echo_norm_two_pass"] = (
            timing.cuda_graph_time(echo_norm_two_pass, iters=5, calls_per_graph=sets).median_s * 1e6 / world)
    for ph in (1, 2, 3):
        def run(i, ph=ph):
            b = bufs[i % sets]
            fk.fused_all_reduce_norm(b["x"][:1], b["fb"][:1], b["table"], lay, w, EPS, residual=b["res"][0],
                                     rank=0, tiling=one_norm, out=b["out"][0], phase=ph, **kw)
        case.times_us[f"phase{ph}" if ph < 3 else "phase3_norm"] = (
            timing.cuda_graph_time(run, iters=10, calls_per_graph=sets).median_s * 1e6)
    for name, fn in _norm_impls(w).items():
        def run(i, fn=fn):
            b = bufs[i % sets]
            fn(b["y"][0].view(tokens, hidden), b["res"][0].view(tokens, hidden))
        case.norm_impls[name] = timing.cuda_graph_time(run, iters=10, calls_per_graph=sets).median_s * 1e6
    case.times_us["norm"] = case.norm_impls["inductor"]
    case.times_us["echo_then_norm"] = case.times_us["echo"] + case.times_us["norm"]
    return case


def table(cases: list[NormCase], gbps: float) -> str:
    head = (f"{'P':>2} {'T':>5} | {'(a) Echo+norm':>13} | {'(b) fused':>9} | {'2 passes':>8} | {'Echo alone':>10} | "
            f"{'b/Echo':>6} | {'saved':>6} | (c) phases alone, us (%roof): phase1, phase2, phase3+norm | norm impls, us")
    lines = [head, "-" * len(head)]
    for c in cases:
        t = c.times_us
        phases = ", ".join(f"{t[k]:.1f} ({100 * c.roof(k, gbps):.0f}%)" for k in ("phase1", "phase2", "phase3_norm"))
        impls = ", ".join(f"{k} {v:.1f}" for k, v in c.norm_impls.items())
        two = f"{t['echo_norm_two_pass']:8.1f}" if "echo_norm_two_pass" in t else f"{'-':>8}"
        lines.append(f"{c.world_size:>2} {c.tokens:>5} | {t['echo_then_norm']:13.1f} | {t['echo_norm']:9.1f} | {two} | "
                     f"{t['echo']:10.1f} | {t['echo_norm'] / t['echo']:6.2f} | "
                     f"{t['echo_then_norm'] - t['echo_norm']:6.1f} | {phases} | {impls}")
    lines.append("(a) = Echo alone + the inductor norm (what vLLM runs under compilation); per rank, P ranks emulated "
                 "in one launch; 2 passes = (b) with the output phase in two passes where the plan takes one")
    return "\n".join(lines)


def projection_table(rows: list[dict]) -> str:
    lines = ["PROJECTION (not measured): Qwen3-8B prefill, 36 layers x (compute + 2 x (all-reduce + norm)), "
             "NCCL by its bus-bandwidth model, Echo = measured kernel + 4-bit wire at the same bandwidth",
             f"{'TP':>2} {'T':>5} {'busbw':>6} | {'NCCL ms':>8} | {'Echo ms':>8} {'x':>5} | {'Echo+norm ms':>12} {'x':>5}"]
    for r in rows:
        us = r["ttft_us"]
        lines.append(f"{r['tp']:>2} {r['tokens']:>5} {r['busbw_gbps']:>6.0f} | {us['nccl'] / 1e3:8.2f} | "
                     f"{us['echo'] / 1e3:8.2f} {r['speedup_echo']:5.2f} | {us['echo_norm'] / 1e3:12.2f} "
                     f"{r['speedup_echo_norm']:5.2f}")
    return "\n".join(lines)


def projections(cases: list[NormCase], layer_us: dict[tuple[int, int], float]) -> list[dict]:
    """:func:`ttft_projection` of every measured (P, T) with a layer time, at each NCCL bandwidth."""
    rows = []
    for c in cases:
        compute = layer_us.get((c.world_size, c.tokens))
        if compute is None:
            continue
        for bw in NCCL_BUSBW_GBPS:
            rows.append(ttft_projection(c.world_size, c.tokens, compute, echo_us=c.times_us["echo"],
                                        echo_norm_us=c.times_us["echo_norm"], norm_us=c.times_us["norm"],
                                        busbw_gbps=bw, hidden=c.hidden))
    return rows


def plot(cases: list[NormCase], path: Path) -> bool:
    """Bars of (a), (b) and Echo alone per case; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases)), 4))
    labels = [f"P={c.world_size}\nT={c.tokens}" for c in cases]
    xs = range(len(cases))
    for k, (key, name) in enumerate([("echo_then_norm", "(a) Echo, then the norm"), ("echo_norm", "(b) fused"),
                                     ("echo", "Echo alone")]):
        ax.bar([x + 0.27 * (k - 1) for x in xs], [c.times_us[key] for c in cases], width=0.27, label=name)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("us per rank (emulated)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return True


def plot_projection(rows: list[dict], path: Path) -> bool:
    """The projected TTFT speed-ups over NCCL per (TP, T), one panel per bus
    bandwidth, titled as a projection; False without matplotlib or rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    bws = sorted({r["busbw_gbps"] for r in rows})
    if not bws:
        return False
    fig, axes = plt.subplots(1, len(bws), figsize=(6 * len(bws), 4), squeeze=False)
    for ax, bw in zip(axes[0], bws):
        sel = [r for r in rows if r["busbw_gbps"] == bw]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [r["speedup_echo"] for r in sel], width=0.4, label="Echo, then the norm")
        ax.bar([x + 0.2 for x in xs], [r["speedup_echo_norm"] for r in sel], width=0.4, label="Echo + norm fused")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(xs), [f"TP={r['tp']}\nT={r['tokens']}" for r in sel])
        ax.set_ylabel("TTFT speed-up over NCCL bf16")
        ax.set_title(f"PROJECTION: Qwen3-8B prefill, NCCL busbw {bw:.0f} GB/s")
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return True


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--world-sizes", type=counts(2, MAX_RANKS, RANKS_WHY), default="8,4,2")
    ap.add_argument("--tokens", type=counts(1), default="1024,4096,8192", help="prompt lengths (rows of the all-reduce)")
    ap.add_argument("--hidden", type=count(1, 1 << 20), default=QWEN3_8B_HIDDEN,
                    help="values per row (Qwen3-8B: 4096)")
    ap.add_argument("--buffer-sets", type=count(1, 64, "each set is a full copy of the buffers"), default=3,
                    help="rotating input/buffer sets (>= 3: L2 holds 60 MB)")
    ap.add_argument("--layer-us", default="", help="measured layer compute per TP and prompt, TP:T:us,... "
                                                   "(e.g. 8:8192:725): adds the TTFT projection")
    ap.add_argument("--measure-layer", action="store_true",
                    help="time Qwen3-8B's layer compute (GEMMs + attention at the shard sizes) on this GPU for each "
                         "(P, T) --layer-us does not give: adds the TTFT projection")
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--from-json", type=existing_file, default=None, metavar="NORM_JSON",
                    help="measure nothing: print the tables of a saved norm.json (no GPU needed) and its projection "
                         "with --layer-us; --out writes the JSON and PNGs again")
    ap.add_argument("--out", type=out_dir, default=None)


#: The files ``bench norm --out`` writes.
OUTPUTS = ("norm.json", "norm.png", "ttft_projection.png")


def run(args: argparse.Namespace) -> int:
    if args.out:
        check_names(args.out, OUTPUTS)
    try:
        layer_us = parse_layer_us(args.layer_us)
    except ValueError as e:
        print(f"bench norm: {e}", file=sys.stderr)
        return 2
    largest = max(args.tokens) * args.hidden * 2
    if largest > report.MAX_BENCH_BYTES:
        print(f"bench norm: --tokens {max(args.tokens)} x --hidden {args.hidden} is {report.human_bytes(largest)} "
              f"of bf16: at most {report.human_bytes(report.MAX_BENCH_BYTES)} ({report.MAX_BENCH_WHY})",
              file=sys.stderr)
        return 2
    if args.measure_layer and args.hidden != QWEN3_8B.hidden:
        print(f"bench norm: --measure-layer times Qwen3-8B's layer (hidden {QWEN3_8B.hidden}), "
              f"not --hidden {args.hidden}", file=sys.stderr)
        return 2
    if args.from_json:
        return report_saved(Path(args.from_json), layer_us, args.out)
    if not torch.cuda.is_available():
        print("bench norm: needs a CUDA GPU", file=sys.stderr)
        return 2
    worlds, tokens = args.world_sizes, args.tokens
    if not args.skip_verify:
        bad = [b for p in worlds for b in verify_norm(p, args.hidden)]
        if not verified("bench norm", bad, "the composed kernels",
                        f"emulated norm kernel == composed output_norm bit for bit (P={worlds})"):
            return 1
    gbps, name = device_line(args.buffer_sets)
    cases = []
    for p in worlds:
        for t in tokens:
            cases.append(measure_norm(p, t, args.hidden, args.buffer_sets))
            print(json.dumps(asdict(cases[-1])), flush=True)
    print(table(cases, gbps))
    if args.measure_layer:
        for c in cases:
            if (c.world_size, c.tokens) not in layer_us:
                layer_us[(c.world_size, c.tokens)] = layer_us_measured(QWEN3_8B, c.world_size, c.tokens)
        print("layer compute, GEMMs + attention at the shard sizes (us; measured here unless --layer-us gave it): "
              + ", ".join(f"TP={p} T={t}: {us:.0f}" for (p, t), us in sorted(layer_us.items())))
    proj = projections(cases, layer_us)
    if proj:
        print(projection_table(proj))
    if args.out:
        write_outputs(Path(args.out), {"device": name, "copy_gbps": gbps, "sm_clock": sm_clock_mhz(),
                                       "cases": [asdict(c) for c in cases]}, cases, layer_us, proj)
    return 0


def write_outputs(out: Path, run: dict, cases: list[NormCase], layer_us: dict[tuple[int, int], float],
                  proj: list[dict]) -> None:
    """``norm.json`` (``run``'s measurements, the layer times, the projection) and the PNGs under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / OUTPUTS[0], {**run, "layer_compute_us": {f"{p}:{t}": us for (p, t), us in sorted(layer_us.items())},
                                  "projection": proj}, indent=1)
    plot(cases, out / OUTPUTS[1])
    plot_projection(proj, out / OUTPUTS[2])


def report_saved(path: Path, layer_us: dict[tuple[int, int], float], out_dir: str) -> int:
    """The tables (and, with ``layer_us`` or the file's own layer times, the
    projection) of a ``norm.json`` a GPU run wrote: what :func:`run` prints,
    from its saved measurements."""
    try:  # everything printed is made first: a malformed file is refused in one line, nothing printed or written
        saved = json.loads(path.read_text())
        cases = [NormCase(**c) for c in saved["cases"]]
        layer_us = {**parse_layer_us(",".join(f"{k}:{v}" for k, v in saved.get("layer_compute_us", {}).items())),
                    **layer_us}
        proj = projections(cases, layer_us)
        lines = [f"measured on {saved.get('device')} (copy {saved['copy_gbps']:.0f} GB/s), from {path}",
                 table(cases, saved["copy_gbps"])] + ([projection_table(proj)] if proj else [])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError) as e:
        print(f"bench norm: --from-json {path}: not a norm.json of this bench ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    print("\n".join(lines))
    if out_dir:
        write_outputs(Path(out_dir), saved, cases, layer_us, proj)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="echo-vllm bench norm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
