"""The link testbed and ``echo-vllm bench link``.

Pure parts everywhere: what the machine must have, the tc commands, the
drop filter's program (run by a tiny classic-BPF interpreter), leftovers,
the bytes arithmetic, refusals. On the testbed itself (root with ``ip`` and
``tc``: this image and CI; skipped elsewhere, saying why): a small bench
run (2 hosts x 1 rank, 1 MiB, quiet and with one background flow, the TP
model's prefill and step), the fault cases (a dropped link, a killed host),
and that nothing the bench made survives a normal, a failing and an
interrupted (SIGINT, SIGTERM) run, nor a dead run's leftovers the next start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from echo_vllm.bench import cli as bench_cli
from echo_vllm.bench import link_bench, link_calls, netns
from echo_vllm.cli_args import UsageError
from echo_vllm.quant import WireLayout

ON_TESTBED = netns.requirements_refusal(sys.platform, os.geteuid(), lambda tool: __import__("shutil").which(tool))
needs_testbed = pytest.mark.skipif(bool(ON_TESTBED), reason=f"the link testbed {ON_TESTBED}")


def _ours(pid: int) -> list[str]:
    """Testbed namespaces of run ``pid`` still present."""
    return [n for n in netns.list_namespaces() if n.startswith(f"{netns.PREFIX}-{pid}-")]


# -- pure ------------------------------------------------------------------------------------


def test_requirements_name_what_is_missing():
    def which_all(tool):
        return f"/usr/sbin/{tool}"

    assert netns.requirements_refusal("linux", 0, which_all) == ""
    assert "needs Linux" in netns.requirements_refusal("darwin", 0, which_all)
    assert "needs root" in netns.requirements_refusal("linux", 1000, which_all)
    assert "needs iproute2's tc on PATH" in netns.requirements_refusal("linux", 0, lambda t: None if t == "tc" else t)
    assert "ip and tc" in netns.requirements_refusal("linux", 0, lambda t: None)


def test_without_root_the_command_refuses_in_one_line(monkeypatch, capsys):
    from echo_vllm import cli

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert cli.main(["bench", "link", "--hosts", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the link testbed needs root" in err[0]


def _run_cbpf(program: str, random32: int) -> int:
    """The classic-BPF program in tc's ``bytecode`` syntax, run on a packet
    whose ``ld rand`` gives ``random32``: its return value (a class id, 0
    for none). Knows the three instructions the drop filter uses."""
    count, *insns = program.split(",")
    insns = [tuple(int(v) for v in i.split()) for i in insns]
    assert int(count) == len(insns)
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k] (word, absolute): only the random ancillary load
            assert k == (1 << 32) - 0x1000 + 56
            acc, pc = random32, pc + 1
        elif code == 0x35:  # jge #k
            pc += 1 + (jt if acc >= k else jf)
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"instruction {code:#x} not expected")


@pytest.mark.parametrize("loss", [0.25, 0.5, 0.01, 1.0])
def test_the_drop_filter_sends_the_loss_fraction_to_the_drop_class(loss):
    program = netns.drop_filter_bytecode(loss)
    drop = int(netns.DROP_CLASS.split(":")[0], 16) << 16 | int(netns.DROP_CLASS.split(":")[1], 16)
    # the program is monotone in the random value: find where it starts dropping
    lo, hi = 0, 1 << 32
    while lo < hi:
        mid = (lo + hi) // 2
        if _run_cbpf(program, mid) == drop:
            hi = mid
        else:
            lo = mid
            lo += 1
    dropped = ((1 << 32) - lo) / (1 << 32)
    assert abs(dropped - loss) <= 2 ** -32
    if lo:
        assert _run_cbpf(program, lo - 1) == 0  # below the threshold: the default class


def test_shaping_puts_delay_and_loss_on_the_sending_side_only():
    shape = netns.LinkShape(50_000_000, delay_s=0.005, loss=0.01)
    send = [" ".join(c) for c in netns.shaping_commands("ns0", "link0", shape, sending_side=True)]
    recv = [" ".join(c) for c in netns.shaping_commands("sw", "port0", shape, sending_side=False)]
    assert any("htb rate 50000000bit ceil 50000000bit" in c for c in send + recv)
    assert any("netem delay 5ms" in c for c in send) and not any("netem" in c for c in recv)
    assert any("bpf bytecode" in c for c in send) and not any("bpf" in c for c in recv)
    assert any(f"bfifo limit {shape.queue_limit_bytes}" in c for c in recv)
    assert all(c.startswith("tc -n ") for c in send + recv)


def test_a_kernel_without_netem_is_named_in_the_error():
    cmd = netns.shaping_commands("ns0", "link0", netns.LinkShape(10**7, delay_s=0.01), sending_side=True)[2]
    why = netns._shaping_hint(cmd, netns.TestbedError("tc ...: Error: Specified qdisc kind is unknown."))
    assert "--delay needs the netem qdisc" in why


def test_leftovers_are_only_dead_runs_of_this_prefix():
    names = ["echo-link-100-h0", "echo-link-100-sw", "echo-link-200-h1", "echo-link-100-other",
             "someone-else-100-h0", "echo-link-x-h0"]
    assert netns.stale_namespaces(names, alive=lambda pid: pid == 200) == {100: ["echo-link-100-h0",
                                                                                "echo-link-100-sw"]}


def test_host_addresses_stay_in_the_benchmarking_range():
    for h in range(netns.MAX_HOSTS):
        addr = netns.host_address(h)
        assert netns.host_of_address(addr) == h
        assert __import__("ipaddress").ip_address(addr) in netns.BENCHMARK_RANGE
    assert netns.host_of_address("10.0.0.1") is None and netns.host_of_address("198.18.0.0") is None


def test_the_arithmetic_at_one_rank_per_host_is_the_layouts_own():
    """With one rank per host every byte a rank sends crosses its host's
    link: the per-rank counts of ``WireLayout`` (written for another use)."""
    for hosts in (2, 3, 4):
        lay = WireLayout((8 << 20) // 2, hosts, 32, 4096)
        assert link_bench.predicted_link_bytes("flat", hosts, 1, lay) == lay.wire_bytes_per_rank
        # ring_bytes_per_rank rounds down to a whole byte
        assert 0 <= link_bench.predicted_link_bytes("16-bit", hosts, 1, lay) - lay.ring_bytes_per_rank() < 1


def test_more_ranks_per_host_send_more_flat_bytes_than_two_level():
    lay = WireLayout((8 << 20) // 2, 4, 32, 4096)
    flat = link_bench.predicted_link_bytes("flat", 2, 2, lay)
    two = link_bench.predicted_link_bytes("two-level", 2, 2, lay)
    ring = link_bench.predicted_link_bytes("16-bit", 2, 2, lay)
    assert two < flat < ring


def test_a_size_too_slow_for_the_rate_is_skipped_with_its_reason():
    ok, why = link_bench.point_plan(256 << 20, 50_000_000, 2, 1, 0, max_call_s=15)
    assert not ok and "16-bit would take >= 43 s per call" in why
    assert link_bench.point_plan(1 << 20, 50_000_000, 2, 1, 0, max_call_s=15) == (True, "")
    ok, why = link_bench.point_plan(32 << 20, 50_000_000, 2, 1, 4, max_call_s=15)  # a fifth of the link: 27 s
    assert not ok and "beside 4 flows" in why


@pytest.mark.parametrize("argv,message", [
    (["--algos", "flat"], "--algos must include 16-bit"),
    (["--sizes", "1000"], "not a whole number of rows of --hidden 4096"),
    (["--hosts", "8", "--ranks-per-host", "9"], "72 ranks: at most 64"),
    (["--workloads", "prefill", "--model-hidden", "100", "--ranks-per-host", "3"], "--model-hidden 100 at 6 ranks"),
])
def test_bad_combinations_are_refused_before_anything_is_made(argv, message, monkeypatch):
    monkeypatch.setattr(netns, "check_requirements", lambda: None)
    args = bench_cli.build_parser().parse_args(["link"] + argv)
    with pytest.raises(UsageError, match=message):
        link_bench._check_args(args)


def test_two_level_is_refused_where_a_host_has_one_rank():
    args = bench_cli.build_parser().parse_args(["link", "--algos", "16-bit,two-level", "--ranks-per-host", "1"])
    with pytest.raises(UsageError, match=r"--algos two-level: two-level Echo cannot run on 2 hosts x 1 rank"):
        link_bench._check_args(args)


@pytest.mark.parametrize("ranks_per_host,algos", [(1, ["16-bit", "flat"]), (2, ["16-bit", "flat", "two-level"])])
def test_the_default_algorithms_are_those_the_placement_runs(ranks_per_host, algos, monkeypatch):
    monkeypatch.setattr(netns, "check_requirements", lambda: None)
    args = bench_cli.build_parser().parse_args(["link", "--ranks-per-host", str(ranks_per_host)])
    link_bench._check_args(args)
    assert args.algos == algos


# -- on the testbed --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """2 hosts x 1 rank, 1 MiB, one call each, quiet and with one background
    flow per host, the all-reduce and a tiny model's prefill and step."""
    if ON_TESTBED:
        pytest.skip(f"the link testbed {ON_TESTBED}")
    out = tmp_path_factory.mktemp("link")
    rc = bench_cli.main(["link", "--hosts", "2", "--ranks-per-host", "1", "--rate", "1gbit", "--sizes", "1M",
                         "--iters", "1", "--warmup", "0", "--background", "0,1", "--timeout-s", "120",
                         "--workloads", "allreduce,prefill,train", "--model-hidden", "64", "--model-layers", "2",
                         "--model-tokens", "32", "--out", str(out)])
    return rc, json.loads((out / "link_h2g1.json").read_text())


