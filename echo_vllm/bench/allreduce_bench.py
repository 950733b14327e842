"""``echo-vllm bench allreduce``: 16-bit all-reduce vs naive 4-bit vs Echo.

Three ways to run, picked by ``--backend``:

* ``nccl`` under ``torchrun --nproc-per-node N`` (N >= 2 GPUs): the real
  measurement. NCCL bf16 ``all_reduce`` against :class:`EchoCommunicator`
  (naive 4-bit, and Echo with a carried error) over the same process group;
  CUDA events, warm-up, median of ``--iters``, inputs rotating through
  several buffers, CUDA-graph replay below 1 MiB.
* ``gloo``: ``--world-size`` spawned processes on one machine over TCP, a
  real bandwidth-bound link; host clock between barriers. With ``--device
  cpu`` Echo runs the numba CPU loops (``backend="numba"``) unless
  ``--cpu-kernels reference``. With ``--device cuda`` every process puts its
  tensors on the one GPU (``cuda:0``) and Echo runs the Triton kernels there;
  both contenders stage their bytes through host memory to cross the link
  (the 16-bit all-reduce its bf16 tensor, Echo its 4-bit chunks).
* one GPU and no torchrun: there is no link to measure; this prints the
  per-kernel table and the projection (``bench kernels``).

Every rank runs every call (an all-reduce is done when the slowest rank is);
rank 0 prints an nccl-tests-style table and writes JSON and a PNG.

``--topology`` and ``--host-map`` set Echo's (``EchoConfig``'s; on one
machine a host map emulates hosts, e.g. ``0,0,1,1``), and a second table
gives, per message size, the bytes each host sends inside itself and out
of itself per call for the 16-bit ring, flat Echo and two-level Echo
(arithmetic: :mod:`echo_vllm.wire_bytes`, what the records count).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

from .. import envs
from ..communicator import EchoCommunicator
from ..cli_args import MAX_RANKS, RANKS_WHY, UsageError, choice_list, count, factor, out_dir, parse_int
from ..config import (BACKEND_CHOICES, FEEDBACK_DTYPES, SUPPORTED_GROUP_SIZES, TOPOLOGY_CHOICES, EchoConfig,
                      EchoConfigError)
from ..envs import EchoEnv
from ..feedback import FeedbackChain
from ..hosts import FLAT, TWO_LEVEL, HostMap, host_map_refusal
from ..quant import WireLayout
from ..transport import ProcessGroupTransport
from ..wire_bytes import echo_bytes, per_host, ring_bytes
from . import report, timing

ALGOS = ("16-bit", "naive4", "echo", "wire-only")
"""``wire-only`` moves Echo's bytes (the all-to-all and the all-gather of
4-bit chunks) without quantizing anything: the time Echo would take if its
stages were free, i.e. what the link alone allows."""


def echo_algo(backend: str) -> str:
    """The algorithm name of Echo on one named backend (``--echo-backends``)."""
    return f"echo-{backend}"


def _named_backend(cfg: EchoConfig, transport, name: str, numel: int):
    """A backend built for one message size: the fused one sized for it
    (so that it never falls back), others as the registry builds them."""
    if name == "fused":
        from ..backends.fused import FusedSymmMemBackend

        return FusedSymmMemBackend(cfg, transport, max_numel=numel)
    return None


class Contenders:
    """The all-reduces of one message size on one rank, each a ``run(i)``
    that reduces input buffer ``i mod k``. ``echo_backends``: Echo also on
    each of these backends (algorithms ``echo-<name>``)."""

    def __init__(self, cfg: EchoConfig, inputs: list[torch.Tensor], capacity_numel: int,
                 echo_backends: tuple[str, ...] = ()):
        transport = ProcessGroupTransport()
        self.inputs = inputs
        # the 16-bit all-reduce works in place: its own copies, so Echo never
        # sees the growing (eventually non-finite) sums
        self.inputs16 = [t.clone() for t in inputs]
        device = inputs[0].device
        self.echo = EchoCommunicator(cfg, transport, device=device)
        self.naive = EchoCommunicator(EchoConfig.naive(group_size=cfg.group_size, backend=cfg.backend,
                                                       topology=cfg.topology, host_map=cfg.host_map), transport,
                                      device=device)
        self.chain = FeedbackChain.of(cfg, 1, inputs[0].device, capacity_numel)
        self.key = self.echo.chain_key(inputs[0].unsqueeze(0))
        lay = self.echo.message_layout(tuple(inputs[0].shape))
        self.wire = torch.zeros(1, lay.world_size, lay.chunk_bytes, dtype=torch.uint8, device=inputs[0].device)
        self.transport = transport
        # gloo with CUDA tensors: the 16-bit baseline crosses the link as Echo does
        self.staged = transport.backend == "gloo" and inputs[0].is_cuda
        self.named = {}
        for name in echo_backends:
            named_cfg = cfg.replace(backend=name)
            backend = _named_backend(named_cfg, transport, name, inputs[0].numel())
            self.named[echo_algo(name)] = EchoCommunicator(named_cfg, transport, device=device, backend=backend)

    def x(self, i: int) -> torch.Tensor:
        return self.inputs[i % len(self.inputs)]

    def sixteen_bit(self, i: int) -> None:
        x = self.inputs16[i % len(self.inputs16)]
        if self.staged:
            x.copy_(self.transport.exact_all_reduce(x.unsqueeze(0)))
        else:
            dist.all_reduce(x)

    def naive4(self, i: int) -> torch.Tensor:
        return self.naive.echo_all_reduce(self.x(i))

    def echo_call(self, i: int) -> torch.Tensor:
        # the steady state of a forward pass: call 1 absorbs call 0's error
        self.chain.record(0, self.key, left_error=True)
        return self.echo.echo_all_reduce(self.x(i), self.chain, 1)

    def wire_only(self, i: int) -> torch.Tensor:
        recv = self.transport.all_to_all(self.wire)
        return self.transport.all_gather(recv[:, 0])

    def named_call(self, algo: str):
        ar = self.named[algo]

        def run(i: int) -> torch.Tensor:
            self.chain.record(0, self.key, left_error=True)
            return ar.echo_all_reduce(self.x(i), self.chain, 1)

        return run

    def runs(self):
        out = {"16-bit": self.sixteen_bit, "naive4": self.naive4, "echo": self.echo_call,
               "wire-only": self.wire_only}
        out.update({algo: self.named_call(algo) for algo in self.named})
        return out


def _inputs(size_bytes: int, device, seed: int, max_buffers: int) -> list[torch.Tensor]:
    k = timing.rotation(size_bytes, max_buffers=max_buffers)
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(size_bytes // 2, generator=gen, device=device).to(torch.bfloat16) for _ in range(k)]


def measure(cfg: EchoConfig, sizes: list[int], iters: int, warmup: int, device, algos=ALGOS,
            max_buffers: int = 16, echo_backends: tuple[str, ...] = ()) -> list[dict]:
    """Per size and algorithm, this rank's median seconds per call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    algos = tuple(algos) + tuple(echo_algo(b) for b in echo_backends)
    for size in sizes:
        inputs = _inputs(size, device, 1000 * rank + size % 997, max_buffers)
        c = Contenders(cfg, inputs, WireLayout(size // 2, world, cfg.group_size).padded_numel, echo_backends)
        for algo in algos:
            run = c.runs()[algo]
            if device.type != "cuda" or c.staged:
                t = timing.host_time(_synced(run, device), iters=iters, warmup=warmup, barrier=dist.barrier)
            elif size < timing.GRAPH_BELOW_BYTES:
                t = timing.cuda_graph_time(run, iters=iters, warmup=warmup)
            else:
                t = timing.cuda_time(run, iters=iters, warmup=warmup)
            rows.append({"size_bytes": size, "algo": algo, "world_size": world, **t.to_dict()})
            if rank == 0:
                print(f"  {report.human_bytes(size):>9} {algo:>7}: {t.median_s * 1e3:9.3f} ms", flush=True)
        del c, inputs
        if "fused" in echo_backends:  # buffers were sized for this message: free them
            from ..backends.fused import release_buffers

            release_buffers()
    return rows


def _synced(run, device: torch.device):
    """``run`` that returns when its GPU work is done (host-clock timing)."""
    if device.type != "cuda":
        return run

    def synced(i: int):
        out = run(i)
        torch.cuda.synchronize(device)
        return out

    return synced


def _gloo_worker(rank, world, cfg_dict, sizes, iters, warmup, threads, device="cpu", echo_backends=()):
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return measure(EchoConfig(**cfg_dict), sizes, iters, warmup, dev, max_buffers=2, echo_backends=echo_backends)


def _slowest_rank(per_rank: list[list[dict]]) -> list[report.Row]:
    """Merge every rank's medians: an all-reduce takes as long as its
    slowest rank."""
    merged: dict[tuple, dict] = {}
    for rank_rows in per_rank:
        for r in rank_rows:
            k = (r["size_bytes"], r["algo"])
            if k not in merged or r["median_s"] > merged[k]["median_s"]:
                merged[k] = r
    return [report.Row(r["size_bytes"], r["algo"], r["world_size"], r["median_s"]) for r in merged.values()]


def level_bytes(sizes: list[int], hosts: HostMap, group_size: int) -> list[dict]:
    """Per message size (bf16 bytes per rank, one row), per algorithm: the
    bytes each host sends inside itself and out of itself in one call, the
    largest over the hosts (``echo_vllm.wire_bytes``; two-level only where
    the hosts allow it)."""
    from ..hosts import choose_topology

    two_level = choose_topology(hosts.host_of_rank, "auto")[0] == TWO_LEVEL
    out = []
    for size in sizes:
        lay = WireLayout(size // 2, hosts.world_size, group_size)
        algos = {"16-bit ring": lambda r: ring_bytes(lay.numel, hosts, r),
                 "flat Echo": lambda r: echo_bytes(lay, hosts, r, FLAT)}
        if two_level:
            algos["two-level Echo"] = lambda r: echo_bytes(lay, hosts, r, TWO_LEVEL)
        for algo, of_rank in algos.items():
            sent = per_host(hosts, of_rank)
            out.append({"size_bytes": size, "algo": algo, "in_host_bytes": max(b.in_host for b in sent),
                        "cross_host_bytes": max(b.cross_host for b in sent)})
    return out


def format_level_bytes(rows: list[dict], hosts: HostMap) -> str:
    """:func:`level_bytes` as a table, each count also per value of the
    message (N bf16 values per rank: ``3.00 N`` is 3 bytes a value)."""
    head = f"{'size':>10} | {'algorithm':<15} | {'inside a host':>21} | {'out of a host':>21}"
    lines = [f"bytes per call, the busiest host's ({hosts.describe()}; arithmetic, echo_vllm.wire_bytes; "
             "N = values per rank)", head, "-" * len(head)]
    for r in rows:
        n = r["size_bytes"] // 2
        lines.append(f"{report.human_bytes(r['size_bytes']):>10} | {r['algo']:<15} | "
                     f"{r['in_host_bytes']:>11} ({r['in_host_bytes'] / n:5.2f} N) | "
                     f"{r['cross_host_bytes']:>11} ({r['cross_host_bytes'] / n:5.2f} N)")
    return "\n".join(lines)


def _finish(args, rows: list[report.Row], meta: dict) -> None:
    title = f"{meta['transport']} P={meta['world_size']}"
    print()
    print(f"all-reduce of bf16 messages, {title}; times are medians per call; "
          "algbw = size/time, busbw = algbw*2(P-1)/P; speedup vs 16-bit")
    algos = [a for a in ALGOS] + sorted({r.algo for r in rows} - set(ALGOS))
    print(report.format_table(rows, "16-bit", algos))
    cfg = _config(args)
    hosts = HostMap.of(cfg.host_map) if cfg.host_map is not None else HostMap((0,) * meta["world_size"])
    levels = level_bytes(sorted({r.size_bytes for r in rows}), hosts, cfg.group_size)
    print()
    print(format_level_bytes(levels, hosts))
    if args.out:
        path = report.write_json(args.out, f"allreduce_{meta['transport']}_p{meta['world_size']}.json",
                                 {**meta, "rows": [r.to_dict() for r in rows], "level_bytes": levels})
        report.plot_lines(
            args.out, f"allreduce_{meta['transport']}_p{meta['world_size']}.png",
            {a: [(r.size_bytes, r.busbw_gbps) for r in rows if r.algo == a] for a in algos},
            title=f"all-reduce busbw (of the 16-bit message), {title}", ylabel="busbw (GB/s)",
        )
        print(f"\nwrote {path}")


def _meta(args, transport: str, world: int) -> dict:
    return {
        "transport": transport,
        "world_size": world,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": _config(args).to_dict(),
        "iters": args.iters,
        "command": " ".join(sys.argv),
    }


def _config(args) -> EchoConfig:
    return EchoConfig(group_size=args.group_size, hadamard=not args.no_hadamard,
                      feedback_dtype=args.feedback_dtype, min_bytes=0, topology=args.topology,
                      host_map=args.host_map)


def _sizes(args, default_lo: str, default_hi: str) -> list[int]:
    if args.sizes:
        return args.sizes
    lo = args.min_size or report.parse_size(default_lo)
    hi = args.max_size or report.parse_size(default_hi)
    return report.size_range(lo, hi, args.factor)


def run_gloo(args) -> int:
    world = args.world_size
    if refusal := host_map_refusal(args.host_map, world):
        raise UsageError(f"--host-map: {refusal}")
    sizes = _sizes(args, "1M", "256M")
    threads = max(1, (os.cpu_count() or 1) // world)
    from ..backends import fastest_cpu_backend

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench allreduce --device cuda: no CUDA device", file=sys.stderr)
            return 2
        mode = "triton"
    else:
        mode = "reference" if args.cpu_kernels == "reference" else fastest_cpu_backend()
        if args.cpu_kernels == "numba" and mode != "numba":
            print("bench allreduce: numba is not installed", file=sys.stderr)
            return 2
    print(f"gloo: {world} processes, {threads} thread(s) each, tensors on {args.device}, Echo stages: {mode}")
    cfg = _config(args).replace(backend=mode)
    results = _launch(_gloo_worker, world, cfg.to_dict(), sizes, args.iters, args.warmup, threads,
                      "cuda:0" if args.device == "cuda" else "cpu",
                      tuple(args.echo_backends), env={})
    meta = _meta(args, "gloo", world)
    meta["echo_stages"] = mode
    meta["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    meta["threads_per_process"] = threads
    _finish(args, _slowest_rank(results), meta)
    return 0


def _launch(fn, world, *fn_args, env):
    from ..spawn import run_processes

    return run_processes(fn, world, *fn_args, backend="gloo", env=env, timeout_s=3600)


def torchrun_int(name: str, default: int) -> int:
    """torchrun's variable ``name`` (``WORLD_SIZE``, ``LOCAL_RANK``) as an
    integer, ``default`` when unset; :class:`UsageError` naming it when it
    is not one (a leftover ``WORLD_SIZE=`` was a traceback)."""
    text = os.environ.get(name)
    try:
        return default if text is None else parse_int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r:.60}: not an integer (torchrun sets it: unset it outside torchrun)") from None


def run_nccl(args) -> int:
    local_rank = torchrun_int("LOCAL_RANK", 0)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        world = dist.get_world_size()
        sizes = _sizes(args, "8K", "1G")
        device = torch.device("cuda", local_rank)
        raw = measure(_config(args), sizes, args.iters, args.warmup, device,
                      echo_backends=tuple(args.echo_backends))
        gathered = [None] * world
        dist.all_gather_object(gathered, raw)
        if dist.get_rank() == 0:
            meta = _meta(args, "nccl", world)
            meta["device"] = torch.cuda.get_device_name(device)
            _finish(args, _slowest_rank(gathered), meta)
    finally:
        dist.destroy_process_group()
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                    help="auto: nccl under torchrun with CUDA, the kernel table on one GPU, gloo otherwise")
    ap.add_argument("--world-size", type=count(2, MAX_RANKS, RANKS_WHY + "; each is a process here"), default=4,
                    help="gloo processes")
    size = report.message_size()
    ap.add_argument("--min-size", type=size, default=None, help="smallest message (default 8K on GPUs, 1M on gloo)")
    ap.add_argument("--max-size", type=size, default=None, help="largest message (default 1G on GPUs, 256M on gloo)")
    ap.add_argument("--factor", type=factor(), default=2, help="size step factor (2..1024)")
    ap.add_argument("--sizes", type=report.message_sizes(), default=None,
                    help="explicit comma list of sizes (overrides min/max)")
    ap.add_argument("--iters", type=count(1, 1 << 20), default=None,
                    help="timed calls per point, the median reported (default 20 GPU, 5 gloo)")
    ap.add_argument("--warmup", type=count(1, 1 << 20, "the first call compiles kernels and builds the communicators"),
                    default=None, help="untimed calls first, at least 1 (default 5 GPU, 1 gloo)")
    ap.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=EchoConfig.group_size)
    ap.add_argument("--no-hadamard", action="store_true")
    ap.add_argument("--feedback-dtype", default=EchoConfig.feedback_dtype, choices=FEEDBACK_DTYPES)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="gloo: where each process keeps its tensors and runs Echo's stages "
                         "(cuda: all processes on cuda:0, bytes staged through the host to cross the link)")
    ap.add_argument("--cpu-kernels", default="auto", choices=("auto", "numba", "reference"),
                    help="gloo: Echo stages as numba loops (auto: if numba imports) or torch references")
    ap.add_argument("--echo-backends", type=choice_list(BACKEND_CHOICES), default=[],
                    help="also time Echo on each of these backends (comma list, e.g. triton,fused; "
                         "columns echo-<name>); the column 'echo' is backend auto")
    ap.add_argument("--topology", default=EchoConfig.topology, choices=TOPOLOGY_CHOICES,
                    help="Echo across hosts (EchoConfig.topology): auto, flat or two_level")
    ap.add_argument("--host-map", type=host_map_arg, default=None, metavar="H0,H1,...",
                    help="the host of each rank (EchoConfig.host_map; e.g. 0,0,1,1 emulates two hosts of two "
                         "ranks on one machine); also the hosts of the bytes table")
    ap.add_argument("--out", type=out_dir, default=None, help="directory for JSON and PNG")


def host_map_arg(text: str) -> tuple[int, ...] | None:
    """argparse type of ``--host-map``: what ``EchoConfig.host_map`` reads."""
    try:
        return EchoConfig.from_mapping({"host_map": text}).host_map
    except EchoConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_echo_backends(names, device_type: str, env: EchoEnv) -> None:
    """Refuse (:class:`UsageError`, before any process starts) a
    ``--echo-backends`` name that cannot run on ``device_type`` tensors:
    the ranks would fail only after timing the other columns."""
    from ..backends import choose_backend

    for name in names:
        try:  # the group is not probed here: the ranks do that
            choose_backend(name, device_type=device_type, stochastic=False, env_kernels=env.kernels,
                           interpreted=env.triton_interpret, probe=lambda: (True, ""))
        except EchoConfigError as e:
            raise UsageError(f"--echo-backends {name} with tensors on {device_type}: {e}") from None


def run(args: argparse.Namespace) -> int:
    backend = args.backend
    under_torchrun = torchrun_int("WORLD_SIZE", 1) > 1
    if backend == "auto":
        backend = "nccl" if (under_torchrun and torch.cuda.is_available()) else (
            "one-gpu" if torch.cuda.is_available() else "gloo")
    if backend in ("gloo", "nccl"):
        check_echo_backends(args.echo_backends, args.device if backend == "gloo" else "cuda", envs.read())
    gpu = backend in ("nccl", "one-gpu")
    args.iters = (20 if gpu else 5) if args.iters is None else args.iters
    args.warmup = (5 if gpu else 1) if args.warmup is None else args.warmup
    if backend == "gloo":
        return run_gloo(args)
    if backend == "nccl":
        if not under_torchrun:
            print("bench allreduce --backend nccl: run it under torchrun --nproc-per-node N (N >= 2)",
                  file=sys.stderr)
            return 2
        return run_nccl(args)
    print("one GPU and no torchrun: no link to measure; the per-kernel table and the projection follow "
          "(echo-vllm bench kernels)")
    from . import kernels_bench

    return kernels_bench.run(one_gpu_kernel_args(args))


def one_gpu_kernel_args(args: argparse.Namespace) -> argparse.Namespace:
    """``bench kernels`` arguments for the one-GPU fallback: its own parser's
    defaults (so no option can be missing), with this command's values."""
    from . import kernels_bench

    ap = argparse.ArgumentParser()
    kernels_bench.add_arguments(ap)
    kargs = ap.parse_args([])
    kargs.min_size = args.min_size or kargs.min_size
    kargs.max_size = args.max_size or kargs.max_size
    kargs.sizes = args.sizes
    kargs.iters, kargs.group_size = args.iters, args.group_size
    kargs.no_hadamard, kargs.feedback_dtype, kargs.out = args.no_hadamard, args.feedback_dtype, args.out
    kargs.no_layout_compare = True
    return kargs
