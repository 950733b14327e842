"""Background traffic on the link testbed: bulk TCP flows between the hosts.

The congested case of the seed paper (time to first token 1.44x, training
step 1.38x "with background traffic"): other jobs' flows share the links a
tensor-parallel group's all-reduces cross. Here host ``h`` opens ``F``
TCP connections to host ``h + 1 (mod H)`` and sends as fast as TCP lets it,
so every host's link carries ``F`` foreign flows out and ``F`` in, queued in
the same FIFO as the ranks' bytes; each flow takes its TCP share of the
rate.

The flows are bounded: they run while the :class:`BackgroundFlows`
context is open (the bench opens it around a measurement) and never longer
than ``max_s`` (a flow process whose bench was killed stops by itself; the
next testbed also kills whatever is left in a dead run's namespaces). Each
host's flows are one process inside its namespace: a listener that drains
what the previous host sends, and ``F`` sender threads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

from .netns import Testbed, enter_namespace, host_address

#: The flows' port, inside the testbed's private namespaces (no other
#: process can hold it there).
FLOW_PORT = 5201
#: Bytes per ``send``: big enough that Python's loop costs nothing next to the link.
CHUNK_BYTES = 1 << 20
#: Seconds a socket operation may block before the flow checks whether to stop.
POLL_S = 0.5
#: Seconds to wait for every flow to connect.
START_TIMEOUT_S = 30.0


@dataclass
class FlowReport:
    """What one host's flows moved while they ran."""

    host: int
    sent_bytes: int
    received_bytes: int
    seconds: float


def _drain(conn: socket.socket, stop: threading.Event, counter: list[int]) -> None:
    conn.settimeout(POLL_S)
    buf = bytearray(CHUNK_BYTES)
    with conn:
        while not stop.is_set():
            try:
                n = conn.recv_into(buf)
            except socket.timeout:
                continue
            except OSError:
                return
            if not n:
                return
            counter[0] += n


def _listen(server: socket.socket, stop: threading.Event, counter: list[int], threads: list[threading.Thread]) -> None:
    server.settimeout(POLL_S)
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except socket.timeout:
            continue
        except OSError:
            return
        t = threading.Thread(target=_drain, args=(conn, stop, counter), daemon=True)
        t.start()
        threads.append(t)


def _send(address: str, stop: threading.Event, counter: list[int], ready: threading.Barrier) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:  # the next host's listener may not be up yet
        try:
            sock = socket.create_connection((address, FLOW_PORT), timeout=POLL_S)
            break
        except OSError:
            if stop.is_set() or time.monotonic() > deadline:
                ready.abort()
                return
            time.sleep(0.05)
    try:
        ready.wait(START_TIMEOUT_S)
    except threading.BrokenBarrierError:
        sock.close()
        return
    payload = memoryview(bytes(CHUNK_BYTES))
    with sock:
        while not stop.is_set():
            try:
                counter[0] += sock.send(payload)
            except socket.timeout:
                continue
            except OSError:
                return


def host_flows(ns: str, host: int, hosts: int, flows: int, stop_event, ready_queue, report_queue,
               max_s: float) -> None:
    """One host's background traffic (a process's target): drain what host
    ``host - 1`` sends, send ``flows`` bulk flows to host ``host + 1``, until
    ``stop_event`` is set or ``max_s`` passed."""
    enter_namespace(ns)
    stop = threading.Event()
    sent, received = [0], [0]
    server = socket.create_server((host_address(host), FLOW_PORT), backlog=max(8, 2 * flows))
    threads: list[threading.Thread] = []
    listener = threading.Thread(target=_listen, args=(server, stop, received, threads), daemon=True)
    listener.start()
    ready = threading.Barrier(flows + 1)
    senders = [threading.Thread(target=_send, args=(host_address((host + 1) % hosts), stop, sent, ready), daemon=True)
               for _ in range(flows)]
    for t in senders:
        t.start()
    try:
        ready.wait(START_TIMEOUT_S)
        ready_queue.put((host, "ok"))
    except threading.BrokenBarrierError:
        ready_queue.put((host, f"host {host}: its {flows} flows could not connect to host {(host + 1) % hosts}"))
        stop.set()
    start = time.monotonic()
    parent = os.getppid()
    while not stop.is_set() and time.monotonic() - start < max_s and os.getppid() == parent:
        if stop_event.wait(POLL_S):
            break
    stop.set()
    server.close()
    for t in senders + threads + [listener]:
        t.join(2 * POLL_S)
    report_queue.put(FlowReport(host, sent[0], received[0], time.monotonic() - start))


class BackgroundFlows:
    """``flows`` bulk TCP flows out of every host of ``testbed`` (to the next
    host), running while the context is open. ``reports`` holds what each
    host's flows moved, after the context closed."""

    def __init__(self, testbed: Testbed, flows: int, max_s: float = 3600.0):
        self.testbed, self.flows, self.max_s = testbed, flows, max_s
        self.reports: list[FlowReport] = []
        self._procs: list = []

    def __enter__(self) -> "BackgroundFlows":
        if self.flows == 0:
            return self
        ctx = mp.get_context("spawn")
        self._stop, ready, self._reports = ctx.Event(), ctx.Queue(), ctx.Queue()
        hosts = self.testbed.hosts
        try:
            for h in range(hosts):
                p = ctx.Process(target=host_flows, args=(self.testbed.host(h), h, hosts, self.flows, self._stop,
                                                         ready, self._reports, self.max_s), daemon=True)
                p.start()
                self._procs.append(p)
            for _ in range(hosts):
                try:
                    host, status = ready.get(timeout=START_TIMEOUT_S + 30)
                except queue.Empty:
                    raise RuntimeError(f"background flows: not every host's flows started in {START_TIMEOUT_S:g} s")
                if status != "ok":
                    raise RuntimeError(f"background flows: {status}")
        except BaseException:
            self._end(collect=False)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._end(collect=exc[0] is None)

    def _end(self, collect: bool) -> None:
        """Stop the flows: gracefully, collecting their reports, after a
        measurement; at once (SIGKILL) when the bench is failing or interrupted."""
        if not self._procs:
            return
        self._stop.set()
        if collect:
            for _ in self._procs:
                try:
                    self.reports.append(self._reports.get(timeout=10 * POLL_S + 5))
                except queue.Empty:
                    break
        for p in self._procs:
            if collect:
                p.join(5)
            if p.is_alive():
                p.kill()
            p.join()
        self._procs = []

    def throughput_bps(self) -> float:
        """Mean bits per second each host's flows sent (0 before any report)."""
        if not self.reports:
            return 0.0
        return sum(8 * r.sent_bytes / max(r.seconds, 1e-9) for r in self.reports) / len(self.reports)


__all__ = ["BackgroundFlows", "FlowReport", "host_flows"]
