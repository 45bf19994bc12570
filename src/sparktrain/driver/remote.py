"""The driver's side of nodes away from the caller (Spark tasks, Ray actors): their messages.

Every remote attempt opens a :class:`~sparktrain.contract.channel.ChannelServer` with a fresh secret
and gives its address to the nodes in their :class:`~sparktrain.contract.spec.NodeSpec`. While the
nodes run, :class:`RemoteNodes` hands every message they send to a :class:`Printer`: rank-tagged
lines are printed (``[rank 1 host] ...``), reports go to the run's monitor, and a rank's non-zero
exit is flagged so that the follow loop stops every node. How nodes are started, killed and
collected is the backend's business (``spark.py``, ``ray.py``).
"""

from __future__ import annotations

import queue
import secrets
import time
from typing import Any

from sparktrain.contract.channel import ChannelServer
from sparktrain.contract.spec import NodeSpec
from sparktrain.driver.backend import Attempt, Nodes
from sparktrain.driver.monitor import Monitor
from sparktrain.node.logs import LogSink

#: After every node returned, how long to wait for log lines still in flight.
DRAIN_SECONDS = 5.0
#: Seconds between the ``busy`` messages passed on to every node.
BUSY_EVERY = 1.0


class Printer:
    """Handles the nodes' messages on the driver: prints lines, notes hosts, failures, byes.

    A node whose connection ended without a bye is noted in :attr:`lost`: its process, or its
    machine, went away (a killed executor, a node gone).
    """

    def __init__(self, log_ranks: frozenset[int] | None, monitor: Monitor) -> None:
        """Print the lines of ``log_ranks`` (``None``: all); give reports to ``monitor``."""
        self.sink = LogSink(log_ranks, prefix="[rank {rank} {host}] ", monitor=monitor)
        self.hosts: dict[int, str] = {}
        self.byes = 0
        self.first_failure: dict[str, Any] | None = None
        self.lost: list[str] = []
        #: Hosts of nodes lost by silence (cut off, frozen): their processes may still run.
        self.silent_hosts: dict[str, str] = {}

    def handle(self, message: dict[str, Any]) -> bool:
        """Act on one message; ``True`` when it reports a rank that failed."""
        kind = message["kind"]
        if kind == "log":
            rank = message["rank"]
            self.sink.set_host(rank, self.hosts.get(rank, "?"))
            self.sink.write(rank, message["stream"], message["lines"])
        elif kind == "report":
            self.sink.reports(message["rank"], message["records"])
        elif kind == "hello":
            self.hosts.update({rank: message["host"] for rank in message["ranks"]})
        elif kind == "bye":
            self.byes += 1
        elif kind == "lost":
            why = message.get("why", "its process ended without a goodbye")
            self.lost.append(f"node {message['node']} on {message['host']} ({why})")
            if message.get("silent"):
                self.silent_hosts[str(message["host"])] = why
            return True
        failed = bool(kind == "exit" and message["code"] != 0)
        if failed and self.first_failure is None:
            self.first_failure = message
        return failed


class RemoteNodes(Nodes):
    """Nodes that talk back over the attempt's authenticated channel."""

    def __init__(self, attempt: Attempt, host: str) -> None:
        """Open the channel on ``host`` (the address at which the nodes reach this process)."""
        self.channel = ChannelServer(
            host, secrets.token_bytes(32), silence=attempt.options.heartbeat_timeout
        )
        self.printer = Printer(attempt.options.log_ranks, attempt.monitor)
        self.spec: NodeSpec = attempt.spec(channel=self.channel.address, secret=self.channel.secret)
        self._busy_sent = 0.0

    def pump(self, wait: float) -> bool:
        """Handle the nodes' messages for up to ``wait`` seconds; whether a rank failed."""
        failed = False
        deadline = time.monotonic() + wait
        while True:
            try:
                message = self.channel.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return failed
            if message["kind"] == "busy":
                self._pass_busy()
                continue
            failed = self.printer.handle(message) or failed
            if failed:
                return True

    def _pass_busy(self) -> None:
        """A node's rank builds an op: every node's hang clock counts it (at most once a second).

        The others' ranks wait for it in the rendezvous, silent; their agents would otherwise
        take the wait for a hang.
        """
        now = time.monotonic()
        if now - self._busy_sent >= BUSY_EVERY:
            self._busy_sent = now
            self.channel.broadcast({"op": "busy"})

    def request_grow(self) -> None:
        """Tell every node that the run grows back at the ranks' next checkpoint."""
        self.channel.broadcast({"op": "grow"})

    def stop_nodes(self) -> None:
        """Tell every node (those still to connect too) to stop its ranks."""
        self.channel.broadcast({"op": "stop"})

    def drain(self, nodes: int) -> None:
        """Handle messages still in flight until ``nodes`` nodes said bye (or a short while)."""
        deadline = time.monotonic() + DRAIN_SECONDS
        while self.printer.byes < nodes and time.monotonic() < deadline:
            self.pump(0.05)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()
