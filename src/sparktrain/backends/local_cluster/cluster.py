"""A cluster of several nodes on this machine, each node its own process group: lose one at will.

``LocalCluster(nodes=2, procs_per_node=1)`` is a :class:`~sparktrain.backends.base.Backend`:
pass it as ``backend=`` to ``launch`` (or a front door). Each node of an attempt is a separate
``python -m sparktrain.backends.local_cluster.node.main`` process in a session of its own, running
the same node code as a Spark task or a Ray actor (a fork server, the agent, the authenticated
channel to this driver on loopback). :meth:`LocalCluster.kill_node` SIGKILLs a node's whole process
group, the way a preempted machine disappears, and marks it down, so that the capacity an elastic
run sees shrinks; :meth:`LocalCluster.freeze_node` stops all of a node's processes (SIGSTOP), the
way a machine that hangs or is cut off by the network goes silent: the driver finds it lost after
the run's ``heartbeat_timeout`` and marks it down. :meth:`LocalCluster.add_node` brings one back.
Tests and ``benchmarks/elastic.py`` use it to lose and regain a "node" without a cluster manager.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import ClassVar

import cloudpickle

from sparktrain.backends.base import Attempt, Backend, Nodes, Polled
from sparktrain.backends.remote import RemoteNodes
from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import Place
from sparktrain.ground import procfs
from sparktrain.ground.errors import ClusterConfigError, ConfigError
from sparktrain.launchplan.layout import LaunchPlan, check_count, check_use_gpu
from sparktrain.launchplan.topology import detect_local
from sparktrain.node import memory
from sparktrain.node.runner import bind_rendezvous

LOOPBACK = "127.0.0.1"
#: The module each node process runs (this wing's node side).
NODE_MODULE = "sparktrain.backends.local_cluster.node.main"


class LocalCluster(Backend):
    """``nodes`` nodes of ``procs_per_node`` CPU ranks each, every node a process of its own."""

    name: ClassVar[str] = "local-cluster"
    in_place: ClassVar[bool] = True
    on_this_machine: ClassVar[bool] = True

    def __init__(self, nodes: int = 2, procs_per_node: int = 1) -> None:
        """Make a cluster of ``nodes`` nodes (all up) of ``procs_per_node`` ranks each."""
        check_count("nodes", nodes)
        self.procs_per_node = check_count("procs_per_node", procs_per_node)
        self._up = [True] * nodes
        self._lock = threading.Lock()
        self._running: dict[int, subprocess.Popen[bytes]] = {}
        self._memory = memory.Memories()  # each node's checkpoint memory, for each run

    # -- the cluster ----------------------------------------------------------------------------
    @property
    def nodes_up(self) -> list[int]:
        """The indices of the nodes that are up."""
        with self._lock:
            return [slot for slot, up in enumerate(self._up) if up]

    def kill_node(self, node: int) -> int | None:
        """Lose node ``node``: SIGKILL its process group (agent, fork server, ranks), mark it down.

        Returns:
            The PID of the node process killed, or ``None`` when none ran there.
        """
        process = self._process(node, down=True)
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        self._memory.lose(node)  # a lost machine's memory is lost with it (once it is dead)
        return None if process is None else process.pid

    def freeze_node(self, node: int) -> int | None:
        """Make node ``node`` go silent: SIGSTOP its agent, fork server and ranks.

        Nothing of it dies or closes a connection, as when a machine hangs or the network cuts
        it off: the driver notices only by the missing heartbeats (``heartbeat_timeout``), then
        marks the node down and kills its processes.

        Returns:
            The PID of the node process frozen, or ``None`` when none ran there.
        """
        process = self._process(node, down=False)
        if process is None:
            return None
        for pid in [process.pid, *procfs.descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return process.pid

    def _process(self, node: int, *, down: bool) -> subprocess.Popen[bytes] | None:
        """Node ``node``'s running process (``None``: none), after marking it down if asked."""
        with self._lock:
            if not 0 <= node < len(self._up):
                raise ConfigError(
                    f"node={node} is not a node of this cluster (0..{len(self._up) - 1})."
                )
            self._up[node] = self._up[node] and not down
            process = self._running.get(node)
        return process if process is not None and process.poll() is None else None

    def mark_down(self, node: int) -> None:
        """Count node ``node`` as down (the driver lost it by silence): no new attempt uses it."""
        with self._lock:
            if 0 <= node < len(self._up):
                self._up[node] = False

    def memory_of(self, run: str, node: int) -> str:
        """Node ``node``'s checkpoint memory folder for the run ``run`` (made on first use)."""
        return self._memory.of(run, node)

    def end_run(self, run: str) -> None:
        """Remove every node's checkpoint memory of ``run``: it is over."""
        self._memory.end(run)

    def add_node(self) -> int:
        """Bring a node (back) up: the first one down, else a new one; its index."""
        with self._lock:
            for slot, up in enumerate(self._up):
                if not up:
                    self._up[slot] = True
                    return slot
            self._up.append(True)
            return len(self._up) - 1

    def node_pids(self) -> dict[int, int]:
        """The PID of each node process running now, by node index."""
        with self._lock:
            return {n: p.pid for n, p in self._running.items() if p.poll() is None}

    def _claim(self, count: int) -> list[int]:
        up = self.nodes_up
        if len(up) < count:
            raise ClusterConfigError(
                f"the local cluster has {len(up)} node(s) up, fewer than the {count} the run "
                "needs; add_node() brings one back."
            )
        return up[:count]

    # -- the backend ----------------------------------------------------------------------------
    def layout(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """``num_processes / procs_per_node`` nodes of the ones up; CPU ranks (gloo)."""
        world = check_count(name, num_processes)
        check_use_gpu(use_gpu)
        if use_gpu:
            raise ClusterConfigError(
                "a LocalCluster runs CPU ranks only; pass use_gpu=False (or None)."
            )
        per = self.procs_per_node
        if world % per:
            raise ConfigError(
                f"{name}={world} is not a multiple of procs_per_node={per}: every node of a "
                f"LocalCluster runs {per} rank(s). Pass a multiple of {per}."
            )
        up = len(self.nodes_up)
        if world // per > up:
            raise ClusterConfigError(
                f"{name}={world} needs {world // per} node(s) of {per} rank(s), but the local "
                f"cluster has {up} node(s) up. Lower {name}, or add_node()."
            )
        return LaunchPlan(
            world_size=world,
            nodes=world // per,
            procs_per_node=per,
            device="cpu",
            dist_backend="gloo",
            gpus=(),
            threads_per_rank=max(1, detect_local(gpus=False).cpus // world),
        )

    def capacity(self, plan: LaunchPlan) -> int:
        """The ranks the nodes up can run."""
        return len(self.nodes_up) * self.procs_per_node

    def start(self, attempt: Attempt) -> Nodes:
        """Start one node process per node of the attempt, on the first nodes up."""
        return LocalClusterNodes(self, attempt)


class LocalClusterNodes(RemoteNodes):
    """The node processes of one attempt on a :class:`LocalCluster`."""

    def __init__(self, cluster: LocalCluster, attempt: Attempt) -> None:
        """Open the channel, then start every node's process (node 0 gets the store's socket)."""
        super().__init__(attempt, LOOPBACK)
        self.cluster = cluster
        self.plan = attempt.plan
        self.run = attempt.run
        self.folder = tempfile.mkdtemp(prefix="sparktrain-cluster-")
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.slots: list[int] = []
        self.killed: set[int] = set()
        self.silent: dict[int, str] = {}  # lost by silence (why), then killed here
        self.master: tuple[str, int] = ("", 0)
        try:
            self.slots = cluster._claim(self.plan.nodes)
            listener = bind_rendezvous(LOOPBACK)
            try:
                master = listener.getsockname()[:2]
                self.master = master
                for node, slot in enumerate(self.slots):
                    self._spawn(node, slot, master, listener if node == 0 else None)
            finally:
                listener.close()  # node 0 holds its own copy
        except BaseException:
            self.close()
            raise

    def _spawn(
        self,
        node: int,
        slot: int,
        master: tuple[str, int],
        listener: socket.socket | None,
        *,
        joining: bool = False,
    ) -> None:
        place = Place(
            node, f"node{slot}", master, (), joining=joining,
            memory=self.cluster.memory_of(self.run, slot),
        )  # fmt: skip
        job = os.path.join(self.folder, f"node-{node}.job")
        with open(job, "wb") as handle:
            cloudpickle.dump((self.spec, place), handle)
        command = [sys.executable, "-m", NODE_MODULE, job, self._report(node)]
        fds: tuple[int, ...] = ()
        if listener is not None:
            fd = listener.fileno()
            command.append(str(fd))
            fds = (fd,)
        environ = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        process = subprocess.Popen(command, pass_fds=fds, env=environ, start_new_session=True)
        self.procs[node] = process
        with self.cluster._lock:
            self.cluster._running[slot] = process

    def _report(self, node: int) -> str:
        return os.path.join(self.folder, f"node-{node}.report")

    def poll(self, wait: float) -> Polled:
        """Show what the nodes sent; collect the reports of the node processes that ended.

        A node lost by silence is marked down in the cluster (as Spark is told to drop a cut-off
        executor), and its processes, which may be frozen, are killed.
        """
        failed = self.pump(wait)
        for host, why in self.printer.silent_hosts.items():
            slot = int(host.removeprefix("node"))
            self.cluster.mark_down(slot)
            self.silent[self.slots.index(slot)] = why
            self._kill(self.procs[self.slots.index(slot)])
            self.cluster._memory.lose(slot)  # a machine cut off: its memory counts as lost
        self.printer.silent_hosts.clear()
        failed = self._reap() or failed
        if len(self.reports) < len(self.procs):
            return Polled(failed=failed)
        self.drain(
            sum(
                1
                for n, r in self.reports.items()
                if not r.agent_error and n not in self.killed and n not in self.left
            )
        )
        return Polled(failed=failed, reports=[self.reports[n] for n in sorted(self.reports)])

    def _reap(self) -> bool:
        """Collect the reports of the node processes that ended; whether one was lost."""
        lost = False
        for node, process in self.procs.items():
            if node in self.reports or process.poll() is None:
                continue
            self.reports[node] = self._ended(node, process.returncode)
            lost = lost or self.reports[node].agent_error is not None
        return lost

    def _ended(self, node: int, code: int) -> NodeReport:
        host = f"node{self.slots[node]}"
        if node in self.silent:
            return NodeReport.broken(node, host, self.silent[node])
        if node in self.killed:
            return NodeReport.killed(node, host, self.spec.ranks_of(node))
        try:
            with open(self._report(node), "rb") as handle:
                report: NodeReport = cloudpickle.load(handle)
            return report
        except OSError:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return NodeReport.broken(
                node, host, f"its process ended ({how}) without a report: the node was lost"
            )

    def collect(self) -> None:
        """Collect the reports of the node processes that ended."""
        self._reap()

    def grow_in_place(self, ranks: int) -> int:
        """Start a joining node on each free node up, for up to ``ranks`` more ranks."""
        if self.generations is None:
            return 0
        busy = {self.slots[n] for n in self.procs if n not in self.reports}
        started = 0
        for slot in self.cluster.nodes_up:
            if slot in busy or started + self.plan.procs_per_node > ranks:
                continue
            node = len(self.procs)  # a new node index: its ranks are new ranks too
            self.slots.append(slot)
            self._spawn(node, slot, self.master, None, joining=True)
            joining = tuple(self.spec.ranks_of(node))
            self.generations.join(joining, f"node {node} on node{slot}, rank(s) {list(joining)}")
            started += len(joining)
        return started

    def cancel(self, *, force: bool) -> None:
        """Tell every node to stop its ranks; or kill the node processes still running."""
        if not force:
            self.stop_nodes()
            return
        for node, process in self.procs.items():
            if process.poll() is None:
                self.killed.add(node)
                self._kill(process)

    @staticmethod
    def _kill(process: subprocess.Popen[bytes]) -> None:
        """SIGKILL a node process's group and every process under it.

        Ranks run in groups of their own, and a frozen fork server could not pass its death on.
        """
        below = procfs.descendants(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Kill what still runs, reap every node process, forget them, close the channel."""
        for process in self.procs.values():
            if process.poll() is None:
                self._kill(process)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        with self.cluster._lock:
            for slot in self.slots:
                running = self.cluster._running.get(slot)
                if running is not None and running in self.procs.values():
                    del self.cluster._running[slot]
        shutil.rmtree(self.folder, ignore_errors=True)
        super().close()
