"""The skeleton's driver side: one rank per node, each node a process of this machine.

``layout`` says how the ranks are laid out; ``start`` starts an attempt's nodes. The channel to
the nodes, their lines, failures and stop requests come from :class:`RemoteNodes`; what is left
here is how a node is started, seen to end, and killed.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import ClassVar

import cloudpickle

from sparktrain.backends.base import Attempt, Backend, Nodes, Polled
from sparktrain.backends.remote import RemoteNodes
from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import Place
from sparktrain.launchplan.layout import LaunchPlan, check_count
from sparktrain.node.runner import bind_rendezvous

LOOPBACK = "127.0.0.1"


class SkeletonBackend(Backend):
    """One CPU rank per node; each node a process started here."""

    name: ClassVar[str] = "skeleton"
    on_this_machine: ClassVar[bool] = True

    def layout(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """``num_processes`` nodes of one gloo rank each."""
        world = check_count(name, num_processes)
        return LaunchPlan(
            world_size=world, nodes=world, procs_per_node=1, device="cpu",
            dist_backend="gloo", gpus=(), threads_per_rank=1,
        )  # fmt: skip

    def start(self, attempt: Attempt) -> Nodes:
        """Start the attempt's node processes."""
        return SkeletonNodes(attempt)


class SkeletonNodes(RemoteNodes):
    """The node processes of one attempt."""

    def __init__(self, attempt: Attempt) -> None:
        """Open the channel; start each node with its spec and place (node 0: the store socket)."""
        super().__init__(attempt, LOOPBACK)
        self.folder = Path(tempfile.mkdtemp(prefix="skeleton-"))
        listener = bind_rendezvous(LOOPBACK)
        master = listener.getsockname()[:2]
        self.procs = {}
        try:
            for node in range(attempt.plan.nodes):
                place = Place(node, f"skeleton{node}", master, ())
                (self.folder / f"{node}.job").write_bytes(cloudpickle.dumps((self.spec, place)))
                fds = (listener.fileno(),) if node == 0 else ()
                command = [sys.executable, "-m", "skeleton_backend.node.body", str(self.folder)]
                self.procs[node] = subprocess.Popen(
                    [*command, str(node), *map(str, fds)], pass_fds=fds, start_new_session=True,
                    env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
                )  # fmt: skip
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def poll(self, wait: float) -> Polled:
        """Pass the nodes' messages on; their reports once every node process has ended."""
        failed = self.pump(wait)
        if any(proc.poll() is None for proc in self.procs.values()):
            return Polled(failed=failed)
        reports = [self._report(node) for node in sorted(self.procs)]
        self.drain(sum(1 for report in reports if not report.agent_error))
        return Polled(failed=failed, reports=reports)

    def _report(self, node: int) -> NodeReport:
        path = self.folder / f"{node}.report"
        if not path.exists():  # killed before it could write one
            return NodeReport.broken(node, f"skeleton{node}", "its process ended without a report")
        report: NodeReport = pickle.loads(path.read_bytes())
        return report

    def cancel(self, *, force: bool) -> None:
        """Tell the nodes to stop their ranks; or kill the node processes."""
        if not force:
            self.stop_nodes()
            return
        for proc in self.procs.values():
            proc.kill()

    def close(self) -> None:
        """Kill what still runs, remove the folder, close the channel."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for path in self.folder.glob("*"):
            path.unlink()
        self.folder.rmdir()
        super().close()
