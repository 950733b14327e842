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

The Ray launches (``--distributed-executor-backend ray``; skipped without
Ray): a local Ray cluster of two nodes, one per host, and the executor vLLM
starts, driven the same way: ``RayExecutorV2`` (0.26's default) and
``RayDistributedExecutor`` (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``).
Each launch takes minutes (every node and worker process imports vLLM).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from echo_vllm import EchoConfig  # noqa: E402
from echo_vllm.emulation import EmulatedTP  # noqa: E402
from echo_vllm.hosts import HostMap  # noqa: E402
from echo_vllm.quant import WireLayout  # noqa: E402
from echo_vllm.wire_bytes import echo_bytes  # noqa: E402
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
#: The launch's Echo settings as the reference reads them, with the hosts
#: vLLM finds as a host map (in-process virtual ranks share one host).
REFERENCE = {"echo_min_bytes": 0, "echo_first_exact_calls": 0, "echo_exact_last_call": False,
             "echo_host_map": ",".join(str(r // PER_HOST) for r in range(TP))}
LAUNCH_S = 900
#: The executor vLLM starts for each launch.
EXECUTORS = {"mp": "MultiprocExecutor", "ray": "RayExecutorV2", "ray_v1": "RayDistributedExecutor"}
#: A valid ECHO_KERNELS (the backend CPU tensors take anyway): the Ray tests
#: start their second node without it.
RAY_KERNELS = "reference"


def serve_argv(model: Path, *launch: str) -> list[str]:
    """Every node's ``echo-vllm serve`` arguments (docs/multi-node.md), with
    ``launch``'s."""
    return [str(model), *ECHO_FLAGS, "--tensor-parallel-size", str(TP), *launch,
            "--worker-cls", "support.probe_worker.ProbeWorker", "--max-model-len", "128"]


def _launch_setup(tmp_path_factory, name):
    """(folder, model, environment, one /dev/shm folder per host)."""
    why = hosts_refusal()
    if why:
        pytest.skip(f"two hosts on one machine: {why}")
    from echo_vllm.testing_models import make_tiny_qwen3
    from support.cpu_platform import DEVICES_PER_HOST, install_platform_plugin
    from support.probe_worker import HIDDEN

    tmp = tmp_path_factory.mktemp(name)
    # the toy decoder's width: the glue takes [tokens, model width] messages as the residual stream
    model = make_tiny_qwen3(tmp / "model", num_layers=1, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                            vocab_size=512)
    env = launch_env(install_platform_plugin(tmp / "platform"), **{DEVICES_PER_HOST: str(PER_HOST)})
    shm = [Path(tmp_path_factory.mktemp(f"{name}-shm{h}")) for h in range(HOSTS)]
    return tmp, model, env, shm


@pytest.fixture(scope="module")
def mp_launch(tmp_path_factory):
    tmp, model, env, shm = _launch_setup(tmp_path_factory, "mp")
    argv = serve_argv(model, "--nnodes", str(HOSTS), "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
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


def _ray_launch(tmp_path_factory, name, **env_extra):
    """The same TP group under vLLM's Ray executor: a local Ray cluster of
    two nodes, one per host (``support.vllm_launch.drive_on_ray``), node 0
    driving the executor ``echo-vllm serve ... --distributed-executor-backend
    ray`` would start. Node 0 runs with ``ECHO_KERNELS`` set; node 1 without."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install ray): vLLM's Ray executor needs it")
    tmp, model, env, shm = _launch_setup(tmp_path_factory, name)
    # Ray's memory monitor kills workers when the whole machine is at 95% of its memory, which
    # other processes on a shared CI machine reach without this test (the kernel's OOM killer stays)
    env.update(env_extra, ECHO_KERNELS=RAY_KERNELS, RAY_memory_monitor_refresh_ms="0")
    argv = serve_argv(model, "--distributed-executor-backend", "ray")
    out = tmp / "node0.pt"
    node0 = subprocess.run(
        host_argv([sys.executable, "-m", "support.vllm_launch", str(out), "--ray-hosts", *map(str, shm),
                   "--devices-per-host", str(PER_HOST), "--", *argv], shm[0]),
        env=env, capture_output=True, text=True, timeout=LAUNCH_S)
    assert node0.returncode == 0, node0.stdout[-3000:] + node0.stderr[-8000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def ray_launch(tmp_path_factory):
    """vLLM 0.26's default Ray executor (``RayExecutorV2``: multiprocessing's
    worker processes as Ray actors)."""
    return _ray_launch(tmp_path_factory, "ray")


@pytest.fixture(scope="module")
def ray_v1_launch(tmp_path_factory):
    """The older one (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``:
    ``RayDistributedExecutor`` and its ``RayWorkerWrapper``)."""
    return _ray_launch(tmp_path_factory, "ray_v1", VLLM_USE_RAY_V2_EXECUTOR_BACKEND="0")


@pytest.fixture(params=["mp", "ray", "ray_v1"])
def launch(request):
    """Each launch's result (the Ray ones skip where Ray is not installed)."""
    return dict(request.getfixturevalue(f"{request.param}_launch"), kind=request.param)



def test_the_plugin_loads_in_every_worker_of_both_nodes(launch):
    assert launch["executor"] == EXECUTORS[launch["kind"]]
    reports = launch["reports"]
    assert [r["rank"] for r in reports] == list(range(TP))
    assert [r["local_rank"] for r in reports] == [r % PER_HOST for r in range(TP)]
    assert len({r["pid"] for r in reports}) == TP
    for r in reports:
        # loaded through vLLM's entry point by each worker itself (nothing preloaded it)
        assert r["plugin_status"].startswith("installed on vLLM 0.26"), r
        assert r["echo_comm"] and r["tp_ranks"] == list(range(TP)), r


@pytest.mark.parametrize("kind", ["ray", "ray_v1"])
def test_ray_workers_on_every_node_get_echos_variables(kind, request):
    """The Ray node of host 1 started without ``ECHO_KERNELS``: its
    workers have it from the executor (V2 sends the driver's environment;
    V1 only the prefixes it is told, which ``echo-vllm serve`` adds)."""
    for r in request.getfixturevalue(f"{kind}_launch")["reports"]:
        assert r["environ"].get("ECHO_KERNELS") == RAY_KERNELS, r


def test_vllm_sees_the_tp_group_on_two_hosts(launch):
    hosts = [r // PER_HOST for r in range(TP)]
    for r in launch["reports"]:
        assert r["same_node_as_tp0"] == [h == 0 for h in hosts], r
        assert r["node_count"] == HOSTS


def test_vllms_node_test_makes_the_tp_group_two_level(launch):
    """No host map is set (both "hosts" report one host name): the glue
    asks vLLM's node test, finds 2 hosts of 2 ranks and takes two-level,
    its sub-groups made with the TP group on every rank."""
    for r in launch["reports"]:
        assert r["snapshot"]["topology"] == ["two_level", f"{HOSTS} hosts x {PER_HOST} ranks"], r


def test_echo_calls_across_the_hosts_give_the_references_bits(launch):
    """Every rank returns the same bits, and they are those of the
    in-process two-level reference (the hosts vLLM found, as a host map)
    fed the four ranks' partials: Echo's calls crossed the hosts."""
    passes = launch["passes"]
    assert len({len(p) for p in passes}) == 1 and len(passes[0]) > 0
    ref = EmulatedTP(TP, EchoConfig.from_mapping(REFERENCE, prefix="echo_"))
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


def test_the_bytes_that_crossed_the_hosts_are_counted(launch):
    """Every call took Echo's path on every rank, and the records count the
    bytes each sent inside its host and across (the two-level arithmetic)."""
    hosts = HostMap(tuple(r // PER_HOST for r in range(TP)))
    for r, calls in zip(launch["after"], launch["passes"]):
        snap = r["snapshot"]
        assert snap["calls"] == {"echo/echo": len(calls)}, r
        want = [echo_bytes(WireLayout(y.numel(), TP, 32, y.shape[-1]), hosts, r["tp_rank"], "two_level")
                for _, _, y in calls]
        assert snap["level_bytes"] == {"cross_host": sum(b.cross_host for b in want),
                                       "in_host": sum(b.in_host for b in want)}
