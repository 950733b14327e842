"""``echo-vllm bench link``: the 16-bit all-reduce against Echo over a real, shaped link.

H hosts of G ranks each on one machine (:mod:`.netns`: network namespaces
joined through a switch, every host's link shaped by tc), gloo between the
ranks over real TCP, bound to each host's link. For every link rate of the
ladder, quiet and with F background TCP flows per host (:mod:`.flows`):

* per message size, each algorithm of ``--algos`` (gloo's own 16-bit
  all-reduce; ``flat`` Echo over all P ranks; ``two-level`` Echo where
  this build has it), **bits verified first** (the first two calls of a
  fresh chain: Echo's output the same on every rank and equal to the
  plain-torch reference's, computed here beforehand on P virtual ranks;
  gloo's 16-bit output the same on every rank), then timed between
  barriers: the slowest rank's median, min and max;
* the **bytes that crossed each host's link** per call, from the host's
  interface counters (quiet runs only: background flows share the counters)
  beside the arithmetic (:func:`predicted_link_bytes`);
* the CPU kernels' own time: Echo over collectives that cost nothing
  (:class:`FreeTransport`), all ranks at once as in the real calls, so the
  **ratio of link speed to kernel speed** is printed beside each rate,
  with the link a GPU with Echo's fused kernel would need for the same
  ratio (:data:`GPU_KERNEL_BYTES_PER_S`);
* with ``--workloads prefill,train`` the package's TP model over the same
  link (:mod:`.link_model`): a prefill and a training step, 16-bit against
  Echo, and the communication's share of each.

Prints the tables (the command and the testbed first), writes JSON and a
PNG with ``--out``. ``--fault drop|down|kill`` runs the fault case instead
(:mod:`.link_faults`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ..cli_args import MAX_RANKS, UsageError, bit_rates, choice_list, count, counts, duration, out_dir, real
from ..config import SUPPORTED_GROUP_SIZES, EchoConfig
from ..quant import WireLayout
from ..training import TPCommConfig
from ..training.collectives import BACKWARD_DEFAULT, FORWARD_DEFAULT
from . import netns, report, timing
from .link_calls import (ALGOS, BASELINE, VERIFIED_CALLS, EchoCalls, FreeTransport, algo_refusal, bench_config,
                         check_bits, contender, digest, echo_config, message, reference_digests)
from .link_model import MODEL_WORKLOADS, ModelWorkload, measure_models

WORKLOADS = ("allreduce",) + MODEL_WORKLOADS

#: Echo's kernel speed on a GPU, to translate this machine's ratio of link
#: to kernel speed: the fused kernel on one H100 reduces a 64 MiB message at
#: P = 8 in 134.4 µs per rank (BENCHMARKS.md, the acceptance run on 306ef68).
GPU_KERNEL_BYTES_PER_S = (64 << 20) / 134.4e-6
GPU_KERNEL_SOURCE = "Echo's fused kernel on one H100: 64 MiB at P = 8 in 134.4 us per rank (BENCHMARKS.md)"

#: Slowest link the bench shapes (below it one 64 KiB packet takes seconds).
MIN_RATE_BPS = 1_000_000
#: Fastest: above it the veths, not the shaper, set the pace on this CPU.
MAX_RATE_BPS = 100_000_000_000

#: The message size ladder, from 1 MiB (sizes whose 16-bit call would outlast
#: ``--max-call-s`` at a rate are skipped there, with the reason).
DEFAULT_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20)
#: The reference is computed on P virtual ranks in this process: above this
#: message size only the ranks' agreement is checked (memory: P inputs and
#: the reference's fp32 intermediates).
DEFAULT_VERIFY_MAX_BYTES = 64 << 20


# -- what each algorithm should send ------------------------------------------------------


def predicted_link_bytes(algo: str, hosts: int, ranks_per_host: int, layout: WireLayout) -> float:
    """Payload bytes each host sends over its link per call (no TCP/IP
    headers), as DESIGN.md "Across hosts" counts them, ranks in rank order
    (hosts contiguous), N = ``layout.numel``, P = H G:

    * 16-bit, a ring (reduce-scatter + all-gather: gloo's): the ring leaves
      each host once per step, 2(P-1) steps of N/P bf16 values:
      2(P-1)/P * 2N;
    * flat Echo: the all-to-all sends each of a host's G ranks' chunks to
      the P - G remote ranks, the all-gather (a ring) leaves the host once
      per step, P - 1 steps: (G (P - G) + P - 1) chunks;
    * two-level Echo: only the cross-host Echo among H ranks of each local
      index crosses, on a 1/G shard: 2(H-1)/H * w N, w the wire bytes per
      value (chunks with their scales and padding)."""
    g, p = ranks_per_host, hosts * ranks_per_host
    if algo == BASELINE:
        return 2 * (p - 1) / p * 2 * layout.numel
    if algo == "flat":
        return (g * (p - g) + p - 1) * layout.chunk_bytes
    wire_per_value = p * layout.chunk_bytes / layout.numel
    return 2 * (hosts - 1) / hosts * wire_per_value * layout.numel


def point_plan(size_bytes: int, rate_bps: int, hosts: int, ranks_per_host: int, flows: int,
               max_call_s: float) -> tuple[bool, str]:
    """Whether to measure ``size_bytes`` at ``rate_bps`` beside ``flows``
    background flows per host, and why not: the 16-bit call's bytes alone
    would take longer than ``max_call_s`` at its share of the link (its
    ring's one connection out of each host against the flows: 1 / (1 + F))."""
    p = hosts * ranks_per_host
    wire_s = 2 * (p - 1) / p * size_bytes * 8 / rate_bps * (1 + flows)
    if wire_s > max_call_s:
        beside = f" beside {flows} flows" if flows else ""
        return False, (f"16-bit would take >= {wire_s:.0f} s per call on the wire at {netns.format_rate(rate_bps)}"
                       f"{beside} (--max-call-s {max_call_s:g})")
    return True, ""


# -- one phase (a rate and a background), on every rank -------------------------------------


@dataclass(frozen=True)
class Phase:
    """What the ranks measure at one link rate and background."""

    hosts: int
    ranks_per_host: int
    sizes: tuple[int, ...]
    algos: tuple[str, ...]
    workloads: tuple[str, ...]
    config: dict
    """EchoConfig fields of the Echo algorithms (before their topology)."""
    hidden: int
    iters: int
    warmup: int
    seed: int
    digests: dict = field(default_factory=dict)
    """(algo, size) -> the reference's digests; absent: agreement only."""
    model: ModelWorkload = ModelWorkload()
    counted: bool = True
    """Read the link counters (not with background flows on the links)."""

    @property
    def host_map(self) -> tuple[int, ...]:
        """Each rank's host, as the testbed placed it (Echo's topology is given it, not left to detect)."""
        return netns.host_map(self.hosts, self.ranks_per_host)


def _deltas(probes: list) -> list[tuple[int, int]]:
    return [(a[0] - b[0], a[1] - b[1]) for b, a in probes]


def _allreduce_rows(rank: int, world: int, phase: Phase) -> list[dict]:
    """Per size: Echo's kernels alone, then every algorithm's bits checked,
    then their calls timed in turn (16-bit, flat, ..., 16-bit, flat, ...)."""
    cfg = EchoConfig(**phase.config)
    host = phase.host_map[rank]
    leader = phase.host_map.index(host) == rank
    probe = netns.link_counters if leader and phase.counted else None
    rows = []
    for size in phase.sizes:
        x = message(rank, size, phase.hidden, phase.seed)
        free = EchoCalls(cfg, x, FreeTransport(world, rank))
        kernels = timing.host_time(free, iters=phase.iters, warmup=phase.warmup, barrier=dist.barrier)
        free.close()
        calls = {algo: contender(algo, cfg, x, phase.host_map) for algo in phase.algos}
        try:
            for algo, c in calls.items():
                check_bits(algo, size, [digest(y) for y in c.first_calls()], phase.digests.get((algo, size)))
            times = timing.interleaved_host_time(calls, iters=phase.iters, warmup=phase.warmup, barrier=dist.barrier,
                                                 probe=probe)
        finally:
            for c in calls.values():
                c.close()
        for algo, t in times.items():
            rows.append({"size_bytes": size, "algo": algo, **t.to_dict(), "samples_s": t.samples_s,
                         "kernel_s": kernels.median_s, "host": host, "link": _deltas(t.probes) if probe else None})
    return rows


def _model_rows(phase: Phase) -> list[dict]:
    configs = {}
    for algo in phase.algos:
        fwd = echo_config(algo, FORWARD_DEFAULT, phase.host_map)
        configs[algo] = (TPCommConfig(mode="exact") if fwd is None else
                         TPCommConfig(mode="echo", forward=fwd,
                                      backward=echo_config(algo, BACKWARD_DEFAULT, phase.host_map)))
    kinds = tuple(w for w in phase.workloads if w in MODEL_WORKLOADS)
    return [{"algo": algo, **out} for algo, out in measure_models(configs, phase.model, kinds).items()]


def rank_main(rank: int, world: int, phase: Phase) -> dict:
    """One phase on one rank (``run_processes``' function)."""
    out: dict = {"rank": rank}
    if "allreduce" in phase.workloads:
        out["allreduce"] = _allreduce_rows(rank, world, phase)
    if any(w in MODEL_WORKLOADS for w in phase.workloads):
        out["model"] = _model_rows(phase)
    return out


# -- merging the ranks' numbers ---------------------------------------------------------------


def merge_allreduce(per_rank: list[dict], phase: Phase, rate_bps: int, flows: int) -> list[dict]:
    """One row per (size, algo): the slowest rank's times (a collective ends
    when its last rank does), each host's link bytes per call (median over
    the calls), the arithmetic beside them."""
    merged: dict[tuple, dict] = {}
    kernel_s: dict[tuple, float] = {}
    links: dict[tuple, dict[int, list]] = {}
    for rank_out in per_rank:
        for r in rank_out.get("allreduce", []):
            k = (r["size_bytes"], r["algo"])
            if k not in merged or r["median_s"] > merged[k]["median_s"]:
                merged[k] = r
            kernel_s[k] = max(kernel_s.get(k, 0.0), r["kernel_s"])
            if r["link"]:
                links.setdefault(k, {})[r["host"]] = r["link"]
    rows = []
    for (size, algo), r in sorted(merged.items(), key=lambda kv: (kv[0][0], ALGOS.index(kv[0][1]))):
        lay = WireLayout(size // 2, phase.hosts * phase.ranks_per_host, phase.config["group_size"], phase.hidden)
        per_host = links.get((size, algo), {})
        tx = {h: statistics.median(d[0] for d in calls) for h, calls in sorted(per_host.items())}
        rx = {h: statistics.median(d[1] for d in calls) for h, calls in sorted(per_host.items())}
        rows.append({
            "rate_bps": rate_bps, "flows": flows, "size_bytes": size, "algo": algo,
            "median_s": r["median_s"], "min_s": r["min_s"], "max_s": r["max_s"], "samples_s": r["samples_s"],
            "kernel_s": kernel_s[(size, algo)],
            "tx_bytes_per_host": tx or None, "rx_bytes_per_host": rx or None,
            "predicted_bytes_per_host": predicted_link_bytes(algo, phase.hosts, phase.ranks_per_host, lay),
        })
    return rows


def merge_model(per_rank: list[dict], rate_bps: int, flows: int) -> list[dict]:
    """Per algorithm: each kind's slowest-rank median pass, the ranks' mean
    seconds inside the residual all-reduces, the first pass's loss."""
    rows = []
    for i, first in enumerate(per_rank[0].get("model", [])):
        row = {"rate_bps": rate_bps, "flows": flows, "algo": first["algo"], "parameters": first["parameters"],
               "message_bytes": first["message_bytes"], "forward_calls": first["forward_calls"],
               "calls": first["calls"], "prefill_loss": first.get("prefill_loss"),
               "train_losses": first.get("train_losses")}
        for kind in MODEL_WORKLOADS:
            if kind in first:
                ranks = [out["model"][i][kind] for out in per_rank]
                slowest = max(ranks, key=lambda t: t["median_s"])
                row[kind] = {"median_s": slowest["median_s"], "min_s": slowest["min_s"], "max_s": slowest["max_s"],
                             "comm_s": statistics.fmean(t["comm_s"] for t in ranks)}
        rows.append(row)
    return rows


# -- tables ---------------------------------------------------------------------------------


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def kernel_bytes_per_s(rows: list[dict]) -> float | None:
    """Echo's kernels' speed (message bytes per second per rank) at the largest size measured."""
    if not rows:
        return None
    big = max(rows, key=lambda r: r["size_bytes"])
    return big["size_bytes"] / big["kernel_s"]


def gpu_equivalent_bps(rate_bps: int, kernel_bps_here: float) -> float:
    """The link a GPU whose Echo kernels run at :data:`GPU_KERNEL_BYTES_PER_S`
    would need for this machine's ratio of link to kernel speed."""
    return rate_bps / 8 / kernel_bps_here * GPU_KERNEL_BYTES_PER_S * 8


def link_use(row: dict) -> float:
    """The share of its link's rate a call used: its bytes by the arithmetic
    over its time. Near 1, the call is link-bound (the link, not the CPU,
    sets its time); with background flows it is the call's share of the link."""
    return row["predicted_bytes_per_host"] * 8 / (row["median_s"] * row["rate_bps"])


def format_phase(rows: list[dict], hosts: int, ranks_per_host: int, rate_bps: int, flows: int) -> str:
    """One phase: per size and algorithm the time, the speedup, the wire's
    limit on it, the link's use, and its bytes against the arithmetic."""
    base = {r["size_bytes"]: r for r in rows if r["algo"] == BASELINE}
    head = (f"{'size':>9} {'algo':>9} | {'ms median':>10} {'min':>9} {'max':>9} | {'speedup':>7} {'wire lim':>8} | "
            f"{'link use':>8} | {'MB out/host':>11} {'arith MB':>9} {'meas/arith':>10} {'MB in/host':>10} | "
            f"{'kernels ms':>10}")
    lines = [f"link {netns.format_rate(rate_bps)}, {hosts} hosts x {ranks_per_host} ranks, "
             f"{'quiet' if not flows else f'{flows} background flows per host'}", head, "-" * len(head)]
    for r in rows:
        b = base.get(r["size_bytes"])
        speed = f"{b['median_s'] / r['median_s']:6.2f}x" if b and r["algo"] != BASELINE else "-"
        limit = (f"{b['predicted_bytes_per_host'] / r['predicted_bytes_per_host']:7.2f}x"
                 if b and r["algo"] != BASELINE else "-")
        tx = statistics.fmean(r["tx_bytes_per_host"].values()) if r["tx_bytes_per_host"] else None
        rx = statistics.fmean(r["rx_bytes_per_host"].values()) if r["rx_bytes_per_host"] else None
        ratio = f"{tx / r['predicted_bytes_per_host']:10.3f}" if tx is not None else "-"
        kern = f"{r['kernel_s'] * 1e3:10.1f}" if r["algo"] != BASELINE else "-"
        lines.append(f"{report.human_bytes(r['size_bytes']):>9} {r['algo']:>9} | {r['median_s'] * 1e3:10.1f} "
                     f"{r['min_s'] * 1e3:9.1f} {r['max_s'] * 1e3:9.1f} | {speed:>7} {limit:>8} | "
                     f"{link_use(r):8.2f} | {_mb(tx):>11} {_mb(r['predicted_bytes_per_host']):>9} {ratio:>10} "
                     f"{_mb(rx):>10} | {kern:>10}")
    return "\n".join(lines)


def format_ladder(rows: list[dict], algos: tuple[str, ...]) -> str:
    """Speedup over 16-bit per rate (rows) and size (columns), quiet and
    congested, with the link/kernel ratio and its GPU equivalent."""
    sizes = sorted({r["size_bytes"] for r in rows})
    cases = sorted({(r["rate_bps"], r["flows"]) for r in rows})
    by = {(r["rate_bps"], r["flows"], r["size_bytes"], r["algo"]): r for r in rows}
    lines = []
    for algo in (a for a in algos if a != BASELINE):
        head = (f"{algo + ' vs 16-bit':>18} {'flows':>5} | {'kernel MB/s':>11} {'link/kernel':>11} {'GPU link':>13} | "
                + " ".join(f"{report.human_bytes(s):>8}" for s in sizes))
        lines += [head, "-" * len(head)]
        for rate, flows in cases:
            at = [r for r in rows if r["rate_bps"] == rate and r["flows"] == flows and r["algo"] == algo]
            k = kernel_bytes_per_s(at)
            speed = f"{k / 1e6:11.1f}" if k else f"{'-':>11}"
            ratio = f"{rate / 8 / k:11.3f}" if k else f"{'-':>11}"
            gpu = netns.format_rate(gpu_equivalent_bps(rate, k)) if k else "-"
            cells = []
            for s in sizes:
                b, e = by.get((rate, flows, s, BASELINE)), by.get((rate, flows, s, algo))
                cells.append(f"{b['median_s'] / e['median_s']:7.2f}x" if b and e else f"{'-':>8}")
            lines.append(f"{netns.format_rate(rate):>18} {flows:>5} | {speed} {ratio} {gpu:>13} | " + " ".join(cells))
        lines.append("")
    return "\n".join(lines)


def format_model(rows: list[dict]) -> str:
    """Prefill and training step per rate and background: time, the share of
    it inside the residual all-reduces, Echo's speedup."""
    head = (f"{'rate':>12} {'flows':>5} {'algo':>9} | {'prefill ms':>10} {'comm %':>6} {'speedup':>7} | "
            f"{'step ms':>9} {'comm %':>6} {'speedup':>7}")
    lines = [head, "-" * len(head)]
    base = {(r["rate_bps"], r["flows"]): r for r in rows if r["algo"] == BASELINE}
    for r in rows:
        b = base.get((r["rate_bps"], r["flows"]))
        cells = []
        for kind in MODEL_WORKLOADS:
            t = r.get(kind)
            if t is None:
                cells.append(f"{'-':>10} {'-':>6} {'-':>7}" if kind == "prefill" else f"{'-':>9} {'-':>6} {'-':>7}")
                continue
            speed = (f"{b[kind]['median_s'] / t['median_s']:6.2f}x"
                     if b is not None and kind in b and r["algo"] != BASELINE else "-")
            width = 10 if kind == "prefill" else 9
            cells.append(f"{t['median_s'] * 1e3:{width}.0f} {100 * t['comm_s'] / t['median_s']:6.1f} {speed:>7}")
        lines.append(f"{netns.format_rate(r['rate_bps']):>12} {r['flows']:>5} {r['algo']:>9} | " + " | ".join(cells))
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------------


def _check_args(args) -> None:
    p = args.hosts * args.ranks_per_host
    if p > MAX_RANKS:
        raise UsageError(f"--hosts {args.hosts} x --ranks-per-host {args.ranks_per_host} = {p} ranks: "
                         f"at most {MAX_RANKS} (each is a process here)")
    host_map = netns.host_map(args.hosts, args.ranks_per_host)
    if args.algos is None:  # every algorithm this placement runs
        args.algos = [a for a in ALGOS if not algo_refusal(a, host_map)]
    for algo in args.algos:
        why = algo_refusal(algo, host_map)
        if why:
            raise UsageError(f"--algos {algo}: {why}")
    if args.fault is None and BASELINE not in args.algos:
        raise UsageError(f"--algos must include {BASELINE}: every speedup is against it")
    for size in args.sizes:
        if size % (2 * args.hidden):
            raise UsageError(f"--sizes {report.human_bytes(size)}: not a whole number of rows of --hidden "
                             f"{args.hidden} bf16 values")
    if any(w in MODEL_WORKLOADS for w in args.workloads):
        cfg = ModelWorkload(layers=args.model_layers, hidden=args.model_hidden, tokens=args.model_tokens)
        try:
            cfg.model_config().validate(p)
        except ValueError as e:
            raise UsageError(f"--model-hidden {args.model_hidden} at {p} ranks: {e}") from None


def _meta(args, bed: netns.Testbed) -> dict:
    return {
        "command": " ".join(["echo-vllm", "bench", "link"] + list(args.argv)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "torch": torch.__version__,
        "testbed": bed.describe(),
        "hosts": args.hosts,
        "ranks_per_host": args.ranks_per_host,
        "loopback_within_host": True,
        "gpu_kernel_bytes_per_s": GPU_KERNEL_BYTES_PER_S,
        "gpu_kernel_source": GPU_KERNEL_SOURCE,
    }


def _phase(args, sizes: tuple[int, ...], digests: dict, flows: int) -> Phase:
    return Phase(hosts=args.hosts, ranks_per_host=args.ranks_per_host, sizes=sizes, algos=tuple(args.algos),
                 workloads=tuple(args.workloads), config=bench_config(args.group_size).to_dict(), hidden=args.hidden,
                 iters=args.iters, warmup=args.warmup, seed=args.seed, digests=digests,
                 model=ModelWorkload(layers=args.model_layers, hidden=args.model_hidden, tokens=args.model_tokens,
                                     iters=args.iters, warmup=args.warmup),
                 counted=flows == 0)


def _references(args, sizes: list[int]) -> dict:
    """The reference's digests of every (Echo algorithm, size) up to --verify-max-size."""
    p = args.hosts * args.ranks_per_host
    host_map = netns.host_map(args.hosts, args.ranks_per_host)
    out = {}
    for size in sizes:
        if size > args.verify_max_size:
            print(f"  {report.human_bytes(size)}: above --verify-max-size, the ranks' agreement only", flush=True)
            continue
        for algo in args.algos:
            cfg = echo_config(algo, bench_config(args.group_size), host_map)
            if cfg is not None:
                t0 = time.perf_counter()
                out[(algo, size)] = reference_digests(cfg, size, p, args.hidden, args.seed)
                print(f"  reference {algo} {report.human_bytes(size)}: {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def run(args: argparse.Namespace) -> int:
    netns.check_requirements()
    _check_args(args)
    try:
        if args.fault is not None:
            from .link_faults import run_fault_command

            return run_fault_command(args)
        return _run(args)
    except netns.TestbedError as e:  # a command that builds the testbed failed: one line, nothing left behind
        print(f"echo-vllm bench link: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from ..spawn import run_processes
    from .flows import BackgroundFlows

    p = args.hosts * args.ranks_per_host
    print(f"command: echo-vllm bench link {' '.join(args.argv)}")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} "
          "(shared: other work runs beside this one)")
    sizes = args.sizes if "allreduce" in args.workloads else []
    plans = {(rate, flows): [(s, *point_plan(s, rate, args.hosts, args.ranks_per_host, flows, args.max_call_s))
                             for s in sizes]
             for rate in args.rate for flows in args.background}
    wanted = sorted({s for plan in plans.values() for s, ok, _ in plan if ok})
    digests = _references(args, wanted)
    shape = netns.LinkShape(args.rate[0], delay_s=args.delay, loss=args.loss)
    all_rows, model_rows, phases = [], [], []
    with netns.Testbed(args.hosts, shape) as bed:
        meta = _meta(args, bed)
        print(f"testbed: {bed.describe()}")
        print(f"ranks: {args.ranks_per_host} per host, {p} in all, gloo over {netns.HOST_IF} "
              "(within a host over the namespace's loopback, unshaped)")
        for rate in args.rate:
            bed.set_shape(netns.LinkShape(rate, delay_s=args.delay, loss=args.loss))
            for flows in args.background:
                print(f"\n== {bed.shape.describe()}; {flows} background flows per host", flush=True)
                for s, ok, why in plans[(rate, flows)]:
                    if not ok:
                        print(f"  {report.human_bytes(s)}: skipped, {why}")
                phase = _phase(args, tuple(s for s, ok, _ in plans[(rate, flows)] if ok), digests, flows)
                t0, load0 = time.perf_counter(), os.getloadavg()[0]
                with BackgroundFlows(bed, flows) as bg:
                    per_rank = run_processes(rank_main, p, phase, rank_setup=bed.placement(args.ranks_per_host),
                                             timeout_s=args.timeout_s)
                record = {"rate_bps": rate, "flows": flows, "seconds": time.perf_counter() - t0,
                          "load_avg_before": load0, "load_avg_after": os.getloadavg()[0],
                          "background_bps": bg.throughput_bps()}
                phases.append(record)
                if flows:
                    print(f"  background: {netns.format_rate(bg.throughput_bps())} sent per host on average")
                rows = merge_allreduce(per_rank, phase, rate, flows)
                all_rows += rows
                model_rows += merge_model(per_rank, rate, flows)
                if rows:
                    print(format_phase(rows, args.hosts, args.ranks_per_host, rate, flows))
                print(f"  ({record['seconds']:.0f} s; machine load {load0:.1f} -> {record['load_avg_after']:.1f})",
                      flush=True)
    _summary(args, meta, all_rows, model_rows, phases)
    return 0


def _summary(args, meta: dict, rows: list[dict], model_rows: list[dict], phases: list[dict]) -> None:
    if rows:
        print("\nspeedup over gloo's 16-bit all-reduce (slowest rank's median per call); link/kernel = link "
              "bytes/s over Echo's CPU kernels' message bytes/s per rank at the largest size; GPU link = the "
              f"link with the same ratio for {GPU_KERNEL_SOURCE}")
        print(format_ladder(rows, tuple(args.algos)))
        print("bits: every Echo output equal on every rank" + (" and to the plain-torch reference (first "
              f"{VERIFIED_CALLS} calls of a chain) up to {report.human_bytes(args.verify_max_size)}"
              if args.verify_max_size else "") + "; gloo's 16-bit output equal on every rank")
    if model_rows:
        w = ModelWorkload(layers=args.model_layers, hidden=args.model_hidden, tokens=args.model_tokens)
        first = model_rows[0]
        print(f"\nTP model: {first['parameters'] / 1e6:.1f} M parameters, {w.layers} layers, hidden {w.hidden}, "
              f"{w.tokens} tokens; {first['forward_calls']} forward all-reduces of "
              f"{report.human_bytes(first['message_bytes'])}; comm % = share of the pass inside them")
        print(format_model(model_rows))
    if args.out:
        name = f"link_h{args.hosts}g{args.ranks_per_host}"
        path = report.write_json(args.out, name + ".json", {**meta, "rows": rows, "model": model_rows,
                                                             "phases": phases, "args": _args_dict(args)})
        print(f"\nwrote {path}")
        _plot(args.out, name + ".png", rows, meta)


def _args_dict(args) -> dict:
    return {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in vars(args).items()}


def speedups(rows: list[dict]) -> list[tuple[dict, float]]:
    """Each Echo row with its speedup over the 16-bit row of the same rate,
    background and size."""
    base = {(r["rate_bps"], r["flows"], r["size_bytes"]): r for r in rows if r["algo"] == BASELINE}
    return [(r, base[k]["median_s"] / r["median_s"]) for r in rows
            if r["algo"] != BASELINE and (k := (r["rate_bps"], r["flows"], r["size_bytes"])) in base]


def _plot(out: str, name: str, rows: list[dict], meta: dict) -> None:
    """Left: speedup against message size, a colour per rate, dashed with
    background flows. Right: every point against its link/kernel ratio (the
    x that carries over to GPUs), the wire's limit as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the JSON holds every number
        return
    points = speedups(rows)
    if not points:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = sorted({r["rate_bps"] for r, _ in points})
    colours = {rate: plt.cm.viridis(i / max(1, len(rates) - 1)) for i, rate in enumerate(rates)}
    for (algo, rate, flows) in sorted({(r["algo"], r["rate_bps"], r["flows"]) for r, _ in points}):
        pts = sorted((r["size_bytes"], x) for r, x in points
                     if (r["algo"], r["rate_bps"], r["flows"]) == (algo, rate, flows))
        left.plot(*zip(*pts), marker="o", ms=3, color=colours[rate], ls="--" if flows else "-",
                  label=f"{algo} {netns.format_rate(rate)}" + (f" +{flows} flows" if flows else ""))
    for flows in sorted({r["flows"] for r, _ in points}):
        pts = [(r["rate_bps"] / 8 / (r["size_bytes"] / r["kernel_s"]), x) for r, x in points if r["flows"] == flows]
        right.scatter(*zip(*pts), s=14, marker="^" if flows else "o", label=f"{flows} background flows")
    base = {r["size_bytes"]: r["predicted_bytes_per_host"] for r in rows if r["algo"] == BASELINE}
    for wall in sorted({round(base[r["size_bytes"]] / r["predicted_bytes_per_host"], 2) for r, _ in points}):
        right.axhline(wall, color="grey", lw=0.8, ls=":")
    for ax in (left, right):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("speedup over 16-bit (x)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    left.set_xscale("log", base=2)
    left.set_xlabel("message size (bytes)")
    right.set_xscale("log")
    right.set_xlabel("link rate / Echo's CPU kernel speed (dotted: the wire's limit)")
    fig.suptitle(f"Echo vs gloo 16-bit over a shaped link, {meta['hosts']} hosts x {meta['ranks_per_host']} ranks",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hosts", type=count(2, netns.MAX_HOSTS, "one /24 of the testbed, a process per rank"),
                    default=2, help="hosts (network namespaces)")
    ap.add_argument("--ranks-per-host", type=count(1, MAX_RANKS, "each rank is a process"), default=2,
                    help="ranks (gloo processes) in each host")
    ap.add_argument("--rate", type=bit_rates(MIN_RATE_BPS, MAX_RATE_BPS, "1 Mbit/s to 100 Gbit/s"),
                    default=[50_000_000], help="link rate per host, each way; a comma list is a ladder "
                                               "(tc units: 20mbit,50mbit,1gbit)")
    ap.add_argument("--delay", type=duration(0, 1, "one-way, added by netem"), default=0.0,
                    help="one-way delay each host adds to what it sends (5ms; needs the netem qdisc)")
    ap.add_argument("--loss", type=real(0, 0.5, why="a fraction of packets; 1 is --fault drop"), default=0.0,
                    help="fraction of the packets each host sends that its link drops (0.01 = 1%%)")
    ap.add_argument("--background", type=counts(0, 64, "bulk TCP flows per host, each a thread"), default=[0],
                    help="background TCP flows out of every host during the measurement; a comma list "
                         "(0,4: quiet and congested)")
    ap.add_argument("--algos", type=choice_list(ALGOS), default=None,
                    help="what to measure (default: all the placement runs; two-level needs 2 or more ranks per host)")
    ap.add_argument("--workloads", type=choice_list(WORKLOADS), default=["allreduce"],
                    help="allreduce (the size ladder), prefill, train (the TP model)")
    size = report.message_size()
    ap.add_argument("--sizes", type=report.message_sizes(), default=list(DEFAULT_SIZES),
                    help="message sizes (bf16), comma list")
    ap.add_argument("--max-call-s", type=real(0, 3600, low_open=True), default=15.0,
                    help="skip a size at a rate where 16-bit's bytes alone take longer per call")
    ap.add_argument("--verify-max-size", type=size, default=DEFAULT_VERIFY_MAX_BYTES,
                    help="largest size whose bits are checked against the reference (above: agreement only)")
    ap.add_argument("--hidden", type=count(32, 1 << 16), default=4096, help="message row width (values)")
    ap.add_argument("--iters", type=count(1, 1000), default=3, help="timed calls per point (median, min, max)")
    ap.add_argument("--warmup", type=count(0, 1000), default=1, help="untimed calls after the verified ones")
    ap.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=EchoConfig.group_size)
    ap.add_argument("--model-layers", type=count(1, 256), default=ModelWorkload.layers)
    ap.add_argument("--model-hidden", type=count(64, 1 << 14), default=ModelWorkload.hidden)
    ap.add_argument("--model-tokens", type=count(1, 1 << 16), default=ModelWorkload.tokens)
    ap.add_argument("--seed", type=count(0, (1 << 31) - 1), default=0)
    ap.add_argument("--timeout-s", type=real(0, 24 * 3600, low_open=True), default=600.0,
                    help="gloo's timeout: a collective that waits longer fails, naming itself")
    ap.add_argument("--fault", choices=("drop", "down", "kill"), default=None,
                    help="instead: run Echo calls and break the last host's link (drop: every packet lost; "
                         "down: its interface down) or kill its ranks, mid-call; every surviving rank must fail "
                         "within --timeout-s, naming the call")
    ap.add_argument("--fault-after-s", type=real(0, 3600), default=1.0,
                    help="seconds into the calls the fault strikes")
    ap.add_argument("--out", type=out_dir, default=None, help="directory for JSON and PNG")


__all__ = ["Phase", "WORKLOADS", "add_arguments", "format_ladder", "format_model", "format_phase", "merge_allreduce",
           "merge_model", "point_plan", "predicted_link_bytes", "rank_main", "run"]
