"""The goodput benchmark's torchft side: four replica groups of one process, one a node.

torchft keeps a run going through lost replica groups: a quorum every step through its
lighthouse, a step committed only where every participant reduced its gradients, and a group
that (re)joins healed from a live one. Each node here is one replica group (a ``Manager``, its
own store, ``torchft.DistributedDataParallel`` over gloo) running the goodput loop's model
(:mod:`goodput_train`); the lighthouse runs beside them with ``--min_replicas 1`` and a
1,000 ms heartbeat timeout (``elastic.py`` measured both 1,000 ms and the 5,000 ms default: the
shorter one recovers faster). The nightly of ``elastic_torchft.py`` is used, in its venv: 0.2.0
takes a surviving group down when a peer is killed mid-allreduce.

The data: each group reads its own quarter of the rows (``from_parquet(rank=group,
world_size=4)``), one batch a step; torchft hands nothing of a lost group's data to the others.
A step that is not committed is tried again on the same batch. A group that joins (a node back)
is healed to the quorum's step and skips its quarter's batches up to that step, so the batches
its quarter had while it was away are never read: the table's "never". A loss is a SIGKILL
(torchft has no notice); the node comes back as a new process of the same replica group. The
first node is never struck, as on every side.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _common import free_port, kill_tree, make_venv
from goodput_plan import Fault
from goodput_torchrun import play_kills

HERE = Path(__file__).resolve().parent
VENV = Path.home() / ".cache" / "sparktrain-bench" / "venvs" / "torchft"
HEARTBEAT_MS = 1000


def setup() -> dict[str, str]:
    """The torchft venv of ``elastic_torchft.py`` (made on first use), or the exact error."""
    from elastic_torchft import PACKAGES

    here = ["--no-deps", "-e", str(HERE.parent)]
    return make_venv(VENV, [*PACKAGES, here, ["cloudpickle", "tqdm"]],
                     "import torchft, sparktrain.data, pyarrow")  # fmt: skip


def worker(  # noqa: PLR0917 - the worker's command line
    group: int, nodes: int, data_dir: str, log_dir: str, lighthouse: str, step_seconds: float,
    batch: int,
) -> None:  # fmt: skip
    """One replica group: the goodput loop under torchft, logging as ``read_in_place`` reads."""
    import torch
    from elastic_torchft import group_manager
    from goodput_train import loss_of, model
    from torchft import DistributedDataParallel

    from sparktrain.data import from_parquet

    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    # synchronous quorum: the step is known after start_quorum, and the data follows it
    manager, store = group_manager(net, optimizer, group, lighthouse, use_async_quorum=False)
    ddp = DistributedDataParallel(manager, net)
    Path(log_dir, f"ready{os.getpid()}").touch()
    while not Path(log_dir, "go").exists():  # the first quorum has every group that started
        time.sleep(0.01)
    batches = iter(from_parquet(data_dir, batch_size=batch, seed=3, rank=group, world_size=nodes))
    read, rows = 0, None  # batches of this group's quarter taken; the one being trained
    with Path(log_dir, f"group{group}-{os.getpid()}.txt").open("a") as out:
        while True:
            manager.start_quorum()
            step = manager.current_step()
            while rows is None or read < step + 1:  # a healed joiner skips to the quorum's step
                rows = next(batches, None)
                read += 1
                if rows is None:
                    break
            if rows is None:
                break
            optimizer.zero_grad()
            loss_of(ddp, rows["id"]).backward()
            if manager.should_commit():
                optimizer.step()
                at, world = time.time(), manager.num_participants()
                ids = " ".join(str(int(i)) for i in rows["id"])
                out.write(f"P {step + 1} 0 {at:.6f} {ids}\nC {step + 1} 0 {at:.6f} {world}\n")
                rows = None
            else:
                out.write(f"D {step + 1} 0 {time.time():.6f}\n")
            out.flush()
            time.sleep(step_seconds)
    manager.shutdown(wait=False)
    del store


class Groups:
    """The run's replica-group processes, by node, and the lighthouse."""

    def __init__(self, work: Path, python: str, nodes: int, worker_args: list[str]) -> None:
        self.work, self.python, self.nodes, self.worker_args = work, python, nodes, worker_args
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started, self.lock = 0, threading.RLock()
        port = free_port()
        command = [str(Path(python).parent / "torchft_lighthouse"), "--min_replicas", "1",
                   "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "10000",
                   "--heartbeat_timeout_ms", str(HEARTBEAT_MS)]  # fmt: skip
        self.lighthouse = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.address = f"http://127.0.0.1:{port}"

    def start(self, node: int) -> None:
        """Start node ``node``'s replica group (again, when it comes back)."""
        command = [self.python, str(Path(__file__).resolve()), "--worker", str(node),
                   str(self.nodes), *self.worker_args[:2], self.address,
                   *self.worker_args[2:]]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
        with self.lock:
            self.started += 1
            with (self.work / f"group{self.started}-node{node}.out").open("wb") as out:
                self.procs[node] = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    env=env, cwd=HERE, start_new_session=True,
                )  # fmt: skip

    def up(self) -> list[int]:
        """The nodes whose group is running."""
        with self.lock:
            return [n for n, proc in self.procs.items() if proc.poll() is None]

    def alive(self) -> list[subprocess.Popen[bytes]]:
        """The running groups' processes."""
        with self.lock:
            return [proc for proc in self.procs.values() if proc.poll() is None]

    def lose(self, node: int) -> None:
        """SIGKILL node ``node``'s group."""
        with self.lock:
            proc = self.procs.pop(node, None)
        if proc is not None:
            kill_tree(proc.pid)
            proc.wait()

    def stop(self) -> None:
        """Kill every group left and the lighthouse."""
        for node in list(self.procs):
            self.lose(node)
        kill_tree(self.lighthouse.pid)
        self.lighthouse.wait()


