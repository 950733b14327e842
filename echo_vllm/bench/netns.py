"""A slow link on one machine: hosts as network namespaces, joined by a switch.

The Mininet method. Each *host* is a network namespace holding the ranks of
one machine; a *switch* namespace holds a Linux bridge; each host is joined
to the switch by one veth pair, its *link*. Everything is made by this
process and named ``echo-link-<pid>-<role>`` (roles ``h0``, ``h1``, ...,
``sw``), so that a run removes only what it made and the next run can tell a
dead run's leftovers (the PID is gone) from a live one's.

::

    [echo-link-<pid>-h0]                [echo-link-<pid>-sw]                [echo-link-<pid>-h1]
     ranks 0..G-1, lo                     br0 (bridge)                       ranks G..2G-1, lo
     link0 198.18.0.1/24 ==== veth ==== port0      port1 ==== veth ==== link0 198.18.0.2/24

* **Addresses** only in 198.18.0.0/24, inside the benchmarking range
  198.18.0.0/15 (RFC 2544), only on interfaces inside these namespaces; no
  default route, no forwarding, no interface in the root namespace. Nothing
  can leave: the namespaces have no path to any other.
* **Within a host**, ranks reach each other at the host's own address,
  which the kernel routes over the namespace's loopback: fast and unshaped,
  as NVLink or PCIe inside a machine is next to its NIC. **Across hosts**
  every byte crosses the sender's link and the receiver's link, each shaped.
* **Shaping** (:func:`shaping_commands`), per link and direction, as a
  switch port and a NIC would: an ``htb`` class at the link's rate in each
  direction (the host side shapes what the host sends, the switch side what
  it receives) over a byte-limited FIFO (``bfifo``, a shallow switch
  buffer), or ``netem`` for an added delay; random loss by a classic-BPF
  filter (``cls_bpf``, ``ld rand``) that sends that fraction of packets to a
  class whose queue holds nothing (``pfifo limit 0``). Delay and loss act on
  the sender's side only, so each packet meets them once.
* **Bytes that crossed a link**: the host's interface counters, read inside
  its namespace (:func:`link_counters`).
* **Teardown** on every exit: :meth:`Testbed.close` from ``with``, from an
  ``atexit`` hook and from SIGTERM/SIGHUP handlers (which raise
  ``SystemExit`` so that every ``finally`` runs; Ctrl-C raises
  ``KeyboardInterrupt`` by itself). A run killed with SIGKILL leaves its
  namespaces; the next :class:`Testbed` finds them (:func:`stale_namespaces`)
  and removes them.

Needs Linux, root (namespaces, veths and qdiscs need CAP_SYS_ADMIN and
CAP_NET_ADMIN) and iproute2's ``ip`` and ``tc``: :func:`requirements_refusal`
says which is missing, in one line.
"""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..cli_args import UsageError

#: Every namespace a testbed makes is named ``<PREFIX>-<pid>-<role>``.
PREFIX = "echo-link"
_NAME = re.compile(rf"{re.escape(PREFIX)}-(\d+)-(sw|h\d+)")

#: The benchmarking range (RFC 2544): never routed on the Internet.
BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
#: The hosts' subnet: host i is ``.i+1``.
SUBNET = ipaddress.ip_network("198.18.0.0/24")
assert SUBNET.subnet_of(BENCHMARK_RANGE)

#: Each host's end of its link (the same name in every host namespace, so
#: one ``GLOO_SOCKET_IFNAME`` serves every rank).
HOST_IF = "link0"
BRIDGE = "br0"

#: Most hosts: one /24 holds 253 addresses, and every host costs processes.
MAX_HOSTS = 64

#: The htb class of a link's traffic, the class that drops (its queue
#: holds nothing), and their parent qdisc's handle.
ROOT, PASS_CLASS, DROP_CLASS = "1:", "1:10", "1:20"
#: htb's quantum (bytes a class sends per round): a few frames, within
#: htb's bounds, so the kernel does not warn about it.
HTB_QUANTUM_BYTES = 1 << 14

