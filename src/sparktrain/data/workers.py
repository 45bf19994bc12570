"""DataLoader worker processes that hand batches to the rank through reused slots (``slots.py``).

One worker process per stream, forked from the rank (as torch's DataLoader forks its workers):
it reads its stream (``StreamingDataset.stream(slot, workers)``), runs the ``transform``, and
copies each batch into a slot of its own. A message on a socket pair says which slot holds the
batch and where each column lies; the rank turns the slot into tensors without a copy.

Flow control is by credit: a worker may run ``prefetch`` batches ahead of the rank. With each
batch it takes, the rank gives one credit back, with the slots it found unused again; a worker
with credit and no free slot makes a new one (the training loop kept a batch). Workers are taken
in turn, as torch's DataLoader takes them, so the order of batches, and with it
``state_dict()``'s arithmetic, is the same with either.

Nothing outlives the loader: workers die with the rank (``PR_SET_PDEATHSIG``), are killed when
the pass ends, breaks or fails, and an error in a worker comes back as the exception, with the
worker's traceback, at the batch it would have been.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import pickle
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from sparktrain.data.slots import Column, Slot, entries, layout, rebuild
from sparktrain.data.threads import rank_threads
from sparktrain.ground import procfs
from sparktrain.ground.errors import ConfigError

_HEADER = struct.Struct("!Q")


def _send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _send_with(sock: socket.socket, message: Any, fd: int) -> None:
    """Send ``message`` with a file descriptor (``SCM_RIGHTS``): the peer gets its own copy."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    framed = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [framed], [fd])
    if sent < len(framed):
        sock.sendall(framed[sent:])


def _receive(sock: socket.socket) -> Any:
    head = _exact(sock, _HEADER.size)
    return pickle.loads(_exact(sock, _HEADER.unpack(head)[0]))


def _receive_with(sock: socket.socket) -> tuple[Any, list[int]]:
    """A message and the descriptors sent with it (they come with its first bytes)."""
    head, fds = b"", []
    while len(head) < _HEADER.size:
        data, got, _flags, _address = socket.recv_fds(sock, _HEADER.size - len(head), 4)
        fds.extend(got)
        if not data:
            for fd in fds:
                os.close(fd)
            raise EOFError("the peer closed the connection")
        head += data
    for fd in fds:
        os.set_inheritable(fd, False)
    return pickle.loads(_exact(sock, _HEADER.unpack(head)[0])), fds


def _exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class WorkerError(RuntimeError):
    """A DataLoader worker failed; the message carries its exception and traceback."""


