"""Inside one Spark barrier task: the node agent of one node of a run.

The driver ships a :class:`TaskSpec` in the task's closure. Task 0 binds the rendezvous port on
its host and every task learns it through ``BarrierTaskContext.allGather``, together with each
task's row count (DataFrame runs) and any setup error, so that all tasks agree to start or not.
Each task then forks its ranks from a fork server kept in the Python worker (warm for the next
job when Spark reuses the worker), streams their lines to the driver over the authenticated
channel, stops them when the driver says so, and returns a :class:`NodeReport` as its one row.
A rank failure never fails the task: the driver turns reports into one error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle

from sparktrain import env, warm
from sparktrain.agent import NodeAgent, RankExit
from sparktrain.backends.ranks import NodeLayout, rank_requests
from sparktrain.channel import ChannelClient
from sparktrain.entrypoint import ScriptEntry
from sparktrain.logs import LogSink, Stream
from sparktrain.results import NodeReport, node_report
from sparktrain.worker import payload_path

_GPU_ADDRESS = re.compile(r"^(0|[1-9][0-9]*)$")


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """What every task of a run needs; travels in the task's closure.

    Attributes:
        channel: The driver's channel address.
        secret: The job's secret for the channel.
        run_id: Identifier of the run.
        world_size: Number of ranks.
        procs_per_node: Ranks per task.
        use_gpu: Whether ranks own GPUs (from the task's Spark resources).
        payload: The pickled function and arguments, or ``None`` for a script.
        script: The script, or ``None`` for a function.
        threads: Intra-op threads per rank.
        timeout: Seconds before the ranks are stopped.
        grace: Seconds between SIGTERM and SIGKILL.
        log_ranks: Ranks whose lines are sent to the driver (``None``: all).
        keep: Ranks whose return values come back.
        with_data: Whether the task's input rows are the ranks' DataFrame shares.
        hang_timeout: Seconds without progress before the node's ranks are declared hung.
        restart: The attempt number (0 at first).
        max_restarts: Restarts the run allows.
        extra_env: Variables of other contracts for every rank (MLflow's run).
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


def _gpus(ctx: Any, spec: TaskSpec) -> tuple[str, ...]:
    if not spec.use_gpu:
        return ()
    resources = ctx.resources()
    addresses = tuple(resources["gpu"].addresses) if "gpu" in resources else ()
    bad = [a for a in addresses if not _GPU_ADDRESS.match(a)]
    if bad:
        raise ValueError(
            f"Spark gave this task GPU addresses {list(addresses)}; {bad} are not plain "
            "integers, which CUDA_VISIBLE_DEVICES needs. Fix the GPU discovery script."
        )
    if len(addresses) != spec.procs_per_node:
        raise ValueError(
            f"Spark gave this task {len(addresses)} GPU(s) {list(addresses)} but the run "
            f"expects {spec.procs_per_node} (spark.task.resource.gpu.amount)."
        )
    return addresses


def run_node(spec: TaskSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """The barrier task's function (for ``mapInArrow``): run this node, yield its report."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    node = ctx.partitionId()
    hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
    run_dir = tempfile.mkdtemp(prefix="sparktrain-task-")
    try:
        report = _run(spec, ctx, node=node, hosts=hosts, batches=batches, run_dir=run_dir)
    except Exception as exc:  # never fail the barrier task: Spark would rerun the whole stage
        report = NodeReport(
            node_rank=node, host=hosts[node], ranks=(), failures={}, stopped=(), values={},
            agent_error=f"node {node} on {hosts[node]}: {type(exc).__name__}: {exc}",
        )  # fmt: skip
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    yield pa.RecordBatch.from_pydict({"node": [node], "report": [cloudpickle.dumps(report)]})


def _run(
    spec: TaskSpec, ctx: Any, *, node: int, hosts: list[str], batches: Iterator[Any], run_dir: str
) -> NodeReport:
    from sparktrain.data import arrow

    host = hosts[node]
    listener: socket.socket | None = None
    error = None
    shares: list[Any] = []
    try:
        gpus = _gpus(ctx, spec)
        table = arrow.concat(batches)
        if spec.with_data:
            shares = arrow.split(table, spec.procs_per_node)
        if node == 0:
            listener = socket.create_server((host, 0))
            listener.set_inheritable(True)
    except Exception as exc:
        gpus, error = (), f"{type(exc).__name__}: {exc}"
    port = listener.getsockname()[1] if listener is not None else None
    mine = {"port": port, "rows": [s.num_rows for s in shares], "error": error}
    gathered = [json.loads(m) for m in ctx.allGather(json.dumps(mine))]
    errors = [f"task {i} on {hosts[i]}: {g['error']}" for i, g in enumerate(gathered) if g["error"]]
    if errors:
        if listener is not None:
            listener.close()
        return NodeReport(
            node_rank=node,
            host=host,
            ranks=(),
            failures={},
            stopped=(),
            values={},
            setup_errors=tuple(errors),
        )
    if spec.with_data:
        counts = [rows for g in gathered for rows in g["rows"]]
        if min(counts) == 0:  # decided from every node's counts, so all nodes agree
            if listener is not None:
                listener.close()
            return NodeReport(
                node_rank=node, host=host, ranks=(), failures={}, stopped=(), values={},
                setup_errors=(
                    f"the DataFrame gave {min(counts)} rows to a rank (rows per rank: {counts}); "
                    "it needs at least as many rows as there are ranks",
                ),
            )  # fmt: skip
        target = max(counts)
        first = node * spec.procs_per_node
        paths = [os.path.join(run_dir, f"share-{first + i}.arrow") for i in range(len(shares))]
        arrow.write_shares(shares, target, paths, first)
    if spec.payload is not None:
        payload_path(run_dir).write_bytes(spec.payload)
    master = (hosts[0], gathered[0]["port"])
    return _supervise(
        spec, node=node, host=host, master=master, gpus=gpus, run_dir=run_dir, listener=listener
    )


def _supervise(
    spec: TaskSpec,
    *,
    node: int,
    host: str,
    master: tuple[str, int],
    gpus: tuple[str, ...],
    run_dir: str,
    listener: socket.socket | None,
) -> NodeReport:
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
        data_paths={r: os.path.join(run_dir, f"share-{r}.arrow") for r in shares},
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
        server = warm.acquire(env.caller_environ())
        agent = NodeAgent(
            server,
            requests,
            sink,
            listen=listener,
            timeout=spec.timeout,
            grace=spec.grace,
            control=channel,
            on_exit=on_exit,
            hang_timeout=spec.hang_timeout,
        )
        try:
            outcome = agent.run()
        finally:
            warm.release(server)
        report = node_report(
            outcome,
            run_dir,
            node_rank=node,
            host=host,
            tails={r.rank: sink.tail(r.rank) for r in requests},
            keep=tuple(r.rank for r in requests if r.keep_value),
            gpus=gpus,
        )
        channel.send({"kind": "bye", "node": node})
        return report
    finally:
        channel.close()
