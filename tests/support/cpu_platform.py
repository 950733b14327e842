"""vLLM's CPU platform in every process vLLM starts, through vLLM's own
``vllm.platform_plugins`` entry point group.

``use_cpu_platform`` (``support.vllm_cpu``) sets the platform in a process
the test controls. The processes vLLM's launchers start themselves
(multiprocessing workers, a node's headless executor, Ray actors) detect
their platform afresh, and on a machine without a GPU the CUDA wheel finds
none. :func:`install_platform_plugin` writes a one-entry distribution
(``dist-info`` only) whose ``vllm.platform_plugins`` entry point names
:func:`cpu_platform`; a process with that folder and ``tests/`` on its
``PYTHONPATH`` (inherited by every process vLLM starts, Ray's workers
included when Ray starts from that environment) resolves to
:class:`HostsCpuPlatform`, vLLM's ``CpuPlatform`` with two facts a GPU
host has and vLLM 0.26's CPU platform lacks:

* ``device_count()``: the devices of this host (``TESTS_DEVICES_PER_HOST``,
  default 1). vLLM's multi-node launch places its workers' reply queues by
  ``rank // device_count()`` (``MessageQueue.create_from_process_group_single_reader``),
  and ``torch.cpu.device_count()`` is 1: on the CPU platform only one
  worker per node can join a multi-node launch.
* ``ray_device_key = "GPU"``: the resource the Ray executor places a
  worker on (the CPU platform has none: ``ray_utils.initialize_ray_cluster``
  refuses it). A local Ray cluster started with ``num_gpus=N`` holds N
  such logical slots; the workers' tensors stay on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm.platforms.cpu import CpuPlatform

#: The distribution's name (its folder: ``<NAME>-0.dist-info``) and the
#: entry point's name, which ``VLLM_PLUGINS`` would have to list if set.
NAME = "echo_tests_cpu_platform"
ENTRY_POINT = "echo_tests_cpu"


#: How many workers each "host" of a launch holds (see the module docstring).
DEVICES_PER_HOST = "TESTS_DEVICES_PER_HOST"


class HostsCpuPlatform(CpuPlatform):
    """vLLM's CPU platform, with a host's device count and a Ray resource."""

    ray_device_key = "GPU"

    @classmethod
    def device_count(cls) -> int:
        return int(os.environ.get(DEVICES_PER_HOST, "1"))


def cpu_platform() -> str:
    """The entry point: the platform class, by qualified name."""
    return f"{__name__}.{HostsCpuPlatform.__qualname__}"


def install_platform_plugin(folder: Path) -> Path:
    """Write the distribution into ``folder`` (to be put on ``PYTHONPATH``
    beside ``tests/``); returns ``folder``."""
    info = folder / f"{NAME}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.platform_plugins]\n{ENTRY_POINT} = support.cpu_platform:cpu_platform\n")
    return folder
