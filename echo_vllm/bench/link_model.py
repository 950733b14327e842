"""The tensor-parallel model over the link testbed: a prefill and a training step.

The analogue of the seed paper's end-to-end claims (time to first token
1.16x, 1.44x with background traffic; training step 1.09x, 1.38x): the
package's Qwen3-architecture TP model (:mod:`echo_vllm.training`) on the
ranks of the testbed, every residual all-reduce over the shaped link,
16-bit against Echo. A *prefill* is one forward pass of a prompt under
``no_grad`` (the model's forward ends in its loss, a few vocab-sized
matmuls: a prefill's LM head); a *training step* is forward, backward,
gradient clipping and AdamW (``trainer.train_step``).

Each is timed per pass between barriers (the slowest rank's median is the
pass's time), with the time its ranks spent inside the residual
all-reduces beside it: the communication share, which is what decides how
much a faster all-reduce can buy. Echo's calls follow the training
defaults (``FORWARD_DEFAULT``, ``BACKWARD_DEFAULT``): the first and last
calls of a chain 16-bit, so a model of L layers quantizes about 2L - 5
of its 2L + 1 forward calls; the counts are reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..training import ModelConfig, TPComm, TPCommConfig, TPGroup, TPQwen3
from ..training.trainer import TrainConfig, make_optimizer, train_step
from . import timing

#: The workloads this module runs.
MODEL_WORKLOADS = ("prefill", "train")


@dataclass(frozen=True)
class ModelWorkload:
    """The model and its input (every size divisible by P up to 8)."""

    layers: int = 8
    """Decoder layers: 2 L + 1 residual all-reduces per forward pass."""
    hidden: int = 512
    """Residual width: each all-reduce moves tokens x hidden bf16 values."""
    tokens: int = 1024
    """Prompt length of the prefill and sequence length of the training
    step (one sequence)."""
    iters: int = 3
    """Timed passes of each kind (their median is reported)."""
    warmup: int = 1
    """Untimed passes first (kernels compile, buffers grow)."""

    def model_config(self) -> ModelConfig:
        heads = max(8, self.hidden // 64)
        return ModelConfig(hidden_size=self.hidden, num_layers=self.layers, num_heads=heads,
                           num_kv_heads=heads // 2, head_dim=64, intermediate_size=3 * self.hidden)

    def message_bytes(self) -> int:
        """Bytes of one residual all-reduce's message (bf16)."""
        return 2 * self.tokens * self.hidden


def _passes(run, workload: ModelWorkload, comm: TPComm) -> dict:
    """Time ``run(i)`` per pass, and this rank's seconds inside the residual
    all-reduces of each timed pass."""
    comm_s: list[float] = []

    def timed(i: int):
        out = run(i)
        if i >= workload.warmup:
            comm_s.append(comm.forward.collect_time().seconds + comm.backward.collect_time().seconds)
        else:  # the warm-up's calls: not this pass's
            comm.forward.collect_time()
            comm.backward.collect_time()
        return out

    t = timing.host_time(timed, iters=workload.iters, warmup=workload.warmup, barrier=dist.barrier)
    return {**t.to_dict(), "samples_s": t.samples_s, "comm_s": sorted(comm_s)[len(comm_s) // 2]}


def measure_model(comm_config: TPCommConfig, workload: ModelWorkload, kinds: tuple[str, ...]) -> dict:
    """This rank's timings of each of ``kinds`` ("prefill", "train") under
    ``comm_config``, with the loss of the first pass (the same on every rank)."""
    group = TPGroup.from_process_group()
    cfg = workload.model_config()
    comm = TPComm(comm_config, group)
    model = TPQwen3(cfg, group, comm, seed=0)
    gen = torch.Generator().manual_seed(1234)  # the same tokens on every rank
    ids = torch.randint(0, cfg.vocab_size, (1, workload.tokens + 1), generator=gen)
    ids, targets = ids[:, :-1], ids[:, 1:]
    out: dict = {"parameters": cfg.num_parameters(), "model": asdict(cfg), "workload": asdict(workload),
                 "message_bytes": workload.message_bytes(), "forward_calls": model.forward_calls}
    if "prefill" in kinds:
        with torch.no_grad():
            out["prefill_loss"] = float(model(ids, targets))
            comm.forward.collect_time()
            out["prefill"] = _passes(lambda i: model(ids, targets), workload, comm)
    if "train" in kinds:
        train_cfg = TrainConfig(steps=workload.warmup + workload.iters, batch_size=1, seq_len=workload.tokens,
                                warmup_steps=1)
        opt = make_optimizer(model, train_cfg)
        losses: list[float] = []

        def step(i: int):
            losses.append(train_step(model, opt, ids, targets, train_cfg, train_cfg.lr_at(i))[0])

        comm.forward.collect_time()
        comm.backward.collect_time()
        out["train"] = _passes(step, workload, comm)
        out["train_losses"] = losses
    out["calls"] = {d: s["calls"] for d, s in comm.stats().items()}
    return out


__all__ = ["MODEL_WORKLOADS", "ModelWorkload", "measure_model"]
