"""A node away from the caller (a Spark task, a Ray actor), connected to the driver.

:func:`run_connected` connects back to the driver over the attempt's authenticated channel
(:mod:`sparktrain.contract.channel`), runs the node (:class:`~sparktrain.node.runner.NodeRun`) with
its lines and reports sent to the driver instead of printed, tells the driver each rank's exit
as soon as it is seen (so that the driver can stop the other nodes at the first failure), stops
its ranks when the driver says so or the channel breaks, and returns the node's report.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Any

from sparktrain.contract.channel import ChannelClient
from sparktrain.contract.outcome import RankExit
from sparktrain.contract.paths import grow_path
from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import NodeSpec, Place
from sparktrain.node.logs import LogSink, Stream
from sparktrain.node.notice import Notice, on_sigterm
from sparktrain.node.runner import NodeRun

#: Seconds between the ``busy`` messages a node sends the driver (its ranks send one a second).
BUSY_EVERY = 1.0


class ChannelSink(LogSink):
    """Sends each rank's lines and reports to the driver instead of printing them."""

    def __init__(self, channel: ChannelClient, shown: frozenset[int] | None) -> None:
        """Forward the lines of ``shown`` ranks over ``channel``."""
        super().__init__(shown)
        self.channel = channel
        self._busy_sent = 0.0

    def busy(self, rank: int, reason: str) -> None:
        """Tell the driver (at most once a second), which tells every node to count it."""
        now = time.monotonic()
        if now - self._busy_sent >= BUSY_EVERY:
            self._busy_sent = now
            self.channel.send({"kind": "busy", "rank": rank, "reason": reason})

    def write(self, rank: int, stream: Stream, lines: list[str]) -> None:
        """Send the lines (prefixing happens on the driver)."""
        self.channel.send({"kind": "log", "rank": rank, "stream": stream, "lines": lines})

    def reports(self, rank: int, records: list[dict[str, Any]]) -> None:
        """Send the reports to the driver's monitor."""
        self.channel.send({"kind": "report", "rank": rank, "records": records})


def run_connected(
    spec: NodeSpec,
    place: Place,
    *,
    run_dir: str,
    listener: socket.socket | None,
    sigterm_is_notice: bool = False,
    executor: str | None = None,
) -> NodeReport:
    """Run one node's ranks to the end, connected to the driver; its report.

    Args:
        spec: The attempt, as every node sees it (with the driver's channel).
        place: Where this node is (index, host, rendezvous address, GPUs).
        run_dir: This node's run directory (the payload already written).
        listener: Node 0's bound rendezvous socket (``None`` on other nodes); closed here.
        sigterm_is_notice: In an in-place run, a SIGTERM to this process (the main thread's)
            is a preemption notice passed on to the ranks (:mod:`sparktrain.node.notice`).
        executor: The Spark executor this node runs in, for the driver to watch (in place).
    """
    if spec.channel is None or spec.secret is None:
        raise ValueError("a remote node needs the driver's channel address and secret")
    try:
        channel = ChannelClient(
            spec.channel, spec.secret, silence=spec.options.limits.heartbeat_timeout
        )
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    try:
        ranks = spec.ranks_of(place.node)
        channel.send(
            {
                "kind": "hello",
                "node": place.node,
                "host": place.host,
                "ranks": list(ranks),
                "executor": executor,
            }
        )
        channel.on_grow = lambda: grow_path(run_dir).touch()

        def on_exit(ended: RankExit) -> None:
            channel.send({"kind": "exit", "rank": ended.rank, "code": ended.exit_code})

        notice = None
        if sigterm_is_notice and spec.options.recovery.in_place:
            told = {"kind": "notice", "node": place.node, "host": place.host}
            notice = Notice(lambda: channel.send(told))
        try:
            with on_sigterm(notice):
                report = NodeRun(
                    spec, place, run_dir=run_dir, listener=listener,
                    sink=ChannelSink(channel, spec.options.output.log_ranks), control=channel,
                    on_exit=on_exit, notice=notice,
                ).run()  # fmt: skip
        finally:
            if notice is not None:
                notice.close()
        channel.send({"kind": "bye", "node": place.node})
        if channel.lost is not None and report.stopped:
            # It stopped its ranks because the channel broke, not because the driver said so:
            # the driver lost this node, and the run must not pass for one that ended well.
            why = f"node {place.node} on {place.host}: {channel.lost}; its ranks were stopped"
            report = dataclasses.replace(report, agent_error=why[:2000])
        return report
    finally:
        channel.close()
