"""The background writer: one checkpoint written at a time while the loop goes on.

Each rank process has one :data:`WRITER`. ``save`` hands it a job (write this rank's part, then
publish) and returns; the job runs on a thread of its own. A second job waits for the first:
the staged buffers are reused, so there is never more than one checkpoint in flight and memory
stays bounded. A job's failure is kept and raised by the next :meth:`Writer.wait` (``save`` calls
it), on every rank, as a :class:`~sparktrain.ground.errors.CheckpointError`.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable

from sparktrain.ground.errors import CheckpointError
from sparktrain.rank import process_groups


class Writer:
    """Runs checkpoint jobs one at a time, on a thread, and keeps the first failure."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.published: object = None

    def busy(self) -> bool:
        """Whether a job is still running."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def join(self) -> None:
        """Wait for the running job, if any, without raising its failure."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wait(self) -> None:
        """Wait for the running job; raise the failure of any job since the last call."""
        self.join()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(str(error)) from error

    def run(self, job: Callable[[], object]) -> None:
        """Run ``job`` here and now (a blocking save), after any job still running."""
        self.wait()
        self.published = job()

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` on a thread of its own, after any job still running."""
        self.wait()

        def body() -> None:
            try:
                self.published = job()
            except BaseException as exc:  # kept for the loop's next save or wait
                with self._lock:
                    self._error = self._error or exc

        thread = threading.Thread(target=body, name="sparktrain-checkpoint", daemon=False)
        self._thread = thread
        thread.start()


#: The rank process's writer.
WRITER = Writer()
atexit.register(WRITER.join)  # a script that ends right after a save still publishes it
process_groups.BEFORE_DESTROY.append(WRITER.join)  # the writer's groups go with the default one
