"""Processes of this machine, read from ``/proc``: find a Ray cluster's, end them by PID.

Each process is identified by its PID *and* its start time, so that a PID reused by an unrelated
process after ours exited is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, parent pid, start time)`` of ``pid``, or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def matching(needles: Iterable[str]) -> set[Proc]:
    """Live processes whose command line contains one of ``needles``, and their descendants."""
    wanted = [n for n in needles if n]
    table: dict[int, tuple[int, int]] = {}
    roots: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        stat = _stat(int(entry))
        if stat is None or stat[0] in ("Z", "X"):
            continue
        table[int(entry)] = (stat[1], stat[2])
        if any(n in _cmdline(int(entry)) for n in wanted):
            roots.append(int(entry))
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: set[Proc] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in table and (pid, table[pid][1]) not in found:
            found.add((pid, table[pid][1]))
            stack.extend(children.get(pid, ()))
    return found


def alive(procs: Iterable[Proc]) -> set[Proc]:
    """Those of ``procs`` still running (not zombies, same start time)."""
    left = set()
    for pid, started in procs:
        stat = _stat(pid)
        if stat is not None and stat[0] not in ("Z", "X") and stat[2] == started:
            left.add((pid, started))
    return left


def end(procs: Iterable[Proc], *, grace: float) -> set[Proc]:
    """Wait up to ``grace`` seconds for ``procs`` to exit, then SIGKILL the rest.

    Returns:
        The processes still alive afterwards (none, unless one could not be killed).
    """
    left = alive(procs)
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive(left)
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = alive(left)
    return left
