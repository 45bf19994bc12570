"""The fault of one ``chaos.py`` run, struck from a thread while the launch runs.

At the run's moment the injector waits for its target to exist (a rank's PID file, its fork
server, its node), then strikes once: SIGKILL, SIGSTOP (kept: the run must end it), short
SIGSTOP/SIGCONT pauses, a tmpfs filled for a while, or TCP connections destroyed with
``ss -K``. ``injected`` then says what was hit; it stays empty when the run ended first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import chaos_procs as procs
from chaos_plan import REMOTE, Run

T = TypeVar("T")


class Injector(threading.Thread):
    """Strikes ``run``'s fault once, ``run.moment`` seconds after ``started``."""

    def __init__(self, run: Run, folder: Path, disk: procs.Disk, started: float) -> None:
        super().__init__(name=f"chaos-inject-{run.index}", daemon=True)
        self.run_ = run
        self.folder = folder
        self.disk = disk
        self.started = started
        self.done = threading.Event()
        self.injected = ""
        self.at: float | None = None  # wall-clock time of the strike
        self.stopped: list[int] = []  # PIDs left SIGSTOPped on purpose

    def finish(self) -> None:
        """The launch returned: stop waiting, end pauses and fills now."""
        self.done.set()
        self.join(timeout=10)
        self.disk.release()

    def _wait_for(self, find: Callable[[], T | None]) -> T | None:
        while not self.done.is_set():
            found = find()
            if found is not None:
                return found
            self.done.wait(0.05)
        return None

    def _rank(self) -> int | None:
        return procs.rank_pid(self.folder, self.run_.rank)

    def _mark(self, what: str) -> str:
        self.at = time.time()
        return what

    def _first_rank(self) -> float | None:
        """When the first rank of the run started (monotonic), from its PID file's time."""
        stamps = []
        for path in self.folder.glob("pid-r*-a0"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                stamps.append(float(path.read_text().split()[1]))
        return min(stamps) - time.time() + time.monotonic() if stamps else None

    def run(self) -> None:
        anchor = self.started if self.run_.from_launch else self._wait_for(self._first_rank)
        if anchor is None:
            return
        delay = anchor + self.run_.moment - time.monotonic()
        if delay > 0 and self.done.wait(delay):
            return
        strike = getattr(self, "_" + self.run_.fault.replace("-", "_"))
        self.injected = strike()

    def _none(self) -> str:
        return ""

    def _kill_rank(self) -> str:
        pid = self._wait_for(self._rank)
        if pid is not None and procs.signal_pid(pid, signal.SIGKILL):
            return self._mark(f"SIGKILL to rank {self.run_.rank} (pid {pid})")
        return ""

    def _server(self) -> int | None:
        if self.run_.workload in REMOTE:
            return procs.forkserver_of(self._rank())
        return procs.idle_forkserver()  # the caller's own, with or without ranks yet

    def _kill_forkserver(self) -> str:
        pid = self._wait_for(self._server)
        if pid is not None and procs.signal_pid(pid, signal.SIGKILL):
            return self._mark(f"SIGKILL to the fork server (pid {pid})")
        return ""

    def _kill_node(self) -> str:
        pid = self._wait_for(lambda: procs.node_of(procs.forkserver_of(self._rank())))
        what = procs.cmdline(pid)[-60:] if pid else ""
        if pid is not None and procs.signal_pid(pid, signal.SIGKILL):
            return self._mark(f"SIGKILL to rank {self.run_.rank}'s node (pid {pid}: {what})")
        return ""

    def _stop_rank(self) -> str:
        pid = self._wait_for(self._rank)
        if pid is not None and procs.signal_pid(pid, signal.SIGSTOP):
            self.stopped.append(pid)  # not continued: the run must find the hang and end it
            return self._mark(f"SIGSTOP to rank {self.run_.rank} (pid {pid})")
        return ""

    def _slow_rank(self) -> str:
        pid = self._wait_for(self._rank)
        if pid is None:
            return ""
        done = []
        for pause in self.run_.pauses:
            if not procs.signal_pid(pid, signal.SIGSTOP):
                break
            self.at = self.at or time.time()
            self.done.wait(pause)
            procs.signal_pid(pid, signal.SIGCONT)
            done.append(f"{pause:.2f}")
            if self.done.wait(0.3):
                break
        return f"rank {self.run_.rank} (pid {pid}) stopped for {', '.join(done)} s" if done else ""

    def _disk_full(self) -> str:
        if self.done.is_set():
            return ""
        written = self.disk.fill()
        self.at = time.time()
        self.done.wait(self.run_.hold)
        self.disk.release()
        return f"checkpoint disk filled ({written} bytes) for {self.run_.hold:.2f}s"

    def _drop_connection(self) -> str:
        remote = self.run_.workload in REMOTE

        def drop() -> list[str] | None:
            rank = self._rank()
            target = procs.node_of(procs.forkserver_of(rank)) if remote else rank
            dropped = procs.drop_connections(target, to_caller_only=remote)
            return dropped or None

        dropped = self._wait_for(drop)
        if not dropped:
            return ""
        whose = f"rank {self.run_.rank}'s node's channel" if remote else f"rank {self.run_.rank}'s"
        return self._mark(f"ss -K of {whose} TCP connections: {', '.join(dropped)}")


def late_starts(folder: Path, killed_at: float) -> list[str]:
    """PID files of ranks that started after ``killed_at`` (+0.2 s): started after the caller
    was gone."""
    late = []
    for path in folder.glob("pid-r*-a*"):
        if ".tmp-" in path.name:
            continue
        pid, started = path.read_text().split()
        if float(started) > killed_at + 0.2:
            late.append(f"{path.name} (pid {pid}) started {float(started) - killed_at:.2f}s late")
    return late


def continue_all(pids: list[int]) -> None:
    for pid in pids:
        procs.signal_pid(pid, signal.SIGCONT)
