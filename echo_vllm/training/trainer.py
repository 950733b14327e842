"""The training loop: one run of one comm mode, with timing and validation.

A run is fully determined by its configs: weights come from ``seed``,
batch ``k`` from (``seed``, ``k``) (``data.train_batch``), so runs of
different modes see the same data in the same order and differ only in
their all-reduces. Each step: forward + backward, the replicated
parameters' gradients summed over ranks (process groups only), global
gradient-norm clipping, AdamW with fp32 master weights.

Time per step is split into communication -- the residual all-reduces of
both chains (CUDA events around each call on GPU; on one GPU emulating TP
that is the kernels' cost only, no link) -- and compute, the rest.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass

import torch

from .collectives import TPComm, TPCommConfig, TPGroup
from .data import Corpus, train_batch, val_windows
from .model import ModelConfig, TPQwen3, is_main_rank


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping of one run."""

    steps: int = 200
    """Optimizer steps (the LR schedule spans exactly these)."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 128
    """Tokens (bytes) per sequence."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warm-up from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on matrices only (not on norm weights)."""
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    seed: int = 0
    """Weights and data order."""
    eval_every: int = 50
    """Validation loss every this many steps (0 = only at the end)."""
    eval_windows: int = 32
    """Validation windows of the periodic evaluations."""
    final_eval_windows: int = 128
    """Validation windows of the final evaluation."""
    max_time_s: float = 0.0
    """Stop after this many seconds of training (0 = never); the run is then
    marked truncated (its LR schedule did not finish)."""

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: TPQwen3, ids: torch.Tensor, targets: torch.Tensor, batch: int, comm: TPComm | None = None) -> float:
    """Mean loss over the windows ``ids``/``targets`` [W, S], run ``batch``
    windows at a time, with the model's own all-reduces or ``comm``'s."""
    own = model.comm
    if comm is not None:
        model.comm = comm
    try:
        total, count = 0.0, 0
        for i in range(0, ids.shape[0], batch):
            x = ids[i : i + batch].to(model.group.device)
            y = targets[i : i + batch].to(model.group.device)
            total += model(x, y).item() * x.shape[0]
            count += x.shape[0]
        return total / count
    finally:
        model.comm = own


def make_optimizer(model: TPQwen3, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    fused = model.group.device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=fused)