#: Largest frame on a link (its MTU plus the Ethernet header). The links
#: build no GSO packets: each TCP segment is its own frame, as on a NIC's
#: wire (segmentation is the NIC's job), so a queue holds frames and a drop
#: loses one.
FRAME_BYTES = 1514
#: Queue of a link: this many seconds of its rate, at least
#: :data:`MIN_QUEUE_FRAMES` frames. A switch port's buffer is shallow; a
#: deep one turns background traffic into queueing delay (256 KiB at
#: 10 Mbit/s: 0.2 s a round trip) instead of a shared rate.
QUEUE_S = 0.02
MIN_QUEUE_FRAMES = 32

#: Seconds any one ``ip``/``tc`` command may take (they take milliseconds).
COMMAND_TIMEOUT_S = 30

#: Settings of every namespace the testbed makes (per-namespace sysctls).
NAMESPACE_SYSCTLS = {
    # no IPv6 (where the kernel has it): no autoconfiguration chatter on the links' counters
    "net/ipv6/conf/default/disable_ipv6": "1",
    "net/ipv6/conf/all/disable_ipv6": "1",
    # keep the congestion window across an idle gap: between an Echo call's
    # phases the ranks run their kernels, milliseconds on a GPU but past
    # TCP's 200 ms idle limit on this CPU, and a GPU cluster's link would
    # never fall back to slow start there
    "net/ipv4/tcp_slow_start_after_idle": "0",
}

_CLONE_NEWNET = 0x40000000


class TestbedUnavailable(UsageError):
    """This machine cannot host the testbed (one line says what it needs)."""


class TestbedError(RuntimeError):
    """A command that builds or changes the testbed failed."""


# -- what the machine must have -----------------------------------------------------


def requirements_refusal(platform: str, euid: int, which: Callable[[str], str | None]) -> str:
    """Why this machine cannot run the testbed, "" if it can: Linux, root,
    ``ip`` and ``tc`` on PATH."""
    if not platform.startswith("linux"):
        return f"needs Linux network namespaces (this is {platform})"
    if euid != 0:
        return ("needs root: it makes network namespaces, veth pairs and tc qdiscs "
                "(CAP_SYS_ADMIN, CAP_NET_ADMIN); run it as root")
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        return f"needs iproute2's {' and '.join(missing)} on PATH (Debian: apt-get install iproute2)"
    return ""


def check_requirements() -> None:
    """Raise :class:`TestbedUnavailable` if this machine cannot run the testbed."""
    why = requirements_refusal(sys.platform, os.geteuid() if hasattr(os, "geteuid") else -1, shutil.which)
    if why:
        raise TestbedUnavailable(f"the link testbed {why}")


# -- the shape of a link ------------------------------------------------------------


