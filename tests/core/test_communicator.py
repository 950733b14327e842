"""``EchoCommunicator`` (here its stacked form over virtual ranks): what each
call records about the path it took, and the arguments it refuses by name."""

from __future__ import annotations

import sys

import pytest
import torch

from echo_vllm import CallSlot, EchoConfig, EchoConfigError, Path, StackedCommunicator, VirtualTransport
from echo_vllm.backends.composed import ComposedBackend
from echo_vllm.communicator import ResidualStream, message_layout
from echo_vllm.backends.stages import ReferenceStages
from echo_vllm.policy import Reason

P = 4
CFG = EchoConfig(min_bytes=0, first_exact_calls=0, exact_last_call=False, backend="reference")


class _SmallBuffers(ComposedBackend):
    """The reference backend with the fused backend's limit: its own kernels
    take messages of up to ``max_numel`` values, its fallback the rest (the
    same references here, so the bits cannot tell the two apart)."""

    def __init__(self, transport, max_numel: int):
        super().__init__(CFG, transport, ReferenceStages())
        self.max_numel = max_numel

    def fits(self, layout) -> bool:
        return layout.numel <= self.max_numel


def test_a_message_beyond_the_fused_buffers_is_recorded_with_its_reason():
    transport = VirtualTransport(P)
    records = []
    comm = StackedCommunicator(CFG, transport, backend=_SmallBuffers(transport, 64 * 128), sink=records.append)
    plain = StackedCommunicator(CFG, VirtualTransport(P))
    small, big = torch.randn(P, 64, 128).bfloat16(), torch.randn(P, 128, 128).bfloat16()
    for i, x in enumerate((small, big)):
        assert torch.equal(comm.all_reduce(x, slot=CallSlot(i)), plain.all_reduce(x, slot=CallSlot(i)))
    assert [(r.path, r.reason) for r in records] == [("echo", Reason.ECHO.value),
                                                     ("echo", Reason.EXCEEDS_FUSED_BUFFERS.value)]


class _RouteSpy(ComposedBackend):
    """The reference backend, noting the calls between the test and its
    ``all_reduce`` / ``all_reduce_norm``."""

    def __init__(self, transport):
        super().__init__(CFG, transport, ReferenceStages())
        self.routes = []

    def _note(self):
        f, route = sys._getframe(2), []
        while f.f_code.co_name != self.caller:
            route.append(f.f_code.co_qualname)
            f = f.f_back
        self.routes.append(route[::-1])

    def all_reduce(self, xs, layout, feedback, *, has_incoming, out=None):
        self._note()
        return super().all_reduce(xs, layout, feedback, has_incoming=has_incoming, out=out)

    def all_reduce_norm(self, xs, layout, feedback, norm, tiling, *, has_incoming):
        self._note()
        return super().all_reduce_norm(xs, layout, feedback, norm, tiling, has_incoming=has_incoming)


def test_both_public_calls_reach_the_backend_through_the_one_echo_path():
    """The route to the kernel launch: vLLM's hook -> ``all_reduce`` ->
    ``_echo`` -> the backend's ``all_reduce`` -> the kernel's host function
    (4 calls to the launch with the fused backend); ``all_reduce_norm``
    takes the same ``_echo``, and ``out`` reaches the backend."""
    from echo_vllm.rmsnorm import NormOperands

    transport = VirtualTransport(P)
    spy = _RouteSpy(transport)
    spy.caller = test_both_public_calls_reach_the_backend_through_the_one_echo_path.__name__
    comm = StackedCommunicator(CFG, transport, backend=spy)
    x = torch.randn(P, 8, 128).bfloat16()
    out = torch.empty(8, 128, dtype=torch.bfloat16)
    y = comm.all_reduce(x, slot=CallSlot(0), out=out)
    comm.all_reduce_norm(x, NormOperands(torch.ones(128, dtype=torch.bfloat16), 1e-6), slot=CallSlot(1))
    assert y is out and spy.routes == [["EchoCommunicator.all_reduce", "EchoCommunicator._echo"],
                                       ["EchoCommunicator.all_reduce_norm", "EchoCommunicator._echo"]]


