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
from typing import Any, ClassVar

from sparktrain.backends.base import Attempt, Nodes
from sparktrain.contract.channel import ChannelServer
from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import NodeSpec
from sparktrain.driver.inplace import Generations
from sparktrain.driver.monitor import Monitor
from sparktrain.driver.results import Rescale
from sparktrain.ground.errors import ConfigError
from sparktrain.node.logs import LogSink

#: After every node returned, how long to wait for log lines still in flight.
DRAIN_SECONDS = 5.0
#: In place: how long a node whose channel closed may take to be seen ended (seconds).
REAP_SECONDS = 1.0
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
        #: Nodes that passed a preemption notice on to their ranks (in place): index -> host.
        self.noticed: dict[int, str] = {}
        #: Each node's host, and its executor where the backend has one (Spark's), by index.
        self.node_hosts: dict[int, str] = {}
        self.executors: dict[int, str] = {}
        #: Nodes whose channel closed without a bye, and why.
        self.lost_nodes: dict[int, str] = {}
        #: Noticed nodes that said bye: their ranks left (in place), to be recorded.
        self.left: list[int] = []
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
            self.node_hosts[int(message["node"])] = str(message["host"])
            if message.get("executor"):
                self.executors[int(message["node"])] = str(message["executor"])
        elif kind == "bye":
            self.byes += 1
            if int(message["node"]) in self.noticed:
                self.left.append(int(message["node"]))
        elif kind == "notice":
            self.noticed[int(message["node"])] = str(message["host"])
        elif kind == "lost":
            why = message.get("why", "its process ended without a goodbye")
            self.lost.append(f"node {message['node']} on {message['host']} ({why})")
            self.lost_nodes[int(message["node"])] = (
                f"node {message['node']} on {message['host']}: {why}"
            )
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
            host, secrets.token_bytes(32), silence=attempt.options.limits.heartbeat_timeout
        )
        self.printer = Printer(attempt.options.output.log_ranks, attempt.monitor)
        self.spec: NodeSpec = attempt.spec(channel=self.channel.address, secret=self.channel.secret)
        self._busy_sent = 0.0
        self.generations = (
            None
            if attempt.store is None
            else Generations(attempt.store, attempt.plan.world_size, attempt.monitor)
        )
        self.reports: dict[int, NodeReport] = {}  # of the nodes that ended, by index
        self.left: set[int] = set()  # in place: nodes lost while the others went on

    def pump(self, wait: float) -> bool:
        """Handle the nodes' messages for up to ``wait`` seconds; whether a rank failed."""
        failed = False
        if self.generations is not None and self.generations.joining:
            self.generations.check_joined()
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
            while self.printer.left and self.generations is not None:
                node = self.printer.left.pop(0)
                where = f"node {node} on {self.printer.noticed[node]}"
                self.generations.left(tuple(self.spec.ranks_of(node)), f"{where} (left on notice)")
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

    def preempt(self, node: int | str) -> tuple[int, ...]:
        """Ask the ranks of ``node`` (its index, or a host only it runs on) to leave in place."""
        if isinstance(node, str):
            named = [n for n, host in self.printer.node_hosts.items() if host == node]
            if len(named) > 1:
                raise ConfigError(
                    f"preempt({node!r}): nodes {named} run on that host; pass a node index."
                )
            node = named[0] if named else -1
        if self.generations is None or node in self.printer.noticed:
            return ()
        if node not in self.printer.node_hosts or node in self.ended_nodes():
            return ()
        ranks = tuple(self.spec.ranks_of(node))
        self.printer.noticed[node] = self.printer.node_hosts[node]
        self.generations.leave(ranks)
        return ranks

    def in_place_world(self) -> int | None:
        """In place: the ranks in the group now, with those starting to join."""
        if self.generations is None:
            return None
        return self.generations.world + sum(len(r) for r in self.generations.joining)

    def ended_nodes(self) -> set[int]:
        """The nodes known to have ended (their reports in)."""
        return set(self.reports)

    def collect(self) -> None:
        """Put the reports of the nodes that ended into :attr:`reports` (without waiting)."""

    #: Whether the survivors of a node lost without notice may go on in place here.
    shrinks_in_place: ClassVar[bool] = True

    def lose_in_place(self) -> bool:
        """Name the surviving nodes' ranks as the next generation, when only nodes were lost.

        A rank's own failure (a non-zero exit) is not a loss: ``False``, and the run stops as
        it always did. So is a loss with no survivor.
        """
        if not self.shrinks_in_place or self.generations is None:
            return False
        if self.printer.first_failure is not None:
            return False
        deadline = time.monotonic() + REAP_SECONDS  # the channel may tell before the node ends
        while True:
            self.collect()
            ended = {n: str(r.agent_error) for n, r in self.reports.items() if r.agent_error}
            why = {**self.printer.lost_nodes, **ended}  # the channel may tell before the node
            lost = set(why) - self.left
            if lost and (set(why) <= set(self.reports) or time.monotonic() > deadline):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not lost:
            return bool(self.left)  # a late message about a node already handled
        detail = "; ".join(why[n] for n in sorted(lost))
        ranks = {rank for node in lost for rank in self.spec.ranks_of(node)}
        if not self.generations.lose(ranks, detail):
            return False
        for node in lost:
            self.reports[node] = NodeReport.left(node, self.printer.node_hosts.get(node, "?"))
        self.left |= lost
        return True

    def in_place_rescales(self) -> tuple[Rescale, ...]:
        """The losses and notices the survivors went on from in place, in order."""
        return tuple(self.generations.rescales) if self.generations is not None else ()

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
