"""Rank-tagged live log lines, with a rank filter and a tail kept for error messages.

Bytes from each rank's stdout and stderr are split into lines as they arrive and written at once
to the caller's ``sys.stdout`` / ``sys.stderr``, looked up at write time so that Jupyter's and
pytest's redirections see them. A partial line is held until its newline (or end of stream), so
lines of different ranks never interleave mid-line. Each rank keeps its last stderr lines for the
error message when it dies without a traceback.

A third stream, ``"report"``, carries ``sparktrain.report()`` records as JSON lines: they are not
printed but parsed and handed to :meth:`LogSink.reports`, which passes them to the run's
:class:`Monitor` (on the driver: the progress bar, ``on_report``) or, inside a
Spark task, sends them to the driver. A ``busy`` record (a rank building a C++ op) is not a
report: it goes to :meth:`LogSink.busy`, which a remote node's sink passes on to the driver. While
a progress bar is drawn, lines are written around it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import sys
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, TextIO

from sparktrain.rank.reporting import BUSY

Stream = Literal["stdout", "stderr", "report"]


class Monitor(Protocol):
    """What a sink hands reports to, and writes around (the driver's monitor is one)."""

    def reports(self, rank: int, records: list[dict[str, Any]]) -> None:
        """Take ``rank``'s reports, in order."""
        ...

    def around_bar(self) -> AbstractContextManager[None]:
        """A block in which lines can be written without tearing a progress bar."""
        ...


class LogSink:
    """Receives raw bytes from ranks and writes prefixed lines to the caller."""

    def __init__(
        self,
        shown: frozenset[int] | None = None,
        *,
        prefix: str = "[rank {rank}] ",
        tail_lines: int = 40,
        out: TextIO | None = None,
        err: TextIO | None = None,
        monitor: Monitor | None = None,
    ) -> None:
        """Create a sink.

        Args:
            shown: Ranks whose lines are written; ``None`` for all. Others are still kept in tails.
            prefix: Format of each line's prefix; ``{rank}`` and ``{host}`` are filled in.
            tail_lines: How many stderr lines to keep per rank.
            out: Where stdout lines go (default: ``sys.stdout`` at write time).
            err: Where stderr lines go (default: ``sys.stderr`` at write time).
            monitor: Receives the ranks' reports and draws the progress bar lines go around.
        """
        self.monitor = monitor
        self._shown = shown
        self._prefix = prefix
        self._out = out
        self._err = err
        self._partial: dict[tuple[int, Stream], bytes] = {}
        self._tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=tail_lines)
        )
        self._hosts: dict[int, str] = {}

    def set_host(self, rank: int, host: str) -> None:
        """Record the host of ``rank`` for the ``{host}`` field of the prefix."""
        self._hosts[rank] = host

    def feed(self, rank: int, stream: Stream, data: bytes) -> None:
        """Take a chunk of bytes a rank wrote; write out every complete line in it."""
        buf = self._partial.pop((rank, stream), b"") + data
        cut = buf.rfind(b"\n")
        if cut < 0:
            if len(buf) > 65536:  # a huge line without newline: write it rather than hold it
                self._emit(rank, stream, [buf.decode("utf-8", "replace")])
            else:
                self._partial[(rank, stream)] = buf
            return
        if cut + 1 < len(buf):
            self._partial[(rank, stream)] = buf[cut + 1 :]
        self._emit(rank, stream, buf[:cut].decode("utf-8", "replace").split("\n"))

    def close(self, rank: int, stream: Stream) -> None:
        """The stream ended: write its last line even without a newline."""
        rest = self._partial.pop((rank, stream), b"")
        if rest:
            self._emit(rank, stream, [rest.decode("utf-8", "replace")])

    def tail(self, rank: int) -> tuple[str, ...]:
        """The last stderr lines of ``rank``."""
        return tuple(self._tails.get(rank, ()))

    def _emit(self, rank: int, stream: Stream, lines: list[str]) -> None:
        if stream == "report":
            records = []
            for line in lines:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict):
                        records.append(record)
            busy = [r[BUSY] for r in records if BUSY in r]
            if busy:
                self.busy(rank, str(busy[-1]))
            records = [r for r in records if BUSY not in r]
            if records:
                self.reports(rank, records)
            return
        if stream == "stderr":
            self._tails[rank].extend(lines)
        if self._shown is not None and rank not in self._shown:
            return
        self.write(rank, stream, lines)

    def write(self, rank: int, stream: Stream, lines: list[str]) -> None:
        """Write whole lines of ``rank`` to the caller, prefixed (no filter, no tail)."""
        prefix = self._prefix.format(rank=rank, host=self._hosts.get(rank, ""))
        target = (self._err or sys.stderr) if stream == "stderr" else (self._out or sys.stdout)
        with self.monitor.around_bar() if self.monitor else contextlib.nullcontext():
            target.write("".join(f"{prefix}{line}\n" for line in lines))
            target.flush()

    def busy(self, rank: int, reason: str) -> None:
        """``rank`` is busy with ``reason`` (its agent already counted it as progress)."""

    def reports(self, rank: int, records: list[dict[str, Any]]) -> None:
        """Hand ``rank``'s parsed reports on (to the monitor; a Spark task sends them)."""
        if self.monitor is not None:
            self.monitor.reports(rank, records)
