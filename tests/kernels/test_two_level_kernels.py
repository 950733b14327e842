"""Two-level Echo on the Triton stage kernels (the composed path on the
sub-groups, what a CUDA group across hosts runs): bit for bit against
``two_level.two_level_reference`` in Triton's interpreter (without a GPU),
and every kernel it launches compiled for sm_90 on the CPU -- stage 1 takes
the fp32 host sums, a specialization the flat path never launches --
without spills or shared memory."""

from __future__ import annotations

import pytest
import torch
from test_kernels import CUDA, DEVICE, _compiler_pool, _reporting, assert_same_bits, in_kernel_process

pytest.importorskip("triton")

#: (host map, rows, cols, feedback dtype): widths not a multiple of P * g
CASES = [((0, 0, 1, 1), 3, 100, "bfloat16"), ((0, 0, 0, 1, 1, 1), 2, 70, "int8")]


def _triton_against_reference(host_map, rows, cols, fb_dtype, dtype) -> int:
    from echo_vllm import EchoConfig, FeedbackChain, StackedCommunicator, VirtualTransport
    from echo_vllm import two_level as tl
    from echo_vllm.backends import TritonStages, TwoLevelBackend
    from echo_vllm.hosts import HostMap
    from echo_vllm.quant import FEEDBACK_STORAGE, feedback_row_len

    hosts, p = HostMap(host_map), len(host_map)
    cfg = EchoConfig(min_bytes=0, topology="two_level", host_map=host_map, feedback_dtype=fb_dtype)
    comm = StackedCommunicator(cfg, VirtualTransport(p), device=DEVICE,
                               backend=TwoLevelBackend.over(cfg, VirtualTransport(p), TritonStages(), hosts))
    chain = FeedbackChain.of(cfg, p, DEVICE)
    lay = comm.message_layout((rows, cols))
    n_fb = tl.shard_layout(lay, hosts.hosts).padded_numel
    storage = FEEDBACK_STORAGE[fb_dtype]
    fb = torch.zeros(p, feedback_row_len(n_fb, storage, 32), dtype=storage)
    g = torch.Generator().manual_seed(rows * cols)
    checked = 0
    for t in range(2):
        xs = (torch.randn(p, rows, cols, generator=g) * (t + 1)).to(dtype)
        y = comm.echo_all_reduce(xs.to(DEVICE), chain, t)
        want = tl.two_level_reference(xs.reshape(p, -1), fb, lay, hosts, hadamard=True, has_incoming=t > 0)
        assert_same_bits(y.reshape(-1).cpu(), want, f"two-level call {t}", nan_any=True)
        assert_same_bits(chain.buffer(n_fb)[:, : fb.shape[1]].cpu(), fb, f"carried error after call {t}")
        checked += 1
    xs = torch.randn(p, rows, cols, generator=g).to(dtype)
    absorbed = comm.absorb(xs.to(DEVICE), chain, 2)
    assert_same_bits(absorbed.reshape(p, -1).cpu(), tl.consume_reference(xs.reshape(p, -1), fb, lay, hosts,
                                                                          hadamard=True), "absorb")
    return checked + 1


@pytest.mark.parametrize("host_map,rows,cols,fb_dtype", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_two_level_matches_the_reference(host_map, rows, cols, fb_dtype, dtype):
    assert in_kernel_process(_triton_against_reference, host_map, rows, cols, fb_dtype, dtype) == 3


def _compiled_reports() -> dict[str, list[dict]]:
    """Every kernel one two-level call (2 hosts x 4 GPUs, 16 rows of 4096,
    bf16 feedback with an incoming error) and its absorb launch, compiled
    for sm_90 and not run: the SASS report of each, by stage."""
    from echo_vllm import EchoConfig, VirtualTransport
    from echo_vllm import two_level as tl
    from echo_vllm.backends import TritonStages, TwoLevelBackend
    from echo_vllm.bench import sass_report
    from echo_vllm.bench.host_overhead import compile_only
    from echo_vllm.hosts import HostMap
    from echo_vllm.kernels import consume_kernel, output_kernel, stage1_kernel, stage2_kernel
    from echo_vllm.quant import WireLayout

    modules = {"stage1": stage1_kernel, "stage2": stage2_kernel, "output": output_kernel, "consume": consume_kernel}
    for m in modules.values():  # this worker may have compiled the flat path's: only this call's count
        for cache in m._LAUNCH.fn.device_caches.values():
            cache[0].clear()
    hosts = HostMap((0, 0, 0, 0, 1, 1, 1, 1))
    cfg = EchoConfig(topology="two_level", host_map=hosts.host_of_rank)
    lay = WireLayout(16 * 4096, 8, 32, 4096)
    with compile_only():
        backend = TwoLevelBackend.over(cfg, VirtualTransport(8), TritonStages(), hosts)
        xs = torch.zeros(8, lay.numel, dtype=torch.bfloat16)
        fb = torch.zeros(8, tl.shard_layout(lay, hosts.hosts).padded_numel, dtype=torch.bfloat16)
        backend.all_reduce(xs, lay, fb, has_incoming=True)
        backend.consume(xs, lay, fb)
    return {name: [sass_report.kernel_report(k) for cache in m._LAUNCH.fn.device_caches.values()
                   for k in cache[0].values()] for name, m in modules.items()}


@pytest.mark.skipif(CUDA, reason="compiled for sm_90 without a GPU; a GPU host runs the kernels themselves")
def test_the_two_level_kernels_compile_for_sm90_without_spills_or_shared_memory():
    reports = _compiler_pool().submit(_reporting, _compiled_reports).result(timeout=900)
    assert all(reports[name] for name in ("stage1", "stage2", "output", "consume")), reports
    for name, rows in reports.items():
        for r in rows:
            spills = {op: n for op, n in r["memory"].items() if op.startswith(("LDL", "STL", "LDS", "STS"))}
            assert not spills and r["shared_bytes"] == 0 and r["barriers"] == 0, (name, r)
            assert r["memory"].get("LDG.E.128", 0) > 0 or name == "output", (name, r)  # 16-byte loads
