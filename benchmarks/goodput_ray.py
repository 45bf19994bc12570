"""The goodput benchmark's sparktrain sides on Ray: the same in-place loops, ``backend="ray"``.

The cluster is Ray Train's side's (:mod:`goodput_raytrain`): four worker nodes of one CPU on
this machine (``ray.cluster_utils``), here with a head of no CPU, so that each worker node runs
one rank. A loss removes a worker node (its raylet and the rank's process killed; a notice is a
kill here as on Ray Train's side, since which rank a Ray node runs is Ray's choice); the node
comes back as a new node of the same resources, and the run grows back onto it in place. Ray
starts and stops nodes from the main thread only, so ``launch`` runs in a thread of its own.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from goodput_plan import Fault
from goodput_raytrain import RayNodes, play


def run(  # noqa: PLR0917 - one side's run
    work: Path, nodes: int, function: Any, fargs: tuple[Any, ...], faults: list[Fault],
    limit: float,
) -> dict[str, Any]:  # fmt: skip
    """Play ``faults`` against ``launch(function, fargs, backend="ray", in_place=True)`` on a
    Ray cluster of ``nodes`` worker nodes; what ``goodput.child`` writes for a side."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray.cluster_utils import Cluster

    import sparktrain

    here = str(Path(__file__).resolve().parent)  # the ranks import goodput_train
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p
    )
    head = {"num_cpus": 0, "include_dashboard": False}  # the ranks go to the worker nodes
    cluster = Cluster(initialize_head=True, head_node_args=head)
    struck: list[dict[str, Any]] = []
    outcome: dict[str, Any] = {}
    try:
        workers = RayNodes(cluster, nodes)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        done = threading.Event()

        def train() -> None:
            try:
                outcome["result"] = sparktrain.launch(
                    function, fargs, num_processes=nodes, backend="ray",
                    min_processes=1, grow_back=True, in_place=True,
                    max_rescales=100_000, progress=False, log_ranks=[], timeout=limit,
                )  # fmt: skip
            except BaseException as exc:  # said by the caller
                outcome["error"] = exc
            finally:
                done.set()

        began, since = time.monotonic(), time.time()
        threading.Thread(target=train, daemon=True).start()
        play(workers, faults, done, began + limit, struck)  # Ray's nodes: the main thread
        if not done.wait(60):
            raise RuntimeError(f"sparktrain on Ray did not finish within {limit:.0f} s; see {work}")
        wall = time.monotonic() - began
        if "error" in outcome:
            raise RuntimeError(f"sparktrain on Ray failed: {outcome['error']!r}")
    finally:
        ray.shutdown()
        cluster.shutdown()
    result = outcome["result"]
    rescales = [(r.cause, r.old_world_size, r.new_world_size, r.in_place, r.at)
                for r in result.rescales]  # fmt: skip
    return {"wall": wall, "struck": struck, "rescales": rescales, "attempts": result.attempts,
            "began": since}  # fmt: skip
