"""Host-side cost of one eager kernel call, measurable without a GPU.

``python -m echo_vllm.bench.host_overhead [--calls N]`` compiles the Echo
kernels for sm_90 on the CPU (Triton's real compiler, ptxas included) under
:class:`CompileOnlyDriver`, a Triton driver whose launcher does nothing,
and times each wrapper per call, with the kernels launched directly
(``direct_launch.Launcher``) and through Triton's ``kernel[grid](...)``.
What it measures is exactly the Python the host runs before the driver's
``cuLaunchKernelEx``: argument checks, plans, Triton's dispatch; not the
C launcher nor the driver call (a few µs on the GPU host), and not the
device. The numbers are the CPU's, not the GPU host's.

``--route`` times instead the communicator above the backend:
``EchoCommunicator.all_reduce`` as vLLM's hook calls it (the call's slot
from a numbering, the residual check, the buffer reserved once, the policy,
the layouts, the chain rule, one record to a sink), over a backend that
returns at once and one rank of a group of 8 (no collective, no kernel).

The same driver lets the CPU tests check that a direct launch hands the
launcher what Triton's path hands it.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from ..cli_args import count

#: What the fake device reports (an H100/H200-class sm_90 part).
FAKE_SM = 90
FAKE_MAX_SHARED = 232448


class RecordingLauncher:
    """Stands in for Triton's compiled launcher: records each call's arguments
    (the last ``keep`` of them) and launches nothing."""

    def __init__(self, src, metadata, keep: int = 8):
        self.calls: list[tuple] = []
        self.keep = keep

    def __call__(self, *args):
        if len(self.calls) >= self.keep:
            self.calls.pop(0)
        self.calls.append(args)


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": FAKE_MAX_SHARED}

    def load_binary(self, name, kernel, shared, device):
        # module, function handle, registers, spills, max threads per block
        return object(), 0x1234, 0, 0, 1024


class CompileOnlyDriver:
    """A Triton driver for a GPU that is not there: kernels compile for
    sm_90 and their launches are recorded, not run. Device -1 is the CPU
    (``tensor.get_device()`` of a CPU tensor), stream 0."""

    launcher_cls = RecordingLauncher

    def __init__(self):
        self.utils = _Utils()

    def get_current_device(self):
        return -1

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", FAKE_SM, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only():
    """Install :class:`CompileOnlyDriver` for Triton and for ``direct_launch``."""
    from triton.runtime.driver import driver as config

    from ..kernels import direct_launch

    fake = CompileOnlyDriver()
    old_active = config._active
    old_dev, old_stream = direct_launch.current_device, direct_launch.current_stream
    config.set_active(fake)
    direct_launch.current_device, direct_launch.current_stream = fake.get_current_device, fake.get_current_stream
    try:
        yield fake
    finally:
        config._active = old_active
        direct_launch.current_device, direct_launch.current_stream = old_dev, old_stream


def _calls(numel: int, world_size: int, fb_dtype: torch.dtype = torch.float32, flips: int = 0,
           encoder: str = "absmax"):
    """One rank's four wrapper calls with caller-supplied buffers (as the
    benchmark and a CUDA-graph caller make them), feedback in ``fb_dtype``,
    the rotation's sign flips ``flips`` (``rotation.sign_flips``), stages 1
    and 2 quantizing with ``encoder``."""
    from .. import kernels
    from ..quant import WireLayout, feedback_row_len

    lay = WireLayout(numel, world_size, 32)
    x = torch.zeros(1, lay.numel, dtype=torch.bfloat16)
    fb = torch.zeros(1, feedback_row_len(lay.padded_numel, fb_dtype, lay.group_size), dtype=fb_dtype)
    wire = torch.empty(1, world_size, lay.chunk_bytes, dtype=torch.uint8)
    q2 = torch.empty(1, lay.chunk_bytes, dtype=torch.uint8)
    y = torch.empty(lay.numel, dtype=torch.bfloat16)
    xo = torch.empty_like(x)
    return {
        "stage1": lambda: kernels.stage1(x, fb, lay, qmax=7, hadamard=True, has_incoming=True, flips=flips,
                                         encoder=encoder, out=wire),
        "stage2": lambda: kernels.stage2(wire, fb, [0], lay, qmax=7, encoder=encoder, out=q2),
        "output": lambda: kernels.output(wire[0], lay, torch.bfloat16, hadamard=True, flips=flips, out=y),
        "consume": lambda: kernels.consume(x, fb, lay, hadamard=True, flips=flips, out=xo),
    }


def _per_call_s(fn, calls: int, repeats: int = 5) -> float:
    """Best of ``repeats`` means over ``calls`` calls (the machine's noise
    only ever adds time)."""
    for _ in range(min(calls, 100)):
        fn()
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls)
    return min(means)


def measure(calls: int = 2000, numel: int = 1 << 19, world_size: int = 8) -> dict[str, dict[str, float]]:
    """Seconds of host time per call, ``{kernel: {"direct": s, "triton": s}}``."""
    from ..kernels import consume_kernel, output_kernel, stage1_kernel, stage2_kernel

    launchers = [m._LAUNCH for m in (stage1_kernel, stage2_kernel, output_kernel, consume_kernel)]
    out: dict[str, dict[str, float]] = {}
    with compile_only():
        runs = _calls(numel, world_size)
        for name, fn in runs.items():
            fn()  # compile (first call: Triton's path)
            out[name] = {}
            for mode in ("direct", "triton"):
                saved = [la.direct for la in launchers]
                for la in launchers:
                    la.direct = la.direct and mode == "direct"
                try:
                    out[name][mode] = _per_call_s(fn, calls)
                finally:
                    for la, d in zip(launchers, saved):
                        la.direct = d
    return out


def route_s(calls: int = 5000, rows: int = 64, cols: int = 4096) -> float:
    """Host seconds per ``EchoCommunicator.all_reduce`` of a ``[rows, cols]``
    bf16 residual message above the backend (the ``--route`` measure)."""
    from ..backends.base import EchoBackend
    from ..communicator import EchoCommunicator, ResidualStream
    from ..config import EchoConfig
    from ..numbering import CallSlot
    from ..transport import Transport

    class OneRankOfEight(Transport):
        capturable = True
        world_size, rank, local_ranks = 8, 0, (0,)

        def all_to_all(self, send):
            raise AssertionError("the no-op backend moves nothing")

        all_gather = exact_all_reduce = all_to_all

        def check_same(self, values):
            pass

    class Returns(EchoBackend):
        name = "no-op"

        def all_reduce(self, xs, layout, feedback, *, has_incoming, out=None):
            return y

        def consume(self, xs, layout, feedback):
            return xs

    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, exact_last_call=False)
    transport = OneRankOfEight()
    x = torch.zeros(rows, cols, dtype=torch.bfloat16)
    y = torch.empty(rows * cols, dtype=torch.bfloat16)
    slots = [CallSlot(i) for i in range(8)]
    count = [0]

    def numbering(n_rows: int, residual: bool) -> CallSlot:
        count[0] += 1
        return slots[count[0] % 8]

    paths: set[str] = set()
    stream = ResidualStream(cols, ndim=2, max_num_tokens=rows, fixed_capacity=True)
    comm = EchoCommunicator(cfg, transport, stream=stream, backend=Returns(cfg, transport), numbering=numbering,
                            sink=lambda record: paths.add(record.path))
    seconds = _per_call_s(lambda: comm.all_reduce(x), calls)
    if paths != {"echo"}:  # an exact return would time the wrong route
        raise RuntimeError(f"the timed calls took the paths {sorted(paths)}, not Echo's alone")
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_vllm.bench.host_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # at least 1: 0 divided by zero, a negative count printed negative times
    ap.add_argument("--calls", type=count(1, 1 << 24), default=2000, help="calls per timing (best of 5 means)")
    ap.add_argument("--route", action="store_true",
                    help="time EchoCommunicator.all_reduce above the backend instead (no kernel, no collective)")
    args = ap.parse_args(argv)
    if args.route:
        print(f"host time per EchoCommunicator.all_reduce on this CPU, 64x4096 bf16, no-op backend: "
              f"{route_s(args.calls) * 1e6:.1f} µs")
        return 0
    res = measure(args.calls)
    print("host time per eager call on this CPU, launcher stubbed (µs): direct launch vs Triton's kernel[grid]")
    for name, r in res.items():
        print(f"  {name:<8} direct {r['direct'] * 1e6:6.1f}   triton {r['triton'] * 1e6:6.1f}")
    print(f"  sum      direct {sum(r['direct'] for r in res.values()) * 1e6:6.1f}   "
          f"triton {sum(r['triton'] for r in res.values()) * 1e6:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
