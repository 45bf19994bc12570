"""The warm fork server: one process per caller that has imported torch and forks fresh ranks.

Starting a rank costs a Python interpreter plus ``import torch`` (1-2 s here). The fork server pays
that once per caller: it imports torch and sparktrain's worker, then forks each rank on request, so
a rank starts in milliseconds. It never runs user code itself, so every rank is a fresh process
with no state from earlier runs. While idle (at once after a run ends, or 0.5 s after start-up), it
also imports ``torch._dynamo``, which the first ``DistributedDataParallel`` would otherwise
import in every rank (1-5 s).

Protocol: an anonymous ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair, so no other process can reach
it and it needs no secret. The client sends ``spawn`` (with the rank's stdout/stderr pipes and,
for rank 0, the store's listening socket, passed as file descriptors) and ``signal`` messages;
the server answers ``spawned`` and ``exited``. When the client's end closes (the caller exited or
was killed), the server kills every rank's process group and exits. Ranks also get
``PR_SET_PDEATHSIG`` so that they die with the server.

A caller may die while the server is still importing torch, with spawn requests already queued:
on an ``AF_UNIX`` socket those stay readable after the peer is gone. So before each fork the
server polls its socket for ``POLLHUP`` and forks nothing once the caller is gone, and each rank
checks once more, just before user code, that the server's parent is still the caller.
The server and the rank both put the rank in its own process group (``setpgid``), so a group
kill that follows a fork at once cannot miss it. The server is a child subreaper: a process a
rank started and left behind is reparented to it rather than to init, and killed when the run's
last rank has exited or when the server exits, whichever comes first.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import select
import signal
import socket
import sys
import time
from typing import Any

from sparktrain.ground import procfs, proctree
from sparktrain.rank.worker import RankFds

#: Imported before the server says it is ready: every rank needs them.
PRELOAD = ("torch", "torch.distributed", "sparktrain.rank.worker")
#: Imported while idle (no rank alive, nothing asked for a moment): only some runs need them.
WARM_LATER = ("torch._dynamo", "torch.nn.parallel")
IDLE_BEFORE_WARMING = 0.5
MAX_MESSAGE = 1 << 20
MAX_FDS = 5
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_CHILD_SUBREAPER = 36


class _BecomeRank(Exception):
    """Raised in a freshly forked child to leave the server loop and run a rank."""

    def __init__(self, request: Any, fds: RankFds, server: int, caller: int) -> None:
        super().__init__()
        self.request = request
        self.fds = fds
        self.server = server
        self.caller = caller


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        sock.send(pickle.dumps(message))


def _kill_group(pid: int, sig: int) -> None:
    """Signal ``pid``'s process group and ``pid`` itself (in case it is not yet its leader)."""
    if pid <= 1 or pid == os.getpgid(0):  # never our own group, whatever happens
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _children_of(parent: int) -> list[int]:
    """Live children of ``parent``, a single-threaded process (from ``/proc``)."""
    with (
        contextlib.suppress(OSError, ValueError),  # the kernel's own list, where it keeps one
        open(f"/proc/{parent}/task/{parent}/children") as listing,
    ):
        return [int(pid) for pid in listing.read().split()]
    return [
        int(entry.name)
        for entry in os.scandir("/proc")
        if entry.name.isdigit() and procfs.parent_of(entry.name) == parent
    ]


