"""The goodput benchmark's Ray Train side: Ray Train v2's elastic worker group on a Ray cluster
of four nodes on this machine.

A head node (one CPU, for Ray Train's controller) and four worker nodes (``ray.cluster_utils``),
each with one CPU and one unit of a ``node`` resource that every training worker asks for, so
that each node runs one worker. ``TorchTrainer`` with ``ScalingConfig(num_workers=(1, 4))``
(elastic), ``FailureConfig(max_failures=-1)``, and a resize look every 2 s
(``elastic_resize_monitor_interval_s``: sparktrain looks at the capacity every 2 s too; Ray's
default is 60 s). The loop (:func:`goodput_train.train_raytrain`) is DDP with a checkpoint every
``--every`` steps reported to Ray Train, from which a new worker group resumes. A loss removes
a worker node (its raylet and worker killed: Ray has no notice here, a notice is a kill); the
node comes back as a new node of the same resources. The first worker node is never struck.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from goodput_plan import Fault, choose


class RayNodes:
    """The cluster's four worker nodes, by index (the head is apart)."""

    def __init__(self, cluster: Any, nodes: int) -> None:
        self.cluster, self.lock = cluster, threading.RLock()
        self.nodes: dict[int, Any] = {}
        for index in range(nodes):
            self.back(index)

    def back(self, index: int) -> None:
        """A worker node (again) at ``index``."""
        with self.lock:
            self.nodes[index] = self.cluster.add_node(num_cpus=1, resources={"node": 1})

    def up(self) -> list[int]:
        with self.lock:
            return list(self.nodes)

    def lose(self, index: int) -> None:
        """Kill the node's raylet and its workers."""
        with self.lock:
            node = self.nodes.pop(index, None)
            if node is not None:
                self.cluster.remove_node(node, allow_graceful=False)


def play(
    workers: RayNodes, faults: list[Fault], done: threading.Event, until: float, struck: list
) -> None:
    """Apply ``faults`` until ``done`` (or ``until``), in this thread: each a node removed, the
    node back after its fault's delay (Ray starts and stops nodes from the main thread only)."""
    start = time.monotonic()
    due: list[tuple[float, int]] = []  # (when, node): the returns
    pending = list(faults)
    while not done.wait(0.05) and time.monotonic() < until:
        now = time.monotonic() - start
        for when, node in [d for d in due if d[0] <= now]:
            due.remove((when, node))
            workers.back(node)
        while pending and pending[0].at <= now:
            fault = pending.pop(0)
            node = choose(fault.pick, workers.up())
            if node is None:
                struck.append({"at": fault.at, "kind": "none up"})
                continue
            workers.lose(node)
            due.append((now + fault.back_after, node))
            struck.append({"at": round(now, 2), "kind": "kill", "node": node})


def run(work: Path, nodes: int, worker_args: list[str], faults: list[Fault],
        limit: float) -> dict[str, Any]:  # fmt: skip
    """Play ``faults`` against a Ray Train run; what ``goodput.child`` writes for a side.

    ``worker_args``: the data folder, the log folder, the sleep a step, the batch size, the
    steps between checkpoints.
    """
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    import goodput_train
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    data, logs, seconds, batch, every = worker_args
    head = {"num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    struck: list[dict[str, Any]] = []
    (work / "ckpt").mkdir(exist_ok=True)
    try:
        workers = RayNodes(cluster, nodes)
        cluster.wait_for_nodes()
        here = str(Path(__file__).resolve().parent)  # the workers import goodput_train
        variables = {"OMP_NUM_THREADS": "1", "PYTHONPATH": here}
        ray.init(address=cluster.address, runtime_env={"env_vars": variables}, log_to_driver=False)
        trainer = TorchTrainer(
            goodput_train.train_raytrain,
            train_loop_config={
                "data": data,
                "logs": logs,
                "step_seconds": float(seconds),
                "batch": int(batch),
                "every": int(every),
                "saved": str(work / "ckpt"),
            },
            scaling_config=ScalingConfig(
                num_workers=(1, nodes),
                resources_per_worker={"CPU": 1, "node": 1},
                elastic_resize_monitor_interval_s=2.0,
            ),
            run_config=RunConfig(
                storage_path=str(work / "ray"),
                name="goodput",
                failure_config=FailureConfig(max_failures=-1),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
        )
        done = threading.Event()
        error: list[BaseException] = []

        def fit() -> None:
            try:
                trainer.fit()
            except BaseException as exc:  # said by the caller
                error.append(exc)
            finally:
                done.set()

        began, since = time.monotonic(), time.time()
        threading.Thread(target=fit, daemon=True).start()
        play(
            workers, faults, done, began + limit, struck
        )  # here: Ray starts nodes in the main thread
        if not done.is_set():
            raise RuntimeError(f"Ray Train did not finish within {limit:.0f} s; see {work}")
        wall = time.monotonic() - began
        if error:
            raise RuntimeError(f"Ray Train failed: {error[0]!r}")
    finally:
        ray.shutdown()
        cluster.shutdown()
    rounds = {p.name.split("-")[0] for p in Path(logs).glob("attempt*")}
    rescales = [("round", 0, 0, False)] * max(0, len(rounds) - 1)
    return {"wall": wall, "struck": struck, "rescales": rescales, "attempts": len(rounds),
            "began": since}  # fmt: skip
