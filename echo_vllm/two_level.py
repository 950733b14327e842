"""Two-level Echo across hosts: where the values go, and the plain-torch reference (the specification).

H hosts of G ranks (P = H G, :class:`~echo_vllm.hosts.HostMap`); rank
(h, l) is host h's l-th rank. One call, rank x_r holding N values:

1. **in-host reduce-scatter, exact**: each rank sends shard l of its
   16-bit input to its host's rank l and sums the G shards it receives in
   fp32, in rank order (:func:`host_sum_reference`): rank (h, l) holds
   s = host h's exact sum of shard l;
2. **cross-host Echo on the shard**: the ranks (0, l) ... (H-1, l) run the
   flat two-shot with P = H on s (``quant.stage1_reference`` on the fp32
   host sum plus the shard's carried error, all-to-all, fp32 rank-order
   sum and requantization, all-gather): each holds the H requantized
   chunks of shard l;
3. **in-host all-gather** of those chunks; every rank decodes the same
   bytes (``quant.output_reference`` of the message's flat layout): the
   same bits on every rank.

Each value is quantized twice, as in the flat path; quantization sums H
host partials instead of P rank partials.

Where the values go
-------------------
The message's flat layout ``WireLayout(numel, P, g, cols)`` cuts every row
into P column blocks of R groups (``row_groups``). Shard l is blocks
l H ... l H + H - 1: the S = H R g columns ``[l S, (l+1) S)`` of every row
(:func:`shard_cols`; zeros past the row's end, so a narrow row's last shards
may be all padding). Cross-host, shard l is a message of ``rows x S``
values over H ranks, :func:`shard_layout`: its ``row_groups`` is R, so its
chunk h is column block l H + h of the message and has the flat layout's
chunk size. Hence:

* a value's owner depends only on its column (column block l H + h is
  summed and requantized by rank (h, l), which keeps its stage-2 error),
  and no group or Hadamard block straddles two rows or two shards: a
  token's bits do not depend on the rest of the batch;
* the shards' gathered chunks, shard after shard, are the flat layout's
  gathered chunks, which the flat output stage decodes.

The in-host all-gather moves the **4-bit wire** (H chunks per rank), not
the 16-bit output: 0.5625 bytes a value instead of 2, 3.6x fewer bytes over
the in-host link, and every rank decodes the same bytes with the flat
output stage, which is what makes the bits the same everywhere. (Gathering
the output would save each rank the decode of the other shards, 1 - 1/G of
one output stage, at 3.6x the in-host bytes.)

The carried error
-----------------
Rank (h, l) keeps the error of its shard only (``shard_layout``'s wire
order): the stage-1 error of its host sum on all H chunks, plus its
stage-2 error on chunk h; ``layout.padded_numel / G`` values, 1/G of the
flat path's buffer. Call t returns y_t = S_t + E_{t-1} - E_t, with E the
sum over ranks of ``rot^-1(e) * OUTPUT_SCALE`` placed on shard l's columns
(docs/architecture.md); an exact call absorbs it: each rank adds its error
to its own input on shard l's columns only (:func:`consume_reference`),
and the exact all-reduce sums them.
"""

from __future__ import annotations

import functools

import torch

from . import quant
from .hosts import HostMap
from .quant import WireLayout


def shard_cols(layout: WireLayout, hosts: int) -> int:
    """S: the columns of one shard (``hosts`` column blocks of the flat layout)."""
    return hosts * layout.row_groups * layout.group_size


@functools.lru_cache(maxsize=1024)  # asked at every call; layouts are frozen
def shard_layout(layout: WireLayout, hosts: int) -> WireLayout:
    """The cross-host layout of one shard of a message of flat ``layout``:
    ``rows x S`` values over ``hosts`` ranks, rows of S (module docstring)."""
    s = shard_cols(layout, hosts)
    lay = WireLayout(layout.rows * s, hosts, layout.group_size, cols=s)
    assert lay.chunk_numel == layout.chunk_numel and lay.row_groups == layout.row_groups, (layout, lay)
    return lay


def to_shards(x: torch.Tensor, layout: WireLayout, ranks_per_host: int) -> torch.Tensor:
    """Message values ``x [R, numel]`` -> ``[R, G, rows * S]``: shard l of
    every row, row after row (zeros past the row's end), ``x``'s dtype."""
    r, s = x.shape[0], layout.padded_cols // ranks_per_host
    padded = x.new_zeros(r, layout.rows, layout.padded_cols)
    padded[:, :, : layout.cols] = x.reshape(r, layout.rows, layout.cols)
    return padded.reshape(r, layout.rows, ranks_per_host, s).transpose(1, 2).reshape(r, ranks_per_host, -1)


