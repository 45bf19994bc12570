"""What ``/proc`` says about a process: its state, parent and start time (Linux only).

Also :func:`die_with_parent`, the one ``prctl`` by which a forked child follows its parent.

Fields are those of ``proc(5)``'s ``/proc/<pid>/stat``, counted from the one after the command
name (whose parentheses may hold anything): index 0 is the state, 1 the parent PID, 19 the start
time in clock ticks since boot. Every function answers ``None`` where there is no such process
or no ``/proc``.
"""

from __future__ import annotations

STATE, PARENT, START = 0, 1, 19
_PR_SET_PDEATHSIG = 1


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name, or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _number(pid: int | str, index: int) -> int | None:
    fields = stat_fields(pid)
    try:
        return int(fields[index]) if fields else None
    except (IndexError, ValueError):
        return None


def parent_of(pid: int | str) -> int | None:
    """The parent PID of ``pid``."""
    return _number(pid, PARENT)


def start_ticks(pid: int | str) -> int | None:
    """When ``pid`` started, in clock ticks since boot (with its PID, it names one process)."""
    return _number(pid, START)


def running(pid: int | str) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    fields = stat_fields(pid)
    return bool(fields) and fields[STATE] not in (b"Z", b"X")  # type: ignore[index]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from one scan of ``/proc``."""
    import os

    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            parent = parent_of(entry.name)
            if parent is not None:
                parents.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return [p for p in found if running(p)]


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` dies; exit now if it already has."""
    import ctypes
    import os
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