@pytest.mark.parametrize("path, reason", [(Path.EXACT, Reason.FORCED_EXACT), (Path.ECHO, Reason.ECHO)])
def test_a_forced_path_is_taken_whatever_the_policy_and_recorded(path, reason):
    """Call 0 with ``first_exact_calls=1``: the policy's exact path, unless
    the caller forces one."""
    records = []
    comm = StackedCommunicator(CFG.replace(first_exact_calls=1), VirtualTransport(P), sink=records.append)
    x = torch.randn(P, 8, 128).bfloat16()
    y = comm.all_reduce(x, slot=CallSlot(0), path=path)
    if path is Path.EXACT:
        assert torch.equal(y, VirtualTransport(P).exact_all_reduce(x))
    assert [(r.path, r.reason) for r in records] == [(path.value, reason.value)]


@pytest.mark.parametrize("arguments, named", [
    (dict(config={"min_bytes": 0}), "StackedCommunicator: config="),
    (dict(transport=4), "StackedCommunicator: transport=4"),
    (dict(stream={"hidden_size": 64}), "StackedCommunicator: stream="),
    (dict(fast_cpu="no"), "StackedCommunicator: fast_cpu='no'")])
def test_a_bad_constructor_argument_is_refused_by_name(arguments, named):
    given = dict(config=CFG, transport=VirtualTransport(P)) | arguments
    with pytest.raises(EchoConfigError, match=named):
        StackedCommunicator(given.pop("config"), given.pop("transport"), **given)


@pytest.mark.parametrize("arguments, named", [
    (dict(capacity_numel=-5), "capacity_numel=-5"), (dict(capacity_numel=1.5), "capacity_numel=1.5"),
    (dict(hidden_size=0), "hidden_size=0"), (dict(max_num_tokens=-1), "max_num_tokens=-1"),
    (dict(ndim=2.0), "ndim=2.0"), (dict(fixed_capacity="no"), "fixed_capacity='no'")])
def test_a_bad_residual_stream_is_refused_by_name(arguments, named):
    """Each failed inside torch (capacity_numel) or at the first call, or ran
    every call on a path nobody asked for (hidden_size=0 made every call
    exact)."""
    with pytest.raises(EchoConfigError, match=f"ResidualStream: {named}"):
        ResidualStream(**arguments)


def test_a_call_after_close_is_refused_and_closing_twice_is_harmless():
    """After close() a call rebuilt the released backends (a fused one
    allocates and rendezvous again) and reran Echo without a word."""
    comm = StackedCommunicator(CFG, VirtualTransport(P))
    x = torch.randn(P, 8, 128).bfloat16()
    comm.all_reduce(x, slot=CallSlot(0))
    comm.close()
    comm.close()
    with pytest.raises(RuntimeError, match="this StackedCommunicator is closed"):
        comm.all_reduce(x, slot=CallSlot(1))


def test_a_slot_or_path_of_another_type_is_refused_by_name():
    comm = StackedCommunicator(CFG, VirtualTransport(P))
    x = torch.randn(P, 8, 128).bfloat16()
    with pytest.raises(TypeError, match=r"slot=3: must be a CallSlot \(CallSlot\(3\)"):
        comm.all_reduce(x, slot=3)  # failed inside the policy
    for path in ("forced", Reason.FORCED_EXACT, 1):
        with pytest.raises(ValueError, match="path=.*must be a policy.Path"):
            comm.all_reduce(x, slot=CallSlot(0), path=path)


