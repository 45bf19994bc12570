"""One node's ranks: start them through a fork server, stream their logs, stop them together.

The agent runs one event loop in the calling thread (no helper threads, so Ctrl-C arrives where
it can be handled): it reads every rank's stdout and stderr pipes and the fork server's events.
When a rank exits non-zero, or the timeout passes, or the caller presses Ctrl-C, the agent sends
SIGTERM to every other rank's process group and SIGKILL after ``grace`` seconds. It returns only
when every rank has exited and its pipes are drained, so no line is lost and nothing survives.

Each rank also says on a status pipe when its outcome (value or failure) is recorded. What runs
after that is teardown: a rank still alive ``exit_grace`` seconds later (a non-daemon thread or an
``atexit`` handler that never ends, a native teardown that hangs) is killed, one warning line
says so, and the rank counts as having ended with the outcome it recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Literal

from sparktrain.contract.outcome import Control, NodeOutcome, RankExit
from sparktrain.contract.paths import stack_path, wait_path
from sparktrain.node import stacks
from sparktrain.node.logs import LogSink, Stream
from sparktrain.node.notice import Notice
from sparktrain.node.warm import ForkServer
from sparktrain.rank import extensions
from sparktrain.rank.worker import RankRequest

#: How long to keep reading pipes after every rank has exited (a grandchild may hold them).
DRAIN_SECONDS = 2.0
#: The hang clock's bound until every rank has started: the fork server may still be importing
#: torch (seconds, more on a loaded machine), which is no rank's doing. A server that never
#: starts a rank is still caught.
SPAWN_WAIT = 120.0
#: How long hung ranks get to write their stacks after SIGUSR1.
STACK_SECONDS = 3.0
#: The pipes each rank writes to: its output, its reports, and its status (outcome recorded).
_PIPES: tuple[Stream | Literal["status"], ...] = ("stdout", "stderr", "report", "status")


class NodeAgent:
    """Starts and supervises the ranks of one node."""

    def __init__(
        self,
        server: ForkServer,
        requests: Sequence[RankRequest],
        sink: LogSink,
        *,
        listen: socket.socket | None = None,
        timeout: float | None = None,
        grace: float = 3.0,
        control: Control | None = None,
        on_exit: Callable[[RankExit], None] | None = None,
        hang_timeout: float | None = None,
        exit_grace: float = 10.0,
        notice: Notice | None = None,
    ) -> None:
        """Prepare to run ``requests`` (one per rank) on ``server``.

        Args:
            server: The fork server that forks the ranks.
            requests: One request per local rank.
            sink: Receives every rank's output.
            listen: The bound socket on which rank 0 hosts the rendezvous store.
            timeout: Seconds before the ranks are stopped, or ``None``.
            grace: Seconds between SIGTERM and SIGKILL.
            control: Tells this node to stop when another node failed (multi-node backends).
            on_exit: Called with each rank's exit as soon as it is seen.
            hang_timeout: Seconds without output or report from any rank after which the
                ranks' stacks are taken and the node is stopped.
            exit_grace: Seconds a rank that recorded its outcome gets to exit before it is
                killed.
            notice: Set when the node gets a preemption notice (in place): the ranks get
                SIGTERM, and no SIGKILL follows; they leave at the end of their step.
        """
        self.server = server
        self.requests = list(requests)
        self.sink = sink
        self.listen = listen
        self.timeout = timeout
        self.grace = grace
        self.control = control
        self.on_exit = on_exit
        self.hang_timeout = hang_timeout
        self.exit_grace = exit_grace
        self.notice = notice
        self._finished: dict[int, tuple[int, float]] = {}  # rank -> (recorded code, when)
        self._lingering: set[int] = set()
        self._last_progress = time.monotonic()
        self._started = self._last_progress
        self._drain_until: float | None = None
        self.outcome = NodeOutcome()
        self._pids: dict[int, int] = {}
        self._ranks: dict[int, int] = {}
        self._signalled: set[int] = set()
        self._kill_at: float | None = None
        self._expected = 0  # ranks whose spawn request reached the server
        self._abandoned = False  # a spawn failed half-way: the server is closed at the end
        self._selector = selectors.DefaultSelector()

    def run(self) -> NodeOutcome:
        """Run the ranks to the end. Re-raises ``KeyboardInterrupt`` after stopping them."""
        try:
            self.start()
            self.step(None)
        except KeyboardInterrupt:
            if not self._abandoned:
                self.stop()
                with contextlib.suppress(KeyboardInterrupt):
                    self.step(None)
            raise
        finally:
            self.close()
        return self.outcome

    def start(self) -> None:
        """Ask the fork server for every rank (they start while :meth:`step` runs)."""
        self._started = time.monotonic()
        self._start()

    def step(self, wait: float | None) -> bool:
        """Handle the node's events for up to ``wait`` seconds (``None``: until the end).

        Returns whether the node is over: every rank has exited and its pipes are drained.
        """
        until = None if wait is None else time.monotonic() + wait
        while not self._over():
            now = time.monotonic()
            deadlines = self._deadlines()
            if until is not None:
                deadlines.append(until)
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            for key, _ in self._selector.select(timeout):
                if key.data is None:
                    self._on_event()
                elif key.data == "control":
                    self._on_control(key.fd)
                elif key.data == "notice":
                    self._pass_notice()
                else:
                    self._on_output(key.fd, *key.data)
            self._check_clocks(self._started)
            if until is not None and time.monotonic() >= until:
                return self._over()
        return True

    def stop(self) -> None:
        """Ask every rank still running to stop (SIGTERM now, SIGKILL after the grace period)."""
        if self.outcome.stop_time is None:
            self.outcome.stop_time = time.time()
        if self._kill_at is None and self._running():  # (re-)armed for ranks spawned late
            self._kill_at = time.monotonic() + self.grace
        for rank, pid in self._pids.items():
            if rank not in self.outcome.exits and rank not in self._signalled:
                self._signalled.add(rank)
                self.server.signal(pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL every rank still running, now (the exits are still seen and reported)."""
        if self.outcome.stop_time is None:
            self.outcome.stop_time = time.time()
        for rank, pid in self._running():
            self._signalled.add(rank)
            self.server.signal(pid, signal.SIGKILL)

    def _start(self) -> None:
        self._selector.register(self.server.fileno(), selectors.EVENT_READ, None)
        if self.control is not None:
            self._selector.register(self.control.fileno(), selectors.EVENT_READ, "control")
        if self.notice is not None:
            self._selector.register(self.notice.fileno(), selectors.EVENT_READ, "notice")
        for request in self.requests:
            pipes = [os.pipe() for _ in _PIPES]  # (read, write) for each of _PIPES
            fds = [w for _, w in pipes]
            if request.rank == 0 and self.listen is not None:
                fds.append(self.listen.fileno())
            for (r, _), stream in zip(pipes, _PIPES, strict=True):
                self._selector.register(r, selectors.EVENT_READ, (request.rank, stream))
            try:
                self.server.spawn(request.rank, request, fds)
                self._expected += 1
            except BaseException:
                # Unknown whether the server got the request (Ctrl-C mid-send): give up on this
                # server; closing it kills whatever it started.
                self._abandoned = True
                raise
            finally:
                for _, w in pipes:
                    os.close(w)
        self._last_progress = time.monotonic()
        if self.listen is not None:
            self.listen.close()

    def _pipes_open(self) -> bool:
        return any(isinstance(key.data, tuple) for key in self._selector.get_map().values())

    def _over(self) -> bool:
        if len(self.outcome.exits) < self._expected:
            return False
        if not self._pipes_open():
            return True
        now = time.monotonic()  # a grandchild may hold a pipe: read it a little longer
        self._drain_until = self._drain_until or now + DRAIN_SECONDS
        return now >= self._drain_until

    def _deadlines(self) -> list[float]:
        deadlines = [d for d in (self._drain_until, self._kill_at) if d is not None]
        deadlines += [t + self.exit_grace for _, t in self._unexited_finishers()]
        if self.timeout is not None and self.outcome.stop_time is None:
            deadlines.append(self._started + self.timeout)
        if self.hang_timeout is not None and self.outcome.stop_time is None:
            deadlines.append(self._last_progress + self._hang_bound())
        cut_off = self.control.deadline() if self.control is not None else None
        if cut_off is not None and self.outcome.stop_time is None:
            deadlines.append(cut_off)
        return deadlines

    def _hang_bound(self) -> float:
        """``hang_timeout``, counted from the last rank's start once every rank has started."""
        assert self.hang_timeout is not None
        if len(self._pids) < self._expected:
            return max(self.hang_timeout, SPAWN_WAIT)
        return self.hang_timeout

    def _check_clocks(self, started: float) -> None:
        now = time.monotonic()
        if (
            self.timeout is not None
            and self.outcome.stop_time is None
            and now - started >= self.timeout
        ):
            self.outcome.timed_out = True
            self.outcome.running_at_timeout = tuple(
                sorted(r.rank for r in self.requests if r.rank not in self.outcome.exits)
            )
            self.stop()
        if (
            self.hang_timeout is not None
            and self.outcome.stop_time is None
            and now - self._last_progress >= self._hang_bound()
        ):
            self._take_stacks()
            self.stop()
        cut_off = self.control.deadline() if self.control is not None else None
        if cut_off is not None and now >= cut_off and self.outcome.stop_time is None:
            self._cut_off()
        for rank, finished_at in self._unexited_finishers():
            if now >= finished_at + self.exit_grace:
                self._kill_lingering(rank)
        if self._kill_at is not None and now >= self._kill_at:
            for rank, pid in self._pids.items():
                if rank not in self.outcome.exits:
                    self.server.signal(pid, signal.SIGKILL)
            self._kill_at = None

    def _cut_off(self) -> None:
        """Nothing from the driver for the heartbeat timeout: this node must not train alone."""
        ranks = ", ".join(str(r.rank) for r in self.requests)
        line = (
            "sparktrain: heard nothing from the driver for the run's heartbeat_timeout (cut "
            f"off by the network, or the driver is gone); stopping ranks {ranks}\n"
        )
        with contextlib.suppress(OSError):  # the driver cannot hear it: this process's log can
            os.write(2, line.encode())
        self.stop()

    def _unexited_finishers(self) -> list[tuple[int, float]]:
        return [
            (rank, when)
            for rank, (_, when) in self._finished.items()
            if rank not in self.outcome.exits and rank not in self._lingering
        ]

    def _kill_lingering(self, rank: int) -> None:
        self._lingering.add(rank)
        self.server.signal(self._pids[rank], signal.SIGKILL)
        self.sink.write(
            rank,
            "stderr",
            [
                f"sparktrain: rank {rank} returned, but its process was still running "
                f"{self.exit_grace:g}s later (a non-daemon thread or an atexit handler that "
                "does not end); it was killed, and what it returned stands. Join your threads "
                "before returning to avoid this."
            ],
        )

    def _on_output(self, fd: int, rank: int, stream: Stream | Literal["status"]) -> None:
        data = os.read(fd, 1 << 16)
        if data:
            self._last_progress = time.monotonic()
            if stream == "status":
                code = 1 if data.strip() != b"0" else 0
                self._finished.setdefault(rank, (code, time.monotonic()))
            else:
                self.sink.feed(rank, stream, data)
            return
        if stream == "status":
            self._selector.unregister(fd)
            os.close(fd)
            return
        self._selector.unregister(fd)
        os.close(fd)
        self.sink.close(rank, stream)

    def _running(self) -> list[tuple[int, int]]:
        return [(r, pid) for r, pid in self._pids.items() if r not in self.outcome.exits]

    def _take_stacks(self) -> None:
        """Ask every running rank for its Python stacks and read where each one waits."""
        self.outcome.hung = True
        running = self._running()
        for _, pid in running:
            self.server.signal(pid, signal.SIGUSR1, group=False)
        run_dirs = {r.rank: r.run_dir for r in self.requests}
        waiting = [rank for rank, _ in running]
        sites = stacks.collect({r: stack_path(run_dirs[r], r) for r in waiting}, STACK_SECONDS)
        for rank, site in sites.items():  # a rank that waits on a build lock nobody holds
            lock = extensions.waited_lock(wait_path(run_dirs[rank], rank))
            if lock is not None:
                sites[rank] = dataclasses.replace(site, note=lock.describe())
        self.outcome.hang_sites = sites
        self.outcome.hang_silent = tuple(r for r in waiting if r not in self.outcome.hang_sites)

    def _on_control(self, fd: int) -> None:
        assert self.control is not None
        heard = self.control.receive()
        if heard == "stop":
            self._selector.unregister(fd)  # nothing more to hear; stop once
            self.stop()
        elif heard == "busy":  # another node's rank builds an op, and ours wait for it
            self._last_progress = time.monotonic()

    def _pass_notice(self) -> None:
        """Pass the node's preemption notice on to its running ranks (SIGTERM, no SIGKILL)."""
        if self.notice is not None and self.notice.take():
            for _, pid in self._running():
                self.server.signal(pid, signal.SIGTERM)
            self.notice.passed()

    def _on_event(self) -> None:
        event = self.server.receive()
        if event["ev"] == "spawned":
            rank, pid = event["key"], event["pid"]
            self._pids[rank] = pid
            self._ranks[pid] = rank
            self._last_progress = time.monotonic()  # a rank that starts is progress
            if self.outcome.stop_time is not None:
                self.stop()
        elif event["ev"] == "exited":
            rank = self._ranks[event["pid"]]
            code = os.waitstatus_to_exitcode(event["status"])
            if rank in self._finished:  # its outcome was recorded: that is how it ended
                code = self._finished[rank][0]
            lingered = rank in self._lingering
            ended = RankExit(rank, code, event["time"], rank in self._signalled, lingered)
            self.outcome.exits[rank] = ended
            if self.on_exit is not None:
                self.on_exit(ended)
            if code != 0:
                self.stop()

    def close(self) -> None:
        """Release the pipes; kill, through the server, ranks whose exit was not seen."""
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, tuple):
                with contextlib.suppress(OSError):
                    os.close(key.fd)
        self._selector.close()
        if self.listen is not None:
            self.listen.close()
        if self._abandoned or len(self.outcome.exits) < self._expected:
            # Ranks we could not see exit: closing the server kills them all.
            self.server.close()
