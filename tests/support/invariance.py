"""The batch-invariance property, as one function every backend's test calls.

For random token rows A and B, a chain of calls (feedback carried from call
to call, one exact call in the middle that absorbs the carried error): the
rows of A reduced alone, inside [A; B] and inside [B; A] must be equal bit
for bit, call after call.
"""

from __future__ import annotations

import torch

from echo_vllm import CallSlot, EchoConfig, FeedbackChain, Path, StackedCommunicator, VirtualTransport


def _rows(world: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, tokens, hidden, generator=g) * torch.exp(torch.randn(world, tokens, 1, generator=g))
    x[..., :: max(1, hidden // 7)] *= 30.0  # outlier channels: they set their groups' scales
    return x.to(dtype)


def check_rows_independent(world: int, hidden: int, group: int, dtype: torch.dtype, *, backend: str,
                           device: str = "cpu", tokens_a: int = 3, tokens_b: int = 5, calls: int = 4,
                           hadamard: bool = True, exact_at: int | None = 2, seed: int = 0,
                           feedback_dtype: str = EchoConfig.feedback_dtype, rotation_seed: int = 0,
                           encoder: str = EchoConfig.encoder) -> int:
    """Raise AssertionError on the first call whose A rows differ; return the
    number of (call, arrangement) pairs compared."""
    cfg = EchoConfig(min_bytes=0, group_size=group, hadamard=hadamard, exact_last_call=False,
                     first_exact_calls=0, backend=backend, feedback_dtype=feedback_dtype, rotation_seed=rotation_seed,
                     encoder=encoder)
    comm = StackedCommunicator(cfg, VirtualTransport(world), device=device)
    chains = {k: FeedbackChain.of(cfg, world, device) for k in ("A", "AB", "BA")}
    compared = 0
    for t in range(calls):
        a = _rows(world, tokens_a, hidden, dtype, seed * 1000 + 2 * t).to(device)
        b = _rows(world, tokens_b, hidden, dtype, seed * 1000 + 2 * t + 1).to(device)
        inputs = {"A": a, "AB": torch.cat([a, b], dim=1), "BA": torch.cat([b, a], dim=1)}
        path = Path.EXACT if t == exact_at else Path.ECHO
        out = {k: comm.all_reduce(x, slot=CallSlot(t), path=path, chain=chains[k]) for k, x in inputs.items()}
        alone = out["A"].cpu()
        for name, rows in (("[A; B]", out["AB"][:tokens_a]), ("[B; A]", out["BA"][tokens_b:])):
            rows = rows.cpu()
            differ = alone.view(torch.int16) != rows.view(torch.int16)
            if differ.any():
                raise AssertionError(
                    f"call {t} ({'exact' if t == exact_at else 'Echo'}), P={world} hidden={hidden} g={group} "
                    f"{dtype} {backend} feedback={feedback_dtype} rotation_seed={rotation_seed} {encoder}: A's rows "
                    f"inside {name} differ from A alone in "
                    f"{int(differ.sum())} of {differ.numel()} values")
            compared += 1
    return compared