@dataclass(frozen=True)
class LinkShape:
    """How each host's link is shaped (the same for every host)."""

    rate_bps: int
    """Bits per second, each direction, of every host's link (a NIC's line rate)."""
    delay_s: float = 0.0
    """One-way delay added to every packet a host sends (``netem``, which
    some kernels lack: then only 0 is possible). The round trip between two
    hosts is twice this, plus the veths' own tens of microseconds."""
    loss: float = 0.0
    """Fraction of the packets a host sends that its link drops, at random
    (0 to 1; 1 drops everything: a cut link)."""
    queue_bytes: int = 0
    """Bytes a link's queue holds before it drops (0: :data:`QUEUE_S` of the
    rate, at least :data:`MIN_QUEUE_FRAMES` frames)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rate_bps, int) or isinstance(self.rate_bps, bool) or not 8000 <= self.rate_bps <= 10**12:
            raise ValueError(f"rate_bps={self.rate_bps!r}: an integer from 8000 (1 kB/s) to 10**12 (1 Tbit/s)")
        if not 0 <= self.delay_s <= 10:
            raise ValueError(f"delay_s={self.delay_s!r}: seconds from 0 to 10")
        if not 0 <= self.loss <= 1:
            raise ValueError(f"loss={self.loss!r}: a fraction from 0 to 1")
        if not isinstance(self.queue_bytes, int) or self.queue_bytes < 0:
            raise ValueError(f"queue_bytes={self.queue_bytes!r}: an integer from 0")

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_bps / 8

    @property
    def queue_limit_bytes(self) -> int:
        return self.queue_bytes or max(MIN_QUEUE_FRAMES * FRAME_BYTES, int(self.rate_bytes_per_s * QUEUE_S))

    def describe(self) -> str:
        """One line: the rate, the queue and the qdiscs that make them."""
        leaf = (f"netem delay {format_seconds(self.delay_s)} limit {self.netem_limit_packets}p"
                if self.delay_s else f"bfifo limit {self.queue_limit_bytes}b")
        text = (f"{format_rate(self.rate_bps)} each way per host link: htb class {PASS_CLASS} rate "
                f"{self.rate_bps}bit -> {leaf}")
        if self.loss:
            text += (f"; loss {self.loss:.4g} on each host's sending side: cls_bpf (ld rand) -> htb class "
                     f"{DROP_CLASS} -> pfifo limit 0")
        return text

    @property
    def netem_limit_packets(self) -> int:
        # netem holds the delayed packets too: the link's queue plus what
        # the delay keeps in flight, in full-size frames
        in_flight = self.rate_bytes_per_s * self.delay_s
        return max(1000, int((self.queue_limit_bytes + in_flight) // FRAME_BYTES) + 1)


def format_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:g} bit/s"


def format_seconds(s: float) -> str:
    return f"{s * 1e3:g}ms" if s < 1 else f"{s:g}s"


def drop_filter_bytecode(loss: float) -> str:
    """Classic BPF, in tc's ``bytecode`` syntax, that classifies a random
    ``loss`` fraction of packets into :data:`DROP_CLASS` and lets the rest
    fall through to the default class: ``ld rand; jge K; ret 1:20; ret 0``,
    with ``K = (1 - loss) * 2**32`` (``ld rand`` loads 32 random bits)."""
    major, minor = DROP_CLASS.split(":")
    drop = (int(major, 16) << 16) | int(minor, 16)  # tc class ids are hex
    if loss >= 1:
        return f"1,6 0 0 {drop}"
    k = min((1 << 32) - 1, max(1, round((1 - loss) * (1 << 32))))
    # SKF_AD_OFF + SKF_AD_RANDOM = -0x1000 + 56, as an unsigned 32-bit offset
    rand = (1 << 32) - 0x1000 + 56
    return f"4,32 0 0 {rand},53 0 1 {k},6 0 0 {drop},6 0 0 0"


def shaping_commands(ns: str, dev: str, shape: LinkShape, *, sending_side: bool) -> list[list[str]]:
    """The ``tc`` commands that shape what ``dev`` (in namespace ``ns``)
    sends: an htb class at the rate over a byte FIFO (or netem with the
    delay), and on the ``sending_side`` (a host's own end) the random drop.
    ``dev`` must have no root qdisc of its own yet (a veth's default)."""
    tc = ["tc", "-n", ns]
    burst = max(4 * FRAME_BYTES, int(shape.rate_bytes_per_s * 0.001))  # a millisecond of the rate
    cmds = [
        tc + ["qdisc", "add", "dev", dev, "root", "handle", ROOT, "htb", "default", PASS_CLASS.split(":")[1]],
        tc + ["class", "add", "dev", dev, "parent", ROOT, "classid", PASS_CLASS, "htb",
              "rate", f"{shape.rate_bps}bit", "ceil", f"{shape.rate_bps}bit",
              "burst", str(burst), "cburst", str(burst), "quantum", str(HTB_QUANTUM_BYTES)],
    ]
    if sending_side and shape.delay_s:
        cmds.append(tc + ["qdisc", "add", "dev", dev, "parent", PASS_CLASS, "handle", "10:", "netem",
                          "delay", format_seconds(shape.delay_s), "limit", str(shape.netem_limit_packets)])
    else:
        cmds.append(tc + ["qdisc", "add", "dev", dev, "parent", PASS_CLASS, "handle", "10:", "bfifo",
                          "limit", str(shape.queue_limit_bytes)])
    if sending_side and shape.loss:
        cmds += drop_commands(ns, dev, shape.loss)
    return cmds


def drop_commands(ns: str, dev: str, loss: float) -> list[list[str]]:
    """A drop class and the random filter into it, on ``dev``'s htb."""
    tc = ["tc", "-n", ns]
    return [
        tc + ["class", "add", "dev", dev, "parent", ROOT, "classid", DROP_CLASS, "htb", "rate", "8000bit",
              "quantum", "1514"],
        tc + ["qdisc", "add", "dev", dev, "parent", DROP_CLASS, "handle", "20:", "pfifo", "limit", "0"],
        tc + ["filter", "add", "dev", dev, "parent", ROOT, "protocol", "all", "prio", "1", "bpf",
              "bytecode", drop_filter_bytecode(loss)],
    ]


# -- names, leftovers and the commands ------------------------------------------------


def namespace_name(pid: int, role: str) -> str:
    return f"{PREFIX}-{pid}-{role}"


def host_address(host: int) -> str:
    return str(SUBNET.network_address + host + 1)


def host_of_address(address: str) -> int | None:
    """The host whose link has ``address``, None if no host's."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip not in SUBNET or ip in (SUBNET.network_address, SUBNET.broadcast_address):
        return None
    return int(ip) - int(SUBNET.network_address) - 1


def stale_namespaces(names: Iterable[str], alive: Callable[[int], bool]) -> dict[int, list[str]]:
    """The testbed namespaces among ``names`` whose run's PID is not
    ``alive``, by PID. Other names, and a live run's, are never in it."""
    out: dict[int, list[str]] = {}
    for name in names:
        m = _NAME.fullmatch(name)
        if m and not alive(int(m.group(1))):
            out.setdefault(int(m.group(1)), []).append(name)
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def run_command(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command; :class:`TestbedError` naming it and its
    error when it fails (``check``)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"{' '.join(cmd)}: no answer in {COMMAND_TIMEOUT_S} s") from None
    if check and done.returncode:
        raise TestbedError(f"{' '.join(cmd)}: {' '.join(done.stderr.split()) or f'exit {done.returncode}'}")
    return done


def list_namespaces() -> list[str]:
    out = run_command(["ip", "-j", "netns", "list"]).stdout.strip()
    return [entry["name"] for entry in json.loads(out)] if out else []


def namespace_pids(ns: str) -> list[int]:
    """The processes inside namespace ``ns`` (``ip netns pids``)."""
    done = run_command(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def remove_namespace(ns: str) -> None:
    """Kill the processes left in ``ns`` (ranks or flows of the run that made
    it), then delete it: its veths, their qdiscs and the bridge go with it."""
    for pid in namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run_command(["ip", "netns", "delete", ns], check=False)


def remove_stale(log: Callable[[str], None] = print) -> dict[int, list[str]]:
    """Remove the namespaces of dead runs (and the processes in them); say
    what was removed. Returns them by PID."""
    stale = stale_namespaces(list_namespaces(), pid_alive)
    for pid, names in sorted(stale.items()):
        log(f"removing leftovers of a dead link testbed (pid {pid}): {', '.join(sorted(names))}")
        for ns in names:
            remove_namespace(ns)
    return stale


# -- inside a namespace ----------------------------------------------------------------


def enter_namespace(ns: str) -> None:
    """Move the calling thread into network namespace ``ns``. Call it first in
    a fresh process, before any thread starts: threads started later inherit
    it (gloo's, the queue's), threads started earlier do not."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns = getattr(os, "setns", None)  # Python 3.12+
        if setns is not None:
            setns(fd, _CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def link_counters(dev: str = HOST_IF) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of ``dev`` in the caller's network namespace:
    ``/proc/self/net/dev``, which shows the namespace of the reading process
    (``/sys/class/net`` shows the namespace sysfs was mounted in, the root
    one here); both are the kernel's ``dev_get_stats``. Bytes are whole
    frames, headers included (the links build no GSO packets: one frame per
    TCP segment, :data:`FRAME_BYTES` at most)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == dev:
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    raise TestbedError(f"no interface {dev!r} in this network namespace (pid {os.getpid()})")


def host_map(hosts: int, ranks_per_host: int) -> tuple[int, ...]:
    """The host of every rank, in rank order: ranks ``h G .. h G + G - 1``
    on host ``h`` (hosts contiguous, as launchers number them)."""
    return tuple(r // ranks_per_host for r in range(hosts * ranks_per_host))


@dataclass(frozen=True)
class RankPlacement:
    """Puts rank ``r`` of a spawned group on host ``r // ranks_per_host``:
    its process enters that host's namespace and binds gloo to the host's
    link (``echo_vllm.spawn.run_processes(rank_setup=...)``)."""

    namespaces: tuple[str, ...]
    ranks_per_host: int

    def __call__(self, rank: int, world_size: int) -> None:
        enter_namespace(self.namespaces[host_map(len(self.namespaces), self.ranks_per_host)[rank]])
        os.environ["GLOO_SOCKET_IFNAME"] = HOST_IF


# -- the testbed ----------------------------------------------------------------------


_LIVE: list["Testbed"] = []
_PREVIOUS_HANDLERS: dict[int, object] = {}
#: Signals that end a run and must still tear its testbed down (SIGINT
#: raises KeyboardInterrupt by itself).
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def _on_signal(signum, frame) -> None:
    # unwind: every `with Testbed` and `finally` on the way closes what it holds
    raise SystemExit(128 + signum)


def _close_all() -> None:
    for bed in list(_LIVE):
        bed.close()


atexit.register(_close_all)


def _watch_signals() -> None:
    import threading

    if _PREVIOUS_HANDLERS or threading.current_thread() is not threading.main_thread():
        return
    for sig in _TERMINATING:
        _PREVIOUS_HANDLERS[sig] = signal.signal(sig, _on_signal)


def _unwatch_signals() -> None:
    if _LIVE:
        return
    for sig, previous in _PREVIOUS_HANDLERS.items():
        signal.signal(sig, previous)
    _PREVIOUS_HANDLERS.clear()


@dataclass
class Testbed:
    """``hosts`` namespaces joined by shaped links through a switch namespace.

    Use it as a context manager (``with Testbed(2, LinkShape(...)) as bed``):
    entering builds everything (removing a dead run's leftovers first), leaving
    removes everything, however the block ends. ``bed.placement(G)`` puts G
    ranks on each host (``run_processes(rank_setup=...)``)."""

    hosts: int
    shape: LinkShape
    log: Callable[[str], None] = print
    run_id: int = field(default_factory=os.getpid)
    """The PID in every name: the process that removes it (and whose death
    marks it a leftover)."""
    made: list[str] = field(default_factory=list, init=False)
    """Namespaces made so far, removed by :meth:`close`."""

    def __post_init__(self) -> None:
        if not isinstance(self.hosts, int) or isinstance(self.hosts, bool) or not 2 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts={self.hosts!r}: an integer from 2 to {MAX_HOSTS}")

    @property
    def switch(self) -> str:
        return namespace_name(self.run_id, "sw")

    def host(self, i: int) -> str:
        return namespace_name(self.run_id, f"h{i}")

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(self.host(i) for i in range(self.hosts))

    def placement(self, ranks_per_host: int) -> RankPlacement:
        return RankPlacement(self.namespaces, ranks_per_host)

    def __enter__(self) -> "Testbed":
        check_requirements()
        _LIVE.append(self)
        _watch_signals()
        try:
            remove_stale(self.log)
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, ns: str) -> None:
        run_command(["ip", "netns", "add", ns])
        self.made.append(ns)
        for key, value in NAMESPACE_SYSCTLS.items():  # the namespace's own copies: the root's stay as they are
            run_command(["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > /proc/sys/{key}"],
                        check=not key.startswith("net/ipv6"))
        run_command(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        sw = self.switch
        self._add_namespace(sw)
        run_command(["ip", "-n", sw, "link", "add", "name", BRIDGE, "type", "bridge"])
        run_command(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        for i in range(self.hosts):
            ns, port = self.host(i), f"port{i}"
            self._add_namespace(ns)
            # both ends are made inside their namespaces: nothing ever appears in the root one
            run_command(["ip", "link", "add", "name", HOST_IF, "netns", ns, "type", "veth",
                         "peer", "name", port, "netns", sw])
            for where, dev in ((ns, HOST_IF), (sw, port)):  # one frame per segment (FRAME_BYTES)
                run_command(["ip", "-n", where, "link", "set", "dev", dev, "gso_max_size", str(FRAME_BYTES - 14),
                             "gso_max_segs", "1"])
            run_command(["ip", "-n", ns, "addr", "add", f"{host_address(i)}/{SUBNET.prefixlen}", "dev", HOST_IF])
            run_command(["ip", "-n", sw, "link", "set", port, "master", BRIDGE])
            run_command(["ip", "-n", ns, "link", "set", HOST_IF, "up"])
            run_command(["ip", "-n", sw, "link", "set", port, "up"])
        self.set_shape(self.shape)

    def set_shape(self, shape: LinkShape) -> None:
        """Shape every link (replacing the shape it had)."""
        for i in range(self.hosts):
            for ns, dev in ((self.host(i), HOST_IF), (self.switch, f"port{i}")):
                run_command(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            for cmd in (shaping_commands(self.host(i), HOST_IF, shape, sending_side=True)
                        + shaping_commands(self.switch, f"port{i}", shape, sending_side=False)):
                try:
                    run_command(cmd)
                except TestbedError as e:
                    raise TestbedError(_shaping_hint(cmd, e)) from None
        self.shape = shape

    def cut(self, host: int) -> None:
        """Drop every packet on ``host``'s link, both ways (a cable pulled
        out, silently: TCP retransmits into the void)."""
        for ns, dev in ((self.host(host), HOST_IF), (self.switch, f"port{host}")):
            run_command(["tc", "-n", ns, "filter", "del", "dev", dev, "parent", ROOT], check=False)
            run_command(["tc", "-n", ns, "class", "del", "dev", dev, "classid", DROP_CLASS], check=False)
            for cmd in drop_commands(ns, dev, 1.0):
                run_command(cmd)

    def set_link_up(self, host: int, up: bool) -> None:
        """Set ``host``'s end of its link up or down (the carrier goes with it)."""
        run_command(["ip", "-n", self.host(host), "link", "set", HOST_IF, "up" if up else "down"])

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process inside ``host``'s namespace (its ranks);
        returns their PIDs."""
        pids = namespace_pids(self.host(host))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def counters(self, host: int) -> tuple[int, int]:
        """``(tx_bytes, rx_bytes)`` of ``host``'s link, from outside (``ip -s``)."""
        out = run_command(["ip", "-n", self.host(host), "-j", "-s", "link", "show", "dev", HOST_IF]).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def describe(self) -> str:
        return (f"{self.hosts} hosts (network namespaces {self.host(0)} .. {self.host(self.hosts - 1)}, "
                f"{SUBNET}), each linked to the switch {self.switch} by a veth pair; {self.shape.describe()}")

    def close(self) -> None:
        """Remove every namespace this testbed made (idempotent)."""
        while self.made:
            remove_namespace(self.made.pop())
        if self in _LIVE:
            _LIVE.remove(self)
        _unwatch_signals()


def _shaping_hint(cmd: list[str], err: TestbedError) -> str:
    """The error of a failed shaping command, saying what the kernel lacks
    when it lacks a qdisc or the classifier."""
    text = str(err)
    missing = {"netem": "--delay needs the netem qdisc (CONFIG_NET_SCH_NETEM): use --delay 0",
               "bpf": "--loss needs the cls_bpf classifier (CONFIG_NET_CLS_BPF): use --loss 0",
               "htb": "shaping needs the htb qdisc (CONFIG_NET_SCH_HTB)",
               "bfifo": "shaping needs the fifo qdiscs (CONFIG_NET_SCH_FIFO)",
               "pfifo": "--loss needs the fifo qdiscs (CONFIG_NET_SCH_FIFO): use --loss 0"}
    if "kind is unknown" in text or "Unknown filter" in text:
        for name, why in missing.items():
            if name in cmd:
                return f"this kernel has no {name}: {why} ({text})"
    return text


__all__ = [
    "BENCHMARK_RANGE", "HOST_IF", "LinkShape", "PREFIX", "RankPlacement", "SUBNET", "Testbed", "TestbedError",
    "TestbedUnavailable", "check_requirements", "drop_filter_bytecode", "enter_namespace", "format_rate",
    "host_address", "host_map", "host_of_address", "link_counters", "namespace_name", "remove_stale", "requirements_refusal",
    "shaping_commands", "stale_namespaces",
]
