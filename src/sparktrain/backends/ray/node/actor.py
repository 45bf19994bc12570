"""Inside one Ray actor: the node agent of one node of a run.

The actor is a plain class; the Ray backend makes it remote (``ray.remote(NodeActor)``) on the
driver, so this module imports nothing of Ray at import time. One actor runs per node, placed by
the run's placement group. The driver first asks every actor where it is (:meth:`where`); actor
0 also binds the rendezvous port there, on its node's address, and keeps the socket for rank 0.
Then :meth:`NodeActor.run` runs the node exactly as a Spark task does, with the same node code
(``remote.run_connected``: the fork server, the agent, the authenticated channel for logs,
reports and stop, a :class:`NodeReport`).
"""

from __future__ import annotations

import os
import shutil
import socket

from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import NodeSpec, Place
from sparktrain.node.remote import run_connected
from sparktrain.node.runner import bind_rendezvous, prepare_run_dir


class NodeActor:
    """One node of a run on Ray."""

    def __init__(self) -> None:
        self._listener: socket.socket | None = None

    def where(self, bind: bool) -> tuple[str, int | None, tuple[str, ...], int]:
        """This node's address, the bound rendezvous port (when ``bind``), GPUs and PID.

        Args:
            bind: Bind the rendezvous port here (node 0 only).

        Returns:
            ``(host, port, gpus, pid)``: the node's IP address as Ray knows it, the port or
            ``None``, the GPU ids Ray assigned to this actor, and this actor's process id.
        """
        import ray

        host = ray.util.get_node_ip_address()
        port = None
        if bind:
            self._listener = bind_rendezvous(host)
            port = self._listener.getsockname()[1]
        gpus = tuple(str(g) for g in ray.get_gpu_ids())
        return host, port, gpus, os.getpid()

    def run(self, spec: NodeSpec, place: Place, caller_threads: str | None) -> NodeReport:
        """Run this node's ranks to the end and report how they ended.

        Args:
            spec: The attempt, as every node sees it.
            place: Where this node is (index, host, rendezvous address, its GPUs).
            caller_threads: The caller's ``OMP_NUM_THREADS`` (Ray sets its own in workers).

        Returns:
            The node's report; an agent that fails is reported, never raised, so that the
            driver can tell it from a rank failure.
        """
        if caller_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = caller_threads
        listener, self._listener = self._listener, None
        run_dir = ""
        try:
            run_dir = prepare_run_dir(spec, "ray")
            return run_connected(spec, place, run_dir=run_dir, listener=listener)
        except Exception as exc:
            if listener is not None:
                listener.close()
            return NodeReport.broken(place.node, place.host, f"{type(exc).__name__}: {exc}")
        finally:
            if run_dir:
                shutil.rmtree(run_dir, ignore_errors=True)
