"""vLLM's batch-invariant mode with Echo: a prompt's greedy tokens are the
same alone and inside a batch of others.

Two gloo processes, real vLLM 0.26 groups and layers (CPU platform), the
plugin's hook. A toy decoder (vocabulary-parallel embedding, row-parallel
o/down projections: 1 + 2L all-reduces per forward pass, Echo's defaults
with a small ``min_bytes``) generates greedily for prompt A alone and for
the batches [A, B, C] and [B, A, C]. With ``VLLM_BATCH_INVARIANT=1`` the
engine's Echo settings drop the size thresholds and A's hidden states --
and so its tokens -- are bit-identical in every batch. Without it (the
control), the size threshold sends A alone to the 16-bit path and the
batches to Echo: the bits differ, so the check is not vacuous.
"""

import pytest
import torch

pytest.importorskip("vllm")

from support.vllm_cpu import run_vllm_processes  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYERS, HIDDEN, VOCAB, STEPS = 4, 128, 1000, 3
# Echo's defaults (first 5 calls and the last in 16-bit) with a threshold
# between A alone (3-5 tokens: <= 1.3 KiB) and the batches (>= 13 tokens)
ECHO = {"tp_comm": "echo", "echo_min_bytes": 2048}
PROMPTS = {"A": [11, 502, 77], "B": [5, 6, 7, 8, 9, 10], "C": [900, 1, 2, 3]}


def _norm(h):
    return (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def _worker(rank, world):
    from support.vllm_cpu import ToyStack, use_cpu_platform

    use_cpu_platform()
    from echo_vllm.vllm_glue.plugin import register

    register()
    stack = ToyStack.random(layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, tokens=(1,), seed=99)
    head = stack.embed.float().t()  # tied LM head, full on every rank
    return {invariant: _engine(invariant, stack, head) for invariant in (True, False)}


def _engine(invariant: bool, stack, head) -> dict:
    """One engine's TP group (created under the mode, as vLLM's workers do)."""
    import os

    # vllm.envs reads the variable when asked; this process is the test's own
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if invariant else "0"
    from support.vllm_cpu import init_model_parallel, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.forward_context import set_forward_context

    from echo_vllm.vllm_glue import session as sessions

    cfg = vllm_config(tp=2, additional_config=ECHO)
    out = {}
    with set_current_vllm_config(cfg):
        init_model_parallel(cfg)
        s = sessions.current()
        out["batch_invariant"] = s.settings.echo.batch_invariant
        emb, o, down = stack.vllm_layers()

        def forward(ids: list[int]) -> torch.Tensor:
            with set_forward_context(None, cfg, num_tokens=len(ids)):
                h = emb(torch.tensor(ids))
                for layer in range(LAYERS):
                    h = h + o[layer](_norm(h))
                    x = _norm(h)
                    h = h + down[layer](torch.nn.functional.silu(torch.cat([x, -x], dim=-1)))
            return h

        def generate(order: list[str]) -> tuple[list[int], list[torch.Tensor]]:
            seqs = {k: list(PROMPTS[k]) for k in order}
            hidden_a = []
            for _ in range(STEPS):
                ids = [t for k in order for t in seqs[k]]
                h = forward(ids)
                start = 0
                for k in order:
                    rows = h[start:start + len(seqs[k])]
                    if k == "A":
                        hidden_a.append(rows.clone())
                    seqs[k].append(int((rows[-1].float() @ head).argmax()))
                    start += len(seqs[k]) - 1
            return seqs["A"], hidden_a

        forward(PROMPTS["A"])  # the first pass teaches the session the call count
        for name, order in (("alone", ["A"]), ("A first", ["A", "B", "C"]), ("A second", ["B", "A", "C"])):
            out[name] = generate(order)
        out["calls"] = s.stats.snapshot()["calls"]
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_vllm_processes(_worker, 2)


@pytest.mark.parametrize("invariant", [True, False], ids=["VLLM_BATCH_INVARIANT=1", "control"])
def test_tokens_and_bits_do_not_depend_on_the_batch(ranks, invariant):
    for r in (ranks[0][invariant], ranks[1][invariant]):
        assert r["batch_invariant"] is invariant
        tokens, hidden = r["alone"]
        for name in ("A first", "A second"):
            other_tokens, other_hidden = r[name]
            same_bits = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                            for a, b in zip(hidden, other_hidden))
            if invariant:
                assert same_bits, f"{name}: A's hidden states differ from A alone"
                assert other_tokens == tokens
            else:
                # the control: A alone stays under min_bytes (16-bit), the batch takes Echo
                assert not same_bits, f"{name}: the control did not exercise different paths"
        echo_calls = sum(n for k, n in r["calls"].items() if k.startswith("echo/"))
        assert echo_calls > 0  # Echo did run
    assert ranks[0][invariant]["alone"][0] == ranks[1][invariant]["alone"][0]
