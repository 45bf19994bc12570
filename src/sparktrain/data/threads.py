"""DataLoader workers as threads of the rank: no hand-off between processes at all.

pyarrow releases the GIL while it reads and decodes, and torch while it copies and gathers, so
threads overlap much of a worker's work with the training step without a second process: the
batches are the rank's own tensors (no copy, no shared memory), and the memory is the rank's.
What holds the GIL (Python code in a ``transform``, the reader's bookkeeping) runs one thread at a
time, so threads cannot spread a transform's Python over cores as worker processes do. On a
2-core machine threads were the faster of the two without a ``transform`` and the slower with
one (docs/data.md, "Workers").

Each thread has a bounded queue of ``prefetch`` batches; the threads are taken in turn, as
processes are. The threads stop when the pass ends, breaks or fails; an error in a thread is
raised at the batch it would have been.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

_END = object()
#: Seconds a thread waits on a full queue before it looks whether it should stop.
_POLL = 0.1
#: Seconds to wait for a stopping thread.
_JOIN = 30.0
#: Seconds to wait for each when the interpreter exits.
_EXIT_JOIN = 5.0
#: Pools whose threads may still run: stopped before the interpreter exits, since a daemon
#: thread that holds a tensor when Python tears it down aborts the process (SIGABRT).
_LIVE: weakref.WeakSet[ThreadWorkers] = weakref.WeakSet()
#: The torch thread counts to put back on a thread, where a pass ended on another one.
_PUT_BACK: dict[int, tuple[int, int]] = {}


def _stop_all() -> None:
    for pool in list(_LIVE):
        pool.close(timeout=_EXIT_JOIN)


atexit.register(_stop_all)


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class ThreadWorkers:
    """``workers`` threads, each streaming ``produce(n)``; iterate for their batches in turn."""

    def __init__(
        self, produce: Callable[[int], Iterator[Any]], workers: int, *, prefetch: int = 2
    ) -> None:
        """Start the threads."""
        self.stop, self.closed = threading.Event(), False
        self.queues: list[queue.Queue[Any]] = [
            queue.Queue(max(1, prefetch)) for _ in range(workers)
        ]
        self.threads = [
            threading.Thread(
                target=self._run, args=(produce, n), name=f"sparktrain-data-{n}", daemon=True
            )
            for n in range(workers)
        ]
        _LIVE.add(self)
        for thread in self.threads:
            thread.start()

    def _run(self, produce: Callable[[int], Iterator[Any]], number: int) -> None:
        out = self.queues[number]
        try:
            for batch in produce(number):
                if not self._put(out, batch):
                    return
            self._put(out, _END)
        except BaseException as exc:
            self._put(out, _Failed(exc))

    def _put(self, out: queue.Queue[Any], item: Any) -> bool:
        while not self.stop.is_set():
            try:
                out.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        """Every thread's batches in turn; the threads stop at the end (or a break)."""
        ended = [False] * len(self.queues)
        try:
            while not all(ended):
                for number, source in enumerate(self.queues):
                    if ended[number]:
                        continue
                    item = source.get()
                    if item is _END:
                        ended[number] = True
                    elif isinstance(item, _Failed):
                        raise item.error
                    else:
                        yield item
        finally:
            self.close()

    def close(self, timeout: float = _JOIN) -> None:
        """Stop the threads and wait for them: each stops at its next batch.

        A daemon thread stuck in a read is left to the process's end, not waited on for ever.
        (Closed by one of its own threads, when the garbage collector runs there, that thread
        stops by itself.)
        """
        if self.closed:  # (again, as the interpreter exits: this module may be torn down)
            return
        self.closed = True
        self.stop.set()
        _LIVE.discard(self)
        me = threading.current_thread()
        for thread in self.threads:
            if thread is not me:
                thread.join(timeout=timeout)


@contextlib.contextmanager
def rank_threads(workers: int) -> Iterator[None]:
    """While ``workers`` readers run beside the rank, its torch uses the cores they leave.

    torch's intra-op threads wait for work by spinning: on 2 cores, a rank with 2 intra-op
    threads and 2 worker processes ran at 0.64x a plain scan, and at 1.0x with 1 thread
    (docs/data.md, "Workers"); a thread reading ahead in the rank lost to them the same way.
    Never raised; put back when the pass ends, breaks or fails, unless the count was set to
    another inside the pass (that one is kept). torch's count is the calling
    thread's: where the pass ends on another thread (the garbage collector freed it there), the
    count is put back when this thread starts its next pass.
    """
    import torch

    owner, finalizing, threads = threading.get_ident(), sys.is_finalizing, torch.set_num_threads
    lowered, back = _PUT_BACK.pop(owner, (0, 0))
    if lowered and torch.get_num_threads() == lowered:  # (unless changed since)
        threads(back)
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    wanted = max(1, min(before, (cores or 1) - workers))
    if wanted != before:
        threads(wanted)
    try:
        yield
    finally:
        if wanted != before and not finalizing():
            if threading.get_ident() != owner:
                _PUT_BACK[owner] = (wanted, before)
            elif torch.get_num_threads() == wanted:  # (a count set inside the loop is kept)
                threads(before)
