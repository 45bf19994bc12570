"""The local backend: every rank on this machine, forked from the caller's warm fork server.

Rank 0 hosts the rendezvous store on a loopback socket that this backend binds to a free port
before any rank starts and hands over as a file descriptor, so concurrent runs never pick the
same port and no rank ever joins another run's store.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sparktrain import env, warm
from sparktrain.agent import NodeAgent
from sparktrain.entrypoint import Entrypoint, FunctionEntry, ScriptEntry
from sparktrain.layout import LaunchPlan
from sparktrain.logs import LogSink
from sparktrain.results import RunResult, finish, node_report
from sparktrain.worker import RankRequest, payload_path

LOOPBACK = "127.0.0.1"


def _bind_free_port(host: str) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.set_inheritable(True)
    return listener


def _requests(
    plan: LaunchPlan,
    entry: Entrypoint,
    run_dir: str,
    port: int,
    base: dict[str, str],
    *,
    data_paths: list[str] | None,
    attempt: int,
) -> list[RankRequest]:
    run_id = uuid.uuid4().hex[:12]
    threads = None if env.user_set_threads(base) else plan.threads_per_rank
    keep = set(range(plan.world_size)) if plan.return_all else {0}
    requests = []
    for rank in range(plan.world_size):
        rank_env = env.RankEnv(
            rank=rank,
            local_rank=rank,
            world_size=plan.world_size,
            local_world_size=plan.procs_per_node,
            node_rank=0,
            nodes=1,
            master_addr=LOOPBACK,
            master_port=port,
            run_id=run_id,
            visible_devices=plan.gpus if plan.device == "cuda" else None,
            threads=plan.threads_per_rank,
            restart=attempt,
            max_restarts=plan.max_restarts,
        )
        requests.append(
            RankRequest(
                rank=rank,
                env=env.rank_environ(base, rank_env),
                cwd=os.getcwd(),
                sys_path=list(sys.path),
                run_dir=run_dir,
                script=entry if isinstance(entry, ScriptEntry) else None,
                threads=threads,
                keep_value=rank in keep and isinstance(entry, FunctionEntry),
                data_path=data_paths[rank] if data_paths else None,
                hang_timeout=plan.hang_timeout,
            )
        )
    return requests


def run_local(
    plan: LaunchPlan,
    entry: Entrypoint,
    *,
    sink: LogSink | None = None,
    data_paths: list[str] | None = None,
    attempt: int = 0,
) -> RunResult:
    """Run ``entry`` on ``plan.world_size`` ranks on this machine; see :func:`sparktrain.launch`."""
    started = time.monotonic()
    run_dir = tempfile.mkdtemp(prefix="sparktrain-run-")  # mode 0700: private to this user
    listener = _bind_free_port(LOOPBACK)
    try:
        if isinstance(entry, FunctionEntry):
            payload_path(run_dir).write_bytes(entry.payload)
        base = env.caller_environ()
        port = listener.getsockname()[1]
        requests = _requests(
            plan, entry, run_dir, port, base, data_paths=data_paths, attempt=attempt
        )
        sink = sink or LogSink(plan.log_ranks)
        server = warm.acquire(base)
        agent = NodeAgent(
            server,
            requests,
            sink,
            listen=listener,
            timeout=plan.timeout,
            grace=plan.stop_grace,
            hang_timeout=plan.hang_timeout,
        )
        try:
            outcome = agent.run()
        finally:
            warm.release(server)
        report = node_report(
            outcome,
            run_dir,
            node_rank=0,
            host=socket.gethostname(),
            tails={r.rank: sink.tail(r.rank) for r in requests},
            keep=tuple(r.rank for r in requests if r.keep_value),
            gpus=plan.gpus,
        )
        return finish(
            [report],
            world_size=plan.world_size,
            timeout=plan.timeout,
            duration=time.monotonic() - started,
            hang_timeout=plan.hang_timeout,
        )
    finally:
        listener.close()
        shutil.rmtree(Path(run_dir), ignore_errors=True)
