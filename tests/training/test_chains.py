"""The two feedback chains of a TP training step, on the Qwen3-style model
(P = 4 emulated ranks): call order and indices, the per-step restart of the
backward chain, naive vs Echo, and exact mode vs Echo's 16-bit path. Every
comparison is bit for bit."""

from __future__ import annotations

import pytest
import torch

from echo_vllm import EchoConfig
from echo_vllm.backends import fastest_cpu_backend
from echo_vllm.training import ModelConfig, TPComm, TPCommConfig, TPGroup, TPQwen3
from echo_vllm.training.data import train_batch
from echo_vllm.training.trainer import TrainConfig, make_optimizer, train_step

P = 4
MC = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128)
CALLS = 1 + 2 * MC.num_layers  # forward: embedding, (o_proj, down_proj) per layer; backward: LM head, 2 per layer
TC = TrainConfig(steps=3, batch_size=2, seq_len=16, warmup_steps=1)
DATA = torch.arange(4096, dtype=torch.int64).mul(7919).remainder(256).to(torch.uint8)  # a fixed byte stream


def _echo(**kw) -> EchoConfig:
    return EchoConfig(min_bytes=0, **kw)


def _model(mode: str, forward: EchoConfig, backward: EchoConfig) -> TPQwen3:
    comm = TPComm(TPCommConfig(mode=mode, forward=forward, backward=backward), TPGroup.virtual(P))
    return TPQwen3(MC, comm.group, comm, seed=0)


