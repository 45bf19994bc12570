"""The driver's side of a remote run, whatever the cluster: the node spec and the nodes' messages.

A remote backend (``spark.py``, ``ray.py``) opens a :class:`ChannelServer`, sends every node the
:class:`TaskSpec` that :func:`task_spec` builds, and, while its nodes run, hands every message
they send to a :class:`Printer`: rank-tagged lines are printed (``[rank 1 host] ...``), reports
go to the launch's monitor, and a rank's non-zero exit is flagged so that the backend stops every
node. How nodes are started, cancelled and collected is the backend's business.
"""

from __future__ import annotations

import queue
import time
import uuid
from typing import Any

from sparktrain.driver.monitor import Monitor
from sparktrain.node.channel import ChannelServer
from sparktrain.node.logs import LogSink
from sparktrain.node.runner import TaskSpec
from sparktrain.plan.entrypoint import Entrypoint, FunctionEntry, ScriptEntry
from sparktrain.plan.layout import LaunchPlan

#: After every node returned, how long to wait for log lines still in flight.
DRAIN_SECONDS = 5.0


def task_spec(
    plan: LaunchPlan,
    entry: Entrypoint,
    channel: ChannelServer,
    *,
    attempt: int,
    extra_env: dict[str, str] | None,
    with_data: bool = False,
) -> TaskSpec:
    """What every node of this attempt needs."""
    keep = frozenset(range(plan.world_size)) if plan.return_all else frozenset({0})
    return TaskSpec(
        channel=channel.address,
        secret=channel.secret,
        run_id=uuid.uuid4().hex[:12],
        world_size=plan.world_size,
        procs_per_node=plan.procs_per_node,
        use_gpu=plan.device == "cuda",
        payload=entry.payload if isinstance(entry, FunctionEntry) else None,
        script=entry if isinstance(entry, ScriptEntry) else None,
        threads=plan.threads_per_rank,
        timeout=plan.timeout,
        grace=plan.stop_grace,
        log_ranks=plan.log_ranks,
        keep=keep if isinstance(entry, FunctionEntry) else frozenset(),
        with_data=with_data,
        hang_timeout=plan.hang_timeout,
        restart=attempt,
        max_restarts=plan.max_restarts,
        extra_env=extra_env,
        exit_grace=plan.exit_grace,
    )


class Printer:
    """Handles the nodes' messages on the driver: prints lines, notes hosts, failures, byes."""

    def __init__(self, log_ranks: frozenset[int] | None, monitor: Monitor) -> None:
        """Print the lines of ``log_ranks`` (``None``: all); give reports to ``monitor``."""
        self.sink = LogSink(log_ranks, prefix="[rank {rank} {host}] ", monitor=monitor)
        self.hosts: dict[int, str] = {}
        self.byes = 0

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
        return bool(kind == "exit" and message["code"] != 0)

    def drain(self, channel: ChannelServer, nodes: int) -> None:
        """Handle messages still in flight until ``nodes`` nodes said bye (or a short while)."""
        deadline = time.monotonic() + DRAIN_SECONDS
        while self.byes < nodes and time.monotonic() < deadline:
            message = next_message(channel, 0.05)
            if message is not None:
                self.handle(message)


def next_message(channel: ChannelServer, wait: float) -> dict[str, Any] | None:
    """The next message from any node, or ``None`` after ``wait`` seconds."""
    try:
        return channel.messages.get(timeout=wait)
    except queue.Empty:
        return None
