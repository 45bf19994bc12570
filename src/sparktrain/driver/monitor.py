"""The driver's side of ``sparktrain.report()``: the progress bar, ``on_report``, stop requests.

A :class:`Monitor` lives for one launch. Backends hand it every report their ranks send (in the
caller's thread: the local agent's loop, or the Spark driver's message loop). Rank 0's reports
drive a ``tqdm`` bar with rate, ETA and the latest metrics: text on a terminal, a widget in
Jupyter when ``ipywidgets`` is installed (text otherwise), nothing when the output is neither or
when ``progress=False``. ``on_report`` sees every report of every rank; when it returns ``True``
the run is stopped (every rank, cleanly) and the launch returns a result marked ``stopped``. The
monitor is the local agent's control (a pipe it can wait on) and is polled by the Spark driver.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

from sparktrain.rank.reporting import RESUMED_METRIC

OnReport = Callable[[int, dict[str, Any]], "bool | None"]


def output_is_interactive() -> bool:
    """Whether the caller's output is a terminal or a Jupyter notebook."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if type(shell).__name__ == "ZMQInteractiveShell":
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _in_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell"


class Monitor:
    """Receives one run's reports; draws its bar; carries stop requests to the backend."""

    def __init__(
        self, *, progress: bool | None = None, on_report: OnReport | None = None, label: str = ""
    ) -> None:
        """Create the monitor of one launch.

        Args:
            progress: Draw a bar from rank 0's reports: ``True``, ``False``, or ``None`` for
                when the output is a terminal or a notebook.
            on_report: Called with ``(rank, record)`` for every report; ``True`` stops the run.
                A record has ``step``, ``total``, ``metrics`` (a dict) and ``time``.
            label: The bar's description.
        """
        self.show_bar = output_is_interactive() if progress is None else bool(progress)
        self.on_report = on_report
        self.label = label or "sparktrain"
        self.latest: dict[str, Any] | None = None
        self.error: BaseException | None = None
        #: Called with the checkpoint step rank 0 of an elastic run resumed from.
        self.on_resumed: Callable[[int], None] | None = None
        self._bar: Any = None
        self._stop = False
        self._lock = threading.Lock()
        self._read, self._write = os.pipe()

    # -- reports ----------------------------------------------------------------------------
    def reports(self, rank: int, records: list[dict[str, Any]]) -> None:
        """Take ``rank``'s reports, in order."""
        for record in records:
            resumed = (record.get("metrics") or {}).get(RESUMED_METRIC)
            if resumed is not None:  # sparktrain's own record: not the user's, not a step
                if rank == 0 and isinstance(resumed, int) and self.on_resumed is not None:
                    self.on_resumed(resumed)
                continue
            if rank == 0:
                self.latest = record
            if self.on_report is not None and self.error is None:
                try:
                    if self.on_report(rank, record):
                        self.request_stop()
                except Exception as exc:  # the run stops; the launch raises it afterwards
                    self.error = exc
                    self.request_stop()
        if rank == 0 and self.show_bar and self.latest is not None:
            self._draw(self.latest)

    def _draw(self, record: dict[str, Any]) -> None:
        step, total = record.get("step"), record.get("total")
        if self._bar is None:
            self._bar = _new_bar(self.label, total)
        bar = self._bar
        if total is not None and bar.total != total:
            bar.total = total
        metrics = record.get("metrics") or {}
        if metrics:
            bar.set_postfix(metrics, refresh=False)
        if isinstance(step, int):
            if step < bar.n:  # a restarted group counts again
                bar.reset(total=bar.total)
            bar.update(step - bar.n)
        elif step is None:
            bar.update(1)

    @contextlib.contextmanager
    def around_bar(self) -> Iterator[None]:
        """Write log lines without tearing the bar (it is cleared and drawn again)."""
        bar = self._bar
        if bar is None or not hasattr(bar, "clear") or _in_notebook():
            yield
            return
        bar.clear()
        try:
            yield
        finally:
            bar.refresh()

    # -- stopping ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the backend to stop every rank (safe to call more than once)."""
        with self._lock:  # another thread may ask while the run closes
            if not self._stop and self._write >= 0:
                os.write(self._write, b"x")
            self._stop = True

    def fileno(self) -> int:
        """A descriptor that becomes readable when a stop is requested (for the local agent)."""
        return self._read

    def stop_requested(self) -> bool:
        """Whether a stop was requested."""
        return self._stop

    def receive(self) -> Literal["stop"] | None:
        """For the local node's agent: ``"stop"`` once a stop was requested."""
        return "stop" if self._stop else None

    def deadline(self) -> float | None:
        """The local node cannot be cut off from its own caller: never."""
        return None

    def close(self) -> None:
        """Leave the bar as it ended and release the pipe."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        with self._lock:
            for fd in (self._read, self._write):
                if fd >= 0:
                    os.close(fd)
            self._read = self._write = -1


def _new_bar(label: str, total: int | None) -> Any:
    if _in_notebook():
        with contextlib.suppress(ImportError):
            import ipywidgets  # noqa: F401  (tqdm.notebook needs it; text bar otherwise)
            from tqdm.notebook import tqdm as notebook_tqdm

            return notebook_tqdm(total=total, desc=label, unit="step")
    from tqdm import tqdm

    size: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        columns, lines = os.get_terminal_size(sys.stderr.fileno())
        if not lines:  # a pseudo-terminal nobody sized: tqdm would hide the bar
            size["nrows"] = 24
        if not columns:
            size["ncols"] = 100
    return tqdm(
        total=total, desc=label, unit="step", file=sys.stderr, dynamic_ncols=not size, **size
    )


def say(line: str, monitor: Monitor | None = None) -> None:
    """Print the driver's ``line`` on stderr, around the monitor's progress bar if it has one."""
    with monitor.around_bar() if monitor is not None else contextlib.nullcontext():
        print(line, file=sys.stderr, flush=True)