def _become_subreaper() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class _Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.caller = os.getppid()
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in _IGNORED:  # its lifetime follows the caller's socket, nothing else
            signal.signal(sig, signal.SIG_IGN)
        _become_subreaper()
        self.warm = list(WARM_LATER)
        self.served = False

    def serve(self) -> None:
        try:
            for name in PRELOAD:
                importlib.import_module(name)
            _send(self.sock, {"ev": "ready", "pid": self.pid})
            while self._step():
                pass
        finally:
            if os.getpid() == self.pid:  # not in a rank that is leaving the loop
                self._kill_everything()

    def _caller_gone(self) -> bool:
        """Whether the caller's end of the socket is closed (queued requests may remain)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))

    def _step(self) -> bool:
        idle = bool(self.warm) and not self.children
        # Before the first run, wait a moment so that a launch right away is not delayed; once a
        # run has ended, warm at once: back-to-back runs (sparktrain.tune's trials) would
        # otherwise never leave the server idle, and every rank would import these itself.
        pause = 0.0 if self.served else IDLE_BEFORE_WARMING
        waiting: list[int] = [self.sock.fileno(), self.wake_r]
        readable, _, _ = select.select(waiting, [], [], pause if idle else None)
        if not readable:
            importlib.import_module(self.warm.pop(0))
            return True
        if self.wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)
            self._reap()
        if self.sock.fileno() in readable:
            return self._handle()
        return True

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid not in self.children:  # an orphan a rank left, reparented to us: reaped
                continue
            self.children.discard(pid)
            _kill_group(pid, signal.SIGKILL)  # whatever the rank left behind in its group
            if not self.children:
                self._kill_strays()  # and what it left outside its group: the run is over
            _send(self.sock, {"ev": "exited", "pid": pid, "status": status, "time": time.time()})

    def _kill_strays(self) -> None:
        """Kill every process reparented to us that is not a rank (and, in turn, theirs)."""
        for _ in range(10):  # each round may reparent the grandchildren of what it killed
            strays = [pid for pid in _children_of(self.pid) if pid not in self.children]
            if not strays:
                return
            for pid in strays:
                _kill_group(pid, signal.SIGKILL)
            time.sleep(0.01)
            self._reap_quietly()

    def _reap_quietly(self) -> None:
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    return
                self.children.discard(pid)

    def _kill_everything(self) -> None:
        for pid in self.children:
            _kill_group(pid, signal.SIGKILL)
        self.children.clear()
        self._kill_strays()

    def _handle(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, MAX_FDS)
        except ConnectionResetError:
            data, fds = b"", []
        if not data:  # the caller is gone
            return False
        message = pickle.loads(data)
        if message["op"] == "spawn":
            if self._caller_gone():  # a request queued before the caller died: fork nothing
                for fd in fds:
                    os.close(fd)
                return False
            self._spawn(message, fds)
        elif message["op"] == "signal" and message["pid"] in self.children:
            if message.get("group", True):
                _kill_group(message["pid"], message["sig"])
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(message["pid"], message["sig"])
        return True

    def _spawn(self, message: dict[str, Any], fds: list[int]) -> None:
        out_fd, err_fd, report_fd, status_fd, *rest = fds
        pid = os.fork()
        if pid == 0:
            self._enter_child(out_fd, err_fd)
            rank_fds = RankFds(report=report_fd, status=status_fd, listen=rest[0] if rest else None)
            raise _BecomeRank(message["request"], rank_fds, self.pid, self.caller)
        with contextlib.suppress(OSError):  # the child does the same; whoever runs first wins
            os.setpgid(pid, pid)
        self.children.add(pid)
        self.served = True
        for fd in fds:
            os.close(fd)
        _send(self.sock, {"ev": "spawned", "key": message["key"], "pid": pid})

    def _enter_child(self, out_fd: int, err_fd: int) -> None:
        os.setpgid(0, 0)  # its own group, in the server's session (which has no terminal)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in _IGNORED:
            signal.signal(sig, signal.SIG_DFL)
        self.sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in (devnull, out_fd, err_fd):
            os.close(fd)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m sparktrain.node.forkserver FD``."""
    args = sys.argv[1:] if argv is None else argv
    proctree.join()  # before any fork: every process of the run is then in the tree's cgroup
    sock = socket.socket(fileno=int(args[0]))
    become: _BecomeRank | None = None
    try:
        _Server(sock).serve()
    except _BecomeRank as forked:
        become = forked
    if become is None:
        # The caller is gone or done: skip the interpreter's teardown of torch (0.5-1 s), which
        # the caller would otherwise wait for at exit.
        sys.stderr.flush()
        os._exit(0)
    # The rank runs outside the except block, so the user's exceptions do not carry this one
    # as their context ("During handling of the above exception ...").
    from sparktrain.rank.worker import exit_rank, run_rank

    code = 1
    try:
        code = run_rank(become.request, become.fds, become.server, become.caller)
    finally:
        exit_rank(code)


if __name__ == "__main__":
    main()
