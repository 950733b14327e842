"""vLLM's launchers with real processes on CPU: a node per mount namespace,
the engine's executor driven by a test.

* :func:`host_argv`: a command run as on a host of its own. vLLM tells
  hosts apart by shared memory (``parallel_state.in_the_same_node_as``
  opens a segment another rank made in ``/dev/shm``); a process in its own
  mount namespace with its own folder bound on ``/dev/shm`` shares memory
  only with the processes of its "host". Every process vLLM starts inherits
  the namespace.
* ``python -m support.vllm_launch OUT [--ray-hosts ...] -- SERVE_ARGS...``:
  node 0's side of ``echo-vllm serve`` with the same command line as every node's:
  the rewrite into ``vllm serve`` arguments, vLLM's parser, the engine
  config, then the executor vLLM would start (multiprocessing across
  nodes, or Ray) -- driven here with ``collective_rpc`` instead of an
  engine core, because the workers are :class:`support.probe_worker.ProbeWorker`
  (``--worker-cls``). Writes every worker's report, its forward passes and
  its report after them to ``OUT`` (``torch.save``). ``--ray-hosts``:
  on a local Ray cluster of one node per host (:func:`drive_on_ray`).

Every process needs ``tests/`` and :mod:`support.cpu_platform`'s folder on
``PYTHONPATH`` (:func:`launch_env`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]

#: Runs ``"$@"`` with the folder ``$0`` as its ``/dev/shm``, in a new mount
#: namespace whose mounts do not propagate back.
_OWN_SHM = 'mount --bind "$0" /dev/shm && exec "$@"'


def hosts_refusal() -> str:
    """Why this machine cannot give processes hosts of their own ("" if it
    can): Linux, root (a mount namespace and a bind mount) and util-linux's
    ``unshare``."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux mount namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "needs root (a mount namespace per host, its own /dev/shm bound in it)"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare on PATH"
    return ""


def host_argv(argv: list[str], shm_dir: Path) -> list[str]:
    """``argv`` as a process of a host of its own (its own ``/dev/shm``)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _OWN_SHM, str(shm_dir), *argv]


def launch_env(plugin_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of every process of a launch: ``tests/`` and the CPU
    platform's entry point on ``PYTHONPATH``; no OpenMP thread binding
    (vLLM's CPU executor would bind each local worker to a NUMA node of
    its own); no model hub."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(plugin_dir), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End ``process`` and everything it started (it leads its own session:
    ``start_new_session=True``): SIGTERM, then SIGKILL after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drive(serve_argv: list[str]) -> dict:
    """Node 0 of ``echo-vllm serve serve_argv``: the executor the engine
    would start, its workers' reports and forward passes (``ray.init``
    must have run first where the command line asks for Ray)."""
    from echo_vllm.server import vllm_serve
    from echo_vllm.server.cli import ray_copy_env
    from echo_vllm.server.rewrite import rewrite_args

    vllm_argv, settings = rewrite_args(serve_argv)
    if settings.glue_active:  # as echo-vllm serve does
        os.environ.update(ray_copy_env(os.environ))
    args = vllm_serve.parse(vllm_argv)
    args.model = args.model_tag or args.model  # as vLLM's ServeSubcommand.cmd
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.executor import Executor

    start = time.monotonic()
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    executor = Executor.get_class(config)(config)
    try:
        started_s = time.monotonic() - start
        return dict(executor=type(executor).__name__, started_s=started_s, tp_comm=settings.tp_comm,
                    reports=executor.collective_rpc("echo_report"),
                    passes=executor.collective_rpc("echo_passes"),
                    after=executor.collective_rpc("echo_report"))
    finally:
        executor.shutdown()


#: Echo's variables: the second Ray node starts without them.
ECHO_PREFIX = "ECHO_"
#: Ray's session folder: its sockets' paths must stay below the 107 bytes of a Unix socket path.
RAY_TEMP_PREFIX = "/tmp/echo-ray-"


def drive_on_ray(serve_argv: list[str], hosts: list[Path], devices_per_host: int) -> dict:
    """:func:`drive` on a local Ray cluster of ``len(hosts)`` nodes with
    ``devices_per_host`` logical GPUs each (the resource
    ``support.cpu_platform`` places workers on): this process starts the
    head, on host 0 (the namespace it runs in); node ``i`` is a
    ``ray start`` in the mount namespace of ``hosts[i]`` (its ``/dev/shm``),
    which vLLM's Ray executor must see as another node (its own address,
    127.0.0.i+1, for Ray and for vLLM's ``VLLM_HOST_IP``), started without
    Echo's variables (what its workers get of them, the executor sent).
    Every Ray process, and Ray's session folder, ends with this call."""
    import ray

    temp = Path(RAY_TEMP_PREFIX + str(os.getpid()))
    # the head takes this machine's address, as vLLM's get_ip() here does (the older executor
    # places its first worker on the node of that address)
    ray.init(num_cpus=devices_per_host, num_gpus=devices_per_host, include_dashboard=False, _temp_dir=str(temp))
    nodes = []
    try:
        gcs = ray.get_runtime_context().gcs_address
        for i, shm in enumerate(hosts[1:], start=1):
            ip = f"127.0.0.{i + 1}"
            argv = [str(Path(sys.executable).with_name("ray")), "start", "--block", f"--address={gcs}",
                    f"--num-cpus={devices_per_host}", f"--num-gpus={devices_per_host}", f"--node-ip-address={ip}"]
            env = {k: v for k, v in os.environ.items() if not k.startswith(ECHO_PREFIX)}
            nodes.append(subprocess.Popen(host_argv(argv, shm), env=dict(env, VLLM_HOST_IP=ip),
                                          start_new_session=True))
        deadline = time.monotonic() + 300
        while sum(n["Alive"] for n in ray.nodes()) < len(hosts):
            if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
                raise RuntimeError(f"Ray nodes alive: {sum(n['Alive'] for n in ray.nodes())} of {len(hosts)}")
            time.sleep(1)
        return drive(serve_argv)
    finally:
        ray.shutdown()
        for node in nodes:
            stop(node)
        shutil.rmtree(temp, ignore_errors=True)


def main(argv: list[str]) -> int:
    """``OUT [--ray-hosts SHM_DIR...] [--devices-per-host G] -- SERVE_ARGS``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m support.vllm_launch")
    parser.add_argument("out", type=Path)
    parser.add_argument("--ray-hosts", type=Path, nargs="+", default=None,
                        help="start a Ray cluster of one node per host folder (host 0: this process's)")
    parser.add_argument("--devices-per-host", type=int, default=1)
    ours, serve_argv = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    opts = parser.parse_args(ours)
    if opts.ray_hosts:
        result = drive_on_ray(serve_argv, opts.ray_hosts, opts.devices_per_host)
    else:
        result = drive(serve_argv)
    torch.save(result, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