def _step_records(model: TPQwen3, step: int = 0):
    rec = []
    model.comm.set_trace(rec)
    ids, tgt = (t.to(model.group.device) for t in train_batch(DATA, TC.batch_size, TC.seq_len, 0, step))
    loss = model(ids, tgt)
    loss.backward()
    model.comm.set_trace(None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, rec


def test_call_order_and_paths():
    cfg = _echo(first_exact_calls=1, exact_last_call=True)
    model = _model("echo", cfg, cfg)
    _, _, rec = _step_records(model)
    for direction in ("forward", "backward"):
        calls = [r for r in rec if r.direction == direction]
        assert [r.index for r in calls] == list(range(CALLS))
        assert [r.last for r in calls] == [False] * (CALLS - 1) + [True]
        assert [r.path for r in calls] == ["exact"] + ["echo"] * (CALLS - 2) + ["exact"]
        assert all(r.x.shape == (P, TC.batch_size, TC.seq_len, MC.hidden_size) for r in calls)
        assert all(r.x.dtype == torch.bfloat16 for r in calls)
    # all forward calls happen before the first backward call
    assert [r.direction for r in rec] == ["forward"] * CALLS + ["backward"] * CALLS
    stats = model.comm.stats()
    for direction in ("forward", "backward"):
        # calls 2 .. CALLS-1 absorb the previous call's error (the last one on the 16-bit path)
        assert stats[direction]["chain"]["carried"] == CALLS - 2
        assert stats[direction]["chain"]["dropped"] == 0


def test_backward_chain_restarts_every_step():
    """After two training steps, a third step's gradients are the bits a fresh
    communicator gives on the same weights: nothing carries across steps."""
    cfg = _echo(first_exact_calls=0, exact_last_call=True)
    model = _model("echo", cfg, cfg)
    opt = make_optimizer(model, TC)
    for step in range(2):
        ids, tgt = train_batch(DATA, TC.batch_size, TC.seq_len, 0, step)
        train_step(model, opt, ids, tgt, TC, TC.lr_at(step))
    fresh = _model("echo", cfg, cfg)  # a new communicator, the trained weights
    fresh.load_state_dict(model.state_dict())
    loss_a, grads_a, rec = _step_records(model, 2)
    loss_b, grads_b, _ = _step_records(fresh, 2)
    assert [r.index for r in rec if r.direction == "backward"] == list(range(CALLS))
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert model.comm.backward.chain.stats.carried == 3 * (CALLS - 1)  # feedback is on in every step

    # the check can fail: a communicator that keeps counting backward calls
    # across steps (no restart) gives other gradients
    class NoRestart(TPComm):
        def begin_forward(self, forward_calls):
            index = self.backward.counter.count
            super().begin_forward(forward_calls)
            self.backward.counter.count = index

    broken = _model("echo", cfg, cfg)
    broken.load_state_dict(model.state_dict())
    broken.comm = NoRestart(model.comm.config, model.group)
    _step_records(broken, 1)
    _, grads_c, _ = _step_records(broken, 2)
    assert any(not torch.equal(grads_c[n], grads_b[n]) for n in grads_b)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_naive_differs_from_echo_exactly_where_feedback_applies(direction):
    """Same configs but feedback: calls 0-1 16-bit, call 2 the first 4-bit one
    (it starts clean), call 3 the first that absorbs an error. Outputs are
    the same bits up to call 2 and differ from call 3 on, whose input is
    still the same: the difference is the feedback alone. The other
    direction is kept all-16-bit so both runs enter it identically."""
    tested = _echo(first_exact_calls=2, exact_last_call=True)
    other = _echo(first_exact_calls=CALLS)
    cfgs = {"forward": tested, "backward": other} if direction == "forward" else {"forward": other, "backward": tested}
    recs = {}
    for mode in ("naive", "echo"):
        _, _, rec = _step_records(_model(mode, cfgs["forward"], cfgs["backward"]))
        recs[mode] = [r for r in rec if r.direction == direction]
        assert [r.path for r in recs[mode]] == ["exact"] * 2 + ["echo"] * (CALLS - 3) + ["exact"]
    naive, echo = recs["naive"], recs["echo"]
    for t in range(3):
        assert torch.equal(naive[t].x, echo[t].x) and torch.equal(naive[t].y, echo[t].y), t
    assert torch.equal(naive[3].x, echo[3].x)
    assert not torch.equal(naive[3].y, echo[3].y)


def test_exact_mode_is_echos_16bit_path():
    """Exact mode gives the bits of Echo with every call routed to 16-bit:
    the baseline differs from Echo only in the calls Echo quantizes."""
    all_exact = _echo(first_exact_calls=CALLS)
    loss_a, grads_a, rec_a = _step_records(_model("exact", _echo(), _echo()))
    loss_b, grads_b, rec_b = _step_records(_model("echo", all_exact, all_exact))
    assert {r.path for r in rec_a} == {"exact"} and {r.path for r in rec_b} == {"exact"}
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_forward_call_count_is_checked():
    model = _model("echo", _echo(), _echo())
    model.comm.begin_forward(CALLS + 1)
    with pytest.raises(RuntimeError, match="declared"):
        model.comm.end_forward()


@pytest.mark.parametrize("mode", ["exact", "echo"])
def test_both_chains_run_the_fastest_cpu_backend_unless_one_is_named(mode, monkeypatch):
    """The three modes share their numerics on the fastest CPU backend
    installed (the references' bits); a named backend is kept."""
    monkeypatch.delenv("ECHO_KERNELS", raising=False)
    cpu = torch.device("cpu")
    comm = TPComm(TPCommConfig(mode=mode), TPGroup.virtual(P))
    assert {ar.comm.backend(cpu).name for ar in (comm.forward, comm.backward)} == {fastest_cpu_backend()}
    named = TPComm(TPCommConfig(mode=mode, forward=_echo(backend="reference")), TPGroup.virtual(P))
    assert named.forward.comm.backend(cpu).name == ("reference" if mode == "echo" else fastest_cpu_backend())


@pytest.mark.parametrize("device, backend", [
    pytest.param("cpu", "numba", marks=pytest.mark.skipif(fastest_cpu_backend() != "numba", reason="numba is not installed")),
    pytest.param("cuda", "triton", marks=[pytest.mark.gpu,
                                          pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_a_training_step_on_the_kernels_gives_the_reference_bits(device, backend):
    """One forward and backward of the TP model with Echo in both directions
    through the device's kernels (numba loops on the CPU, the Triton stage
    kernels on a GPU) and through the torch references on the same device:
    every all-reduce's input and output, the loss and every gradient are the
    same bits. Attention runs its math kernel (flash attention's backward
    adds in a varying order, which would blame Echo for the model's noise)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = _echo(first_exact_calls=1, exact_last_call=True)
    runs = {}
    for name in (backend, "reference"):
        c = cfg.replace(backend=name)
        comm = TPComm(TPCommConfig(mode="echo", forward=c, backward=c), TPGroup.virtual(P, device))
        with sdpa_kernel(SDPBackend.MATH):
            runs[name] = _step_records(TPQwen3(MC, comm.group, comm, seed=0))
    (loss_k, grads_k, rec_k), (loss_r, grads_r, rec_r) = runs[backend], runs["reference"]
    assert [r.path for r in rec_k].count("echo") == 2 * (CALLS - 2)
    for a, b in zip(rec_k, rec_r, strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y), (a.direction, a.index)
    assert torch.equal(loss_k, loss_r)
    for name in grads_r:
        assert torch.equal(grads_k[name], grads_r[name]), name
