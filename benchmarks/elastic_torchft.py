"""torchft on the loop of ``benchmarks/elastic.py``: a replica group lost mid-epoch.

PyTorch's torchft keeps training through a lost replica group without a restart: a quorum every
step (through its lighthouse), a step committed only when its gradients were reduced, and a
joining group healed from a live peer. This runs it on the same loop as ``elastic.py`` (DDP of
an ``nn.Linear`` over gloo, one epoch of the same Parquet ids streamed by
``sparktrain.data.from_parquet``, batches of ``BATCH``, ``STEP_SECONDS`` a step), with two
replica groups of one process each, ``min_replica_size=1``, and SIGKILLs the second group's
process at step ``KILL_STEP``; the first goes on alone. It runs twice: the lighthouse's heartbeat
timeout at 1,000 ms and at its default (5,000 ms).

torchft-nightly 2026.10.26 is used, not torchft 0.2.0: in 0.2.0 a group killed during the
gradient allreduce takes its peer down too (an ``assert`` in its DDP comm hook; issue 32). It
needs its own venv (``~/.cache/sparktrain-bench/venvs/torchft``: torch 2.13.0 CPU, the nightly,
pyarrow, and this checkout of sparktrain for the data), made on first use.

Measured from the groups' step logs (each committed step: its number, time, participants, ids):

* recovery: from the kill to the survivor's first step committed with 1 participant;
* work lost: the survivor's steps that were not committed (the one in flight), since torchft's
  step count never goes back;
* duplicated and lost samples: the committed steps' ids against the dataset's. torchft does not
  hand a lost group's data to the survivors: each group reads its own shard (here
  ``from_parquet(rank=group, world_size=2)``), so the lost group's unread rows stay unread.

    python benchmarks/elastic_torchft.py --repeat 1     # both heartbeats, one run each
    (elastic.py runs it as its third column)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import make_venv

HERE = Path(__file__).resolve().parent
VENV = Path.home() / ".cache" / "sparktrain-bench" / "venvs" / "torchft"
PACKAGES = [["torch==2.13.0"], ["torchft-nightly==2026.10.26", "pyarrow", "numpy"]]
HEARTBEATS_MS = (1000, 5000)  # 5,000: the lighthouse's default


def setup() -> dict[str, str]:
    """Make (or reuse) the torchft venv; its python, or the exact error."""
    here = ["--no-deps", "-e", str(HERE.parent)]  # this checkout, for sparktrain.data
    installs = [*PACKAGES, here, ["cloudpickle", "tqdm"]]
    return make_venv(VENV, installs, "import torchft, sparktrain.data, pyarrow")


def worker(group: int, data_dir: str, log_dir: str, lighthouse: str, step_seconds: float) -> None:
    """One replica group of one process: the loop of ``elastic.train`` under torchft."""

    import torch
    from elastic import BATCH
    from torch import nn
    from torchft import DistributedDataParallel

    from sparktrain.data import from_parquet

    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    manager, store = group_manager(net, optimizer, group, lighthouse)
    model = DistributedDataParallel(manager, net)
    Path(log_dir, f"ready{group}").touch()  # heartbeating: the first quorum waits for both
    while not all(Path(log_dir, f"ready{g}").exists() for g in (0, 1)):
        time.sleep(0.01)
    data = from_parquet(data_dir, batch_size=BATCH, seed=3, rank=group, world_size=2)
    with Path(log_dir, f"group{group}-{os.getpid()}.txt").open("a") as out:
        for batch in data:
            manager.start_quorum()
            optimizer.zero_grad()
            loss = (model(batch["x"][:, None]) ** 2).mean()
            loss.backward()
            committed = manager.should_commit()
            if committed:
                optimizer.step()
            ids = " ".join(str(int(i)) for i in batch["id"])
            word = "commit" if committed else "dropped"
            out.write(f"{word} {manager.current_step()} {time.time():.6f} ")
            out.write(f"{manager.num_participants()} {ids}\n")
            out.flush()
            time.sleep(step_seconds)
    manager.shutdown(wait=False)
    del store


def group_manager(
    net: Any, optimizer: Any, group: int, lighthouse: str, *, use_async_quorum: bool = True
) -> tuple[Any, Any]:
    """A replica group of one process: its ``Manager`` (model and optimizer healed from a live
    group) and the store it hosts (keep it alive as long as the manager)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store_port = _free_port()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=lambda state: (
            net.load_state_dict(state["model"]),
            optimizer.load_state_dict(state["optimizer"]),
        ),
        state_dict=lambda: {"model": net.state_dict(), "optimizer": optimizer.state_dict()},
        use_async_quorum=use_async_quorum,
        replica_id=f"group{group}",
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=_free_port(),
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
    )
    return manager, store


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _lighthouse(python: str, heartbeat_ms: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    binary = str(Path(python).parent / "torchft_lighthouse")
    command = [binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}"]
    command += ["--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(heartbeat_ms)]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    return process, f"http://127.0.0.1:{port}"


def _steps(path: Path) -> list[tuple[str, int, float, int, list[int]]]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        word, step, at, participants, *ids = line.split()
        rows.append((word, int(step), float(at), int(participants), [int(i) for i in ids]))
    return rows


def run_once(python: str, data_dir: str, work: Path, heartbeat_ms: int, limit: float) -> dict:
    """One run: two groups, the second killed at ``KILL_STEP``; what the logs say."""
    from elastic import KILL_STEP, ROWS, STEP_SECONDS

    logs = work / "logs"
    logs.mkdir(parents=True)
    lighthouse, address = _lighthouse(python, heartbeat_ms)
    groups: list[subprocess.Popen[bytes]] = []
    problems: list[str] = []
    killed_at = None
    try:
        for group in (0, 1):
            command = [python, str(Path(__file__).resolve()), "--worker", str(group), data_dir]
            command += [str(logs), address, str(STEP_SECONDS)]
            with open(work / f"group{group}.err", "wb") as err:  # the child keeps its copy
                groups.append(
                    subprocess.Popen(
                        command,
                        cwd=HERE,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + limit
        first = logs / f"group0-{groups[0].pid}.txt"
        while killed_at is None and time.monotonic() < deadline:
            done = [s for s in _steps(first) if s[0] == "commit" and s[3] == 2]
            if done and done[-1][1] >= KILL_STEP:
                os.killpg(groups[1].pid, signal.SIGKILL)
                killed_at = time.time()
            time.sleep(0.01)
        try:
            groups[0].wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            problems.append(f"the surviving group passed the wall-clock limit ({limit:.0f}s)")
        if groups[0].returncode not in (0, None):
            tail = (work / "group0.err").read_text().strip().splitlines()[-5:]
            problems.append(f"the surviving group failed (exit {groups[0].returncode}): {tail}")
    finally:
        for process in [*groups, lighthouse]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    survivor = _steps(logs / f"group0-{groups[0].pid}.txt")
    lost = _steps(logs / f"group1-{groups[1].pid}.txt")
    committed = [i for word, *_, ids in survivor + lost if word == "commit" for i in ids]
    after = killed_at or float("inf")
    alone = [at for word, _, at, n, _ in survivor if word == "commit" and n == 1 and at > after]
    if killed_at is None:
        problems.append("the group was never killed")
    elif not alone:
        problems.append("no step committed by the survivor alone")
    return {
        "heartbeat_ms": heartbeat_ms,
        "recovery_s": (min(alone) - killed_at) if alone and killed_at else None,
        "work_lost": sum(1 for word, *_ in survivor if word == "dropped"),
        "duplicated": len(committed) - len(set(committed)),
        "missing": len(set(range(ROWS)) - set(committed)),
        "steps": [(word, step, n) for word, step, _, n, _ in survivor],
        "problems": problems,
    }


def measure(data_dir: str, work: Path, repeat: int, limit: float) -> dict[str, Any]:
    """Every heartbeat ``repeat`` times; ``{"error": ...}`` when the venv cannot be made."""
    made = setup()
    if "error" in made:
        return made
    runs: dict[str, Any] = {}
    for heartbeat in HEARTBEATS_MS:
        runs[str(heartbeat)] = [
            run_once(made["python"], data_dir, work / f"tf{heartbeat}-{n}", heartbeat, limit)
            for n in range(repeat)
        ]
    return {"runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=5, metavar=("GROUP", "DATA", "LOGS", "LH", "STEP_S"))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--limit", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.worker:
        group, data_dir, log_dir, lighthouse, step = args.worker
        worker(int(group), data_dir, log_dir, lighthouse, float(step))
        return 0
    import tempfile

    from elastic import write_rows

    with tempfile.TemporaryDirectory(prefix="sparktrain-torchft-") as tmp:
        data_dir = write_rows(Path(tmp) / "data")
        print(json.dumps(measure(data_dir, Path(tmp), args.repeat, args.limit), indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
