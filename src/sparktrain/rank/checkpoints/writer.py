"""The background writer: one checkpoint written at a time while the loop goes on.

Each rank process has one :data:`WRITER`. ``save`` hands it a job (write this rank's part, then
publish) and returns; the job runs on a thread of its own. A second job waits for the first to
let go of the staged buffers (its publication, then the node's memory copy made from them): the
buffers are reused, so there is never more than one checkpoint in flight and memory stays
bounded. :meth:`Writer.wait` returns at the publication. A job's failure is kept and raised by
the next :meth:`Writer.wait` or save, on every rank, as a
:class:`~sparktrain.ground.errors.CheckpointError`.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
from collections.abc import Callable

from sparktrain.ground.errors import CheckpointError
from sparktrain.rank import process_groups

#: What to do once a checkpoint is published: first what still reads the staged buffers (the
#: next save waits for it), then tidying up (the next save may go on beside it).
After = tuple[Callable[[], object] | None, Callable[[], object] | None]

#: A checkpoint's job: it writes and publishes, and returns what to do afterwards.
Job = Callable[[], After | None]


class Writer:
    """Runs checkpoint jobs one at a time, each on a thread, and keeps the first failure.

    A job returns what to do once its checkpoint is published (:data:`After`), or ``None``: the
    node's memory copy, made from the staged buffers, which the next job waits for; then rank
    0's pruning of old checkpoints, which goes on beside the next job (it never touches the
    staged buffers nor a checkpoint newer than the one published).
    """

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._published = threading.Event()
        self._published.set()
        self._released = threading.Event()  # the staged buffers are free for the next job
        self._released.set()

    def busy(self) -> bool:
        """Whether a checkpoint still holds the staged buffers (written, or copied to memory)."""
        return not self._released.is_set()

    def join(self) -> None:
        """Wait for every job and its tidying up to end, without raising a failure."""
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join()
        self._threads = [t for t in self._threads if t.is_alive()]

    def wait(self) -> None:
        """Wait until the latest checkpoint is published (or failed); raise any failure since."""
        self._wait_for(self._published)

    def settle(self) -> None:
        """Wait until the staged buffers are free again (back-pressure); raise any failure."""
        self._wait_for(self._released)

    def _wait_for(self, event: threading.Event) -> None:
        if not any(t is threading.current_thread() for t in self._threads):
            event.wait()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(str(error)) from error

    def forget(self, why: str) -> None:
        """Drop a kept failure (saying so on stderr): it belongs to a world that is gone."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            print(f"sparktrain: a checkpoint write failed before {why}, and was not "
                  f"published: {error}", file=sys.stderr, flush=True)  # fmt: skip

    def _body(self, job: Job) -> None:
        hold, tidy = None, None
        try:
            hold, tidy = job() or (None, None)
        except BaseException as exc:  # kept for the loop's next save or wait
            with self._lock:
                self._error = self._error or exc
        finally:
            self._published.set()
        try:
            if hold is not None:
                hold()  # says its own failure: the checkpoint is published whatever it does
        finally:
            self._released.set()
        if tidy is not None:
            with contextlib.suppress(Exception):  # tidying up is no part of the checkpoint
                tidy()

    def run(self, job: Job) -> None:
        """Run ``job`` here and now (a blocking save), after the one in flight."""
        self._start()
        self._body(job)
        self.wait()

    def submit(self, job: Job) -> None:
        """Run ``job`` on a thread of its own, once the one in flight let go of the buffers."""
        self._start()
        thread = threading.Thread(
            target=self._body, args=(job,), name="sparktrain-checkpoint", daemon=False
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _start(self) -> None:
        self.settle()
        self._published.clear()
        self._released.clear()


#: The rank process's writer.
WRITER = Writer()
atexit.register(WRITER.join)  # a script that ends right after a save still publishes it
process_groups.BEFORE_DESTROY.append(WRITER.join)  # the writer's groups go with the default one
