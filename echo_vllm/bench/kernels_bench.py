"""``echo-vllm bench kernels``: every stage kernel of one Echo call, on one GPU.

For each world size P and message size it times the work ONE rank of P does
in one call (stage 1 on its whole message, stage 2 on the P chunks it
receives, the output decode of the P gathered chunks; and ``consume``, the
exact path's absorb), reports bytes/s against a measured device copy
(counting only the bytes a kernel must read and write), and projects the
all-reduce time on stated links (``projection``: labelled as such).

Two times exist for a kernel call: its device time (CUDA-graph replay: no
host in it) and its eager time (CUDA events around one Python call on an
idle stream: host launch work + device time, what an eager caller such as
vLLM's prefill waits). ``--timing auto`` takes the first below 1 MiB and the
second above; ``graph`` the first everywhere; ``both`` reports both, the
device time for bytes/s.

Before timing anything it checks the kernels against the references bit for
bit on a mid-sized message: a fast wrong kernel is not a result.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch

from .. import quant
from ..cli_args import MAX_RANKS, RANKS_WHY, UsageError, choice_list, count, counts, device, out_dir, real
from ..config import ENCODERS, SUPPORTED_GROUP_SIZES, EchoConfig
from ..outputs import check_names
from ..quant import FEEDBACK_STORAGE, WireLayout, feedback_row_len, write_feedback
from . import projection, report, timing


@dataclass
class KernelResult:
    name: str
    time_s: float
    """Seconds per call: device time when graph-timed, else eager time."""
    bytes_moved: int
    eager_s: float | None = None
    """Eager call time (host launch + device), with ``--timing both``."""

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.time_s / 1e9


@dataclass
class SizeResult:
    world_size: int
    size_bytes: int
    wire_bytes_per_rank: int
    kernels: dict[str, KernelResult] = field(default_factory=dict)

    def total_s(self, names) -> float:
        return sum(self.kernels[n].time_s for n in names)


ECHO_KERNELS = ("stage1", "stage2", "output")
NAIVE_KERNELS = ("naive_stage1", "naive_stage2", "naive_output")


# -- the operations under test ------------------------------------------------


def _backend(device: torch.device):
    """The stages under test: the Triton kernels on CUDA; on CPU (smoke
    runs) the references."""
    from ..backends.stages import ReferenceStages

    if device.type == "cuda":
        try:
            from ..backends.triton_stages import TritonStages
        except ImportError as e:
            raise SystemExit(f"bench kernels: {e}") from None
        return TritonStages()
    return ReferenceStages()


def random_feedback(rows: int, lay: WireLayout, fb_dtype: torch.dtype, device, gen=None) -> torch.Tensor:
    """A feedback buffer ``[rows, row length]`` in ``fb_dtype``'s format
    holding small carried errors (0.01 x normal draws) for ``lay``; written a
    row at a time (the int8 encode's temporaries take 4 bytes a value each)."""
    fb = torch.empty(rows, feedback_row_len(lay.padded_numel, fb_dtype, lay.group_size), dtype=fb_dtype,
                     device=device)
    for r in range(rows):
        write_feedback(fb[r:r + 1], 0, 1e-2 * torch.randn(1, lay.padded_numel, generator=gen, device=device),
                       lay.group_size)
    return fb


class Slot:
    """One set of input buffers (calls rotate through several)."""

    def __init__(self, backend, lay: WireLayout, fb_dtype: torch.dtype, device: torch.device, seed: int):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.randn(1, lay.numel, generator=gen, device=device).to(torch.bfloat16)
        self.fb = random_feedback(1, lay, fb_dtype, device, gen)
        # valid wire bytes: this rank's own stage-1 output stands in for what
        # it would receive (same sizes, same value statistics)
        wire = backend.stage1(self.x, None, lay, qmax=7, hadamard=False, has_incoming=False)
        self.recv = wire.contiguous()
        self.gathered = wire[0].contiguous()


def kernel_bytes(lay: WireLayout, fb_dtype: torch.dtype, in_elem_bytes: int = 2) -> dict[str, int]:
    """Bytes each kernel must read + write for one rank's share of one call
    (the numbers bytes/s are computed from); the feedback buffer in
    ``fb_dtype``'s format (int8: codes and scales)."""
    p, cb, n, x = lay.world_size, lay.chunk_bytes, lay.numel, in_elem_bytes
    fb = feedback_row_len(lay.padded_numel, fb_dtype, lay.group_size) * fb_dtype.itemsize
    own = feedback_row_len(lay.chunk_numel, fb_dtype, lay.group_size) * fb_dtype.itemsize
    return {
        "stage1": x * n + 2 * fb + p * cb,            # x, feedback in + out, wire
        "stage2": p * cb + 2 * own + cb,              # P chunks, own feedback chunk in + out, 1 chunk
        "output": p * cb + x * n,                     # P chunks, result
        "consume": x * n + fb + x * n,                # x, feedback, result
        "naive_stage1": x * n + p * cb,
        "naive_stage2": p * cb + cb,
        "naive_output": p * cb + x * n,
    }


def _ops(backend, lay: WireLayout, slots: list[Slot], outs: dict, qmax: int, hadamard: bool,
         encoders: tuple[str, ...] = ("absmax",)):
    """name -> (run(i), bytes it must move); stages 1 and 2 once per encoder
    (``report.encoder_key``), the naive ones with the first."""
    nbytes = kernel_bytes(lay, slots[0].fb.dtype)
    k = len(slots)
    first = encoders[0]

    def s(i):
        return slots[i % k]

    def consume(i):
        return backend.consume(s(i).x, s(i).fb, lay, hadamard=hadamard, out=outs["x"])

    def stage1(e):
        return lambda i: backend.stage1(s(i).x, s(i).fb, lay, qmax=qmax, hadamard=hadamard, has_incoming=True,
                                        encoder=e, out=outs["wire"])

    def stage2(e):
        return lambda i: backend.stage2(s(i).recv, s(i).fb, [0], lay, qmax=qmax, encoder=e, out=outs["q2"])

    runs = {
        **{report.encoder_key("stage1", e, encoders): stage1(e) for e in encoders},
        **{report.encoder_key("stage2", e, encoders): stage2(e) for e in encoders},
        "output": lambda i: backend.output(s(i).gathered, lay, torch.bfloat16, hadamard=hadamard,
                                           out=outs["y"]),
        "consume": consume,
        "naive_stage1": lambda i: backend.stage1(s(i).x, None, lay, qmax=qmax, hadamard=False,
                                                 has_incoming=False, encoder=first, out=outs["wire"]),
        "naive_stage2": lambda i: backend.stage2(s(i).recv, None, [0], lay, qmax=qmax, encoder=first,
                                                 out=outs["q2"]),
        "naive_output": lambda i: backend.output(s(i).gathered, lay, torch.bfloat16, hadamard=False,
                                                 out=outs["y"]),
    }
    return {name: (run, nbytes[name.split()[0]]) for name, run in runs.items()}


# -- verification -------------------------------------------------------------


def message_layout(numel: int, world_size: int, group_size: int, hidden: int) -> WireLayout:
    """The layout of a message of ``numel`` values in rows of ``hidden``
    (0, or a ``hidden`` that does not divide ``numel``: one row)."""
    cols = hidden if hidden and numel % hidden == 0 else 0
    return WireLayout(numel, world_size, group_size, cols)


def verify(backend, device: torch.device, cfg: EchoConfig, world_size: int, numel: int = 3 * (1 << 20) + 77,
           passes: int = 2, hidden: int = 0) -> list[str]:
    """Kernel vs reference (run on the same device), bit for bit, for one
    Echo call and one naive call, ``passes`` times: the first launch of a
    shape goes through Triton's dispatch, the later ones launch the compiled
    kernel directly (``kernels.direct_launch``), and both must be right.
    Returns what differs (empty: all equal)."""
    bad: list[str] = []
    for i in range(passes):
        bad += [f"{b} (pass {i + 1})" for b in _verify_once(backend, device, cfg, world_size, numel, hidden)]
    return bad


def _verify_once(backend, device: torch.device, cfg: EchoConfig, world_size: int, numel: int,
                 hidden: int = 0) -> list[str]:
    lay = message_layout(numel, world_size, cfg.group_size, hidden)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(world_size, numel, generator=gen, device=device)
    x = (x * torch.exp(torch.randn(world_size, numel, generator=gen, device=device))).to(torch.bfloat16)
    fb0 = random_feedback(world_size, lay, FEEDBACK_STORAGE[cfg.feedback_dtype], device, gen)
    own = list(range(world_size))
    bad = []
    for name, fb, had in (("echo", fb0, cfg.hadamard), ("naive", None, False)):
        fb_ref = None if fb is None else fb.clone()
        fb_ker = None if fb is None else fb.clone()
        inc = fb is not None
        enc = cfg.encoder
        w_ref = quant.stage1_reference(x, fb_ref, lay, qmax=cfg.qmax, hadamard=had, has_incoming=inc, encoder=enc)
        w = backend.stage1(x, fb_ker, lay, qmax=cfg.qmax, hadamard=had, has_incoming=inc, encoder=enc)
        recv = w_ref.transpose(0, 1).contiguous()
        q_ref = quant.stage2_reference(recv, fb_ref, own, lay, qmax=cfg.qmax, encoder=enc)
        q = backend.stage2(recv, fb_ker, own, lay, qmax=cfg.qmax, encoder=enc)
        y_ref = quant.output_reference(q_ref, lay, torch.bfloat16, hadamard=had)
        y = backend.output(q_ref, lay, torch.bfloat16, hadamard=had)
        checks = {"stage1": (w, w_ref), "stage2": (q, q_ref)}
        checks["output"] = (y.view(torch.int16), y_ref.view(torch.int16))
        if fb is not None:
            checks["feedback"] = (fb_ker, fb_ref)
        bad += [f"{name}.{what}" for what, (got, want) in checks.items() if not torch.equal(got, want)]
    return bad


# -- measurement --------------------------------------------------------------


def _median_s(device: torch.device, run, iters: int) -> float:
    timer = timing.cuda_time if device.type == "cuda" else timing.host_time
    return timer(run, iters=iters).median_s


def measure_copy_gbps(device: torch.device, nbytes: int, iters: int) -> float:
    """Device-to-device copy: bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_s(device, lambda i: dst.copy_(src), iters) / 1e9


def measure_reference_gbps(device: torch.device, nbytes: int, iters: int) -> dict[str, float]:
    """Bytes/s of plain torch kernels with other read:write mixes than a
    copy's 1:1, for context: ``write`` (fill, 0:1) and ``add`` (bf16
    ``a + b``, 2:1). The kernels' mixes range from 3:1 (consume) to 1:4
    (output), and HBM need not move every mix at the copy's rate."""
    n = nbytes // 2
    dst = torch.empty(n, dtype=torch.bfloat16, device=device)
    a, b = torch.ones_like(dst), torch.ones_like(dst)
    out = {"write": n * 2 / _median_s(device, lambda i: dst.fill_(1.0), iters) / 1e9}
    out["add"] = n * 6 / _median_s(device, lambda i: torch.add(a, b, out=dst), iters) / 1e9
    return out