def put_shard(x: torch.Tensor, shard: torch.Tensor, layout: WireLayout, index: int, ranks_per_host: int) -> None:
    """Write ``shard [R, rows * S]`` (shard ``index``, as :func:`to_shards`
    cuts it) onto its columns of ``x [R, numel]``, in place; the padding
    past the row's end is dropped."""
    r, s = x.shape[0], layout.padded_cols // ranks_per_host
    lo, hi = index * s, min((index + 1) * s, layout.cols)
    if hi > lo:
        x.view(r, layout.rows, layout.cols)[:, :, lo:hi] = shard.reshape(r, layout.rows, s)[:, :, : hi - lo]


def host_sum_reference(recv: torch.Tensor) -> torch.Tensor:
    """``recv [R, G, n]`` (``recv[r, j]``: the shard local rank r received
    from its host's rank j, 16-bit) -> fp32 ``[R, n]``: the sum in fp32 in
    rank order j = 0 .. G-1, each partial sum rounded to fp32 (what the
    exact path's sum does: ``VirtualTransport.exact_all_reduce``). A sum of
    finite values that leaves fp32's range (bf16 inputs near their largest
    value only) saturates to +-fp32 max, so finite inputs stay finite
    (``quant``'s Range); NaN and infinite inputs stay NaN or infinite."""
    acc = torch.zeros(recv.shape[0], recv.shape[2], dtype=torch.float32, device=recv.device)
    finite = torch.ones(acc.shape, dtype=torch.bool, device=recv.device)
    for j in range(recv.shape[1]):
        acc = acc + recv[:, j].float()
        finite &= torch.isfinite(recv[:, j])
    big = torch.finfo(torch.float32).max
    return torch.where(finite, acc.clamp(-big, big), acc)


def two_level_reference(
    xs: torch.Tensor,
    feedback: torch.Tensor | None,
    layout: WireLayout,
    hosts: HostMap,
    *,
    qmax: int = 7,
    hadamard: bool = False,
    has_incoming: bool = False,
    flips: int = 0,
    encoder: str = "absmax",
) -> torch.Tensor:
    """Two-level Echo of every rank's input ``xs [P, numel]`` (rank order)
    over the hosts of ``hosts`` (equal sizes, ``choose_topology``'s two-level)
    -> ``[numel]`` of ``xs.dtype``, the bits every rank gets.

    ``layout``: the message's flat layout (P ranks). ``feedback``: every
    rank's buffer ``[P, >= shard_layout.padded_numel]`` (any format,
    ``quant.read_feedback``) or None; its values are added to the host sums
    if ``has_incoming``, and it ends holding this call's errors (module
    docstring), in place. ``flips``: the rotation seed's sign pattern
    (``rotation.sign_flips``) and ``encoder``, as on the flat path.
    """
    p, g_ranks, h_hosts = xs.shape[0], hosts.ranks_per_host[0], hosts.hosts
    assert p == hosts.world_size == layout.world_size == g_ranks * h_hosts, (p, hosts, layout)
    sl = shard_layout(layout, h_hosts)
    shards = to_shards(xs, layout, g_ranks)
    sums = torch.empty(p, sl.numel, dtype=torch.float32, device=xs.device)
    for members in hosts.in_host_groups:  # 1. rank (h, l) sums shard l of its host's ranks
        for l, rank in enumerate(members):
            sums[rank] = host_sum_reference(shards[list(members), l].unsqueeze(0))[0]
    gathered = []
    for members in hosts.cross_host_groups:  # 2. Echo over the hosts on shard l
        idx = list(members)
        fb = feedback[idx] if feedback is not None else None
        wire = quant.stage1_reference(sums[idx], fb, sl, qmax=qmax, hadamard=hadamard, has_incoming=has_incoming,
                                      flips=flips, encoder=encoder)
        q2 = quant.stage2_reference(wire.transpose(0, 1), fb, list(range(h_hosts)), sl, qmax=qmax,
                                    encoder=encoder)
        if feedback is not None:
            feedback[idx] = fb
        gathered.append(q2)
    # 3. shard after shard: the flat layout's chunks
    return quant.output_reference(torch.cat(gathered), layout, xs.dtype, hadamard=hadamard, flips=flips)


def consume_reference(xs: torch.Tensor, feedback: torch.Tensor, layout: WireLayout, hosts: HostMap, *,
                      hadamard: bool = False, flips: int = 0) -> torch.Tensor:
    """The inputs ``[P, numel]`` of an exact call that absorbs every rank's
    carried error: rank (h, l)'s input with ``quant.consume_reference`` of
    its buffer applied on shard l's columns (the others as they are)."""
    g_ranks = hosts.ranks_per_host[0]
    sl = shard_layout(layout, hosts.hosts)
    shards = to_shards(xs, layout, g_ranks)
    out = xs.clone()
    for rank in range(xs.shape[0]):
        l = hosts.local_index(rank)
        absorbed = quant.consume_reference(shards[rank : rank + 1, l], feedback[rank : rank + 1], sl,
                                           hadamard=hadamard, flips=flips)
        put_shard(out[rank : rank + 1], absorbed, layout, l, g_ranks)
    return out


__all__ = ["consume_reference", "host_sum_reference", "put_shard", "shard_cols", "shard_layout", "to_shards",
           "two_level_reference"]
