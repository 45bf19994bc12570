"""The goodput benchmark's torchrun side: four elastic agents on this machine, one a node.

Each node is ``python -m torch.distributed.run --nnodes=1:4 --nproc-per-node=1
--rdzv-backend=c10d`` running :func:`goodput_train.train_torchrun` (DDP, DCP ``async_save``).
The first agent hosts the rendezvous store, so the schedule never takes it (as
:func:`goodput_plan.choose` never picks the first node). A loss SIGKILLs a node's agent and its
worker (torchrun has no notice: a notice is a kill); the node comes back as a new agent that
joins the next rendezvous round. torchrun's default rendezvous timeouts apply. When torchrun
gives up (a node lost inside its rendezvous fails the job), the job is launched again on the
nodes up, as a cluster scheduler's requeue would, and resumes from its newest checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import free_port, kill_tree, listening
from goodput_plan import Fault, choose

HERE = Path(__file__).resolve().parent
#: How many times a failed job is launched again.
RELAUNCHES = 20


class Agents:
    """The run's torchrun agents, by node, and the nodes down (killed, not yet back)."""

    def __init__(self, work: Path, nodes: int, worker_args: list[str]) -> None:
        self.work, self.nodes, self.worker_args = work, nodes, worker_args
        self.port, self.rdzv_id = 0, uuid.uuid4().hex[:12]
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.down: set[int] = set()
        self.started = 0
        self.lock = threading.RLock()

    def launch(self) -> None:
        """(Re)start the job: every node not down gets a new agent, the first one hosting a new
        rendezvous store (a scheduler's requeue, after the old job's agent 0 failed)."""
        with self.lock:
            for node in list(self.agents):
                self._kill(node)
            self.port = free_port()
            self._start(0)
        began = time.monotonic()
        while not listening(self.port):  # the first agent hosts the c10d store
            if time.monotonic() - began > 60:
                raise RuntimeError("torchrun's first agent never opened its rendezvous store")
            time.sleep(0.05)
        with self.lock:
            for node in range(1, self.nodes):
                if node not in self.down:
                    self._start(node)

    def back(self, node: int) -> None:
        """Node ``node`` returns: a new agent joins the next rendezvous round."""
        with self.lock:
            self.down.discard(node)
            self._start(node)

    def _start(self, node: int) -> None:
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{self.nodes}",
            "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.rdzv_id}", "--max-restarts=100000",
            str(HERE / "goodput_train.py"), *self.worker_args,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
        self.started += 1
        with (self.work / f"agent{self.started}-node{node}.out").open("wb") as out:
            self.agents[node] = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )  # fmt: skip

    def up(self) -> list[int]:
        """The nodes whose agent is alive."""
        with self.lock:
            return [n for n, agent in self.agents.items() if agent.poll() is None]

    def lose(self, node: int) -> None:
        """SIGKILL node ``node``'s agent and its worker; the node is down until :meth:`back`."""
        with self.lock:
            self.down.add(node)
            self._kill(node)

    def _kill(self, node: int) -> None:
        agent = self.agents.pop(node, None)
        if agent is not None:
            kill_tree(agent.pid)
            agent.wait()

    def stop(self) -> None:
        """Kill every agent left."""
        with self.lock:
            for node in list(self.agents):
                self._kill(node)


def play_kills(  # noqa: PLR0917 - the schedule's player, for a thread
    up: Callable[[], list[int]],
    lose: Callable[[int], None],
    back: Callable[[int], None],
    faults: list[Fault],
    stop: threading.Event,
    struck: list,
) -> None:
    """Apply ``faults`` from now on until ``stop``: each a SIGKILL (``lose``) of a node among
    those ``up``, the node ``back`` after its fault's delay. The returns not yet due are
    cancelled at the end. (Also torchft's side: neither rival has a notice.)"""
    start, timers = time.monotonic(), []
    try:
        for fault in faults:
            if stop.wait(max(0.0, start + fault.at - time.monotonic())):
                return
            node = choose(fault.pick, up())
            if node is None:
                struck.append({"at": fault.at, "kind": "none up"})
                continue
            lose(node)
            timers.append(threading.Timer(fault.back_after, back, (node,)))
            timers[-1].start()
            struck.append({"at": round(time.monotonic() - start, 2), "kind": "kill", "node": node})
    finally:
        for timer in timers:
            timer.cancel()


def run(work: Path, nodes: int, worker_args: list[str], faults: list[Fault],
        limit: float) -> dict[str, Any]:  # fmt: skip
    """Play ``faults`` against a torchrun run; what ``goodput.child`` writes for a side.

    A job whose agent 0 fails (torchrun gives up when a node dies inside its rendezvous) is
    launched again on the nodes up, as a scheduler's requeue would, at most ``RELAUNCHES``
    times; it resumes from its newest DCP checkpoint.
    """
    agents = Agents(work, nodes, worker_args)
    struck: list[dict[str, Any]] = []
    stop = threading.Event()
    began, since, relaunches = time.monotonic(), time.time(), 0
    player = threading.Thread(
        target=play_kills, args=(agents.up, agents.lose, agents.back, faults, stop, struck)
    )
    try:
        agents.launch()
        player.start()
        while True:
            code = agents.agents[0].wait(timeout=max(1.0, began + limit - time.monotonic()))
            if code == 0 or relaunches == RELAUNCHES:
                break
            relaunches += 1
            agents.launch()
    finally:
        wall = time.monotonic() - began
        stop.set()
        if player.is_alive():
            player.join()  # it cancels the return timers not yet fired
        agents.stop()
    if code != 0:
        raise RuntimeError(f"torchrun's agent 0 exited {code} {relaunches + 1} times; see {work}")
    rounds = {p.name.split("-")[0] for p in Path(worker_args[2]).glob("attempt*")}
    # A rendezvous round after the first is a rescale (lost, grown or relaunched).
    rescales = [("round", 0, 0, False)] * max(0, len(rounds) - 1)
    return {"wall": wall, "struck": struck, "rescales": rescales, "attempts": len(rounds),
            "relaunches": relaunches, "began": since}  # fmt: skip