TIMINGS = ("auto", "graph", "both")


def time_call(run, device: torch.device, size_bytes: int, iters: int, mode: str = "auto"):
    """``(seconds per call, eager seconds or None)`` under timing ``mode``."""
    if device.type != "cuda":
        return timing.host_time(run, iters=iters).median_s, None
    if mode == "auto":
        timer = timing.cuda_graph_time if size_bytes < timing.GRAPH_BELOW_BYTES else timing.cuda_time
        return timer(run, iters=iters).median_s, None
    device_s = timing.cuda_graph_time(run, iters=iters).median_s
    return device_s, (timing.cuda_time(run, iters=iters).median_s if mode == "both" else None)


#: On CPU the reference stages' float32 temporaries come on top of the
#: buffers: peak RSS measured 27-28 x the message at 64 and 256 MiB, of
#: which the buffers are 7.5 x.
CPU_TEMPORARIES = 19


def memory_needed(size_bytes: int, world_size: int, cfg: EchoConfig, device: torch.device) -> int:
    """Bytes one size of :func:`measure_size` holds at once: its rotating
    input slots and outputs, plus on CPU the reference stages' temporaries
    (:data:`CPU_TEMPORARIES`); on CUDA a lower bound (temporaries not counted)."""
    lay = message_layout(size_bytes // 2, world_size, cfg.group_size, 0)
    fb_dtype = FEEDBACK_STORAGE[cfg.feedback_dtype]
    fb = feedback_row_len(lay.padded_numel, fb_dtype, lay.group_size) * fb_dtype.itemsize
    slot = 2 * lay.numel + fb + 2 * world_size * lay.chunk_bytes  # x, feedback, recv, gathered
    outs = (world_size + 1) * lay.chunk_bytes + 2 * 2 * lay.numel  # wire, q2, y, x
    temporaries = CPU_TEMPORARIES * size_bytes if device.type == "cpu" else 0
    return timing.rotation(size_bytes * (1 + fb_dtype.itemsize)) * slot + outs + temporaries


def device_memory_bytes(device: torch.device) -> int:
    """The device's whole memory: the GPU's, or the host's for ``cpu``."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_size(backend, device, cfg: EchoConfig, world_size: int, size_bytes: int, iters: int,
                 mode: str = "auto", hidden: int = 0, encoders: tuple[str, ...] = ()) -> SizeResult:
    """``encoders``: stages 1 and 2 timed with each (default: ``cfg.encoder``)."""
    lay = message_layout(size_bytes // 2, world_size, cfg.group_size, hidden)
    fb_dtype = FEEDBACK_STORAGE[cfg.feedback_dtype]
    n_slots = timing.rotation(size_bytes * (1 + fb_dtype.itemsize))
    slots = [Slot(backend, lay, fb_dtype, device, seed) for seed in range(n_slots)]
    outs = {
        "wire": torch.empty(1, world_size, lay.chunk_bytes, dtype=torch.uint8, device=device),
        "q2": torch.empty(1, lay.chunk_bytes, dtype=torch.uint8, device=device),
        "y": torch.empty(lay.numel, dtype=torch.bfloat16, device=device),
        "x": torch.empty(1, lay.numel, dtype=torch.bfloat16, device=device),
    }
    result = SizeResult(world_size, size_bytes, lay.wire_bytes_per_rank)
    for name, (run, nbytes) in _ops(backend, lay, slots, outs, cfg.qmax, cfg.hadamard,
                                    tuple(encoders) or (cfg.encoder,)).items():
        t, eager = time_call(run, device, size_bytes, iters, mode)
        result.kernels[name] = KernelResult(name, t, nbytes, eager)
    del slots
    return result


# -- output -------------------------------------------------------------------


def _size_table(results: list[SizeResult], names, cell_head, cell, tail_head: str, tail) -> str:
    """One row per (P, size): ``cell(kernel)`` for each of ``names``, then ``tail(row)``."""
    head = f"{'P':>2} {'size':>9} |" + "".join(cell_head(n) for n in names) + tail_head
    lines = [head, "-" * len(head)]
    for r in results:
        cells = "".join(cell(r.kernels[n]) for n in names)
        lines.append(f"{r.world_size:>2} {report.human_bytes(r.size_bytes):>9} |{cells}{tail(r)}")
    return "\n".join(lines)


def kernel_table(results: list[SizeResult], copy_gbps: float) -> str:
    """Per size: each kernel's time and its bytes/s as % of the copy."""
    short = {"naive_stage1": "n.stage1", "naive_stage2": "n.stage2", "naive_output": "n.output"}
    return _size_table(
        results, ECHO_KERNELS + ("consume",) + NAIVE_KERNELS,
        lambda n: f" {short.get(n, n) + ' us':>11} {'%cp':>4} |",
        lambda k: f" {k.time_s * 1e6:11.1f} {100 * k.gbps / copy_gbps:4.0f} |",
        f" {'echo us':>9} {'naive us':>9}",
        lambda r: f" {r.total_s(ECHO_KERNELS) * 1e6:9.1f} {r.total_s(NAIVE_KERNELS) * 1e6:9.1f}",
    )


def eager_table(results: list[SizeResult]) -> str:
    """Per size: each kernel's eager call time (host + device) beside its
    device time, and the Echo call's sum of both ("" if not measured)."""
    names = ECHO_KERNELS + ("consume",)
    rows = [r for r in results if all(r.kernels[n].eager_s is not None for n in names)]
    if not rows:
        return ""
    return _size_table(
        rows, names,
        lambda n: f" {n + ' eager/dev us':>22} |",
        lambda k: f" {k.eager_s * 1e6:10.1f} /{k.time_s * 1e6:9.1f} |",
        f" {'echo eager/dev us':>19}",
        lambda r: f" {sum(r.kernels[n].eager_s for n in ECHO_KERNELS) * 1e6:9.1f} /"
                  f"{r.total_s(ECHO_KERNELS) * 1e6:7.1f}",
    )


def compile_report() -> list[dict]:
    """Registers / spills / shared memory of every compiled kernel variant
    (Triton's cache after the run); empty if this Triton exposes no cache."""
    from ..kernels import consume_kernel, output_kernel, stage1_kernel, stage2_kernel

    rows = []
    for fn in (stage1_kernel._stage1_kernel, stage2_kernel._stage2_kernel,
               output_kernel._output_kernel, consume_kernel._consume_kernel):
        caches = getattr(fn, "device_caches", None) or {}
        for dev_cache in caches.values():
            kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for key, k in getattr(kernels, "items", lambda: [])():
                consts = getattr(getattr(k, "src", None), "constants", {}) or {}
                names = getattr(fn, "arg_names", [])
                named = {names[i[0]] if isinstance(i, tuple) and i[0] < len(names) else str(i): v
                         for i, v in consts.items()}
                rows.append({
                    "kernel": getattr(fn, "__name__", str(fn)),
                    "constants": " ".join(f"{n}={v}" for n, v in named.items() if n.isupper()),
                    "n_regs": getattr(k, "n_regs", None),
                    "n_spills": getattr(k, "n_spills", None),
                    "shared_bytes": getattr(getattr(k, "metadata", None), "shared", None),
                })
    return rows


def projections(results: list[SizeResult], copy_gbps: float) -> list[projection.Projection]:
    out = []
    by = {(r.world_size, r.size_bytes): r for r in results}
    for link in projection.default_links(copy_gbps):
        for (p, size), r in sorted(by.items()):
            if p != link.world_size:
                continue
            out.append(projection.project(link, size, r.wire_bytes_per_rank,
                                          r.total_s(ECHO_KERNELS), r.total_s(NAIVE_KERNELS)))
    return out


def projection_table(projs: list[projection.Projection], min_bytes: int = 1 << 20, source: str = "measured") -> str:
    lines = [f"PROJECTION (not a measurement): NCCL 16-bit vs Echo from {source} kernel times + wire bytes; "
             "'overlap' = if kernels hid under the transfers (not implemented)",
             f"{'link':<58} {'size':>9} {'nccl us':>9} {'echo us':>9} {'speedup':>7} {'overlap':>7} {'naive':>7}"]
    for pr in projs:
        if pr.size_bytes < min_bytes:
            continue
        lines.append(
            f"{pr.link:<58} {report.human_bytes(pr.size_bytes):>9} {pr.nccl_s * 1e6:9.1f} "
            f"{pr.echo_s * 1e6:9.1f} {pr.speedup:6.2f}x {pr.speedup_overlapped:6.2f}x {pr.speedup_naive:6.2f}x"
        )
    return "\n".join(lines)


def model_results(worlds, sizes, cfg: EchoConfig, copy_gbps: float, efficiency: float) -> list[SizeResult]:
    """Kernel times predicted from bytes moved, for ``--model-only``: every
    kernel at ``efficiency`` x the copy bandwidth."""
    out = []
    for p in worlds:
        for size in sizes:
            lay = WireLayout(size // 2, p, cfg.group_size)
            r = SizeResult(p, size, lay.wire_bytes_per_rank)
            for name, nb in kernel_bytes(lay, FEEDBACK_STORAGE[cfg.feedback_dtype]).items():
                r.kernels[name] = KernelResult(name, nb / (efficiency * copy_gbps * 1e9), nb)
            out.append(r)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--world-sizes", type=counts(2, MAX_RANKS, RANKS_WHY), default="4,8",
                    help="virtual world sizes P (comma list)")
    size = report.message_size()
    ap.add_argument("--min-size", type=size, default="8K", help="smallest message (bytes of bf16 input)")
    ap.add_argument("--max-size", type=size, default="1G", help="largest message")
    ap.add_argument("--sizes", type=report.message_sizes(), default=None,
                    help="explicit comma list of sizes (overrides min/max)")
    ap.add_argument("--iters", type=count(1, 1 << 20), default=20, help="timed calls per point (median reported)")
    ap.add_argument("--timing", default="auto", choices=TIMINGS,
                    help="auto: CUDA-graph replay below 1 MiB, eager above; graph: device time everywhere; "
                         "both: device time for bytes/s plus each call's eager time (host launch included)")
    ap.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=EchoConfig.group_size)
    ap.add_argument("--hidden", type=count(0, 1 << 20), default=4096,
                    help="values per row (token) of the messages: the row-aligned, position-owned layout "
                         "(0: one row)")
    ap.add_argument("--no-hadamard", action="store_true", help="time Echo without the rotation")
    ap.add_argument("--feedback-dtype", default=EchoConfig.feedback_dtype, choices=tuple(FEEDBACK_STORAGE))
    ap.add_argument("--encoders", type=choice_list(ENCODERS), default=EchoConfig.encoder,
                    help="comma list of encoders (EchoConfig.encoder) to time stages 1 and 2 with, in one run; "
                         "the first is the Echo call's (totals, projection), the others are compared with it")
    ap.add_argument("--device", type=device(), default="cuda", help="cuda (the real benchmark) or cpu (smoke run)")
    ap.add_argument("--skip-verify", action="store_true", help="do not check kernels against references first")
    ap.add_argument("--out", type=out_dir, default=None, help="directory for kernels.json and PNGs")
    ap.add_argument("--model-only", action="store_true",
                    help="measure nothing: predict kernel times from bytes moved (no GPU needed)")
    ap.add_argument("--copy-gbps", type=real(0, 1e6, low_open=True), default=4180.0,
                    help="--model-only: copy bandwidth to assume (default: H200, 4.18 TB/s measured)")
    ap.add_argument("--efficiency", type=real(0, 1, low_open=True), default=0.85,
                    help="--model-only: fraction of the copy bandwidth the kernels reach")


