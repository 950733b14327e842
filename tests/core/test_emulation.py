"""``echo_vllm.emulation``: tensor parallelism of size P on one device --
vLLM's shard bounds, the partials each rank would compute, the stacked
communicator, and ``EmulatedTP``'s per-forward call numbering (the vLLM and
transformers glue that uses it: tests/vllm/test_vllm_emulation.py,
tests/eval/test_eval_emulation.py).

Values are small integers where sums are compared, so that every sum is
exact in fp32 whatever its order: "equal" means bit for bit."""

import re

import pytest
import torch
import torch.nn.functional as F

from echo_vllm import EchoConfig, EchoConfigError
from echo_vllm.backends import fastest_cpu_backend
from echo_vllm.emulation import (
    EmulatedTP,
    StackedCommunicator,
    row_parallel_partials,
    shard_bounds,
    vocab_parallel_partials,
    vocab_shard_bounds,
)
from echo_vllm.transport import VirtualTransport


def _ints(*shape, seed=0, high=8):
    return torch.randint(-high, high + 1, shape, generator=torch.Generator().manual_seed(seed)).float()


def test_shards_are_even_and_contiguous_or_refused():
    assert shard_bounds(12, 3) == [(0, 4), (4, 8), (8, 12)]
    assert shard_bounds(5, 1) == [(0, 5)]
    with pytest.raises(EchoConfigError, match="dimension 10 is not divisible by the emulated tensor-parallel size 4"):
        shard_bounds(10, 4)


@pytest.mark.parametrize("vocab,world,bounds", [
    (1000, 4, [(0, 256), (256, 512), (512, 768), (768, 1000)]),  # padded to 1024
    (100, 2, [(0, 64), (64, 100)]),                               # padded to 128
    (128, 4, [(0, 32), (32, 64), (64, 96), (96, 128)]),           # a multiple of 64: no padding
    (10, 4, [(0, 10), (16, 10), (32, 10), (48, 10)]),              # shards past the vocabulary are empty
])
def test_vocabulary_shards_follow_vllms_padding_to_64(vocab, world, bounds):
    got = vocab_shard_bounds(vocab, world)
    assert got == bounds
    assert sum(max(0, hi - lo) for lo, hi in got) == vocab  # every id in exactly one shard


def test_row_parallel_partials_split_the_input_features_and_rank_0_adds_the_bias():
    x, w, b = _ints(3, 5, 8, seed=1), _ints(6, 8, seed=2), _ints(6, seed=3)
    parts = row_parallel_partials(x, w, 4, b)
    assert parts.shape == (4, 3, 5, 6)
    for r in range(4):
        lo, hi = 2 * r, 2 * r + 2
        want = F.linear(x[..., lo:hi], w[:, lo:hi]) + (b if r == 0 else 0)
        assert torch.equal(parts[r], want), r
    assert torch.equal(parts.sum(0), F.linear(x, w, b))  # integers: exact in any order


def test_vocab_parallel_partials_hold_each_row_once_and_zeros_elsewhere():
    w = _ints(100, 8, seed=4) + 0.5  # no zero rows: a zero in a partial is a row not held
    ids = torch.tensor([[0, 63, 64, 99], [5, 70, 63, 0]])
    parts = vocab_parallel_partials(ids, w, 2)  # shards [0, 64) and [64, 100)
    assert parts.shape == (2, 2, 4, 8)
    holder = (ids >= 64).long()
    for r in range(2):
        mine = holder == r
        assert torch.equal(parts[r][mine], w[ids[mine]]), r
        assert torch.equal(parts[r][~mine], torch.zeros((~mine).sum().item(), 8)), r
    assert torch.equal(parts.sum(0), F.embedding(ids, w))


def test_the_stacked_communicator_takes_one_input_per_local_rank():
    comm = StackedCommunicator(EchoConfig(min_bytes=0), VirtualTransport(3))
    with pytest.raises(ValueError, match=r"3 local ranks of a group of 3 expect inputs stacked as \[3, \.\.\.\], "
                                         r"got shape \(2, 64\)"):
        comm.all_reduce(torch.zeros(2, 64, dtype=torch.bfloat16))
    for shape in ((0, 8, 128), (0,), ()):  # an empty stack has no rank 0 (it raised IndexError)
        with pytest.raises(ValueError, match=rf"expect inputs stacked as \[3, \.\.\.\], got shape {re.escape(str(shape))}"):
            comm.all_reduce(torch.zeros(shape, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="expect inputs stacked as"):
            comm.all_reduce_norm(torch.zeros(shape, dtype=torch.bfloat16), None)


def test_the_emulation_runs_the_fastest_cpu_backend_the_library_the_references(monkeypatch):
    monkeypatch.delenv("ECHO_KERNELS", raising=False)
    cpu = torch.device("cpu")
    assert EmulatedTP(2).comm.backend(cpu).name == fastest_cpu_backend()
    assert EmulatedTP(2, EchoConfig(backend="reference")).comm.backend(cpu).name == "reference"
    assert StackedCommunicator(EchoConfig(), VirtualTransport(2)).backend(cpu).name == "reference"


def test_emulated_tp_exact_mode_sums_and_bad_modes_are_refused():
    parts = _ints(4, 3, 64, seed=5).bfloat16()
    exact = EmulatedTP(4, EchoConfig(min_bytes=0), mode="exact")
    exact.begin_forward()
    assert torch.equal(exact.reduce(parts), parts.float().sum(0).bfloat16())  # small integers: exact
    with pytest.raises(EchoConfigError, match=r"mode='fp8': choose one of \('exact', 'naive', 'echo'\)"):
        EmulatedTP(4, mode="fp8")
    naive = EmulatedTP(4, EchoConfig(min_bytes=0), mode="naive")
    assert not naive.comm.config.feedback  # naive: Echo's path without error feedback


def test_the_last_call_of_a_pass_is_exact_once_the_count_is_known():
    """The first pass teaches the counter its 3 calls; from the second on,
    call 2 is the exact 16-bit sum (no feedback: nothing to consume), calls
    0 and 1 are Echo's 4-bit sums. A declared count needs no first pass."""
    cfg = EchoConfig(min_bytes=0, first_exact_calls=0, feedback=False)
    parts = [torch.randn(4, 5, 256, generator=torch.Generator().manual_seed(s)).bfloat16() for s in range(3)]
    exact = EmulatedTP(4, cfg, mode="exact")

    def one_pass(tp):
        tp.begin_forward()
        outs = [tp.reduce(p) for p in parts]
        tp.end_forward()
        return outs

    want = one_pass(exact)
    learning = EmulatedTP(4, cfg)
    first, second = one_pass(learning), one_pass(learning)
    assert not torch.equal(first[2], want[2]) and torch.equal(second[2], want[2])
    assert not any(torch.equal(o, w) for o, w in zip(second[:2], want[:2]))  # 4-bit: not the exact bits
    declared = one_pass(EmulatedTP(4, cfg, calls_per_forward=3))
    assert torch.equal(declared[2], want[2])