@needs_testbed
@pytest.mark.slow
def test_a_small_run_measures_every_case_and_leaves_nothing(small_run):
    rc, result = small_run
    assert rc == 0
    cases = {(r["flows"], r["algo"]) for r in result["rows"]}
    assert cases == {(f, a) for f in (0, 1) for a in ("16-bit", "flat")}
    assert all(r["median_s"] > 0 for r in result["rows"])
    assert [p["flows"] for p in result["phases"]] == [0, 1] and result["phases"][1]["background_bps"] > 0
    assert {(m["flows"], m["algo"]) for m in result["model"]} == cases
    assert all(m["prefill"]["median_s"] > 0 and m["train"]["median_s"] > 0 for m in result["model"])
    assert "htb" in result["testbed"] and result["command"].startswith("echo-vllm bench link --hosts 2")
    assert _ours(os.getpid()) == []


@needs_testbed
@pytest.mark.slow
def test_the_link_counters_match_the_arithmetic(small_run):
    """Each host's link carried at least the payload the arithmetic says and
    at most its TCP/IP overhead more. The links send one frame per TCP
    segment (no GSO): a segment carries up to 1448 payload bytes (MSS of a
    1500-byte MTU with timestamps) under 66 header bytes (Ethernet 14, IPv4
    20, TCP 32), and the worst case acknowledges every segment coming the
    other way with a 66-byte frame (as many bytes come back as go out):
    at most 2 * 66 / 1448 more; plus the barriers' and the last partial
    segments' few frames (under 64 KiB)."""
    _, result = small_run
    quiet = [r for r in result["rows"] if r["flows"] == 0]
    for r in quiet:
        for host, sent in r["tx_bytes_per_host"].items():
            most = (1 + 2 * 66 / 1448) * r["predicted_bytes_per_host"] + (64 << 10)
            assert r["predicted_bytes_per_host"] <= sent <= most, (r["algo"], host)
    congested = [r for r in result["rows"] if r["flows"]]
    assert all(r["tx_bytes_per_host"] is None for r in congested)  # the flows share the counters: not read


