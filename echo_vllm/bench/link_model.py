"""The tensor-parallel model over the link testbed: a prefill and a training step.

The analogue of the seed paper's end-to-end claims (time to first token
1.16x, 1.44x with background traffic; training step 1.09x, 1.38x): the
package's Qwen3-architecture TP model (:mod:`echo_vllm.training`) on the
ranks of the testbed, every residual all-reduce over the shaped link,
16-bit against Echo. A *prefill* is one forward pass of a prompt under
``no_grad`` (the model's forward ends in its loss, a few vocab-sized
matmuls: a prefill's LM head); a *training step* is forward, backward,
gradient clipping and AdamW (``trainer.train_step``).

One model per algorithm, the same weights and tokens, their passes taken
in turn (16-bit, Echo, 16-bit, Echo, ...: a load that comes and goes on a
shared machine falls on both alike). Each is timed per pass between
barriers (the slowest rank's median is the pass's time), with the time its
ranks spent inside the residual all-reduces beside it: the communication share, which is what decides how
much a faster all-reduce can buy. Echo's calls follow the training
defaults (``FORWARD_DEFAULT``, ``BACKWARD_DEFAULT``): the first and last
calls of a chain 16-bit, so a model of L layers quantizes about 2L - 5
of its 2L + 1 forward calls; the counts are reported.
"""

from __future__ import annotations

import statistics
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


def _passes(runs: dict[str, object], comms: dict[str, TPComm], workload: ModelWorkload) -> dict[str, dict]:
    """Time one pass of each model in turn (``runs[algo](i)``), and each
    rank's seconds inside that model's residual all-reduces per timed pass."""
    comm_s: dict[str, list[float]] = {algo: [] for algo in runs}

    def counted(algo: str, run):
        def one(i: int):
            out = run(i)
            seconds = comms[algo].forward.collect_time().seconds + comms[algo].backward.collect_time().seconds
            if i >= workload.warmup:  # the warm-up's calls are not a timed pass's
                comm_s[algo].append(seconds)
            return out

        return one

    for comm in comms.values():  # nothing before this measurement counts
        comm.forward.collect_time()
        comm.backward.collect_time()
    times = timing.interleaved_host_time({algo: counted(algo, run) for algo, run in runs.items()},
                                         iters=workload.iters, warmup=workload.warmup, barrier=dist.barrier)
    return {algo: {**t.to_dict(), "samples_s": t.samples_s, "comm_s": statistics.median(comm_s[algo])}
            for algo, t in times.items()}


def measure_models(configs: dict[str, TPCommConfig], workload: ModelWorkload, kinds: tuple[str, ...]) -> dict:
    """This rank's timings of each of ``kinds`` ("prefill", "train") for a
    model per entry of ``configs`` (algorithm -> how its all-reduces are
    done): the same weights and tokens, passes taken in turn; with the
    first prefill's loss and the training losses (the same on every rank)."""
    group = TPGroup.from_process_group()
    cfg = workload.model_config()
    comms = {algo: TPComm(c, group) for algo, c in configs.items()}
    models = {algo: TPQwen3(cfg, group, comm, seed=0) for algo, comm in comms.items()}
    gen = torch.Generator().manual_seed(1234)  # the same tokens on every rank
    ids = torch.randint(0, cfg.vocab_size, (1, workload.tokens + 1), generator=gen)
    ids, targets = ids[:, :-1], ids[:, 1:]
    out = {algo: {"parameters": cfg.num_parameters(), "model": asdict(cfg), "workload": asdict(workload),
                  "message_bytes": workload.message_bytes(), "forward_calls": m.forward_calls}
           for algo, m in models.items()}
    if "prefill" in kinds:
        with torch.no_grad():
            for algo, m in models.items():
                out[algo]["prefill_loss"] = float(m(ids, targets))
            runs = {algo: (lambda i, m=m: m(ids, targets)) for algo, m in models.items()}
            for algo, t in _passes(runs, comms, workload).items():
                out[algo]["prefill"] = t
    if "train" in kinds:
        train_cfg = TrainConfig(steps=workload.warmup + workload.iters, batch_size=1, seq_len=workload.tokens,
                                warmup_steps=1)
        losses: dict[str, list[float]] = {algo: [] for algo in models}

        def stepper(algo: str, model: TPQwen3):
            opt = make_optimizer(model, train_cfg)

            def step(i: int):
                losses[algo].append(train_step(model, opt, ids, targets, train_cfg, train_cfg.lr_at(i))[0])

            return step

        for algo, t in _passes({algo: stepper(algo, m) for algo, m in models.items()}, comms, workload).items():
            out[algo]["train"] = t
            out[algo]["train_losses"] = losses[algo]
    for algo, comm in comms.items():
        out[algo]["calls"] = {d: s["calls"] for d, s in comm.stats().items()}
    return out


__all__ = ["MODEL_WORKLOADS", "ModelWorkload", "measure_models"]
