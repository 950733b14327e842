"""Real tensor parallelism (2 gloo processes, one rank each) against the
one-process emulation (2 virtual ranks): same data, same seed, a few AdamW
steps with Echo on both chains -- the same losses, gradient norms and
weights, bit for bit.

Why bit-identical and not "close": every per-rank computation is the same
operation on the same shapes in both settings (the emulation batches the
ranks on a leading dimension, ``echo_vllm.training.layers``); Echo's stages
are elementwise per rank and sum in rank order; the exact fp32 collectives
(loss, replicated-parameter gradients) add P = 2 values, one rounding,
in either order. With P > 2 gloo's reduction order may differ from the
emulation's rank order in the last bit of those fp32 sums (not in Echo's
messages); P = 2 is where the claim is exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from echo_vllm import EchoConfig
from echo_vllm.spawn import run_processes
from echo_vllm.training import ModelConfig, TPComm, TPCommConfig, TPGroup, TPQwen3
from echo_vllm.training.data import train_batch
from echo_vllm.training.trainer import TrainConfig, make_optimizer, train_step

WORLD = 2
MC = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
TC = TrainConfig(steps=4, batch_size=2, seq_len=32, warmup_steps=2)
# calls 0 and the last one 16-bit, the rest 4-bit with feedback: every path
ECHO = EchoConfig(min_bytes=0, first_exact_calls=1, exact_last_call=True)
README = Path(__file__).resolve().parents[2] / "README.md"  # real text, offline


def _run(group: TPGroup, mode: str) -> dict:
    comm = TPComm(TPCommConfig(mode=mode, forward=ECHO, backward=ECHO), group)
    model = TPQwen3(MC, group, comm, seed=0)
    opt = make_optimizer(model, TC)
    data = torch.frombuffer(bytearray(README.read_bytes()), dtype=torch.uint8)
    steps = []
    for step in range(TC.steps):
        ids, tgt = train_batch(data, TC.batch_size, TC.seq_len, 0, step)
        steps.append(train_step(model, opt, ids, tgt, TC, TC.lr_at(step)))
    return {"steps": steps, "weights": model.full_state(), "stats": comm.stats()}


def _worker(rank: int, world: int, mode: str) -> dict:
    return _run(TPGroup.from_process_group(), mode)


def test_gloo_training_matches_virtual_ranks():
    real = run_processes(_worker, WORLD, "echo")
    threads = torch.get_num_threads()
    # the workers run with cores // world threads each (echo_vllm.spawn)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))
    try:
        virtual = _run(TPGroup.virtual(WORLD), "echo")
    finally:
        torch.set_num_threads(threads)
    for rank in range(WORLD):
        assert real[rank]["steps"] == virtual["steps"], rank  # (loss, grad norm) per step, exact floats
        for name, w in virtual["weights"].items():
            assert torch.equal(real[rank]["weights"][name], w), (rank, name)
    # the runs did go through Echo, with feedback, in both directions
    for direction in ("forward", "backward"):
        stats = virtual["stats"][direction]
        assert stats["calls"]["echo/echo"] == TC.steps * (2 * MC.num_layers - 1)
        assert stats["chain"]["carried"] > 0
        assert real[0]["stats"][direction]["calls"] == stats["calls"]
    # and training moved: the weights are not the initial ones
    first = virtual["steps"][0][0]
    assert virtual["steps"][-1][0] < first
