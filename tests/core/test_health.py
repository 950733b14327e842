"""Numerical health (echo_vllm.health): which calls are checked, what a
check counts, and that the counts reach the records a CUDA-graph replay
repeats and the stats that /metrics exports."""

import pytest
import torch

from echo_vllm import CallSlot, EchoConfig, EchoStats, StackedCommunicator, VirtualTransport
from echo_vllm.health import HealthCounters, HealthCounts, sampled

P = 2


def test_sampled_positions_depend_on_the_call_index_alone():
    assert [i for i in range(40) if sampled(i, 16)] == [15, 31]
    assert [i for i in range(4) if sampled(i, 1)] == [0, 1, 2, 3]
    assert not any(sampled(i, 0) for i in range(40))  # 0: off
    assert not sampled(None, 1)  # outside a forward pass


def test_a_check_counts_nonfinite_inputs_and_outputs():
    h = HealthCounters("cpu")
    assert h.read() == (0, 0, 0)  # nothing allocated yet: nothing counted
    fine = torch.ones(3, 4, dtype=torch.bfloat16)
    bad = fine.clone()
    bad[1, 2] = float("nan")
    inf = fine.clone()
    inf[0, 0] = float("inf")
    assert h.observe(fine, fine) and h.read() == (0, 0, 0)
    h.observe(bad, fine)
    h.observe(fine, inf)
    h.observe(bad, bad)
    assert h.read() == HealthCounts(input=2, output=2, saturated=0)
    h.reset()
    assert h.read() == (0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_output_at_the_dtypes_largest_value_counts_as_saturated(dtype):
    """Echo decodes a sum beyond the dtype's range to +-max (the exact path:
    +-inf): counted as saturated, not as non-finite; values just below the
    largest, and an empty message, are not."""
    top = torch.finfo(dtype).max
    h = HealthCounters("cpu")
    ok = torch.ones(2, 64, dtype=dtype)
    for sign in (1, -1):
        y = ok.clone()
        y[1, 7] = sign * top
        assert h.observe(ok, y)
    below = ok.clone()
    below[0, 0] = torch.nextafter(torch.tensor(top, dtype=dtype), torch.tensor(0.0, dtype=dtype))
    h.observe(ok, below)
    assert not h.observe(ok[:0], ok[:0])  # nothing to check
    assert h.read() == HealthCounts(input=0, output=0, saturated=2)


def test_an_overflowing_sum_is_counted_saturated_by_the_communicator():
    """Two ranks' finite bf16 partials whose sum exceeds bf16's range: the
    exact sum is +inf, Echo's output +max, and the sampled check counts the
    call as saturated, not as a non-finite output (the fp32 sum of two
    maxima, the old check, overflowed and called it Echo's NaN)."""
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, health_every=1, exact_last_call=False)
    health = HealthCounters("cpu")
    comm = StackedCommunicator(cfg, VirtualTransport(P), stats=EchoStats(health=health))
    x = torch.ones(P, 4, 64, dtype=torch.bfloat16)
    x[:, 2, 9] = torch.finfo(torch.bfloat16).max
    y = comm.all_reduce(x, slot=CallSlot(0))
    assert comm.transport.exact_all_reduce(x)[2, 9] == float("inf")
    assert y[2, 9] == torch.finfo(torch.bfloat16).max and torch.isfinite(y).all()
    assert health.read() == HealthCounts(input=0, output=0, saturated=1)


def test_sampled_echo_calls_are_checked_and_recorded():
    """Every ``health_every``-th Echo call is checked; its record says so (a
    replayed plan counts it); a NaN in a partial is counted on input and
    output; exact calls are not checked."""
    records = []
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, health_every=2)
    health = HealthCounters("cpu")
    comm = StackedCommunicator(cfg, VirtualTransport(P), stats=EchoStats(health=health), sink=records.append)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(P, 4, 64, generator=g).bfloat16() for _ in range(5)]
    xs[3][1, 2, 5] = float("nan")
    for t, x in enumerate(xs):
        comm.all_reduce(x, slot=CallSlot(t, last_call=t == 4))
    assert [r.checked for r in records] == [False, True, False, True, False]  # call 4: exact last call
    assert health.read() == (1, 1, 0)
    comm.stats.health = health
    for r in records:
        comm.stats.record(r)
    snap = comm.stats.snapshot()
    assert snap["health_checked"] == 2 and snap["nonfinite"] == {"input": 1, "output": 1}
    assert snap["saturated"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checks_captured_in_a_cuda_graph_count_on_every_replay():
    h = HealthCounters("cuda")
    h.allocate()
    x = torch.ones(8, 256, dtype=torch.bfloat16, device="cuda")
    y = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up, as vLLM does before capture
        h.observe(x, y)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h.observe(x, y)
    y[0, 0] = float("nan")
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    h.read()  # starts the copy; the next read sees it (no sync in read itself)
    torch.cuda.synchronize()
    assert h.read() == (0, 3, 0)


def _counters_made_in_inference_mode(device: str, allocate: bool) -> HealthCounters:
    """Counters as vLLM makes them: allocated (or first used) under
    ``torch.inference_mode()``, with one non-finite output counted there."""
    h = HealthCounters(device)
    ok = torch.ones(4, 8, device=device)
    bad = ok.clone()
    bad[0, 0] = float("inf")
    with torch.inference_mode():
        if allocate:
            h.allocate()
        assert h.observe(ok, bad)
    return h


def _read_settled(h: HealthCounters) -> HealthCounts:
    """A read that has seen every queued count (CUDA reads lag by one copy)."""
    if h.device.type == "cuda":
        torch.cuda.synchronize()
        h.read()
        torch.cuda.synchronize()
    return h.read()


@pytest.mark.parametrize("allocate", [True, False], ids=["allocated", "first-observe"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_counters_made_in_inference_mode_read_and_reset_in_either_mode(device, allocate):
    """``reset`` and ``read`` (what ``reset_stats`` and ``snapshot`` call) work
    inside and outside inference mode on counters made inside it; outside,
    the old counters raised ``Inplace update to inference tensor``."""
    h = _counters_made_in_inference_mode(device, allocate)
    assert _read_settled(h) == (0, 1, 0)
    h.reset()  # outside inference mode
    assert _read_settled(h) == (0, 0, 0)
    ok = torch.ones(4, 8, device=device)
    assert h.observe(ok, ok * float("nan"))  # outside
    assert _read_settled(h) == (0, 1, 0)
    with torch.inference_mode():
        assert h.observe(ok * float("nan"), ok)
        assert _read_settled(h) == (1, 1, 0)
        h.reset()
        assert _read_settled(h) == (0, 0, 0)


def test_stats_snapshot_reads_counters_made_in_inference_mode():
    from echo_vllm.stats import EchoStats

    stats = EchoStats()
    stats.health = _counters_made_in_inference_mode("cpu", allocate=True)
    assert stats.snapshot()["nonfinite"] == {"input": 0, "output": 1}
    stats.health.reset()
    assert stats.snapshot()["nonfinite"] == {"input": 0, "output": 0}