def run(work: Path, nodes: int, worker_args: list[str], faults: list[Fault],
        limit: float) -> dict[str, Any]:  # fmt: skip
    """Play ``faults`` against a torchft run; what ``goodput.child`` writes for a side.

    ``worker_args``: the data folder, the log folder, the sleep a step, the batch size. The run
    ends when every group up has read its quarter (or at ``limit``).
    """
    made = setup()
    if "error" in made:
        raise RuntimeError(f"torchft's venv could not be made: {made['error']}")
    groups = Groups(work, made["python"], nodes, worker_args)
    struck: list[dict[str, Any]] = []
    stop = threading.Event()
    player = threading.Thread(
        target=play_kills, args=(groups.up, groups.lose, groups.start, faults, stop, struck)
    )
    began, since = time.monotonic(), time.time()
    try:
        for node in range(nodes):
            groups.start(node)
        player.start()
        logs = Path(worker_args[1])
        while not all(Path(logs, f"ready{p.pid}").exists() for p in groups.alive()):
            time.sleep(0.05)  # the first groups up are ready (a group struck meanwhile is not)
        Path(logs, "go").touch()
        while groups.procs[0].poll() is None and time.monotonic() - began < limit:
            time.sleep(0.1)
        code = groups.procs[0].poll()
        while groups.up() and time.monotonic() - began < limit:  # the others end at its step
            time.sleep(0.1)
    finally:
        wall = time.monotonic() - began
        stop.set()
        if player.is_alive():
            player.join()
        groups.stop()
    if code != 0:
        raise RuntimeError(f"torchft's group 0 exited {code}; see {work}")
    return {"wall": wall, "struck": struck, "rescales": [], "attempts": 1, "began": since}


if __name__ == "__main__":  # a replica group: group nodes data logs lighthouse step_s batch
    sys.path.insert(0, str(HERE))
    group, count, data, logs, address, seconds, size = sys.argv[2:9]
    worker(int(group), int(count), data, logs, address, float(seconds), int(size))
