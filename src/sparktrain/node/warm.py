"""The caller's side of the warm fork servers: start, reuse, and stop them.

One idle fork server is kept per caller process and reused by the next run with the same
environment; a run that finds none idle (the first run, or a concurrent one) starts its own.
A server started under another environment is replaced, because torch reads some variables at
import time. All servers stop when the caller exits (their socket closes), and
:func:`shutdown` stops them now.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparktrain.ground import proctree
from sparktrain.ground.errors import ClusterError
from sparktrain.node.forkserver import MAX_MESSAGE

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding sparktrain/
#: Variables that change without changing what a fork server imports (pytest sets the first
#: for every test); they do not make an idle server stale.
VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "PWD", "OLDPWD", "_"})


def _stable(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in VOLATILE}


class ForkServerError(ClusterError):
    """The fork server died or could not start (infrastructure: restarted under max_restarts)."""


class ForkServer:
    """A handle on one fork server process."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        """Start a fork server with ``environ`` (it imports torch before it serves)."""
        self.environ = dict(environ)
        proctree.sweep_stale()  # what an earlier caller killed with its fork server left
        self.tree = proctree.Tree()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = self.tree.environ(dict(environ))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sparktrain.node.forkserver", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches the caller, not the server
            )
        except BaseException:
            self.tree.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.broken = False

    def fileno(self) -> int:
        """The socket to wait on for events."""
        return self.sock.fileno()

    def spawn(self, key: int, request: Any, fds: Sequence[int]) -> None:
        """Ask for a rank to be forked; ``fds``: stdout, stderr, report, status, [listen socket]."""
        self._send({"op": "spawn", "key": key, "request": request}, fds)

    def signal(self, pid: int, sig: int, *, group: bool = True) -> None:
        """Send ``sig`` to a rank the server started: its whole process group, or it alone."""
        self._send({"op": "signal", "pid": pid, "sig": sig, "group": group}, ())

    def receive(self) -> dict[str, Any]:
        """Read one event; raises :class:`ForkServerError` if the server is gone."""
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except OSError as exc:
            data = b""
            reason = str(exc)
        else:
            reason = ""
        if not data:
            self.broken = True
            self.tree.kill()  # what its ranks started, reparented to init when it died
            code = self.process.poll()
            raise ForkServerError(
                f"sparktrain's fork server (pid {self.process.pid}) exited unexpectedly "
                f"(exit code {code}){f' ({reason})' if reason else ''}; its error, if any, is on "
                "the caller's stderr."
            )
        event: dict[str, Any] = pickle.loads(data)
        return event

    def _send(self, message: dict[str, Any], fds: Sequence[int]) -> None:
        try:
            socket.send_fds(self.sock, [pickle.dumps(message)], list(fds))
        except OSError as exc:
            self.broken = True
            raise ForkServerError(f"sparktrain's fork server is not reachable: {exc}") from exc

    @property
    def alive(self) -> bool:
        """Whether the server process runs and its socket works."""
        return not self.broken and self.process.poll() is None

    def close(self, wait: float = 5.0) -> None:
        """Stop the server: it kills any rank still alive, then exits."""
        with contextlib.suppress(OSError):
            self.sock.close()
        try:
            self.process.wait(wait)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.tree.close()


_lock = threading.Lock()
_idle: list[ForkServer] = []


def acquire(environ: Mapping[str, str]) -> ForkServer:
    """An idle fork server started with ``environ``, or a new one."""
    stale: list[ForkServer] = []
    found: ForkServer | None = None
    with _lock:
        while _idle:
            server = _idle.pop()
            if found is None and server.alive and _stable(server.environ) == _stable(environ):
                found = server
            else:
                stale.append(server)
    for server in stale:
        server.close()
    return found or ForkServer(environ)


def release(server: ForkServer) -> None:
    """Give a server back after a run, to be reused by the next one."""
    if not server.alive:
        server.close()
        return
    with _lock:
        if not _idle:
            _idle.append(server)
            return
    server.close()


#: How long :func:`shutdown` lets an idle server exit on its own before it kills it (seconds).
IDLE_EXIT_SECONDS = 0.2


def shutdown() -> None:
    """Stop every idle fork server now (they also stop when the caller exits).

    An idle server runs no rank, but may be importing what the next run would need (it warms
    at once after a run): that import does not look at the socket, so waiting for the server
    to see it closed cost a node's end about 2 s a server. It is killed after a moment instead.
    """
    with _lock:
        servers = list(_idle)
        _idle.clear()
    for server in servers:
        server.close(wait=IDLE_EXIT_SECONDS)


def _forget_in_child() -> None:
    # A process forked from the caller must not keep the servers' sockets open, or they would
    # not see the caller exit.
    for server in _idle:
        with contextlib.suppress(OSError):
            server.sock.close()
    _idle.clear()


atexit.register(shutdown)
os.register_at_fork(after_in_child=_forget_in_child)
