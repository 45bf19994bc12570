"""Fault benchmark: inject each fault into a real 2-rank run and time its detection.

Prints the table of ``docs/reliability.md``: the fault, what sparktrain did, the seconds from
the fault to the caller knowing (the error raised, or every rank gone), and what was lost.

    python benchmarks/faults.py

Local backend only (the Spark variants are in the test suite). Each row is one run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sparktrain
from sparktrain import HangError, TrainingFailedError, checkpoint, launch

Row = tuple[str, str, float, str]


def _stamp(folder: str, name: str) -> None:
    Path(folder, name).write_text(repr(time.time()))


def _read_stamp(folder: str, name: str) -> float:
    return float(Path(folder, name).read_text())


def raise_on_rank_one(folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        _stamp(folder, "fault")
        raise ValueError("injected")
    dist.barrier()


def sigkill_rank_one(folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        _stamp(folder, "fault")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def deadlock(folder: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    _stamp(folder, f"fault-{dist.get_rank()}")
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.recv(t, src=0)


def checkpointed(folder: str, epochs: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    start = 0
    if sparktrain.restart_count() == 1 and os.environ["RANK"] == "0":
        _stamp(folder, "restarted")
    latest = checkpoint.load_latest(folder)
    if latest is not None:
        start = latest.state["epoch"] + 1
    for epoch in range(start, epochs):
        if epoch == 3 and os.environ["RANK"] == "1" and sparktrain.restart_count() == 0:
            _stamp(folder, "fault")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)  # an epoch of work
        checkpoint.save({"epoch": epoch}, folder, step=epoch)
    return start


def _expect_error(fn: Callable[[str], None], **options: object) -> tuple[float, BaseException]:
    with tempfile.TemporaryDirectory() as folder:
        try:
            launch(fn, (folder,), num_processes=2, use_gpu=False, **options)  # type: ignore[arg-type]
        except TrainingFailedError as error:
            caught = time.time()
            stamps = [p for p in Path(folder).iterdir() if p.name.startswith("fault")]
            fault = max(float(p.read_text()) for p in stamps)
            return caught - fault, error
    raise AssertionError("the fault was not detected")


CALLER = """
import os, sys, time
from pathlib import Path
from sparktrain import launch
def hang(folder):
    Path(folder, os.environ["RANK"]).write_text(str(os.getpid()))
    time.sleep(600)
if __name__ == "__main__":
    launch(hang, (sys.argv[1],), num_processes=2, use_gpu=False)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _caller_dies(sig: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder, "caller.py")
        script.write_text(CALLER)
        pids_dir = Path(folder, "pids")
        pids_dir.mkdir()
        proc = subprocess.Popen([sys.executable, str(script), str(pids_dir)])
        while len(list(pids_dir.iterdir())) < 2:
            time.sleep(0.05)
        time.sleep(0.3)
        ranks = [int(p.read_text()) for p in pids_dir.iterdir()]
        sent = time.time()
        proc.send_signal(sig)
        while any(_alive(p) for p in ranks):
            time.sleep(0.02)
        gone = time.time() - sent
        proc.wait()
        return gone


def _restart_row() -> Row:
    with tempfile.TemporaryDirectory() as folder:
        started = time.time()
        resumed = launch(
            checkpointed, (folder, 6), num_processes=2, use_gpu=False, max_restarts=1
        ).value
        restarted = _read_stamp(folder, "restarted") - _read_stamp(folder, "fault")
        return (
            "rank SIGKILLed at epoch 3 of 6, max_restarts=1, checkpoint every epoch",
            f"restarted, resumed at epoch {resumed}, done in {time.time() - started:.1f}s",
            restarted,
            f"the work of epochs {resumed}-3 (epochs 0-{resumed - 1} were checkpointed)",
        )


def main() -> None:
    print(
        f"cpus={os.cpu_count()} python={sys.version.split()[0]} sparktrain={sparktrain.__version__}"
    )
    launch(os.getpid, num_processes=2, use_gpu=False)  # warm the fork server
    rows: list[Row] = []
    seconds, error = _expect_error(raise_on_rank_one)
    rows.append(
        (
            "rank 1 raises",
            f"TrainingFailedError: {str(error).splitlines()[0][:60]}",
            seconds,
            "nothing",
        )
    )
    seconds, error = _expect_error(sigkill_rank_one)
    rows.append(
        (
            "rank 1 SIGKILLed",
            f"TrainingFailedError: {str(error).splitlines()[0][:60]}",
            seconds,
            "nothing",
        )
    )
    seconds, error = _expect_error(deadlock, hang_timeout=5)
    assert isinstance(error, HangError)
    sites = "; ".join(s.describe() for s in error.sites.values())
    rows.append(
        (
            "deadlock (rank 1 skips all_reduce), hang_timeout=5",
            f"HangError: {sites}",
            seconds,
            "nothing",
        )
    )
    rows.append(_restart_row())
    rows.append(("caller SIGKILLed", "every rank gone", _caller_dies(signal.SIGKILL), "the run"))
    rows.append(
        (
            "caller Ctrl-C (SIGINT)",
            "every rank gone, KeyboardInterrupt",
            _caller_dies(signal.SIGINT),
            "the run",
        )
    )
    print()
    print("| fault | outcome | seconds to detection | lost |")
    print("| --- | --- | ---: | --- |")
    for fault, outcome, secs, lost in rows:
        print(f"| {fault} | {outcome} | {secs:.2f} | {lost} |")
    sparktrain.shutdown_warm()


if __name__ == "__main__":
    main()
