"""What ``chaos.py`` hits and how: ranks, fork servers and nodes found in /proc; signals, a
TCP connection destroyed with ``ss -K``, a tmpfs of 1 MiB filled; and what a run leaves behind.

A rank is found from the PID file its body writes (``pid-r<rank>-a<attempt>``, the newest
attempt) and checked in /proc to be a child of a fork server (``python -m
sparktrain.node.forkserver``: a rank is a fork of it, with its command line; ``RANK`` is not in
``/proc/PID/environ`` of a forked rank, whose environment block is the server's). Its fork server
is its parent, and its node the server's parent: the caller itself on the local backend, a
``LocalCluster`` node process, or the Spark executor's Python worker that runs the node agent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from _common import cmdline, tagged_processes

from sparktrain.ground import procfs

FORKSERVER = "sparktrain.node.forkserver"


def is_forkserver(pid: int | None) -> bool:
    return pid is not None and FORKSERVER in cmdline(pid)


def is_rank(pid: int) -> bool:
    """A live process forked by a fork server (a rank, or a rank's DataLoader worker)."""
    return procfs.running(pid) and is_forkserver(procfs.parent_of(pid))


def rank_pid(folder: Path, rank: int) -> int | None:
    """The live PID of ``rank`` in its newest attempt, from its PID file; ``None`` if none."""
    files = sorted(folder.glob(f"pid-r{rank}-a*"), key=lambda p: int(p.name.split("-a")[-1]))
    for path in reversed(files):
        with contextlib.suppress(OSError, ValueError):
            pid = int(path.read_text().split()[0])
            if is_rank(pid):
                return pid
    return None


def forkserver_of(rank: int | None) -> int | None:
    parent = procfs.parent_of(rank) if rank else None
    return parent if is_forkserver(parent) else None


def node_of(server: int | None) -> int | None:
    """The node process that started ``server``: ``None`` on the local backend (the caller)."""
    parent = procfs.parent_of(server) if server else None
    return None if parent in (None, 1, os.getpid()) else parent


def idle_forkserver() -> int | None:
    """This caller's own fork server (the local backend's), whether or not it has ranks."""
    for pid in procfs.descendants(os.getpid()):
        if is_forkserver(pid) and procfs.parent_of(pid) == os.getpid():
            return pid
    return None


def signal_pid(pid: int | None, sig: int) -> bool:
    """Send ``sig`` to a live ``pid``; whether it was delivered."""
    if pid is None or not procfs.running(pid):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _connections(pid: int) -> list[tuple[str, str]]:
    """``(local, peer)`` address:port pairs of ``pid``'s established TCP connections."""
    listing = subprocess.run(
        ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=False
    ).stdout
    found = []
    for line in listing.splitlines():
        if f"pid={pid}," in line:
            fields = line.split()
            found.append((fields[2], fields[3]))
    return found


def _listening_ports(pid: int) -> set[str]:
    listing = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=False).stdout
    return {
        line.split()[3].rsplit(":", 1)[1] for line in listing.splitlines() if f"pid={pid}," in line
    }


def drop_connections(pid: int | None, *, to_caller_only: bool) -> list[str]:
    """Destroy ``pid``'s TCP connections with ``ss -K`` (its socket aborted, the peer reset).

    ``to_caller_only``: only those to a port this process listens on (a node's channel to the
    driver). Returns the connections destroyed, as ``local->peer``.
    """
    if pid is None or not procfs.running(pid):
        return []
    ours = _listening_ports(os.getpid()) if to_caller_only else None
    dropped = []
    for local, peer in _connections(pid):
        local_port, peer_port = local.rsplit(":", 1)[1], peer.rsplit(":", 1)[1]
        if ours is not None and peer_port not in ours:
            continue
        query = [
            "ss",
            "-K",
            "state",
            "established",
            f"( sport = :{local_port} and dport = :{peer_port} )",
        ]
        if subprocess.run(query, capture_output=True, check=False).returncode == 0:
            dropped.append(f"{local}->{peer}")
    return dropped


class Disk:
    """A tmpfs of 1 MiB for the runs' checkpoints, which a fault fills; or why there is none."""

    def __init__(self, root: Path) -> None:
        self.path = root / "disk"
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
            check=False,
        )
        self.mounted = done.returncode == 0
        self.why_not = "" if self.mounted else f"mount -t tmpfs: {done.stderr.strip()}"
        self.filler = self.path / "filler"

    def fill(self) -> int:
        """Write zeros until the disk is full; the bytes written."""
        written = 0
        with contextlib.suppress(OSError), open(self.filler, "wb", buffering=0) as out:
            while True:
                written += out.write(b"\0" * 4096)
        return written

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def close(self) -> None:
        self.release()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def _allowed(pid: int, cmd: str) -> bool:
    """A long-lived process of the soak itself: the Spark JVMs and Python workers, and idle
    fork servers of this caller or of a Python worker (reused by the next run)."""
    parent = procfs.parent_of(pid)
    if is_forkserver(parent):  # a rank, or what a rank forked
        return False
    if cmd.split(" ", 1)[0].endswith("java") or "pyspark" in cmd:
        return True
    if FORKSERVER in cmd:
        return parent == os.getpid() or (parent is not None and "pyspark" in cmdline(parent))
    return False


def describe(pid: int, cmd: str) -> str:
    fields = procfs.stat_fields(pid)
    state = fields[procfs.STATE].decode() if fields else "?"
    return f"pid {pid} (state {state}, parent {procfs.parent_of(pid)}): {cmd[:100]}"


def leftovers(grace_s: float) -> dict[int, str]:
    """Processes of this soak still alive after up to ``grace_s`` that no run should leave."""
    deadline = time.monotonic() + grace_s
    while True:
        strays = {p: c for p, c in tagged_processes().items() if not _allowed(p, c)}
        if not strays or time.monotonic() >= deadline:
            return strays
        time.sleep(0.25)


def kill_all(pids: list[int]) -> None:
    """SIGKILL these PIDs (what a run left, to start the next one clean)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
