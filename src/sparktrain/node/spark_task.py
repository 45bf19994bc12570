"""Inside one Spark barrier task: the node agent of one node of a run.

The driver ships a :class:`TaskSpec` in the task's closure. Task 0 binds the rendezvous port on
its host and every task learns it through ``BarrierTaskContext.allGather``, together with each
task's row count (DataFrame runs) and any setup error, so that all tasks agree to start or not.
Each task then runs the shared node code (``node.supervise``): it forks its ranks from a fork
server kept in the Python worker (warm for the next job when Spark reuses the worker), streams
their lines to the driver over the authenticated channel, stops them when the driver says so,
and returns a :class:`NodeReport` as its one row.
A rank failure never fails the task: the driver turns reports into one error.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import cloudpickle

from sparktrain.node.report import NodeReport
from sparktrain.node.runner import TaskSpec, supervise
from sparktrain.rank import rundirs
from sparktrain.rank.paths import payload_path, share_path

_GPU_ADDRESS = re.compile(r"^(0|[1-9][0-9]*)$")


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
    run_dir = rundirs.make("task")
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
        paths = [str(share_path(run_dir, first + i)) for i in range(len(shares))]
        arrow.write_shares(shares, target, paths, first)
    if spec.payload is not None:
        payload_path(run_dir).write_bytes(spec.payload)
    master = (hosts[0], gathered[0]["port"])
    return supervise(
        spec, node=node, host=host, master=master, gpus=gpus, run_dir=run_dir, listener=listener
    )
