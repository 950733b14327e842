"""``echo_vllm.hosts``: the host of each rank, and flat or two-level as a table
(hosts, ranks per host, setting -> choice, reason); a host map that does
not fit the group is refused before anything runs."""

import pytest
import torch

from echo_vllm import EchoCommunicator, EchoConfig, EchoConfigError, StackedCommunicator, VirtualTransport
from echo_vllm.backends import make_backend
from echo_vllm.envs import EchoEnv
from echo_vllm.hosts import HostMap, choose_topology, host_map_refusal, transport_hosts
from echo_vllm.spawn import run_processes

#: (host of each rank, setting, stochastic) -> (choice, what the reason says)
TABLE = [
    ((0, 0, 1, 1), "auto", False, "two_level", "2 hosts x 2 ranks"),
    ((0, 0, 0, 0, 1, 1, 1, 1), "auto", False, "two_level", "2 hosts x 4 ranks"),
    ((0, 0, 0, 1, 1, 1), "auto", False, "two_level", "2 hosts x 3 ranks"),
    ((0, 0, 1, 1, 2, 2, 3, 3), "auto", False, "two_level", "4 hosts x 2 ranks"),
    ((0, 1, 0, 1), "auto", False, "two_level", "2 hosts x 2 ranks"),  # round-robin: not contiguous, fine
    ((7, 7, 3, 3), "auto", False, "two_level", "2 hosts x 2 ranks"),  # labels are any integers
    ((0, 0, 1, 1), "two_level", False, "two_level", "(configured)"),
    ((0, 0, 0, 0), "auto", False, "flat", "one host"),
    ((0, 1, 2, 3), "auto", False, "flat", "one rank per host"),
    ((0, 0, 0, 1), "auto", False, "flat", "unequal size"),
    ((0, 0, 1, 1, 1, 1), "auto", False, "flat", "unequal size"),
    ((0, 1, 1, 0), "auto", False, "flat", "another host order"),
    ((0, 0, 1, 1), "auto", True, "flat", "stochastic rounding"),
    ((0, 0, 1, 1), "flat", False, "flat", "configured"),
    ((0, 0, 0, 0), "flat", False, "flat", "configured"),
]


@pytest.mark.parametrize("hosts,setting,stochastic,choice,reason", TABLE)
def test_the_topology_table(hosts, setting, stochastic, choice, reason):
    got, why = choose_topology(hosts, setting, stochastic=stochastic)
    assert got == choice and reason in why, (got, why)


@pytest.mark.parametrize("hosts,stochastic,reason", [
    ((0, 0, 0, 0), False, "one host"),
    ((0, 0, 0, 1), False, "unequal size"),
    ((0, 1), False, "one rank per host"),
    ((0, 1, 1, 0), False, "another host order"),
    ((0, 0, 1, 1), True, "stochastic"),
])
def test_an_explicit_two_level_the_group_cannot_run_is_refused_in_one_line(hosts, stochastic, reason):
    with pytest.raises(EchoConfigError, match="topology='two_level' cannot run on this group") as e:
        choose_topology(hosts, "two_level", stochastic=stochastic)
    assert reason in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_setting_is_refused():
    with pytest.raises(EchoConfigError, match="topology='hierarchical'"):
        choose_topology((0, 0, 1, 1), "hierarchical")


def test_host_map_numbers_hosts_by_first_rank_and_gives_the_groups():
    hosts = HostMap.of((5, 9, 5, 9, 2, 2))  # unequal: no cross-host groups
    assert hosts.host_of_rank == (0, 1, 0, 1, 2, 2) and hosts.ranks_per_host == (2, 2, 2)
    assert hosts.in_host_groups == ((0, 2), (1, 3), (4, 5))
    assert [hosts.local_index(r) for r in range(6)] == [0, 0, 1, 1, 0, 1]
    assert hosts.cross_host_groups == ((0, 1, 4), (2, 3, 5))
    with pytest.raises(ValueError, match="equal size"):
        _ = HostMap.of((0, 0, 1)).cross_host_groups


def test_a_host_map_of_the_wrong_length_is_refused_before_anything_runs():
    assert host_map_refusal(None, 4) == "" and host_map_refusal((0, 0, 1, 1), 4) == ""
    assert "names 3 ranks but the group has 4" in host_map_refusal((0, 0, 1), 4)
    cfg = EchoConfig(host_map=(0, 0, 1))
    for build in (lambda: StackedCommunicator(cfg, VirtualTransport(4)),
                  lambda: make_backend(cfg, VirtualTransport(4), device_type="cpu", env=EchoEnv())):
        with pytest.raises(EchoConfigError, match=r"host_map=0,0,1 names 3 ranks but the group has 4"):
            build()


@pytest.mark.parametrize("raw,parsed", [("0,0,1,1", (0, 0, 1, 1)), (" 3, 3 ,4,4 ", (3, 3, 4, 4)),
                                        ([0, 1, 0, 1], (0, 1, 0, 1)), ("", None), ("none", None)])
def test_host_map_setting_reads_text_and_lists(raw, parsed):
    assert EchoConfig.from_mapping({"echo_host_map": raw}, prefix="echo_").host_map == parsed


@pytest.mark.parametrize("raw,message", [
    ("0,0,x,1", "host_map='0,0,x,1': expected the host of each rank as integers separated by commas"),
    ("0;0;1;1", "expected the host of each rank"),
    ((0, -1), "host_map=(0, -1): must be the host of each rank"),
    ((0, True), "must be the host of each rank"),
    (7, "host_map=7: must be the host of each rank"),
    (tuple(range(2000)), "at most 1024 ranks"),
])
def test_bad_host_maps_get_one_line_naming_the_value(raw, message):
    with pytest.raises(EchoConfigError) as e:
        EchoConfig.from_mapping({"host_map": raw})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_two_level_with_stochastic_rounding_is_refused_by_the_config():
    with pytest.raises(EchoConfigError, match="topology='two_level' with rounding='stochastic'"):
        EchoConfig(topology="two_level", rounding="stochastic")


def test_virtual_ranks_share_one_host_so_auto_stays_flat():
    comm = StackedCommunicator(EchoConfig(), VirtualTransport(4))
    backend = comm.backend(torch.device("cpu"))
    assert transport_hosts(VirtualTransport(4)).host_of_rank == (0, 0, 0, 0)
    assert backend.topology == "flat" and "one host" in backend.topology_reason


def test_a_host_map_makes_virtual_ranks_two_level():
    comm = StackedCommunicator(EchoConfig(host_map=(0, 0, 1, 1)), VirtualTransport(4))
    backend = comm.backend(torch.device("cpu"))
    assert backend.topology == "two_level" and backend.topology_reason == "2 hosts x 2 ranks"
    assert backend.hosts == HostMap((0, 0, 1, 1))


def _ask_the_group(rank, world):
    from echo_vllm.transport import ProcessGroupTransport

    comm = EchoCommunicator(EchoConfig(), ProcessGroupTransport())
    backend = comm.backend(torch.device("cpu"))
    return transport_hosts(ProcessGroupTransport()).host_of_rank, backend.topology, backend.topology_reason


def test_processes_of_one_machine_are_found_on_one_host():
    for hosts, topology, reason in run_processes(_ask_the_group, 2):
        assert hosts == (0, 0) and topology == "flat" and "one host" in reason