def run_model(args, cfg: EchoConfig, worlds, sizes) -> int:
    results = model_results(worlds, sizes, cfg, args.copy_gbps, args.efficiency)
    print(f"MODEL ONLY (nothing measured): kernels at {args.efficiency:.0%} of a {args.copy_gbps:.0f} GB/s copy; "
          f"{cfg.group_size=} feedback={cfg.feedback_dtype}")
    print(kernel_table(results, args.copy_gbps))
    print()
    projs = projections(results, args.copy_gbps)
    print(projection_table(projs, source="MODELLED"))
    if args.out:
        path = report.write_json(args.out, OUTPUTS[0], {
            "model_only": True, "efficiency": args.efficiency, "copy_gbps": args.copy_gbps, "config": cfg.to_dict(),
            "results": results_json(results, args.copy_gbps), "projection_model": projection.__doc__,
            "projections": [pr.to_dict() for pr in projs]})
        print(f"\nwrote {path} (modelled, nothing measured; no PNGs)")
    return 0


def results_json(results: list[SizeResult], copy_gbps: float) -> list[dict]:
    """``kernels.json``'s ``results``: per (P, size), each kernel's time, bytes and fraction of the copy."""
    return [{"world_size": r.world_size, "size_bytes": r.size_bytes, "wire_bytes_per_rank": r.wire_bytes_per_rank,
             "kernels": {k: {"time_s": v.time_s, "eager_s": v.eager_s, "bytes": v.bytes_moved, "gbps": v.gbps,
                             "fraction_of_copy": v.gbps / copy_gbps} for k, v in r.kernels.items()}}
            for r in results]


