"""Echo under vLLM 0.26's multi-node launch: the TP group spans two hosts.

Two "hosts" on this machine: each node's processes run in a mount
namespace of their own with their own ``/dev/shm``, so vLLM's own node test
(``in_the_same_node_as``: shared memory) sees two nodes, as it would on two
machines (``support.vllm_launch``). Every process vLLM starts gets the CPU
platform through vLLM's platform entry point (``support.cpu_platform``).

The multiprocessing launch across nodes, with docs/multi-node.md's command
line: node 1 runs ``echo-vllm serve MODEL ... --nnodes 2 --node-rank 1
--headless`` as a user would; node 0 runs the same command line's engine
config and the executor vLLM starts for it (``MultiprocExecutor``), driven
by the test instead of an engine core, because the workers are
``support.probe_worker.ProbeWorker``: vLLM's worker path down to the
groups (the plugin loaded by ``WorkerWrapperBase.init_worker``, the TP
group made by ``init_worker_distributed_environment``) with vLLM's own
parallel layers for a model (vLLM's CPU worker needs the CPU build's
kernels, which the CUDA wheel lacks).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from echo_vllm.emulation import EmulatedTP  # noqa: E402
from support.vllm_launch import free_port, host_argv, hosts_refusal, launch_env, stop  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HOSTS, PER_HOST = 2, 2
TP = HOSTS * PER_HOST
#: Echo's flags of the launch: every call takes Echo (the defaults keep small
#: messages, the first calls and the last in 16-bit; the 16-bit path is
#: vLLM's own all-reduce, gloo's sum of four bf16 partials, which no
#: reference here reproduces bit for bit).
ECHO_FLAGS = ["--tp-comm", "echo", "--echo-min-bytes", "0", "--echo-first-exact-calls", "0",
              "--no-echo-exact-last-call"]
LAUNCH_S = 900


def serve_argv(model: Path, master_port: int) -> list[str]:
    """Every node's ``echo-vllm serve`` arguments (docs/multi-node.md), less
    ``--node-rank``."""
    return [str(model), *ECHO_FLAGS, "--tensor-parallel-size", str(TP), "--nnodes", str(HOSTS),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port),
            "--worker-cls", "support.probe_worker.ProbeWorker", "--max-model-len", "128"]


@pytest.fixture(scope="module")
def mp_launch(tmp_path_factory):
    why = hosts_refusal()
    if why:
        pytest.skip(f"two hosts on one machine: {why}")
    from echo_vllm.testing_models import make_tiny_qwen3
    from support.cpu_platform import DEVICES_PER_HOST, install_platform_plugin
    from support.probe_worker import HIDDEN

    tmp = tmp_path_factory.mktemp("multinode")
    # the toy decoder's width: the glue takes [tokens, model width] messages as the residual stream
    model = make_tiny_qwen3(tmp / "model", num_layers=1, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                            vocab_size=512)
    env = launch_env(install_platform_plugin(tmp / "platform"), **{DEVICES_PER_HOST: str(PER_HOST)})
    argv = serve_argv(model, free_port())
    shm = [Path(tmp_path_factory.mktemp(f"shm{h}")) for h in range(HOSTS)]
    out = tmp / "node0.pt"
    echo_vllm = str(Path(sys.executable).with_name("echo-vllm"))
    with open(tmp / "node1.log", "wb") as log1:
        node1 = subprocess.Popen(host_argv([echo_vllm, "serve", *argv, "--node-rank", "1", "--headless"], shm[1]),
                                 env=env, stdout=log1, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            node0 = subprocess.run(
                host_argv([sys.executable, "-m", "support.vllm_launch", str(out), "--", *argv, "--node-rank", "0"], shm[0]),
                env=env, capture_output=True, text=True, timeout=LAUNCH_S)
        finally:
            stop(node1)
    assert node0.returncode == 0, node0.stdout[-3000:] + node0.stderr[-5000:] + (tmp / "node1.log").read_text()[-3000:]
    return torch.load(out, weights_only=False)


def test_the_plugin_loads_in_every_worker_of_both_nodes(mp_launch):
    assert mp_launch["executor"] == "MultiprocExecutor"
    reports = mp_launch["reports"]
    assert [r["rank"] for r in reports] == list(range(TP))
    assert [r["local_rank"] for r in reports] == [r % PER_HOST for r in range(TP)]
    assert len({r["pid"] for r in reports}) == TP
    for r in reports:
        # loaded through vLLM's entry point by each worker itself (nothing preloaded it)
        assert r["plugin_status"].startswith("installed on vLLM 0.26"), r
        assert r["echo_comm"] and r["tp_ranks"] == list(range(TP)), r


def test_vllm_sees_the_tp_group_on_two_hosts(mp_launch):
    hosts = [r // PER_HOST for r in range(TP)]
    for r in mp_launch["reports"]:
        assert r["same_node_as_tp0"] == [h == 0 for h in hosts], r
        assert r["node_count"] == HOSTS


def test_echo_calls_across_the_hosts_give_the_references_bits(mp_launch):
    """Every rank returns the same bits, and they are those of the
    in-process reference fed the four ranks' partials: Echo's calls
    crossed the hosts (gloo over TCP between the two namespaces' ranks)."""
    from echo_vllm.vllm_glue.settings import TpCommSettings

    passes = mp_launch["passes"]
    assert len({len(p) for p in passes}) == 1 and len(passes[0]) > 0
    settings = TpCommSettings.from_additional_config(
        {"tp_comm": "echo", "echo_min_bytes": 0, "echo_first_exact_calls": 0, "echo_exact_last_call": False})
    ref = EmulatedTP(TP, settings.echo)
    forward = None
    for calls in zip(*passes):
        f = calls[0][0]
        if f != forward:
            if forward is not None:
                ref.end_forward()
            ref.begin_forward()
            forward = f
        expect = ref.reduce(torch.stack([p for _, p, _ in calls]))
        for _, _, y in calls:
            assert torch.equal(y, expect), f
    ref.end_forward()
    for r in mp_launch["after"]:  # every call took Echo's path, on every rank
        assert r["snapshot"]["calls"] == {"echo/echo": len(passes[0])}, r
