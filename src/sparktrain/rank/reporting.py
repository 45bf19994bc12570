"""``sparktrain.report()`` and ``sparktrain.progress()``: cheap progress from inside a rank.

Each report becomes one short JSON line written to a non-blocking pipe that the rank's node agent
reads. The agent forwards the reports to the driver, where rank 0's drive the progress bar and
feed ``sparktrain.tune``'s schedulers; every report also counts as progress for hang detection
(``hang_timeout=``).

Reports are cheap by construction: a call costs a ``time.monotonic()`` and a dict when the last
write was less than :data:`MIN_INTERVAL` ago (the newest report then waits for the next call or
the rank's exit, so the latest one always arrives), and one ``os.write`` otherwise. When the pipe
is full the report is dropped rather than slowing training. Outside a rank started by
sparktrain, both functions only do their local work, so training code can call them
unconditionally.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

#: Reports closer together than this (seconds) are coalesced: the newest one wins.
MIN_INTERVAL = 0.05

T = TypeVar("T")


class _Pipe:
    """This rank's report pipe (one per rank process, attached once) and the report held back."""

    fd: int | None = None
    last_write = 0.0
    pending: dict[str, Any] | None = None


_pipe = _Pipe()


#: The metric rank 0 of an elastic run reports when it resumed from a checkpoint (its step).
RESUMED_METRIC = "sparktrain.resumed_step"
#: The key of a record that says the rank is busy with work it has no steps for (a C++ build):
#: it counts as progress for ``hang_timeout`` on every node of the run, and is not a report.
BUSY = "busy"


def attach(fd: int) -> None:
    """Use ``fd`` for this rank's reports (called by the worker before user code runs)."""
    os.set_blocking(fd, False)
    _pipe.fd, _pipe.pending, _pipe.last_write = fd, None, 0.0


def report(step: int | None = None, total: int | None = None, **metrics: Any) -> None:
    """Tell the driver this rank made progress (and, optionally, where it is and how it does).

    Rank 0's reports drive the progress bar on the driver (with rate, ETA and the latest
    metrics) and are what ``sparktrain.tune`` reads; other ranks' reports count as liveness for
    ``hang_timeout=``.

    Args:
        step: The current step (or epoch), counted from 1, if counted.
        total: The number of steps, if known (the bar shows an ETA with it).
        **metrics: Numbers to show with the progress, e.g. ``loss=0.41``. Values must be
            JSON numbers or strings; tensors are converted with ``float()``.
    """
    if _pipe.fd is None:
        return
    _pipe.pending = {"step": step, "total": total, "metrics": metrics}
    now = time.monotonic()
    if now - _pipe.last_write >= MIN_INTERVAL or (step is not None and step == total):
        _pipe.last_write = now
        flush()


def busy(reason: str) -> None:
    """Tell the agent that this rank is busy with ``reason``, which is progress (thread-safe).

    Written at once and never coalesced: a report held back stays held back. A line shorter
    than the pipe's atomic size, so it never interleaves with another thread's report.
    """
    if _pipe.fd is None:
        return
    line = json.dumps({BUSY: reason[:200], "time": time.time()}).encode() + b"\n"
    with contextlib.suppress(BlockingIOError, BrokenPipeError):
        os.write(_pipe.fd, line)


def flush() -> None:
    """Write the report still waiting, if any (the worker calls this when the rank ends)."""
    if _pipe.fd is None or _pipe.pending is None:
        return
    record, _pipe.pending = _pipe.pending, None
    record["time"] = time.time()
    try:
        line = json.dumps(record, default=_number)
    except (TypeError, ValueError):
        metrics = {k: _number(v) for k, v in record["metrics"].items()}
        line = json.dumps({**record, "metrics": metrics}, default=str)
    with contextlib.suppress(BlockingIOError, BrokenPipeError):  # best effort: never block
        os.write(_pipe.fd, line.encode() + b"\n")


def _number(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def progress(iterable: Iterable[T], total: int | None = None, **metrics: Any) -> Iterator[T]:
    """Yield from ``iterable``, reporting the step after each item (a progress bar's loop).

    ``for batch in sparktrain.progress(loader): ...`` reports ``step=1, 2, ...`` with ``total``
    taken from ``len(iterable)`` when it has one.

    Args:
        iterable: What the loop walks over.
        total: The number of items, when ``len(iterable)`` does not say.
        **metrics: Constant values to show with every report (e.g. ``epoch=3``).
    """
    if total is None:
        with contextlib.suppress(TypeError):
            total = len(iterable)  # type: ignore[arg-type]
    for step, item in enumerate(iterable, start=1):
        yield item
        report(step=step, total=total, **metrics)