# -- inside the worker ------------------------------------------------------------------------
class _Producer:
    """A worker's end: its slots, its credit, and the loop that fills them."""

    def __init__(self, sock: socket.socket, prefetch: int) -> None:
        self.sock = sock
        self.credit = prefetch
        self.slots: dict[int, Slot] = {}
        self.free: list[int] = []

    def _hear(self, block: bool) -> None:
        """Take the rank's credits and freed slots: wait for one message if ``block``."""
        while True:
            if not block:
                try:
                    waiting = self.sock.recv(_HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return
                if not waiting:
                    raise EOFError("the rank closed the connection")
            credit, freed = _receive(self.sock)  # a whole message: one sendall of a few bytes
            self.credit += credit
            self.free.extend(freed)
            block = False

    def _slot_for(self, need: int) -> Slot:
        for number in self.free:
            if self.slots[number].size >= need:  # smaller ones wait for smaller batches
                self.free.remove(number)
                return self.slots[number]
        slot = Slot.create(len(self.slots), need)
        self.slots[slot.number] = slot
        _send_with(self.sock, ("slot", slot.number, slot.size), slot.fd)
        return slot

    def put(self, batch: Any) -> None:
        self._hear(block=False)
        while self.credit <= 0:
            self._hear(block=True)
        found = entries(batch)
        if found is None:
            _send(self.sock, ("object", batch))  # no tensors to place: sent as it is
        else:
            kind, named = found
            columns, rest, need = layout(named)
            slot = self._slot_for(need) if columns else None
            if slot is not None:
                slot.write(named, columns)
            number = slot.number if slot else -1
            _send(self.sock, ("batch", number, kind, list(named), columns, rest))
        self.credit -= 1


def _work(produce: Callable[[], Iterator[Any]], sock: socket.socket, prefetch: int) -> None:
    producer = _Producer(sock, prefetch)
    try:
        for batch in produce():
            producer.put(batch)
        _send(sock, ("end",))
    except BaseException as exc:  # the rank raises it at this worker's next batch
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            pickled = pickle.dumps(exc)
        except Exception:
            pickled = b""
        with contextlib.suppress(OSError):
            _send(sock, ("error", f"{type(exc).__qualname__}: {exc}", text, pickled))


def _start(
    produce: Callable[[], Iterator[Any]],
    number: int,
    prefetch: int,
    init: Callable[[int], Any],
    others: list[socket.socket],
) -> tuple[int, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    gc.freeze()  # the rank's objects out of the worker's collections: their pages stay shared
    try:
        pid = os.fork()
    finally:
        if os.getpid() == parent:
            gc.unfreeze()
    if pid == 0:  # the worker
        try:
            for sock in (ours, *others):  # the rank's ends: only the rank may hold them
                sock.close()
            procfs.die_with_parent(parent)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the rank's to handle
            import torch

            torch.set_num_threads(1)
            init(number)
            _work(produce, theirs, prefetch)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(0)
    theirs.close()
    return pid, ours


# -- in the rank ------------------------------------------------------------------------------
class _Worker:
    """The rank's view of one worker: its process, socket, slots and the batches it lent."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock
        self.slots: dict[int, Slot] = {}
        self.lent: dict[int, list[Any]] = {}  # slot -> weak references to its batch's memory
        self.ended = False


class ProcessWorkers:
    """``workers`` worker processes, each streaming ``produce(n)``; iterate for their batches.

    Args:
        produce: Called in worker ``n`` (after the fork) for its iterator of batches.
        workers: How many workers.
        prefetch: Batches each worker may hold ready.
        pin_memory: Page-lock the slots for fast copies to a CUDA device.
        init: Called in each worker with its number first (``worker_init_fn``).
    """

    def __init__(
        self,
        produce: Callable[[int], Iterator[Any]],
        workers: int,
        *,
        prefetch: int = 2,
        pin_memory: bool = False,
        init: Callable[[int], Any] | None = None,
    ) -> None:
        self.pin = pin_memory
        self.workers: list[_Worker] = []
        try:
            for number in range(workers):
                pid, sock = _start(
                    functools.partial(produce, number), number, prefetch, init or _nothing,
                    [w.sock for w in self.workers],
                )  # fmt: skip
                self.workers.append(_Worker(pid, sock))
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[Any]:
        """Every worker's batches, taking the workers in turn; closes them at the end."""
        try:
            with rank_threads(len(self.workers)):
                yield from self._batches()
        finally:
            self.close()

    def _batches(self) -> Iterator[Any]:
        while not all(w.ended for w in self.workers):
            for number, worker in enumerate(self.workers):
                if worker.ended:
                    continue
                found = self._next(number, worker)
                if found is not _ENDED:
                    yield found

    def _next(self, number: int, worker: _Worker) -> Any:
        while True:
            try:
                message, fds = _receive_with(worker.sock)
            except (EOFError, OSError):
                raise WorkerError(
                    f"DataLoader worker {number} (process {worker.pid}) ended without a word "
                    f"({_how_it_ended(worker.pid)}); the machine may be out of memory."
                ) from None
            kind = message[0]
            if kind == "slot":
                _, slot, size = message
                worker.slots[slot] = Slot.attach(slot, fds[0], size)
                if self.pin:
                    worker.slots[slot].register_pinned()
                continue
            if kind == "end":
                worker.ended = True
                return _ENDED
            if kind == "error":
                raise _failure(number, message[1], message[2], message[3])
            if kind == "object":
                self._give_credit(worker)
                return message[1]
            return self._batch(worker, message[1:])

    def _batch(
        self, worker: _Worker, message: tuple[int, str, list[str], list[Column], dict[str, Any]]
    ) -> Any:
        slot, kind, names, columns, rest = message
        named = dict(rest)
        if slot >= 0:
            tensors, refs = worker.slots[slot].read(columns)
            named.update(tensors)
            worker.lent[slot] = refs
        self._give_credit(worker)
        return rebuild(kind, {name: named[name] for name in names})  # the worker's order

    def _give_credit(self, worker: _Worker) -> None:
        """One batch taken: one more credit, and the slots no batch uses any more."""
        freed = [s for s, refs in worker.lent.items() if all(r() is None for r in refs)]
        for slot in freed:
            del worker.lent[slot]
        with contextlib.suppress(OSError):
            _send(worker.sock, (1, freed))

    def close(self) -> None:
        """Stop every worker (SIGKILL), reap it, release the slots."""
        for worker in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
        for worker in self.workers:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(worker.pid, 0)
            worker.sock.close()
            for slot in worker.slots.values():
                if self.pin:
                    slot.unregister_pinned()
                slot.close()
            worker.slots.clear()
        self.workers = []


_ENDED = object()


def _failure(number: int, summary: str, text: str, pickled: bytes) -> BaseException:
    """The worker's own exception (as torch's DataLoader raises it), its traceback as cause."""
    where = WorkerError(f"DataLoader worker {number} failed: {summary}\n{text}")
    try:
        original = pickle.loads(pickled) if pickled else None
    except Exception:
        original = None
    if not isinstance(original, BaseException):
        return where
    original.__cause__ = where
    return original


def _nothing(_number: int) -> None:
    """No ``worker_init_fn``."""


def _how_it_ended(pid: int, within: float = 1.0) -> str:
    """How worker ``pid`` ended; its socket closes a moment before the kernel can tell."""
    deadline = time.monotonic() + within
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "already reaped"
        if done != 0:
            break
        if time.monotonic() > deadline:
            return "still running"
        time.sleep(0.01)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def check_workers(count: object) -> int:
    """``num_workers`` checked."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"num_workers={count!r} must be a whole number >= 0.")
    return count
