"""How far one training step's gradient moves under each chain's options.

Choosing Echo's options for a chain by final loss alone is noisy (two
trainings diverge chaotically from the first differing bit). This
measurement is deterministic: train the model with exact all-reduces for a
while, then on a few fixed batches compute the gradient with every variant
of one chain's options -- the other chain kept all-16-bit, so the two
directions are measured apart -- and report its distance to the exact
gradient, ``||g - g_exact|| / ||g_exact||`` over all parameters and for the
worst single parameter tensor (and the loss's relative change, which only
the forward chain affects).

    echo-vllm train-demo --fidelity --data DIR [--steps N] [--fidelity-batches K]
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

from echo_vllm import EchoConfig
from echo_vllm.config import MAX_CALLS
from echo_vllm.outputs import write_json, write_text

from .collectives import TPComm, TPCommConfig, TPGroup
from .data import Corpus, train_batch
from .model import ModelConfig, TPQwen3
from .trainer import TrainConfig, make_optimizer, train_step

#: A first_exact_calls value no pass reaches: the chain stays 16-bit.
ALL_EXACT = MAX_CALLS


def variants() -> list[tuple[str, str, str, EchoConfig]]:
    """(direction, mode, name, options) for every combination measured."""
    out = []
    for direction in ("backward", "forward"):
        for hadamard, last, first in itertools.product((True, False), (True, False), (0, 1, 3, 5)):
            cfg = EchoConfig(min_bytes=0, hadamard=hadamard, exact_last_call=last, first_exact_calls=first)
            name = f"hadamard={'on' if hadamard else 'off'} last={'16b' if last else '4b'} first16={first}"
            for mode in ("naive", "echo"):
                out.append((direction, mode, name, cfg))
    return out


def _grads(model: TPQwen3, ids, tgt) -> tuple[float, list[torch.Tensor]]:
    loss = model(ids, tgt)
    loss.backward()
    model.sync_replicated_grads()
    g = [p.grad.detach().double().reshape(-1) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), g


def _errors(g: list[torch.Tensor], g_x: list[torch.Tensor]) -> tuple[float, float]:
    """Relative error of the whole gradient, and of the worst parameter
    tensor: Adam scales each parameter's update by its own gradient's size,
    so a tensor whose gradient is mostly error gets a mostly-wrong update
    however small its share of the global norm."""
    whole = torch.cat(g) - torch.cat(g_x)
    per = [((a - b).norm() / b.norm()).item() for a, b in zip(g, g_x, strict=True) if b.norm() > 0]
    return (whole.norm() / torch.cat(g_x).norm()).item(), max(per)


def measure(model_cfg: ModelConfig, train_cfg: TrainConfig, corpus: Corpus, group: TPGroup,
            batches: int = 4, placements: tuple[bool, ...] = (True, False), progress: bool = True) -> dict:
    """Train with exact all-reduces for ``train_cfg.steps`` steps, then measure
    every variant on ``batches`` batches (for each norm placement: the same
    function and weights, a different backward all-reduce)."""
    exact_cfg = TPCommConfig(mode="exact")
    model = TPQwen3(model_cfg, group, TPComm(exact_cfg, group), seed=train_cfg.seed)
    opt = make_optimizer(model, train_cfg)
    for step in range(train_cfg.steps):
        ids, tgt = train_batch(corpus.train, train_cfg.batch_size, train_cfg.seq_len, train_cfg.seed, step)
        train_step(model, opt, ids.to(group.device), tgt.to(group.device), train_cfg, train_cfg.lr_at(step))
    state = model.state_dict()
    data = [train_batch(corpus.train, train_cfg.batch_size, train_cfg.seq_len, train_cfg.seed + 1, k)
            for k in range(batches)]
    data = [(i.to(group.device), t.to(group.device)) for i, t in data]
    rows = []
    grid = variants()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(placements) * (len(grid) + 1), desc="gradient error", unit="variant", file=sys.stderr)
    for inside in placements:
        cfg = model_cfg.__class__(**{**model_cfg.to_dict(), "norm_in_tp_region": inside})
        ref = TPQwen3(cfg, group, TPComm(exact_cfg, group), seed=train_cfg.seed)
        ref.load_state_dict(state)
        exact = [_grads(ref, i, t) for i, t in data]
        if bar is not None:
            bar.update()
        for direction, mode, name, echo_cfg in grid:
            other = EchoConfig(min_bytes=0, first_exact_calls=ALL_EXACT)
            comm_cfg = TPCommConfig(mode=mode, forward=echo_cfg if direction == "forward" else other,
                                    backward=echo_cfg if direction == "backward" else other)
            ref.comm = TPComm(comm_cfg, group)
            errs, worst, dloss = [], [], []
            for (i, t), (loss_x, g_x) in zip(data, exact, strict=True):
                loss, g = _grads(ref, i, t)
                whole, tensor = _errors(g, g_x)
                errs.append(whole)
                worst.append(tensor)
                dloss.append(abs(loss / loss_x - 1))
            rows.append({"norm_in_tp_region": inside, "direction": direction, "mode": mode, "options": name,
                         "grad_rel_err": sum(errs) / len(errs), "worst_tensor_rel_err": sum(worst) / len(worst),
                         "loss_rel_err": sum(dloss) / len(dloss),
                         "echo_calls": ref.comm.stats()[direction]["calls"].get("echo/echo", 0) // len(data)})
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    return {"model": model_cfg.to_dict(), "train": {"steps": train_cfg.steps, "batch_size": train_cfg.batch_size,
            "seq_len": train_cfg.seq_len, "lr": train_cfg.lr, "seed": train_cfg.seed},
            "world_size": group.world_size, "batches": batches, "rows": rows}


def format_rows(result: dict) -> str:
    lines = []
    for inside in sorted({r["norm_in_tp_region"] for r in result["rows"]}, reverse=True):
        for direction in ("backward", "forward"):
            rows = [r for r in result["rows"] if r["norm_in_tp_region"] == inside and r["direction"] == direction]
            if not rows:
                continue
            lines.append(f"\n{direction} chain (other chain 16-bit), norm {'inside' if inside else 'outside'} "
                         f"the TP region: ||g - g_exact|| / ||g_exact||, mean over {result['batches']} batches")
            lines.append("| options | 4-bit calls | naive 4-bit | Echo | Echo / naive | worst tensor: naive | "
                         "worst tensor: Echo | loss rel. change (Echo) |")
            lines.append("|---|---|---|---|---|---|---|---|")
            by = {(r["options"], r["mode"]): r for r in rows}
            for opts in dict.fromkeys(r["options"] for r in rows):
                n, e = by[(opts, "naive")], by[(opts, "echo")]
                lines.append(f"| {opts} | {e['echo_calls']} | {n['grad_rel_err']:.4f} | {e['grad_rel_err']:.4f} | "
                             f"{e['grad_rel_err'] / n['grad_rel_err']:.2f} | {n['worst_tensor_rel_err']:.3f} | "
                             f"{e['worst_tensor_rel_err']:.3f} | {e['loss_rel_err']:.2e} |")
    return "\n".join(lines)


#: The files :func:`run` writes into its folder.
OUTPUTS = ("fidelity.json", "fidelity.md")


def run(model_cfg, train_cfg, corpus, group, out: Path, batches: int, progress: bool) -> int:
    result = measure(model_cfg, train_cfg, corpus, group, batches=batches, progress=progress)
    text = format_rows(result)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / OUTPUTS[0], result, indent=1)
    write_text(out / OUTPUTS[1], text + "\n")
    print(text)
    print(f"wrote {out}/fidelity.json, fidelity.md")
    return 0


__all__ = ["measure", "variants", "format_rows", "run"]
