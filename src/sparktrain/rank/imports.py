"""A long import is progress: the rank says ``busy`` while its main thread imports on the CPU.

Importing DeepSpeed, Transformers or TensorFlow takes seconds on a quiet machine and many more
on a loaded one, and prints nothing: to ``hang_timeout`` it looked like a hang (a fresh-clone
run with one core busy stopped a DeepSpeed run with ``hang_timeout=5`` inside ``import
deepspeed``). So while ``hang_timeout`` is set, one daemon thread looks at the rank's main thread
every half second; when it is inside an import (``importlib``'s ``_find_and_load`` is on its
stack) and has used the CPU since the last look, the rank sends ``busy`` ("importing
deepspeed"), which resets the hang clock as a build does (:mod:`sparktrain.rank.extensions`).

An import that waits instead (a module that enters a collective or takes a lock at import, a
deadlock between threads' imports) uses no CPU, so the hang clock runs and the hang report
names where it waits, as before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from types import FrameType

from sparktrain.ground import procfs
from sparktrain.rank import reporting

#: Seconds between two looks at the main thread.
EVERY = 0.5
#: CPU seconds the main thread must have used since the last look for an import to count.
MIN_CPU = 0.02
_LOADER = "_find_and_load"
_UTIME, _STIME = 11, 12  # in procfs.stat_fields' numbering (proc(5)'s utime and stime)


def importing(frame: FrameType | None) -> str | None:
    """The outermost module being imported in the stack ending at ``frame``, or ``None``."""
    name: str | None = None
    while frame is not None:
        if frame.f_code.co_name == _LOADER and frame.f_code.co_filename.startswith("<frozen"):
            with contextlib.suppress(Exception):
                found = frame.f_locals.get("name")
                name = found if isinstance(found, str) else name or "a module"
        frame = frame.f_back
    return name


def _cpu_seconds(tid: int) -> float | None:
    """CPU seconds thread ``tid`` of this process has used (``/proc``), or ``None``."""
    fields = procfs.stat_fields(f"self/task/{tid}")
    if fields is None:
        return None
    return (int(fields[_UTIME]) + int(fields[_STIME])) / os.sysconf("SC_CLK_TCK")


def _watch(main: threading.Thread, tid: int) -> None:
    last, ident = _cpu_seconds(tid), main.ident or -1
    while main.is_alive():
        time.sleep(EVERY)
        now = _cpu_seconds(tid)
        if now is None or last is None:
            return
        used, last = now - last, now
        if used < MIN_CPU:
            continue
        name = importing(sys._current_frames().get(ident))
        if name is not None:
            reporting.busy(f"importing {name.split('.')[0]}")


def watch() -> None:
    """Start the watcher thread for the calling thread, the rank's main one (once).

    The thread's id is taken here: after a fork, ``threading`` may still hold the parent's.
    """
    if any(t.name == "sparktrain-imports" for t in threading.enumerate()):
        return
    here = (threading.current_thread(), threading.get_native_id())
    thread = threading.Thread(target=_watch, args=here, name="sparktrain-imports", daemon=True)
    thread.start()
