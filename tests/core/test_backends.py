"""The one backend chooser (echo_vllm.backends): make_backend asks the pure
choose_backend and builds its answer, probing the group only where the
answer depends on it. The fused backend itself needs GPUs (tests/kernels);
here its builder and the probe are stand-ins that record what they get."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from echo_vllm import backends
from echo_vllm.config import EchoConfig, EchoConfigError
from echo_vllm.envs import EchoEnv
from support.fake_group import FakeRank


@pytest.fixture
def group(monkeypatch):
    """The fused backend's probe and builder, recording their calls; the
    probe answers ``group.p2p``."""
    state = SimpleNamespace(probed=[], built=[], p2p=(True, "2 GPUs with P2P"))

    def probe(peers, device_type):
        state.probed.append(peers)
        return state.p2p

    def build(cfg, transport, env, **facts):
        state.built.append((transport, facts))
        return SimpleNamespace(name="the fused backend")

    monkeypatch.setattr(backends, "fused_support", probe)
    monkeypatch.setitem(backends.BACKENDS, "fused", dataclasses.replace(backends.BACKENDS["fused"], build=build))
    return state


def test_fused_is_built_with_the_groups_facts(group):
    pynccl, nccl = FakeRank("pynccl"), FakeRank("nccl")
    backend, reason = backends.make_backend(EchoConfig(), pynccl, device_type="cuda", env=EchoEnv(),
                                            peers=nccl, max_numel=4096)
    assert backend.name == "the fused backend" and "peer-to-peer" in reason and "2 GPUs with P2P" in reason
    assert group.probed == [nccl]  # the probe runs on the process group, not on pynccl
    assert group.built == [(pynccl, {"peers": nccl, "max_numel": 4096})]


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_echo_kernels_wins_over_fused(group, kernels):
    backend, reason = backends.make_backend(EchoConfig(), FakeRank(), device_type="cuda",
                                            env=EchoEnv(kernels=kernels), peers=FakeRank("nccl"))
    assert backend.name == kernels and reason == f"ECHO_KERNELS={kernels}"
    assert group.probed == [] and group.built == []  # the answer did not depend on the GPUs


def test_without_p2p_auto_takes_triton_and_says_why(group):
    group.p2p = (False, "GPU 0 cannot access GPU 1")
    backend, reason = backends.make_backend(EchoConfig(), FakeRank(), device_type="cuda", env=EchoEnv())
    assert backend.name == "triton" and reason == "CUDA tensors (fused unavailable: GPU 0 cannot access GPU 1)"
    with pytest.raises(EchoConfigError, match="cannot access GPU 1"):
        backends.make_backend(EchoConfig(backend="fused"), FakeRank(), device_type="cuda", env=EchoEnv())
    assert len(group.probed) == 2 and group.built == []


def test_fused_with_stochastic_rounding_is_refused_before_anything_runs(group):
    cfg = EchoConfig(backend="fused", rounding="stochastic")
    with pytest.raises(EchoConfigError, match="rounding='stochastic' runs on the reference backend, not 'fused'"):
        backends.make_backend(cfg, FakeRank(), device_type="cuda", env=EchoEnv())
    assert group.probed == [] and group.built == []
    # stochastic rounding where the choice is free: the references, unprobed
    backend, reason = backends.make_backend(EchoConfig(rounding="stochastic"), FakeRank(), device_type="cuda",
                                            env=EchoEnv())
    assert backend.name == "reference" and "stochastic" in reason and group.probed == []


def test_cpu_groups_are_never_probed(group):
    backend, reason = backends.make_backend(EchoConfig(), FakeRank(), device_type="cpu", env=EchoEnv())
    assert backend.name == "reference" and reason == "cpu tensors" and group.probed == []


def test_the_fastest_cpu_backend_is_asked_only_where_it_decides():
    """The tools' preference for the fastest CPU backend is one more input
    of the one choice: it decides ``auto`` on CPU tensors and nothing else."""
    asked = []

    def fastest():
        asked.append("asked")
        return "numba"

    def choose(requested, device_type="cpu", **kw):
        return backends.choose_backend(requested, device_type=device_type, **{"stochastic": False, **kw},
                                       fastest_cpu=fastest)

    assert choose("auto") == ("numba", "cpu tensors, the fastest CPU backend installed (numba: the references' bits)")
    assert asked == ["asked"]
    assert choose("reference") == ("reference", "configured")
    assert choose("auto", env_kernels="reference") == ("reference", "ECHO_KERNELS=reference")
    assert choose("auto", stochastic=True) == ("reference", "stochastic rounding (torch noise)")
    assert choose("auto", device_type="cuda")[0] == "triton"
    assert asked == ["asked"]
    # numba missing: the references, with the library's reason
    assert backends.choose_backend("auto", device_type="cpu", stochastic=False,
                                   fastest_cpu=lambda: "reference") == ("reference", "cpu tensors")


def test_make_backend_takes_the_fastest_cpu_backend_where_asked(monkeypatch):
    numba = SimpleNamespace(name="numba")  # a stand-in: the test runs where numba is not installed too
    monkeypatch.setitem(backends.BACKENDS, "numba",
                        dataclasses.replace(backends.BACKENDS["numba"], build=lambda *a, **k: numba))
    monkeypatch.setattr(backends, "fastest_cpu_backend", lambda: "reference")
    assert backends.make_backend(EchoConfig(), FakeRank(), device_type="cpu", env=EchoEnv(),
                                 fast_cpu=True)[1] == "cpu tensors"
    monkeypatch.setattr(backends, "fastest_cpu_backend", lambda: "numba")
    backend, reason = backends.make_backend(EchoConfig(), FakeRank(), device_type="cpu", env=EchoEnv(),
                                            fast_cpu=True)
    assert backend is numba and "fastest CPU backend" in reason
    assert backends.make_backend(EchoConfig(), FakeRank(), device_type="cpu", env=EchoEnv())[0].name == "reference"


def test_the_backend_the_communicator_builds_is_make_backends():
    from echo_vllm import StackedCommunicator, VirtualTransport

    comm = StackedCommunicator(EchoConfig(), VirtualTransport(2), env=EchoEnv(kernels="numba"))
    assert comm.backend(torch.device("cpu")).name == "numba"


def test_int8_feedback_runs_on_the_backend_auto_picks(group):
    """Every backend reads and writes every feedback format (int8 included):
    the format takes no part in the choice, on CUDA tensors int8 feedback
    gets the fused kernel or the Triton stage kernels as the others do."""
    int8 = EchoConfig(feedback_dtype="int8")
    assert backends.make_backend(int8, FakeRank(), device_type="cuda", env=EchoEnv(),
                                 peers=FakeRank("nccl"))[0].name == "the fused backend"
    assert backends.make_backend(int8.replace(backend="fused"), FakeRank(), device_type="cuda",
                                 env=EchoEnv())[0].name == "the fused backend"
    group.p2p = (False, "GPU 0 cannot access GPU 1")
    backend, reason = backends.make_backend(int8, FakeRank(), device_type="cuda", env=EchoEnv())
    assert backend.name == "triton" and "cannot access GPU 1" in reason
    assert backends.make_backend(int8, FakeRank(), device_type="cpu", env=EchoEnv(kernels="numba"))[0].name == "numba"


@pytest.mark.parametrize("requested,env_kernels", [("triton", "auto"), ("auto", "triton")])
def test_triton_on_cpu_without_the_interpreter_is_refused_by_name(requested, env_kernels):
    """Not Triton's bare "Found no NVIDIA driver" at the first call: the
    choice says what to set or use instead."""
    with pytest.raises(EchoConfigError, match="TRITON_INTERPRET=1.*'numba' or 'reference'"):
        backends.choose_backend(requested, device_type="cpu", stochastic=False, env_kernels=env_kernels)
    assert backends.choose_backend(requested, device_type="cpu", stochastic=False, env_kernels=env_kernels,
                                   interpreted=True)[0] == "triton"
    assert backends.choose_backend(requested, device_type="cuda", stochastic=False,
                                   env_kernels=env_kernels)[0] == "triton"


def test_the_interpreter_flag_is_read_from_the_environment():
    from echo_vllm import envs

    assert envs.read({"TRITON_INTERPRET": "1"}).triton_interpret
    assert not envs.read({}).triton_interpret
