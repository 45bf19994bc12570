"""A preemption notice to a node (SIGTERM to its process), passed on to its ranks.

In an in-place elastic run (``in_place=True``) a node process that gets SIGTERM (the cloud's or
the cluster manager's warning before a machine goes) does not stop its ranks: it passes the
SIGTERM on to them, and each leaves the group at the end of its current step, which commits
everywhere (:mod:`sparktrain.rank.inplace`); the node then ends as its ranks do, reporting as
usual. The signal handler only writes a byte to a pipe, which the node agent's loop watches.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Notice:
    """A pipe that a signal handler may set and the agent's selector watches."""

    def __init__(self, tell: Callable[[], None] | None = None) -> None:
        """Open the pipe (non-blocking at both ends); ``tell`` is called once it is passed on."""
        self.tell = tell
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        """The end to watch."""
        return self._read

    def set(self) -> None:
        """Note the notice (safe in a signal handler)."""
        with contextlib.suppress(OSError):  # the pipe is full: a notice is pending already
            os.write(self._write, b"n")

    def take(self) -> bool:
        """Whether a notice came since the last look."""
        try:
            return bool(os.read(self._read, 4096))
        except BlockingIOError:
            return False

    def passed(self) -> None:
        """The ranks have the notice: tell whoever wants to know (the driver)."""
        if self.tell is not None:
            self.tell()

    def close(self) -> None:
        """Close both ends."""
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def on_sigterm(notice: Notice | None) -> Iterator[None]:
    """While inside, SIGTERM sets ``notice`` (main thread only; ``None``: nothing changes)."""
    if notice is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    before: Any = signal.signal(signal.SIGTERM, lambda signum, frame: notice.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
