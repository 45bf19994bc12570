"""The background writer: one checkpoint written at a time while the loop goes on.

Each rank process has one :data:`WRITER`. ``save`` hands it a job (write this rank's part, then
publish) and returns; the job runs on a thread of its own. A second job waits for the first:
the staged buffers are reused, so there is never more than one checkpoint in flight and memory
stays bounded. A job's failure is kept and raised by the next :meth:`Writer.wait` (``save`` calls
it), on every rank, as a :class:`~sparktrain.ground.errors.CheckpointError`.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
from collections.abc import Callable

from sparktrain.ground.errors import CheckpointError
from sparktrain.rank import process_groups

#: A checkpoint's job: it writes, and returns what to do once the checkpoint is published.
Job = Callable[[], Callable[[], object] | None]


class Writer:
    """Runs checkpoint jobs one at a time, each on a thread, and keeps the first failure.

    A job returns what to do once its checkpoint is published (rank 0 prunes old ones), or
    ``None``. The next job may start at the publication: that tidying up goes on beside it
    (it never touches the staged buffers nor a checkpoint newer than the one published).
    """

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._published = threading.Event()
        self._published.set()

    def busy(self) -> bool:
        """Whether a checkpoint is still being written."""
        return not self._published.is_set()

    def join(self) -> None:
        """Wait for every job and its tidying up to end, without raising a failure."""
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join()
        self._threads = [t for t in self._threads if t.is_alive()]

    def wait(self) -> None:
        """Wait until the latest checkpoint is published (or failed); raise any failure since."""
        if not any(t is threading.current_thread() for t in self._threads):
            self._published.wait()
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
        afterwards = None
        try:
            afterwards = job()
        except BaseException as exc:  # kept for the loop's next save or wait
            with self._lock:
                self._error = self._error or exc
        finally:
            self._published.set()
        if afterwards is not None:
            with contextlib.suppress(Exception):  # tidying up is no part of the checkpoint
                afterwards()

    def run(self, job: Job) -> None:
        """Run ``job`` here and now (a blocking save), after the one in flight."""
        self.wait()
        self._published.clear()
        self._body(job)
        self.wait()

    def submit(self, job: Job) -> None:
        """Run ``job`` on a thread of its own, once the one in flight is published."""
        self.wait()
        self._published.clear()
        thread = threading.Thread(
            target=self._body, args=(job,), name="sparktrain-checkpoint", daemon=False
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()


#: The rank process's writer.
WRITER = Writer()
atexit.register(WRITER.join)  # a script that ends right after a save still publishes it
process_groups.BEFORE_DESTROY.append(WRITER.join)  # the writer's groups go with the default one