def _sizes(args: argparse.Namespace) -> list[int]:
    return args.sizes or report.size_range(args.min_size, args.max_size)


#: The files ``bench kernels --out`` writes (``--model-only``: the JSON alone).
OUTPUTS = ("kernels.json", "kernels_bandwidth.png", "projected_speedup.png")


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if args.out:
        check_names(args.out, OUTPUTS)
    if getattr(args, "model_only", False):
        cfg = EchoConfig(group_size=args.group_size, hadamard=not args.no_hadamard,
                         feedback_dtype=args.feedback_dtype)
        return run_model(args, cfg, args.world_sizes, _sizes(args))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench kernels: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    cfg = EchoConfig(group_size=args.group_size, hadamard=not args.no_hadamard, feedback_dtype=args.feedback_dtype,
                     encoder=args.encoders[0])
    worlds, sizes, encoders = args.world_sizes, _sizes(args), tuple(args.encoders)
    need, size, p = max((memory_needed(z, p, cfg, device), z, p) for p in worlds for z in sizes)
    if need > device_memory_bytes(device):  # an allocation would fail (or the OOM killer strike) mid-run
        raise UsageError(f"size {report.human_bytes(size)} at P={p}: needs about "
                         f"{need / (1 << 30):.1f} GiB, more than the {device_memory_bytes(device) / (1 << 30):.1f} GiB "
                         f"of {device} memory (--sizes / --max-size)")
    backend = _backend(device)
    if not args.skip_verify:
        bad = []
        for e in encoders:
            ecfg = cfg.replace(encoder=e)
            bad += [f"P={p} {e}: {b}" for p in worlds
                    for b in verify(backend, device, ecfg, p, numel=min(3 << 20, max(sizes)) + 77)]
            if args.hidden:  # the row layout too: whole rows of the model's width
                rows = max(1, min(3 << 20, max(sizes)) // args.hidden)
                bad += [f"P={p} {e} rows of {args.hidden}: {b}" for p in worlds
                        for b in verify(backend, device, ecfg, p, numel=rows * args.hidden, hidden=args.hidden)]
        if bad:
            print("bench kernels: kernels differ from the references, refusing to time them: " + ", ".join(bad),
                  file=sys.stderr)
            return 1
        print(f"verified: kernels match the references bit for bit (P={worlds})")
    copy_gbps = measure_copy_gbps(device, min(max(sizes), 1 << 30), args.iters)
    refs = measure_reference_gbps(device, min(max(sizes), 1 << 30), args.iters)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; copy bandwidth (read+write): {copy_gbps:.0f} GB/s "
          f"(for context, not the yardstick: fill {refs['write']:.0f} GB/s write-only, "
          f"bf16 add {refs['add']:.0f} GB/s 2:1 read:write)")
    results = []
    for p in worlds:
        for size in sizes:
            results.append(measure_size(backend, device, cfg, p, size, args.iters, args.timing, args.hidden,
                                        encoders))
            r = results[-1]
            print(f"  P={p} {report.human_bytes(size):>9}: echo {r.total_s(ECHO_KERNELS) * 1e6:9.1f} us, "
                  f"naive {r.total_s(NAIVE_KERNELS) * 1e6:9.1f} us", flush=True)
    print()
    print(f"Per-rank kernel times, config {cfg.group_size=} hadamard={cfg.hadamard} "
          f"feedback={cfg.feedback_dtype} encoder={cfg.encoder}; %copy = bytes read+written / time vs copy bandwidth")
    print(kernel_table(results, copy_gbps))
    if len(encoders) > 1:
        print(f"\nStages 1 and 2 by encoder (device time; x: against {encoders[0]})")
        print(report.encoder_table([(f"P={r.world_size} {report.human_bytes(r.size_bytes)}",
                                     {k: v.time_s * 1e6 for k, v in r.kernels.items()}) for r in results],
                                   ("stage1", "stage2"), encoders))
    eager = eager_table(results)
    if eager:
        print("\nEager call time (CUDA events around one Python call: host launch + device) / device time "
              "(CUDA-graph replay), us")
        print(eager)
    projs = projections(results, copy_gbps)
    print()
    print(projection_table(projs))
    compiled = compile_report() if device.type == "cuda" else []
    if compiled:
        print("\ncompiled variants (registers per thread, spilled bytes, shared memory):")
        for c in compiled:
            print(f"  {c['kernel']:<16} regs={c['n_regs']} spills={c['n_spills']} shared={c['shared_bytes']} "
                  f"{c['constants']}")
    if args.out:
        payload = {
            "device": name,
            "copy_gbps": copy_gbps,
            "reference_gbps": refs,
            "timing": args.timing,
            "config": cfg.to_dict(),
            "encoders": list(encoders),
            "results": results_json(results, copy_gbps),
            "projection_model": projection.__doc__,
            "compiled": compiled,
            "projections": [pr.to_dict() for pr in projs],
        }
        path = report.write_json(args.out, OUTPUTS[0], payload)
        p0 = max(worlds)
        report.plot_lines(
            args.out, OUTPUTS[1],
            {n: [(r.size_bytes, r.kernels[n].gbps / copy_gbps) for r in results if r.world_size == p0]
             for n in ECHO_KERNELS + ("consume",)},
            title=f"{name}: kernel bytes/s as a fraction of copy bandwidth (P={p0})",
            ylabel="fraction of copy bandwidth", hline=0.85,
        )
        report.plot_lines(
            args.out, OUTPUTS[2],
            {pr_link: [(pr.size_bytes, pr.speedup) for pr in projs if pr.link == pr_link]
             for pr_link in dict.fromkeys(pr.link for pr in projs)},
            title="PROJECTED Echo speedup over NCCL 16-bit (measured kernels + link model)",
            ylabel="speedup (x)", hline=1.0,
        )
        print(f"\nwrote {path}")
    return 0