@pytest.mark.parametrize("out, why", [
    (torch.empty(128, 8, dtype=torch.bfloat16), r"is \(128, 8\) torch.bfloat16 on cpu: must be the message's"),
    (torch.empty(2, 8, 128, dtype=torch.bfloat16), r"is \(2, 8, 128\)"),
    (torch.empty(8, 128, dtype=torch.int32), "torch.int32"),
    (torch.empty(8, 128, dtype=torch.bfloat16, device="meta"), "on meta"),
    (torch.empty(128, 8, dtype=torch.bfloat16).t(), "must be contiguous")])
@pytest.mark.parametrize("exact", [False, True])
def test_out_must_be_the_messages_shape_dtype_and_device_on_both_paths(out, why, exact):
    """Before, each path took a different subset: Echo's reshaped a [128, 8]
    out, the exact path broadcast into [2, 8, 128]; both truncated into an
    int32 out and wrote nothing into a meta one."""
    comm = StackedCommunicator(CFG, VirtualTransport(P))
    x = torch.randn(P, 8, 128).bfloat16()
    with pytest.raises(ValueError, match=why):
        comm.all_reduce(x, slot=CallSlot(0), out=out, path=Path.EXACT if exact else None)


def test_an_input_on_another_device_than_the_communicator_is_refused_by_name():
    """The feedback buffer lives on the communicator's ``device``: an input
    elsewhere failed inside torch (or, on a GPU, inside a kernel)."""
    comm = StackedCommunicator(CFG, VirtualTransport(P), device="meta")
    with pytest.raises(ValueError, match="the input is on cpu, but this communicator's feedback buffer is on meta"):
        comm.all_reduce(torch.randn(P, 8, 128).bfloat16(), slot=CallSlot(0))


class _CompileSpy(ComposedBackend):
    """The reference backend, noting what :meth:`compile` was asked for."""

    def __init__(self, transport, config=CFG):
        super().__init__(config, transport, ReferenceStages())
        self.compiled = []

    def compile(self, xs, layout, feedback, *, has_incoming):
        self.compiled.append((tuple(xs.shape), layout.numel, None if feedback is None else feedback.dtype,
                              has_incoming))


@pytest.mark.parametrize("feedback", [True, False], ids=["feedback", "no-feedback"])
def test_compile_asks_for_every_kernel_a_chain_launches_and_changes_nothing(feedback):
    """A chain's first call takes no incoming error, its later ones do: both
    kernels compiled with feedback, one without; the chain's error is
    untouched (the next call's bits, which absorb it, are the plain ones) (``scripts/gpu_fused_check.py``'s sweep)."""
    from echo_vllm.feedback import FeedbackChain

    cfg = CFG.replace(feedback=feedback)
    transport = VirtualTransport(P)
    spy = _CompileSpy(transport, cfg)
    comm = StackedCommunicator(cfg, transport, backend=spy)
    plain = StackedCommunicator(cfg, VirtualTransport(P))
    x = torch.randn(P, 3, 96).bfloat16()
    chain, twin = FeedbackChain.of(cfg, P), FeedbackChain.of(cfg, P)
    comm.all_reduce(x, slot=CallSlot(0), path=Path.ECHO, chain=chain)
    plain.all_reduce(x, slot=CallSlot(0), path=Path.ECHO, chain=twin)
    comm.compile(x, chain)
    lay = message_layout((3, 96), P, cfg.group_size)
    fb_dtype = chain.buffer(lay.padded_numel).dtype if feedback else None
    assert spy.compiled == [((P, lay.numel), lay.numel, fb_dtype, False)] + (
        [((P, lay.numel), lay.numel, fb_dtype, True)] if feedback else [])
    assert torch.equal(comm.all_reduce(x, slot=CallSlot(1), path=Path.ECHO, chain=chain),
                       plain.all_reduce(x, slot=CallSlot(1), path=Path.ECHO, chain=twin))


def test_a_backend_without_kernels_to_compile_compiles_nothing():
    comm = StackedCommunicator(CFG, VirtualTransport(P))
    assert comm.compile(torch.randn(P, 2, 64).bfloat16()) is None
