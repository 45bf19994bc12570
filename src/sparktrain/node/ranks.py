"""One node's ranks, for every backend: the requests that start them, and the agent that runs them.

Shared by every backend, so a rank sees the same environment, and a node reports the same way,
whether it runs on this machine, in a Spark task or in a Ray actor.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from sparktrain.node import warm
from sparktrain.node.agent import Control, NodeAgent, RankExit
from sparktrain.node.logs import LogSink
from sparktrain.node.report import NodeReport, node_report
from sparktrain.plan.entrypoint import ScriptEntry
from sparktrain.rank import env
from sparktrain.rank.worker import RankRequest


@dataclass(frozen=True, kw_only=True)
class NodeLayout:
    """Where one node sits in the run.

    Attributes:
        world_size: Ranks in the run.
        nodes: Nodes in the run.
        node_rank: This node.
        procs_per_node: Ranks on each node.
        master: Host and port of the rendezvous store.
        run_id: Identifier of the run.
        restart: The attempt number (0 at first).
        max_restarts: Restarts the run allows.
    """

    world_size: int
    nodes: int
    node_rank: int
    procs_per_node: int
    master: tuple[str, int]
    run_id: str
    restart: int
    max_restarts: int


def rank_requests(
    layout: NodeLayout,
    *,
    run_dir: str,
    script: ScriptEntry | None,
    gpus: tuple[str, ...] | None,
    threads: int,
    keep: Collection[int],
    hang_timeout: float | None,
    data_paths: Mapping[int, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> list[RankRequest]:
    """One request per rank of the node, from the caller's (or the task's) environment.

    ``extra_env`` adds variables of other contracts (MLflow's run) to every rank.
    """
    base = {**env.caller_environ(), **(extra_env or {})}
    requests = []
    for local in range(layout.procs_per_node):
        rank = layout.node_rank * layout.procs_per_node + local
        rank_env = env.RankEnv(
            rank=rank,
            local_rank=local,
            world_size=layout.world_size,
            local_world_size=layout.procs_per_node,
            node_rank=layout.node_rank,
            nodes=layout.nodes,
            master_addr=layout.master[0],
            master_port=layout.master[1],
            run_id=layout.run_id,
            visible_devices=gpus,
            threads=threads,
            restart=layout.restart,
            max_restarts=layout.max_restarts,
        )
        requests.append(
            RankRequest(
                rank=rank,
                env=env.rank_environ(base, rank_env),
                cwd=os.getcwd(),
                sys_path=list(sys.path),
                run_dir=run_dir,
                script=script,
                threads=None if env.user_set_threads(base) else threads,
                keep_value=rank in keep,
                data_path=data_paths.get(rank) if data_paths else None,
                hang_timeout=hang_timeout,
            )
        )
    return requests


def run_node_agent(
    requests: list[RankRequest],
    sink: LogSink,
    *,
    run_dir: str,
    node_rank: int,
    host: str,
    gpus: tuple[str, ...],
    listen: socket.socket | None,
    timeout: float | None,
    grace: float,
    hang_timeout: float | None,
    control: Control | None,
    on_exit: Callable[[RankExit], None] | None = None,
    exit_grace: float = 10.0,
) -> NodeReport:
    """Run one node's ranks from a warm fork server to their end; return the node's report."""
    server = warm.acquire(env.caller_environ())
    agent = NodeAgent(
        server,
        requests,
        sink,
        listen=listen,
        timeout=timeout,
        grace=grace,
        control=control,
        on_exit=on_exit,
        hang_timeout=hang_timeout,
        exit_grace=exit_grace,
    )
    try:
        outcome = agent.run()
    finally:
        warm.release(server)
    return node_report(
        outcome,
        run_dir,
        node_rank=node_rank,
        host=host,
        tails={r.rank: sink.tail(r.rank) for r in requests},
        keep=tuple(r.rank for r in requests if r.keep_value),
        gpus=gpus,
    )
