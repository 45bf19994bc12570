"""A Ray that sparktrain started ends with its caller, however the caller ends.

``ray.init()`` with no cluster to join starts a local one (GCS, raylet, workers, agents) as the
caller's children. On a normal exit Ray's own exit hook stops it, and Ray asks the kernel to kill
its GCS and raylet when the caller dies; but the helpers those start are reparented to init, and
nothing in Ray tests that they go. So when sparktrain starts a Ray it also starts a keeper:

    python -c "from sparktrain.backends.ray.keeper import main; main()" CALLER START_TICKS SESSION

a small process in its own session (Ctrl-C at a terminal does not reach it) that polls the caller
every :data:`POLL` seconds. Once the caller is gone it ends every process of that Ray session (by
the session folder on their command lines, and their descendants): :data:`GRACE` seconds to exit
on their own, then SIGKILL. It exits as soon as the session has no process left (the caller, or
sparktrain, called ``ray.shutdown()``), so it never outlives the Ray it keeps. A Ray the user
started (``ray.init()`` before the launch, or an address to join) gets no keeper and is never
touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from sparktrain.backends.ray import procs
from sparktrain.ground import procfs

POLL = 0.2
#: How long the session's processes get to exit once the caller is gone, before SIGKILL.
GRACE = 3.0
#: How often the keeper looks whether the session still has processes.
LOOK = 1.0


def session_dir(ray: Any) -> str | None:
    """The session folder of the Ray this process started, or ``None`` if it joined one."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not getattr(node, "head", False):
        return None
    return str(node.get_session_dir_path())


def watch(session: str) -> subprocess.Popen[bytes]:
    """Start a keeper for the Ray session ``session``, started by this process."""
    me = os.getpid()
    # Not ``-m``: the package imports this module, and runpy warns when it runs one so imported.
    run = f"from {__name__} import main; main()"
    return subprocess.Popen(
        [sys.executable, "-c", run, str(me), str(procfs.start_ticks(me)), session],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def keep(caller: int, ticks: int, session: str) -> int:
    """Wait for the caller to die, then end the session's processes; returns how many were left.

    Returns 0 at once when the session ends first.
    """
    # Known while the caller lives: Ray's workers do not name the session on their command
    # line, and once the raylet has died with the caller they are no longer its descendants.
    known = procs.matching([session])
    next_look = time.monotonic() + LOOK
    while procfs.start_ticks(caller) == ticks:
        time.sleep(POLL)
        if time.monotonic() > next_look:
            next_look = time.monotonic() + LOOK
            known = procs.alive(known) | procs.matching([session])
            if not known:
                return 0
    return len(procs.end(known | procs.matching([session]), grace=GRACE))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the keeper process: ``argv`` (or ``sys.argv[1:]``) is CALLER TICKS SESSION."""
    caller, ticks, session = argv or sys.argv[1:]
    sys.exit(1 if keep(int(caller), int(ticks), session) else 0)


if __name__ == "__main__":
    main()
