"""nccl-tests-style tables, JSON and PNG output for the benchmarks.

``algbw`` is message bytes / time; ``busbw`` is ``algbw * 2 (P-1) / P``, the
per-GPU link throughput a bandwidth-optimal all-reduce of that message
needs (nccl-tests' definition), so 16-bit and 4-bit rows compare on the
message the user asked to reduce, not on the bytes Echo happens to send.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

from ..cli_args import UsageError, byte_size, byte_sizes
from ..config import parse_bytes
from .. import outputs


@dataclass
class Row:
    """One measured (or projected) all-reduce."""

    size_bytes: int
    """Message size in bytes of the 16-bit input."""
    algo: str
    world_size: int
    time_s: float
    kind: str = "measured"
    """"measured" or "projected"."""

    @property
    def algbw_gbps(self) -> float:
        return self.size_bytes / self.time_s / 1e9

    @property
    def busbw_gbps(self) -> float:
        p = self.world_size
        return self.algbw_gbps * 2 * (p - 1) / p

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(algbw_gbps=self.algbw_gbps, busbw_gbps=self.busbw_gbps)
        return d


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n} B"


#: ``8K``, ``64MiB``, ``1G``, ``1000`` -> bytes: the config's parser (binary suffixes).
parse_size = parse_bytes


#: Largest message a benchmark allocates: 64 GiB, where the message and its
#: buffers stop fitting in one device's (or host's) memory.
MAX_BENCH_BYTES = 1 << 36
MAX_BENCH_WHY = "a bf16 value is 2 bytes; above 64 GiB the message and its buffers do not fit in memory"


def _whole_values(parse):
    """argparse type ``parse`` (a size or a list of sizes) that refuses an
    odd byte count: a bf16 message of 3 bytes would be 1 value (2 bytes),
    timed as 2 bytes and reported as 3."""

    def convert(text: str):
        got = parse(text)
        for value in got if isinstance(got, list) else [got]:
            if value % 2:
                raise argparse.ArgumentTypeError(
                    f"{text!r:.60}: {value} bytes is not a whole number of bf16 values (2 bytes each)")
        return got

    convert.__name__ = parse.__name__
    return convert


def message_size() -> Callable[[str], int]:
    """argparse type: one bf16 message's bytes, even, from 2 bytes to :data:`MAX_BENCH_BYTES`."""
    return _whole_values(byte_size(2, MAX_BENCH_BYTES, MAX_BENCH_WHY))


def message_sizes() -> Callable[[str], list[int]]:
    """argparse type: a comma list of :func:`message_size` values (each once)."""
    return _whole_values(byte_sizes(2, MAX_BENCH_BYTES, MAX_BENCH_WHY))


def size_range(lo: int, hi: int, factor: int = 2) -> list[int]:
    """``lo, lo * factor, ...`` up to ``hi``; :class:`UsageError` when that
    holds nothing (``lo > hi``) or would never end (``factor <= 1``, ``lo <= 0``)."""
    if factor <= 1 or lo <= 0:
        raise UsageError(f"size ladder from {lo} by x{factor}: needs a smallest size of at least 1 byte and a "
                         "factor of at least 2 (it would never reach the largest size)")
    if lo > hi:
        raise UsageError(f"smallest size {human_bytes(lo)} is above the largest {human_bytes(hi)} "
                         "(--min-size / --max-size): nothing to measure")
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def format_table(rows: Sequence[Row], baseline: str, algos: Sequence[str]) -> str:
    """One line per size: time / algbw / busbw of each algo and its speedup
    over ``baseline`` (> 1 means faster than the baseline)."""
    by = {(r.size_bytes, r.algo): r for r in rows}
    sizes = sorted({r.size_bytes for r in rows})
    head = f"{'size':>10} |"
    for a in algos:
        head += f" {a + ' us':>12} {'algbw':>7} {'busbw':>7}" + ("" if a == baseline else f" {'speedup':>7}") + " |"
    lines = [head, "-" * len(head)]
    for s in sizes:
        line = f"{human_bytes(s):>10} |"
        base = by.get((s, baseline))
        for a in algos:
            r = by.get((s, a))
            if r is None:
                line += f" {'-':>12} {'-':>7} {'-':>7}" + ("" if a == baseline else f" {'-':>7}") + " |"
                continue
            line += f" {r.time_s * 1e6:12.1f} {r.algbw_gbps:7.2f} {r.busbw_gbps:7.2f}"
            if a != baseline:
                line += f" {base.time_s / r.time_s if base else float('nan'):6.2f}x"
            line += " |"
        lines.append(line)
    return "\n".join(lines)


def encoder_key(kernel: str, encoder: str, encoders: Sequence[str]) -> str:
    """The result key of ``kernel`` quantizing with ``encoder`` in a run over
    ``encoders`` (``EchoConfig.encoder`` values, ``--encoders``): the bare
    name for the first (the run's other tables use it), ``"<kernel>
    <encoder>"`` for the others."""
    return kernel if encoder == encoders[0] else f"{kernel} {encoder}"


def encoder_table(rows: Sequence[tuple[str, dict[str, float]]], kernels: Sequence[str], encoders: Sequence[str]) -> str:
    """One line per ``(label, times)``: each of ``kernels``' time with each
    of ``encoders`` (``times`` keyed by :func:`encoder_key`, in us), the
    others as a ratio to the first's."""
    head = f"{'':>20} |" + "".join(
        f" {k + ' ' + e:>26} |" if e == encoders[0] else f" {k + ' ' + e:>19} {'x':>6} |"
        for k in kernels for e in encoders)
    lines = [head, "-" * len(head)]
    for label, times in rows:
        cells = ""
        for k in kernels:
            base = times.get(k)
            for e in encoders:
                t = times.get(encoder_key(k, e, encoders))
                if e == encoders[0]:
                    cells += f" {t:23.1f} us |" if t else f" {'-':>26} |"
                else:
                    ratio = f"{t / base:6.3f}" if t and base else f"{'-':>6}"
                    cells += (f" {t:16.1f} us {ratio} |" if t else f" {'-':>19} {ratio} |")
        lines.append(f"{label:>20} |{cells}")
    return "\n".join(lines)


def write_json(out_dir: str, name: str, payload: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    outputs.write_json(path, payload, indent=2, default=str)
    return path


def plot_lines(
    out_dir: str,
    name: str,
    series: dict[str, Iterable[tuple[float, float]]],
    *,
    title: str,
    ylabel: str,
    xlabel: str = "message size (bytes)",
    hline: float | None = None,
) -> str | None:
    """Log-x line plot of ``{label: [(x, y), ...]}``; None if matplotlib is
    missing (the JSON still holds every number)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    plotted = 0
    for label, pts in series.items():
        pts = sorted(pts)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
            plotted += 1
    if hline is not None:
        ax.axhline(hline, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if plotted:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    outputs.save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path