@pytest.mark.parametrize("kind", ["drop", "kill"])
@needs_testbed
@pytest.mark.slow
def test_a_fault_fails_every_surviving_rank_in_time_naming_the_call(kind):
    from echo_vllm.bench.link_faults import FaultPlan, fault_verdicts, run_fault

    timeout_s = 3.0
    plan = FaultPlan(kind=kind, host=1, algo="flat", size_bytes=1 << 20, hidden=4096,
                     config=link_calls.bench_config(32).to_dict(), ranks_per_host=1)
    with netns.Testbed(2, netns.LinkShape(10_000_000)) as bed:
        result = run_fault(bed, plan, timeout_s=timeout_s, after_s=0.3)
    assert fault_verdicts(result, timeout_s, slack_s=5.0) == []
    survivors = [r for r in result["reports"] if r is not None]
    assert len(survivors) == (2 if kind == "drop" else 1)
    for r in survivors:
        assert r["collective"] in ("stage-1 all-to-all", "stage-2 all-gather")
        timed_out = "Timed out waiting 3000ms" in r["error"]
        if kind == "drop":
            assert timed_out
        else:
            # a send to the dead host fails naming its address; where our sends
            # had all left before it died, the receive from it times out
            assert "198.18.0.2" in r["error"] or timed_out
    assert _ours(os.getpid()) == []


