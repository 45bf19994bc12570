"""Private run directories, named after the process that owns them, and the sweep of dead owners'.

A run keeps its payload, results and data shares in a directory of the temporary folder, created
with mode 0700 and removed in a ``finally``. A process killed with SIGKILL runs no ``finally``,
so its directory stays. Each name therefore carries its owner: ``sparktrain-<kind>-<pid>-<start>-
<random>``, where ``<start>`` is the process's start time in clock ticks since boot (``/proc``),
so a PID reused by a later process never passes for the owner. :func:`make` first sweeps the
directories whose owner is gone; it never touches a live owner's, another user's, or a name it
cannot read.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from sparktrain.ground import procfs

_NAME = re.compile(r"^sparktrain-(?P<kind>[a-z]+)-(?P<pid>\d+)-(?P<start>\d+)-")


def _can_tell() -> bool:
    return Path("/proc/self/stat").exists()


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that created a directory (``pid`` started at ``start``) still runs."""
    return procfs.start_ticks(pid) == start


def sweep(root: str | None = None) -> list[str]:
    """Remove this user's sparktrain directories in ``root`` whose owner is gone; their paths."""
    if not _can_tell():
        return []
    folder = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            found = _NAME.match(entry.name)
            if found is None or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                if owner_alive(int(found["pid"]), int(found["start"])):
                    continue
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def make(kind: str, root: str | None = None) -> str:
    """A new private directory (mode 0700) for ``kind`` (``run``, ``task``, ...), after a sweep.

    It is made in ``root`` (the temporary folder by default), whose dead owners' are swept.
    """
    sweep(root)
    pid = os.getpid()
    start = procfs.start_ticks(pid) or 0
    return tempfile.mkdtemp(prefix=f"sparktrain-{kind}-{pid}-{start}-", dir=root)
