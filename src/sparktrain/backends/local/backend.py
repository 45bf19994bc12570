"""The local backend: one node, run in the caller's process, with every rank on this machine.

The node is the same :class:`~sparktrain.node.runner.NodeRun` that Spark tasks and Ray actors
run; here the driver's follow loop steps it (so Ctrl-C, the caller's ``on_report`` stop and
restarts behave as on a cluster), its lines go straight to the caller's output, and the caller's
monitor also wakes its agent at once when a stop is asked. Rank 0 hosts the rendezvous store on
a loopback socket bound to a free port before any rank starts, so concurrent runs never pick the
same port and no rank ever joins another run's store.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from typing import ClassVar

from sparktrain.backends.base import Attempt, Backend, Nodes, Polled, Wanted
from sparktrain.backends.local.topology import local_topology
from sparktrain.contract.spec import Place
from sparktrain.launchplan.layout import LaunchPlan, make_plan
from sparktrain.launchplan.topology import Topology
from sparktrain.node import memory as node_memory
from sparktrain.node.logs import LogSink
from sparktrain.node.runner import NodeRun, bind_rendezvous, prepare_run_dir

LOOPBACK = "127.0.0.1"


class LocalBackend(Backend):
    """Every rank on this machine, forked from the caller's warm fork server."""

    name: ClassVar[str] = "local"
    in_place: ClassVar[bool] = True
    on_this_machine: ClassVar[bool] = True
    multi_node: ClassVar[bool] = False

    def __init__(self, *, topology: Topology | None = None) -> None:
        """Use ``topology`` (tests pass their own), or detect this machine's when planning."""
        self.topology = topology
        self._memory = node_memory.Memories()  # the node's checkpoint memory, for each run

    @classmethod
    def open(cls, wanted: Wanted) -> Backend:
        """This machine, with ``wanted.topology`` (detected when ``None``)."""
        return cls(topology=wanted.topology)

    def tasks(self, plan: LaunchPlan) -> int:
        """Every rank is a process of its own here (pyspark's local mode counts them as tasks)."""
        return plan.world_size

    def layout(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """One node holding every rank: one GPU each, or a share of the CPUs each.

        With an active SparkSession whose driver has GPU resources, those are the GPUs
        (``use_gpu=True``, or ``None`` where CUDA sees GPUs), as in pyspark's local mode.
        """
        topology = self.topology or local_topology(use_gpu)
        return make_plan(num_processes, topology=topology, use_gpu=use_gpu, name=name)

    def start(self, attempt: Attempt) -> Nodes:
        """Prepare the node and ask for its ranks."""
        return LocalNodes(attempt, self._memory.of(attempt.run, 0))

    def end_run(self, run: str) -> None:
        """Remove the node's checkpoint memory of ``run``."""
        self._memory.end(run)


class LocalNodes(Nodes):
    """The one node of a local attempt."""

    def __init__(self, attempt: Attempt, memory: str = "") -> None:
        """Start the node's ranks; everything prepared so far is released if that fails.

        ``memory`` is the node's checkpoint memory folder (empty: none).
        """
        self._cleanup = contextlib.ExitStack()
        try:
            spec = attempt.spec()
            run_dir = prepare_run_dir(spec, "run")
            self._cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
            listener = bind_rendezvous(LOOPBACK)
            self._cleanup.callback(listener.close)
            plan = attempt.plan
            gpus = plan.gpus if plan.device == "cuda" else ()
            master = listener.getsockname()[:2]
            place = Place(0, socket.gethostname(), master, gpus, memory=memory)
            self.node = NodeRun(
                spec, place, run_dir=run_dir, listener=listener,
                sink=LogSink(spec.options.output.log_ranks, monitor=attempt.monitor),
                control=attempt.monitor,
            )  # fmt: skip
            self._cleanup.callback(self.node.close)
            self.node.start()
        except BaseException:
            self._cleanup.close()
            raise

    def poll(self, wait: float) -> Polled:
        """Run the node's agent for up to ``wait`` seconds; the report once it has ended.

        A failed rank is not flagged: the agent has already stopped the node's other ranks.
        """
        if self.node.step(wait):
            return Polled(reports=[self.node.report()])
        return Polled()

    def cancel(self, *, force: bool) -> None:
        """Stop the ranks (SIGTERM, then SIGKILL after the grace period), or SIGKILL them now."""
        if force:
            self.node.kill()
        else:
            self.node.stop()

    def close(self) -> None:
        """Release the agent, the fork server, the socket, and the run directory."""
        self._cleanup.close()
