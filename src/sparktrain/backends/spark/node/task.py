"""Inside one Spark barrier task: one node of a run.

The driver ships a :class:`~sparktrain.contract.spec.NodeSpec` in the task's closure. Task 0 binds
the rendezvous port on its host and every task learns it through
``BarrierTaskContext.allGather``, together with any setup error, so that all tasks agree to
start or not. Each task then runs the shared node code
(``remote.run_connected``): it forks its ranks from a fork server kept in the Python worker
(warm for the next job when Spark reuses the worker), streams their lines to the driver over the
authenticated channel, stops them when the driver says so, and returns a :class:`NodeReport` as
its one row. A rank failure never fails the task: the driver turns reports into one error.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import cloudpickle

from sparktrain.contract import env
from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import NodeSpec, Place
from sparktrain.launchplan.topology import spark_gpus
from sparktrain.node.remote import run_connected
from sparktrain.node.runner import bind_rendezvous, prepare_run_dir


def _gpus(ctx: Any, spec: NodeSpec, node: int) -> tuple[str, ...]:
    """The devices this task's ranks own.

    Its Spark GPUs, read through the executor's ``CUDA_VISIBLE_DEVICES``; with shares (one rank
    owning several GPUs), the first ones, as many as the node's share.
    """
    if not spec.use_gpu:
        return ()
    resources = ctx.resources()
    addresses = tuple(resources["gpu"].addresses) if "gpu" in resources else ()
    devices = spark_gpus(addresses, env.cuda_visible_devices())
    wanted = spec.gpu_shares[node] if spec.gpu_shares else spec.procs_per_node
    if len(devices) < wanted or (not spec.gpu_shares and len(devices) != wanted):
        raise ValueError(
            f"Spark gave this task {len(addresses)} GPU(s) {list(addresses)} but the run "
            f"expects {wanted} (spark.task.resource.gpu.amount)."
        )
    return devices[:wanted]


def run_node(spec: NodeSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """The barrier task's function (for ``mapInArrow``): run this node, yield its report."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:  # the task's one input row: read it all, or the task's end waits on it
        pass
    ctx = BarrierTaskContext.get()
    node = ctx.partitionId()
    hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
    run_dir = prepare_run_dir(spec, "task")
    try:
        report = _run(spec, ctx, node=node, hosts=hosts, run_dir=run_dir)
    except Exception as exc:  # never fail the barrier task: Spark would rerun the whole stage
        report = NodeReport.broken(node, hosts[node], f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    yield pa.RecordBatch.from_pydict({"node": [node], "report": [cloudpickle.dumps(report)]})


def _run(spec: NodeSpec, ctx: Any, *, node: int, hosts: list[str], run_dir: str) -> NodeReport:
    host = hosts[node]
    listener: socket.socket | None = None
    error = None
    try:
        gpus = _gpus(ctx, spec, node)
        if node == 0:
            listener = bind_rendezvous(host)
    except Exception as exc:
        gpus, error = (), f"{type(exc).__name__}: {exc}"
    port = listener.getsockname()[1] if listener is not None else None
    gathered = [json.loads(m) for m in ctx.allGather(json.dumps({"port": port, "error": error}))]
    errors = [f"task {i} on {hosts[i]}: {g['error']}" for i, g in enumerate(gathered) if g["error"]]
    if errors:
        if listener is not None:
            listener.close()
        return NodeReport.not_started(node, host, errors)
    master = (hosts[0], gathered[0]["port"])
    place = Place(node, host, master, gpus, address=host)
    return run_connected(spec, place, run_dir=run_dir, listener=listener, executor=_executor())


def _executor() -> str | None:
    """This task's executor id, where a standalone worker shows it, or ``None``.

    The worker starts an executor in ``<workDir>/<appId>/<executorId>``; the driver watches that
    executor for decommissioning (in place).
    """
    name = os.path.basename(os.getcwd())
    return name if name.isdigit() else None
