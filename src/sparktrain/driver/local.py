"""The local backend: every rank on this machine, forked from the caller's warm fork server.

Rank 0 hosts the rendezvous store on a loopback socket that this backend binds to a free port
before any rank starts and hands over as a file descriptor, so concurrent runs never pick the
same port and no rank ever joins another run's store.
"""

from __future__ import annotations

import shutil
import socket
import time
import uuid
from pathlib import Path

from sparktrain.driver.monitor import Monitor
from sparktrain.driver.results import RunResult, finish_plan
from sparktrain.node.logs import LogSink
from sparktrain.node.ranks import NodeLayout, rank_requests, run_node_agent
from sparktrain.plan.entrypoint import Entrypoint, FunctionEntry, ScriptEntry
from sparktrain.plan.layout import LaunchPlan
from sparktrain.rank import rundirs
from sparktrain.rank.paths import payload_path

LOOPBACK = "127.0.0.1"


def _bind_free_port(host: str) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.set_inheritable(True)
    return listener


def run_local(
    plan: LaunchPlan,
    entry: Entrypoint,
    *,
    sink: LogSink | None = None,
    data_paths: list[str] | None = None,
    attempt: int = 0,
    extra_env: dict[str, str] | None = None,
    monitor: Monitor | None = None,
) -> RunResult:
    """Run ``entry`` on ``plan.world_size`` ranks on this machine; see :func:`sparktrain.launch`."""
    started = time.monotonic()
    run_dir = rundirs.make("run")  # mode 0700: private to this user
    listener = _bind_free_port(LOOPBACK)
    try:
        if isinstance(entry, FunctionEntry):
            payload_path(run_dir).write_bytes(entry.payload)
        layout = NodeLayout(
            world_size=plan.world_size,
            nodes=1,
            node_rank=0,
            procs_per_node=plan.procs_per_node,
            master=(LOOPBACK, listener.getsockname()[1]),
            run_id=uuid.uuid4().hex[:12],
            restart=attempt,
            max_restarts=plan.max_restarts,
        )
        kept = range(plan.world_size) if plan.return_all else (0,)
        requests = rank_requests(
            layout,
            run_dir=run_dir,
            script=entry if isinstance(entry, ScriptEntry) else None,
            gpus=plan.gpus if plan.device == "cuda" else None,
            threads=plan.threads_per_rank,
            keep=kept if isinstance(entry, FunctionEntry) else (),
            hang_timeout=plan.hang_timeout,
            data_paths=dict(enumerate(data_paths)) if data_paths else None,
            extra_env=extra_env,
        )
        sink = sink or LogSink(plan.log_ranks, monitor=monitor)
        report = run_node_agent(
            requests,
            sink,
            run_dir=run_dir,
            node_rank=0,
            host=socket.gethostname(),
            gpus=plan.gpus,
            listen=listener,
            timeout=plan.timeout,
            grace=plan.stop_grace,
            hang_timeout=plan.hang_timeout,
            control=monitor,
            exit_grace=plan.exit_grace,
        )
        stopped = monitor is not None and monitor.stop_requested()
        return finish_plan([report], plan, started=started, stopped=stopped)
    finally:
        listener.close()
        shutil.rmtree(Path(run_dir), ignore_errors=True)
