"""One node of a run on a cluster, whatever the cluster: the part every remote backend shares.

A remote backend (Spark's barrier tasks, Ray's actors) gets a :class:`TaskSpec` to each node,
lets node 0 bind the rendezvous port on its host, and calls :func:`supervise` on every node with
that address. :func:`supervise` connects back to the driver over the authenticated channel
(``channel.py``), forks the node's ranks from a fork server kept warm in the calling process,
streams their lines and reports to the driver, stops them when the driver says so, and returns
the node's :class:`NodeReport`. How the nodes are started and how they learn the rendezvous
address is the backend's business (``spark_task.py``, ``ray_actor.py``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from sparktrain.node.agent import RankExit
from sparktrain.node.channel import ChannelClient
from sparktrain.node.logs import LogSink, Stream
from sparktrain.node.ranks import NodeLayout, rank_requests, run_node_agent
from sparktrain.node.report import NodeReport
from sparktrain.plan.entrypoint import ScriptEntry
from sparktrain.rank.paths import share_path


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """What every node of a run needs; travels to each (a Spark task's closure, a Ray actor call).

    Attributes:
        channel: The driver's channel address.
        secret: The job's secret for the channel.
        run_id: Identifier of the run.
        world_size: Number of ranks.
        procs_per_node: Ranks per node.
        use_gpu: Whether ranks own GPUs (those the cluster gave the node).
        payload: The pickled function and arguments, or ``None`` for a script.
        script: The script, or ``None`` for a function.
        threads: Intra-op threads per rank.
        timeout: Seconds before the ranks are stopped.
        grace: Seconds between SIGTERM and SIGKILL.
        log_ranks: Ranks whose lines are sent to the driver (``None``: all).
        keep: Ranks whose return values come back.
        with_data: Whether the node's ranks read DataFrame shares from its run directory.
        hang_timeout: Seconds without progress before the node's ranks are declared hung.
        restart: The attempt number (0 at first).
        max_restarts: Restarts the run allows.
        extra_env: Variables of other contracts for every rank (MLflow's run).
        exit_grace: Seconds a rank that has returned gets to exit before it is killed.
    """

    channel: tuple[str, int]
    secret: bytes
    run_id: str
    world_size: int
    procs_per_node: int
    use_gpu: bool
    payload: bytes | None
    script: ScriptEntry | None
    threads: int
    timeout: float | None
    grace: float
    log_ranks: frozenset[int] | None
    keep: frozenset[int]
    with_data: bool
    hang_timeout: float | None = None
    restart: int = 0
    max_restarts: int = 0
    extra_env: dict[str, str] | None = None
    exit_grace: float = 10.0


class ChannelSink(LogSink):
    """Sends each rank's lines to the driver instead of printing them."""

    def __init__(self, channel: ChannelClient, shown: frozenset[int] | None) -> None:
        """Forward the lines of ``shown`` ranks over ``channel``."""
        super().__init__(shown)
        self.channel = channel

    def write(self, rank: int, stream: Stream, lines: list[str]) -> None:
        """Send the lines (prefixing happens on the driver)."""
        self.channel.send({"kind": "log", "rank": rank, "stream": stream, "lines": lines})

    def reports(self, rank: int, records: list[dict[str, Any]]) -> None:
        """Send the reports to the driver's monitor."""
        self.channel.send({"kind": "report", "rank": rank, "records": records})


def supervise(
    spec: TaskSpec,
    *,
    node: int,
    host: str,
    master: tuple[str, int],
    gpus: tuple[str, ...],
    run_dir: str,
    listener: socket.socket | None,
) -> NodeReport:
    """Run one node's ranks to the end, connected to the driver; its report.

    Args:
        spec: The run, as every node sees it.
        node: This node's rank.
        host: This node's address (for the driver's log prefixes and the report).
        master: Host and port of the rendezvous store.
        gpus: GPU addresses this node's ranks own (one each), empty on CPU.
        run_dir: This node's private directory (payload and data shares already written).
        listener: Node 0's bound rendezvous socket (``None`` on other nodes); closed here.
    """
    layout = NodeLayout(
        world_size=spec.world_size,
        nodes=spec.world_size // spec.procs_per_node,
        node_rank=node,
        procs_per_node=spec.procs_per_node,
        master=master,
        run_id=spec.run_id,
        restart=spec.restart,
        max_restarts=spec.max_restarts,
    )
    first = node * spec.procs_per_node
    shares = range(first, first + spec.procs_per_node) if spec.with_data else ()
    requests = rank_requests(
        layout,
        run_dir=run_dir,
        script=spec.script,
        gpus=gpus if spec.use_gpu else None,
        threads=spec.threads,
        keep=spec.keep,
        hang_timeout=spec.hang_timeout,
        data_paths={r: str(share_path(run_dir, r)) for r in shares},
        extra_env=spec.extra_env,
    )
    try:
        channel = ChannelClient(spec.channel, spec.secret)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    try:
        channel.send(
            {"kind": "hello", "node": node, "host": host, "ranks": [r.rank for r in requests]}
        )

        def on_exit(ended: RankExit) -> None:
            channel.send({"kind": "exit", "rank": ended.rank, "code": ended.exit_code})

        sink = ChannelSink(channel, spec.log_ranks)
        report = run_node_agent(
            requests,
            sink,
            run_dir=run_dir,
            node_rank=node,
            host=host,
            gpus=gpus,
            listen=listener,
            timeout=spec.timeout,
            grace=spec.grace,
            hang_timeout=spec.hang_timeout,
            control=channel,
            on_exit=on_exit,
            exit_grace=spec.exit_grace,
        )
        channel.send({"kind": "bye", "node": node})
        return report
    finally:
        channel.close()
