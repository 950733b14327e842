"""A clearly labelled *projection* of the all-reduce speedup on hardware we
do not have, from kernel times measured on one GPU and the bytes each
algorithm puts on the link.

Model (per rank, one call; P ranks, message of S bytes):

* NCCL 16-bit ring/tree all-reduce at bus bandwidth B:
  ``t = 2 (P-1)/P * S / B`` (the nccl-tests definition of busbw, inverted);
  its reduction arithmetic hides under the transfers.
* Echo, as implemented (stages in sequence):
  ``t = t_stage1 + t_stage2 + t_output + wire / B`` with
  ``wire = WireLayout.wire_bytes_per_rank`` (all-to-all + all-gather of
  4-bit chunks), assuming the all-to-all and all-gather reach the same B.
* Echo, overlapped bound: ``max(kernels, wire / B)`` -- what a chunked
  pipeline that quantizes one piece while sending the previous could
  approach; not implemented, shown to say where the time goes.

Kernel times measured on one device scale to another by the ratio of copy
bandwidths (``mem_scale``): the kernels are memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A projected system."""

    name: str
    busbw_gbps: float
    """All-reduce bus bandwidth NCCL reaches there (GB/s)."""
    world_size: int
    mem_scale: float = 1.0
    """Multiply measured kernel times by this (measuring device's copy
    bandwidth / projected device's)."""


#: Assumed copy bandwidth of an A100-SXM4-80GB (HBM2e, 2.04 TB/s peak;
#: device-to-device copies reach ~1.7 TB/s). An assumption, stated as such.
A100_COPY_GBPS = 1700.0


def default_links(measured_copy_gbps: float) -> list[Link]:
    a100_scale = measured_copy_gbps / A100_COPY_GBPS
    return [
        Link("H200 NVLink busbw 480 GB/s (NVLS off), P=4", 480.0, 4),
        Link("H200 NVLink busbw 480 GB/s (NVLS off), P=8", 480.0, 8),
        Link(f"A100 NVLink busbw 200 GB/s, P=8 (kernels x{a100_scale:.2f})", 200.0, 8, a100_scale),
        Link("PCIe busbw 25 GB/s, P=4", 25.0, 4),
    ]


def nccl_time_s(size_bytes: int, world_size: int, busbw_gbps: float) -> float:
    return 2 * (world_size - 1) / world_size * size_bytes / (busbw_gbps * 1e9)


def echo_time_s(kernel_s: float, wire_bytes: int, busbw_gbps: float, *, overlapped: bool = False) -> float:
    comm = wire_bytes / (busbw_gbps * 1e9)
    return max(kernel_s, comm) if overlapped else kernel_s + comm


@dataclass
class Projection:
    link: str
    size_bytes: int
    world_size: int
    nccl_s: float
    echo_s: float
    echo_overlapped_s: float
    naive_s: float

    @property
    def speedup(self) -> float:
        return self.nccl_s / self.echo_s

    @property
    def speedup_overlapped(self) -> float:
        return self.nccl_s / self.echo_overlapped_s

    @property
    def speedup_naive(self) -> float:
        return self.nccl_s / self.naive_s

    def to_dict(self) -> dict:
        return {
            **self.__dict__,
            "speedup": self.speedup,
            "speedup_overlapped": self.speedup_overlapped,
            "speedup_naive": self.speedup_naive,
        }


def project(
    link: Link, size_bytes: int, wire_bytes: int, echo_kernels_s: float, naive_kernels_s: float
) -> Projection:
    b = link.busbw_gbps
    echo_k = echo_kernels_s * link.mem_scale
    naive_k = naive_kernels_s * link.mem_scale
    return Projection(
        link=link.name,
        size_bytes=size_bytes,
        world_size=link.world_size,
        nccl_s=nccl_time_s(size_bytes, link.world_size, b),
        echo_s=echo_time_s(echo_k, wire_bytes, b),
        echo_overlapped_s=echo_time_s(echo_k, wire_bytes, b, overlapped=True),
        naive_s=echo_time_s(naive_k, wire_bytes, b),
    )