def train_step(
    model: TPQwen3, opt: torch.optim.Optimizer, ids, targets, cfg: TrainConfig, lr: float
) -> tuple[float, float]:
    """One optimizer step; returns (loss, gradient norm before clipping)."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss = model(ids, targets)
    loss.backward()
    model.sync_replicated_grads()
    gnorm = model.clip_grads(cfg.grad_clip) if cfg.grad_clip > 0 else model.grad_norm()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), gnorm.item()


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    comm_cfg: TPCommConfig,
    corpus: Corpus,
    group: TPGroup,
    *,
    label: str | None = None,
    progress: bool = True,
    log=None,
) -> dict:
    """Train one model from scratch; returns a JSON-able record of the run."""
    label = label or comm_cfg.mode
    device = group.device
    comm = TPComm(comm_cfg, group)
    model = TPQwen3(model_cfg, group, comm, seed=train_cfg.seed)
    opt = make_optimizer(model, train_cfg)
    exact_comm = TPComm(comm_cfg.replace(mode="exact"), group)
    v_ids, v_tgt = val_windows(corpus.val, train_cfg.seq_len, train_cfg.eval_windows)
    main = is_main_rank(group)
    tokens_per_step = train_cfg.batch_size * train_cfg.seq_len

    bar = _progress(train_cfg.steps, label) if progress and main else None
    losses, grad_norms, val_curve = [], [], []
    step_s = fwd_s = bwd_s = 0.0
    timed_steps = 0
    truncated = False
    start = time.perf_counter()
    for step in range(train_cfg.steps):
        ids, tgt = train_batch(corpus.train, train_cfg.batch_size, train_cfg.seq_len, train_cfg.seed, step)
        ids, tgt = ids.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        loss, gnorm = train_step(model, opt, ids, tgt, train_cfg, train_cfg.lr_at(step))
        _sync(device)
        dt = time.perf_counter() - t0
        f, b = comm.forward.collect_time(), comm.backward.collect_time()
        if step > 0:  # the first step pays one-off costs (allocation, kernel compilation)
            step_s += dt
            fwd_s += f.seconds
            bwd_s += b.seconds
            timed_steps += 1
        losses.append(loss)
        grad_norms.append(gnorm)
        if not math.isfinite(loss):
            raise FloatingPointError(f"{label}: loss {loss} at step {step}")
        if train_cfg.eval_every and (step + 1) % train_cfg.eval_every == 0 and step + 1 < train_cfg.steps:
            val_curve.append({"step": step + 1, "tokens": (step + 1) * tokens_per_step,
                              "loss": evaluate(model, v_ids, v_tgt, train_cfg.batch_size)})
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
            bar.update()
        if train_cfg.max_time_s and time.perf_counter() - start > train_cfg.max_time_s and step + 1 < train_cfg.steps:
            truncated = True
            break
    train_seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()

    steps_done = len(losses)
    f_ids, f_tgt = val_windows(corpus.val, train_cfg.seq_len, train_cfg.final_eval_windows)
    val_loss = evaluate(model, f_ids, f_tgt, train_cfg.batch_size)
    val_loss_exact = evaluate(model, f_ids, f_tgt, train_cfg.batch_size, comm=exact_comm)
    val_curve.append({"step": steps_done, "tokens": steps_done * tokens_per_step, "loss": val_loss})
    tail = max(1, steps_done // 10)
    record = {
        "label": label,
        "mode": comm_cfg.mode,
        "world_size": group.world_size,
        "emulated": group.emulated,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": model_cfg.to_dict(),
        "parameters": sum(p.numel() for p in model.full_state().values()),
        "train": asdict(train_cfg),
        "comm": {
            "mode": comm_cfg.mode,
            "comm_dtype": str(comm_cfg.comm_dtype).replace("torch.", ""),
            "forward": _echo_dict(comm_cfg.echo_config("forward")),
            "backward": _echo_dict(comm_cfg.echo_config("backward")),
        },
        "steps_done": steps_done,
        "truncated": truncated,
        "tokens": steps_done * tokens_per_step,
        "train_loss": losses,
        "grad_norm": grad_norms,
        "val_curve": val_curve,
        "final": {
            "train_loss": sum(losses[-tail:]) / tail,
            "train_loss_window": tail,
            "val_loss": val_loss,
            "val_loss_exact_comm": val_loss_exact,
        },
        "timing": {
            "train_seconds": train_seconds,
            **_per_step(timed_steps, step_s, fwd_s, bwd_s, tokens_per_step),
            "timed_steps": timed_steps,
            "comm_timer": "cuda events" if device.type == "cuda" else "wall clock",
        },
        "comm_stats": comm.stats(),
    }
    if log is not None and main:
        speed = record["timing"]["tokens_per_s"]
        log(f"{label}: final train {record['final']['train_loss']:.4f}, val {val_loss:.4f} "
            f"(exact comm {val_loss_exact:.4f}), "
            + (f"{speed:,.0f} tok/s" if speed is not None else f"tok/s {NOT_MEASURED}"))
    return record


#: What a run's timing says when no step was timed.
NOT_MEASURED = "not measured (the first step, which compiles and allocates, is not timed: run 2 steps or more)"


def _per_step(timed_steps: int, step_s: float, fwd_s: float, bwd_s: float, tokens_per_step: int) -> dict:
    """Mean times of the timed steps and the tokens/s they give; every one
    None when no step was timed (one step, or a run cut after its first):
    0 s and 0 tokens/s would read as results."""
    if not timed_steps:
        return dict.fromkeys(("step_s", "comm_forward_s", "comm_backward_s", "compute_s", "tokens_per_s"))
    return {"step_s": step_s / timed_steps, "comm_forward_s": fwd_s / timed_steps,
            "comm_backward_s": bwd_s / timed_steps, "compute_s": (step_s - fwd_s - bwd_s) / timed_steps,
            "tokens_per_s": tokens_per_step * timed_steps / step_s}


class _PlainProgress:
    """tqdm's calls, printed as a line every tenth of the run (tqdm missing)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.n, self.postfix = total, label, 0, {}

    def set_postfix(self, **kw) -> None:
        self.postfix = kw

    def update(self) -> None:
        self.n += 1
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            print(f"{self.label}: step {self.n}/{self.total} {extra}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, label: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, label)
    # a log file gets an update every 15 s, a terminal every second
    return tqdm(total=total, desc=label, unit="step", file=sys.stderr,
                mininterval=1.0 if sys.stderr.isatty() else 15.0)


def _echo_dict(cfg) -> dict | None:
    if cfg is None:
        return None
    d = cfg.to_dict()
    return {k: d[k] for k in ("group_size", "feedback", "hadamard", "exact_last_call", "first_exact_calls",
                              "min_bytes", "feedback_dtype", "encoder", "rounding")}


__all__ = ["TrainConfig", "evaluate", "make_optimizer", "train", "train_step"]
