"""torch's extension build lock, as every process of ours reads it (any process).

torch's ``torch.utils.cpp_extension`` serialises the builders of one op with a ``lock`` file in
the op's build folder (``FileBaton``): created with ``O_EXCL``, removed when the build ends, and
waited on by every other process that loads the op. The file holds nothing, so nobody can tell a
live builder from one that was killed, and a lock left by a killed builder blocks every later
load of the op forever.

sparktrain's ranks make the lock with a mark in it and a kernel ``flock`` already on it
(:func:`create`): the file is written and locked under a temporary name, then hard-linked to
``lock``, which is atomic and fails when a lock exists. The kernel drops a process's flock however
the process dies, so a lock that bears the mark and whose flock is free is provably **stale**.
:func:`release` removes the file before it lets the flock go, so that a lock is never seen
unlocked while its builder lives.

A lock without the mark was made by a process outside sparktrain (torch itself, an older
sparktrain). It is **orphaned** when no process on this host has it open; that proves nothing
when the folder is shared with other machines or containers, whose builders we cannot see, so
it is never removed behind the user's back: the rank says so, the hang report names the file,
and ``sparktrain doctor --build-ops`` removes it when asked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: The first bytes of a lock made by sparktrain.
MARK = b"sparktrain-build-lock"
#: The file name torch gives the lock, in each op's build folder.
LOCK_NAME = "lock"

Kind = Literal["free", "building", "stale", "foreign", "orphan"]


@dataclass(frozen=True)
class LockState:
    """What one build lock is now.

    Attributes:
        path: The lock file.
        kind: ``free`` (no file), ``building`` (ours, its builder alive), ``stale`` (ours, its
            builder gone), ``foreign`` (not ours, open in a process of this host), ``orphan``
            (not ours, open in no process of this host).
        holders: The processes of this host that have a foreign lock open.
    """

    path: str
    kind: Kind
    holders: tuple[int, ...] = ()

    @property
    def op(self) -> str:
        """The op the lock guards (its build folder's name)."""
        return Path(self.path).parent.name

    def describe(self) -> str:
        """One sentence for a line or a hang report, with what to do where it matters."""
        if self.kind == "orphan":
            return (
                f"the build lock {self.path} of the op {self.op!r} is held by no process on "
                "this host (a build that was killed left it); if no other machine sharing this "
                f"folder is building {self.op!r}, remove the file (rm {self.path}) or run "
                "`sparktrain doctor --build-ops`"
            )
        if self.kind == "foreign":
            holders = ", ".join(map(str, self.holders))
            return f"the op {self.op!r} is being built by process {holders} ({self.path})"
        if self.kind == "stale":
            return f"the build lock {self.path} of the op {self.op!r} was left by a killed build"
        return f"the op {self.op!r} is being built ({self.path})"


def create(path: str) -> int | None:
    """Take the lock at ``path``: its descriptor (holding the flock), or ``None`` if it exists."""
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file of this thread's own
        os.write(fd, MARK + f" {socket.gethostname()} {os.getpid()}\n".encode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)
            return None
        except OSError:  # a filesystem without hard links: create, then lock (a short window)
            os.close(fd)
            return _create_in_place(path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return fd


def _create_in_place(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, MARK + f" {socket.gethostname()} {os.getpid()}\n".encode())
    return fd


def release(path: str, fd: int | None) -> None:
    """Give the lock back: the file goes first, then the flock with the descriptor."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    if fd is not None:
        os.close(fd)


def state(path: str) -> LockState:
    """What the lock at ``path`` is now (a foreign lock's holders are looked up in ``/proc``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return LockState(path, "free")
    try:
        ours = os.read(fd, len(MARK)) == MARK
        if ours:
            return LockState(path, "stale" if _flock_free(fd) else "building")
    finally:
        os.close(fd)
    holders = _holders(path)
    return LockState(path, "foreign" if holders else "orphan", holders)


def clear_stale(path: str) -> bool:
    """Remove the lock at ``path`` if it is ours and stale; whether the way is now clear.

    The check and the removal happen under the lock's own flock, and only if ``path`` still
    names the file that was checked, so a lock taken meanwhile by a live builder is never removed.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        if os.read(fd, len(MARK)) != MARK or not _flock_free(fd):
            return False
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.remove(path)
        return True
    finally:
        os.close(fd)


def clear_orphan(path: str) -> bool:
    """Remove a lock that is stale or that no process on this host holds (an explicit request)."""
    found = state(path)
    if found.kind == "stale":
        return clear_stale(path)
    if found.kind != "orphan":
        return found.kind == "free"
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    return True


def locks_under(root: str) -> list[LockState]:
    """Every build lock in the op folders under ``root`` (a ``TORCH_EXTENSIONS_DIR``)."""
    try:
        folders = sorted(p for p in Path(root).iterdir() if p.is_dir())
    except OSError:
        return []
    found = [state(str(f / LOCK_NAME)) for f in folders]
    return [s for s in found if s.kind != "free"]


def _flock_free(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True  # the flock is ours until fd is closed


def _holders(path: str) -> tuple[int, ...]:
    """The processes of this host that have ``path`` open (those ``/proc`` lets us read)."""
    target = os.path.realpath(path)
    found = []
    with contextlib.suppress(OSError):
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                            found.append(int(pid))
                            break
    return tuple(found)
