"""The order in which the suite's test files are handed to pytest-xdist's
workers (the README runs ``pytest -n auto``; pyproject's ``addopts`` picks
``--dist loadfile --no-loadscope-reorder``: each file runs whole on one
worker, files handed out in collection order).

Whole files, because many share a module-scoped fixture (spawned gloo or
vLLM processes, a prepared model, kernels compiled for sm_90): every
worker that ran one of a file's tests would set it up again (tens of
seconds for a vLLM launch). Files with a test marked ``slow`` come first,
so that the last file a worker starts is a short one rather than a
minute-long one while the other worker idles.

Each worker also runs torch on its share of the cores (cores // workers
threads, as ``echo_vllm.spawn`` gives its ranks): two workers with a thread
per core each would have their threads spin and wait on each other.

None of this changes what a test runs or checks.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in xdist's workers only
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = {_file(item) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: _file(item) not in slow)  # stable: files in their order, slow ones first
