"""``run_processes`` refuses what it cannot run before any process starts
(a child could only report a pickling error, or wait out a timeout); its
runs themselves are every distributed test's (``start_method="forkserver"``:
the vLLM tests', through ``support.vllm_cpu.run_vllm_processes``)."""

from __future__ import annotations

import math
import os
import signal

import pytest

from echo_vllm.spawn import check_run_arguments, run_processes


def _module_level(rank, world_size):
    return rank


def test_good_arguments_pass():
    check_run_arguments(_module_level, 4, "gloo", 300)
    check_run_arguments(_module_level, 4, "gloo", 300, "forkserver")


@pytest.mark.parametrize("start_method", ["fork", "Spawn", None])
def test_a_start_method_other_than_spawn_or_forkserver_is_refused(start_method):
    """Plain ``fork`` would copy the caller's threads' locks mid-use (torch, pytest)."""
    with pytest.raises(ValueError, match=f"start_method={start_method!r}: one of spawn, forkserver"):
        run_processes(_module_level, 2, start_method=start_method)


@pytest.mark.parametrize("world_size,backend,timeout_s,message", [
    (0, "gloo", 300, "world_size=0: must be an integer from 1 to 256"),
    (2.5, "gloo", 300, "world_size=2.5"),
    (True, "gloo", 300, "world_size=True"),
    (10**6, "gloo", 300, "world_size=1000000"),
    (2, "mpi", 300, "backend='mpi': gloo or nccl"),
    (2, "gloo", math.nan, "timeout_s=nan: must be a number of seconds above 0"),
    (2, "gloo", 0, "timeout_s=0"),
    (2, "gloo", 1e300, "timeout_s=1e+300"),
])
def test_bad_arguments_are_refused_by_name(world_size, backend, timeout_s, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        run_processes(_module_level, world_size, backend=backend, timeout_s=timeout_s)


def test_a_local_function_is_refused_before_spawning():
    def local(rank, world_size):
        return rank

    for fn in (local, lambda rank, world_size: rank):
        with pytest.raises(ValueError, match="must be a module-level function"):
            run_processes(fn, 2)


def _name_rank(rank, world_size):
    os.environ["ECHO_TEST_RANK_SETUP"] = f"{rank} of {world_size}"


def _setup_seen_or_die(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.environ.get("ECHO_TEST_RANK_SETUP")


def test_rank_setup_runs_in_each_child_and_a_rank_that_may_die_gives_none():
    """``rank_setup`` runs before the group forms (the link testbed enters
    a network namespace there); a rank in ``may_die`` that is killed fails
    nothing (a fault test kills a host's ranks on purpose)."""
    got = run_processes(_setup_seen_or_die, 2, rank_setup=_name_rank, may_die=frozenset({1}), timeout_s=120)
    assert got == ["0 of 2", None]


def test_may_die_names_ranks_of_the_group():
    with pytest.raises(ValueError, match=r"may_die=\[2\]: ranks from 0 to 1"):
        run_processes(_module_level, 2, may_die=frozenset({2}))
