"""``sparktrain.report()``: cheap progress messages from inside a rank to its node agent.

Each call is one ``os.write`` of a short JSON line to a non-blocking pipe that the agent reads;
when the pipe is full the report is dropped rather than slowing training. Reports count as
progress for hang detection (``hang_timeout=``). Outside a rank started by sparktrain,
``report`` does nothing, so training code can call it unconditionally.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

_fd: int | None = None


def attach(fd: int) -> None:
    """Use ``fd`` for this rank's reports (called by the worker before user code runs)."""
    global _fd  # noqa: PLW0603 - one pipe per rank process, set once
    os.set_blocking(fd, False)
    _fd = fd


def report(step: int | None = None, total: int | None = None, **metrics: Any) -> None:
    """Tell the driver this rank made progress (and, optionally, where it is and how it does).

    Args:
        step: The current step (or epoch), if counted.
        total: The number of steps, if known.
        **metrics: Numbers to show with the progress, e.g. ``loss=0.41``.
    """
    if _fd is None:
        return
    line = json.dumps({"time": time.time(), "step": step, "total": total, "metrics": metrics})
    with contextlib.suppress(BlockingIOError, BrokenPipeError):  # best effort: never block
        os.write(_fd, line.encode() + b"\n")