SLOW_CALLS = ["--hosts", "2", "--ranks-per-host", "1", "--rate", "1mbit", "--sizes", "1M", "--max-call-s", "100",
              "--verify-max-size", "2", "--algos", "16-bit,flat"]
"""A 16-bit call of 1 MiB over 1 Mbit/s: seconds long, to fail or interrupt mid-call."""


@needs_testbed
@pytest.mark.slow
def test_a_failing_run_leaves_nothing():
    """gloo's timeout (1 s) is shorter than the call: the ranks fail, the
    error reaches the command, the testbed goes."""
    with pytest.raises(RuntimeError, match="distributed run failed"):
        bench_cli.main(["link"] + SLOW_CALLS + ["--timeout-s", "1"])
    assert _ours(os.getpid()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@needs_testbed
@pytest.mark.slow
def test_an_interrupted_run_leaves_nothing(sig):
    proc = subprocess.Popen([sys.executable, "-m", "echo_vllm.cli", "bench", "link"] + SLOW_CALLS,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        ranks: list[int] = []
        while not ranks and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if _ours(proc.pid):
                ranks = netns.namespace_pids(netns.namespace_name(proc.pid, "h0"))
        assert ranks, "the ranks never entered their namespace"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out
    assert _ours(proc.pid) == []
    assert all(_gone(pid) for pid in ranks)


def _gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@needs_testbed
def test_a_dead_runs_leftovers_are_removed_and_a_live_runs_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "120"])
    made = [netns.namespace_name(dead.pid, "h0"), netns.namespace_name(dead.pid, "sw"),
            netns.namespace_name(live.pid, "h0")]
    try:
        for ns in made:
            netns.run_command(["ip", "netns", "add", ns])
        straggler = subprocess.Popen(["ip", "netns", "exec", made[0], "sleep", "120"])
        time.sleep(0.5)
        with netns.Testbed(2, netns.LinkShape(10**8), log=lambda line: None):
            names = netns.list_namespaces()
            assert made[0] not in names and made[1] not in names and made[2] in names
        assert straggler.wait(timeout=10) == -signal.SIGKILL
    finally:
        for ns in made:
            netns.run_command(["ip", "netns", "delete", ns], check=False)
        live.kill()
        live.wait()


@needs_testbed
def test_the_hosts_reach_nothing_but_each_other():
    """No interface appears in the root namespace; each host has its
    loopback and its link, one route (its /24 in the benchmarking range),
    no default route and no forwarding; the switch has no address."""
    def root_links() -> set[str]:
        return {link["ifname"] for link in json.loads(netns.run_command(["ip", "-j", "link", "show"]).stdout)}

    before = root_links()
    with netns.Testbed(3, netns.LinkShape(10**8), log=lambda line: None) as bed:
        assert root_links() == before
        for h in range(3):
            ns = bed.host(h)
            links = json.loads(netns.run_command(["ip", "-n", ns, "-j", "link", "show"]).stdout)
            assert {link["ifname"] for link in links} == {"lo", netns.HOST_IF}
            routes = json.loads(netns.run_command(["ip", "-n", ns, "-j", "route", "show"]).stdout)
            assert [r["dst"] for r in routes] == [str(netns.SUBNET)]
            forwarding = netns.run_command(["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/ip_forward"])
            assert forwarding.stdout.strip() == "0"
        addrs = json.loads(netns.run_command(["ip", "-n", bed.switch, "-j", "-4", "addr", "show"]).stdout)
        assert all(a["ifname"] == "lo" for a in addrs if a.get("addr_info"))
    assert root_links() == before
