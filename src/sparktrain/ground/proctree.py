"""One fork server's whole process tree, found and killed whoever died first (Linux only).

Every process a run starts descends from one fork server: the ranks it forks, what they start
(a ``subprocess.Popen(["sleep", "1000"])``, DataLoader workers, a compiler), and what those
start. A :class:`Tree` marks all of them, so that they can be killed together even after their
parents are gone and the kernel has reparented them to init. Two marks, the first where the
machine allows it:

- **A cgroup** (v2): where this process may make a child of its own cgroup (root in a container,
  or a systemd user slice with delegation), the fork server moves itself into
  ``sparktrain-<tag>`` before it forks. No descendant can leave it (a double fork or a new
  session does not), and writing ``cgroup.kill`` ends them all at once.
- **A tag in the environment**, always: ``SPARKTRAIN_TREE`` holds the tags of the trees a
  process belongs to (a run inside a rank adds its own), inherited by every descendant that does
  not clear its environment. The sweep reads ``/proc/<pid>/environ`` of this user's processes.

Who kills the tree: the fork server itself when its caller is gone (it is also a child
subreaper, see :mod:`sparktrain.node.forkserver`); the caller when its fork server died or is
closed; and, where both were killed at once, the next fork server started on the machine, which
sweeps every tree whose owner (the process that made it, named in its tag) is dead.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path

from sparktrain.ground import procfs

#: The tags of the trees a process belongs to, separated by ``:`` (outermost first).
TREE_VAR = "SPARKTRAIN_TREE"
#: The cgroup folder a fork server moves itself into before it forks, where there is one.
CGROUP_VAR = "SPARKTRAIN_TREE_CGROUP"
_PREFIX = "sparktrain-"
#: How long :meth:`Tree.close` waits for a killed tree's cgroup to empty.
EMPTY_WAIT = 2.0


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner_tag() -> str:
    """``<pid namespace>.<pid>.<start ticks>``: names this process as an owner, uniquely."""
    return f"{_pid_namespace()}.{os.getpid()}.{procfs.start_ticks(os.getpid()) or 0}"


def owner_dead(tag: str) -> bool:
    """Whether the process that made the tree ``tag`` is gone (``False`` when it cannot tell)."""
    try:
        namespace, pid, ticks, _ = tag.split(".")
    except ValueError:
        return False
    if int(namespace or 0) != _pid_namespace():  # another container's tree: never ours to judge
        return False
    return procfs.start_ticks(pid) != int(ticks)


def cgroup_home() -> Path | None:
    """This process's own cgroup v2 folder, where trees are made; ``None`` without cgroup v2."""
    try:
        own = next(
            line.split("::", 1)[1].strip()
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except (OSError, StopIteration):
        return None
    for line in mounts:
        before, _, after = line.partition(" - ")
        if after.split(" ", 1)[0] == "cgroup2":
            return Path(before.split()[4]) / own.lstrip("/")
    return None


class Tree:
    """The marks of one fork server's process tree, and the means to kill all of it."""

    def __init__(self) -> None:
        """Make a new tree owned by this process: a tag, and a cgroup where one can be made."""
        self.tag = f"{_owner_tag()}.{secrets.token_hex(4)}"
        self.cgroup: Path | None = None
        home = cgroup_home()
        if home is not None:
            with contextlib.suppress(OSError):
                (home / f"{_PREFIX}{self.tag}").mkdir()
                self.cgroup = home / f"{_PREFIX}{self.tag}"

    def environ(self, environ: dict[str, str]) -> dict[str, str]:
        """``environ`` with this tree's marks, for the fork server's start."""
        marked = dict(environ)
        outer = marked.get(TREE_VAR)
        marked[TREE_VAR] = f"{outer}:{self.tag}" if outer else self.tag
        marked.pop(CGROUP_VAR, None)
        if self.cgroup is not None:
            marked[CGROUP_VAR] = str(self.cgroup)
        return marked

    def kill(self) -> int:
        """SIGKILL every process of the tree; returns how many were found (0: it was empty)."""
        found = 0
        for _ in range(10):  # a process forked while we scanned is caught by the next round
            members = tagged().get(self.tag, set())
            if self.cgroup is not None:
                members |= _cgroup_members(self.cgroup)
                with contextlib.suppress(OSError):
                    (self.cgroup / "cgroup.kill").write_text("1")
            members.discard(os.getpid())
            if not members:
                return found
            found += len(members)
            for pid in members:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        return found

    def close(self) -> None:
        """Kill the tree and remove its cgroup."""
        self.kill()
        if self.cgroup is not None:
            _remove_cgroup(self.cgroup)


def join() -> None:
    """Move this process into the cgroup its caller made for it (the fork server, at start)."""
    folder = os.environ.get(CGROUP_VAR)
    if folder:
        with contextlib.suppress(OSError):
            Path(folder, "cgroup.procs").write_text(str(os.getpid()))


def _cgroup_members(folder: Path) -> set[int]:
    found: set[int] = set()
    for procs in folder.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            found.update(int(pid) for pid in procs.read_text().split())
    return found


def _remove_cgroup(folder: Path) -> None:
    """Remove ``folder`` and the cgroups inside it (nested runs), deepest first, once empty."""
    deadline = time.monotonic() + EMPTY_WAIT
    while True:
        inner = sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        try:
            for path in [*inner, folder]:
                with contextlib.suppress(FileNotFoundError):
                    path.rmdir()
            return
        except OSError:  # still populated for a moment after cgroup.kill
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)


def tagged() -> dict[str, set[int]]:
    """Every tree tag found in this user's processes' environments, with its processes."""
    found: dict[str, set[int]] = {}
    marker = f"{TREE_VAR}=".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                block = environ.read()
        except OSError:
            continue
        for item in block.split(b"\0"):
            if item.startswith(marker):
                for tag in item[len(marker) :].decode(errors="replace").split(":"):
                    found.setdefault(tag, set()).add(int(entry.name))
    return found


def sweep_stale() -> int:
    """Kill the trees whose owner is dead (their caller and fork server were killed at once).

    Returns how many processes were killed.
    """
    killed = 0
    for tag, pids in tagged().items():
        if owner_dead(tag):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
    home = cgroup_home()
    if home is not None:
        with contextlib.suppress(OSError):
            for folder in home.glob(f"{_PREFIX}*"):
                if owner_dead(folder.name[len(_PREFIX) :]):
                    with contextlib.suppress(OSError):
                        (folder / "cgroup.kill").write_text("1")
                    killed += len(_cgroup_members(folder))
                    _remove_cgroup(folder)
    return killed
