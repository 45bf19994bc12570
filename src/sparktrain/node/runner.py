"""One node of a run, wherever it runs: its run directory, its ranks, its agent, its report.

Every backend runs its nodes through :class:`NodeRun`: the local backend in the caller's process
(stepped by the driver's follow loop), a Spark barrier task and a Ray actor in theirs (run to the
end, connected to the driver by :mod:`sparktrain.node.remote`). So a rank sees the same
environment, and a node reports the same way, on every backend. What differs is only what the
node learns where it runs (its index, host, GPUs, the rendezvous address) and where its lines
go (the caller's terminal, or the driver's channel).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

from sparktrain.contract import env
from sparktrain.contract.outcome import Control, RankExit
from sparktrain.contract.paths import grow_path, payload_path
from sparktrain.contract.report import NodeReport, node_report
from sparktrain.contract.spec import NodeSpec, Place
from sparktrain.node import interfaces, warm
from sparktrain.node.agent import NodeAgent
from sparktrain.node.logs import LogSink
from sparktrain.node.notice import Notice
from sparktrain.rank import rundirs
from sparktrain.rank.worker import RankRequest


def prepare_run_dir(spec: NodeSpec, kind: str) -> str:
    """A private run directory for this node (swept if its owner dies), the payload in it."""
    run_dir = rundirs.make(kind)
    if spec.payload is not None:
        payload_path(run_dir).write_bytes(spec.payload)
    return run_dir


def bind_rendezvous(host: str) -> socket.socket:
    """Node 0's rendezvous socket on ``host`` at a free port, for rank 0 to host the store on.

    Bound before any rank starts and handed to rank 0, so that no other process can take the
    port in between and no rank ever joins another run's store.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen()
        listener.set_inheritable(True)
    except BaseException:
        listener.close()
        raise
    return listener


def rank_requests(
    spec: NodeSpec,
    place: Place,
    *,
    run_dir: str,
) -> list[RankRequest]:
    """One request per rank of the node at ``place``.

    Each rank's environment is this process's (the caller's or the task's), plus the run's
    ``env`` option, plus the variables of other contracts (``spec.extra_env``), plus the
    interface of the node's address for gloo and NCCL where none of these names one, plus the
    contract.
    """
    base = {
        **env.caller_environ(),
        **(spec.options.environment.env or {}),
        **(spec.extra_env or {}),
    }
    base.update(interfaces.ifname_environ(place.address or place.master[0], base))
    if place.joining:
        base[env.IN_PLACE_JOIN] = "1"
    requests = []
    for local, rank in enumerate(spec.ranks_of(place.node)):
        rank_env = env.RankEnv(
            rank=rank,
            local_rank=local,
            world_size=spec.world_size,
            local_world_size=spec.procs_per_node,
            node_rank=place.node,
            nodes=spec.nodes,
            master_addr=place.master[0],
            master_port=place.master[1],
            run_id=spec.run_id,
            visible_devices=place.gpus if spec.use_gpu else None,
            threads=spec.threads,
            restart=spec.attempt,
            max_restarts=spec.options.recovery.max_restarts,
            target_world_size=spec.target_world_size,
            grow_file=str(grow_path(run_dir)) if spec.target_world_size is not None else None,
            memory=place.memory or None,
        )
        requests.append(
            RankRequest(
                rank=rank,
                env=env.rank_environ(base, rank_env),
                cwd=os.getcwd(),
                sys_path=list(sys.path),
                run_dir=run_dir,
                script=spec.script,
                threads=None if env.user_set_threads(base) else spec.threads,
                keep_value=rank in spec.keep,
                data_path=spec.data_uri,
                hang_timeout=spec.options.limits.hang_timeout,
            )
        )
    return requests


class NodeRun:
    """The ranks of one node, from their fork server to the node's report."""

    def __init__(
        self,
        spec: NodeSpec,
        place: Place,
        *,
        run_dir: str,
        listener: socket.socket | None,
        sink: LogSink,
        control: Control | None = None,
        on_exit: Callable[[RankExit], None] | None = None,
        notice: Notice | None = None,
    ) -> None:
        """Prepare the node's ranks; nothing starts until :meth:`start` (or :meth:`run`).

        Args:
            spec: The attempt, as every node sees it.
            place: Where this node is (index, host, rendezvous address, GPUs).
            run_dir: This node's run directory (the payload already in it).
            listener: Node 0's bound rendezvous socket (``None`` elsewhere); closed by the
                agent once rank 0 holds it.
            sink: Where the ranks' lines and reports go.
            control: Tells the node to stop (the driver's channel, or the caller's monitor).
            on_exit: Called with each rank's exit as soon as it is seen.
            notice: A preemption notice to pass on to the ranks (in place), or ``None``.
        """
        self.spec, self.place, self.run_dir, self.sink = spec, place, run_dir, sink
        self.requests = rank_requests(spec, place, run_dir=run_dir)
        options = spec.options
        try:
            self.server = warm.acquire(env.caller_environ())
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        self.agent = NodeAgent(
            self.server,
            self.requests,
            sink,
            listen=listener,
            timeout=options.limits.timeout,
            grace=options.limits.stop_grace,
            control=control,
            on_exit=on_exit,
            hang_timeout=options.limits.hang_timeout,
            exit_grace=options.limits.exit_grace,
            notice=notice,
        )

    def start(self) -> None:
        """Ask for the node's ranks."""
        self.agent.start()

    def step(self, wait: float | None) -> bool:
        """Run the node for up to ``wait`` seconds; whether every rank has ended."""
        return self.agent.step(wait)

    def stop(self) -> None:
        """Stop every rank (SIGTERM, then SIGKILL after the stop grace period)."""
        self.agent.stop()

    def kill(self) -> None:
        """SIGKILL every rank still running, now."""
        self.agent.kill()

    def report(self) -> NodeReport:
        """How the node's ranks ended (call once :meth:`step` says they have)."""
        return node_report(
            self.agent.outcome,
            self.run_dir,
            node_rank=self.place.node,
            host=self.place.host,
            tails={r.rank: self.sink.tail(r.rank) for r in self.requests},
            keep=tuple(r.rank for r in self.requests if r.keep_value),
            gpus=self.place.gpus,
        )

    def close(self) -> None:
        """Release the agent's pipes and give the fork server back for the next run."""
        try:
            self.agent.close()
        finally:
            warm.release(self.server)

    def run(self) -> NodeReport:
        """Run the node to its end and report (re-raises ``KeyboardInterrupt`` after stopping)."""
        try:
            self.agent.run()
        finally:
            warm.release(self.server)
        return self.report()
