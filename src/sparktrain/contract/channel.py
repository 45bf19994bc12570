"""An authenticated TCP channel between the driver and its node agents (Spark tasks).

Each job has its own random secret. A connection proves it knows the secret with an HMAC
challenge-response in both directions before any message is read, under a handshake timeout,
so a rogue or silent connection is refused (and logged) without ever reaching the unpickler or
blocking the others. Every later frame carries an HMAC over its direction, its sequence number
and its bytes, checked before unpickling, so bytes injected into or replayed on the stream are
refused too. Messages are length-prefixed pickled dicts. An agent's send that cannot progress
for :data:`SEND_TIMEOUT` seconds (a stalled driver) breaks its channel, and the node then stops
its ranks rather than block its event loop.

Heartbeats go both ways, one every :data:`BEAT_EVERY` seconds, so that silence means something:
a job that prints nothing for minutes keeps its channel, but a node that has sent nothing for
the run's ``heartbeat_timeout`` (a partition, a frozen machine) is reported lost, and a node
that has heard nothing from the driver that long knows itself cut off (:meth:`ChannelClient.
deadline`) and stops its ranks. TCP alone notices neither for many minutes.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

log = logging.getLogger("sparktrain.contract.channel")

HANDSHAKE_TIMEOUT = 10.0
SEND_TIMEOUT = 60.0
#: Seconds between heartbeats, both ways.
BEAT_EVERY = 1.0
_NONCE = 32
_HEADER = struct.Struct("!I")
_MAX_FRAME = 256 << 20


class ChannelError(ConnectionError):
    """The peer failed authentication, or the connection broke."""


def _mac(secret: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, label + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int, *, frame_start: bool = False) -> bytes:
    chunks: list[bytes] = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            if frame_start and not chunks:  # closed between frames: the peer is done
                raise EOFError("connection closed")
            raise ChannelError("connection closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


class _Framed:
    """One authenticated connection: frames signed with the secret and a sequence number."""

    def __init__(self, sock: socket.socket, secret: bytes, *, sends: bytes, receives: bytes):
        self.sock = sock
        self._secret = secret
        self._labels = (sends, receives)
        self._counts = [0, 0]
        self._lock = threading.Lock()

    def _sign(self, which: int, data: bytes) -> bytes:
        count = self._counts[which].to_bytes(8, "big")
        self._counts[which] += 1
        return _mac(self._secret, self._labels[which] + count, data)

    def send(self, message: dict[str, Any]) -> None:
        """Send one message."""
        data = pickle.dumps(message)
        with self._lock:
            self.sock.sendall(_HEADER.pack(len(data)) + self._sign(0, data) + data)

    def receive(self) -> dict[str, Any]:
        """Receive one message.

        Raises:
            ChannelError: The frame is not signed by the peer, or the connection broke in it.
            EOFError: The peer closed the connection between frames.
        """
        (size,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size, frame_start=True))
        if size > _MAX_FRAME:
            raise ChannelError(f"frame of {size} bytes is too large")
        mac = _recv_exact(self.sock, 32)
        data = _recv_exact(self.sock, size)
        if not hmac.compare_digest(mac, self._sign(1, data)):
            raise ChannelError("a frame was not signed with this job's secret")
        message: dict[str, Any] = pickle.loads(data)
        return message


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Prove the peer knows ``secret`` and prove we do; raises :class:`ChannelError` if not."""
    challenge = os.urandom(_NONCE)
    sock.sendall(challenge)
    answer = _recv_exact(sock, 32 + _NONCE)
    if not hmac.compare_digest(answer[:32], _mac(secret, b"client", challenge)):
        raise ChannelError("the peer does not know this job's secret")
    sock.sendall(_mac(secret, b"server", answer[32:]))


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """The client's half of :func:`server_handshake`."""
    challenge = _recv_exact(sock, _NONCE)
    mine = os.urandom(_NONCE)
    sock.sendall(_mac(secret, b"client", challenge) + mine)
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(secret, b"server", mine)):
        raise ChannelError("the server does not know this job's secret")


class ChannelServer:
    """The driver's end: accepts authenticated agents and queues what they send."""

    def __init__(self, host: str, secret: bytes, *, silence: float | None = None) -> None:
        """Listen on ``host`` at a free port.

        Args:
            host: The address at which the nodes reach this process.
            secret: The attempt's secret.
            silence: Seconds a node may send nothing before it is reported lost (``None``: no
                bound, and no heartbeats).
        """
        self.secret = secret
        self.silence = silence
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self.refused: collections.deque[str] = collections.deque(maxlen=100)
        self._peers: list[_Framed] = []
        self._lock = threading.Lock()
        self._closed = False
        self._stop_sent = False
        self._grow_sent = False
        threading.Thread(target=self._accept_loop, name="sparktrain-channel", daemon=True).start()
        if silence is not None:
            threading.Thread(target=self._beat, name="sparktrain-beat", daemon=True).start()

    def _beat(self) -> None:
        while not self._closed:
            self.broadcast({"op": "beat"})
            time.sleep(BEAT_EVERY)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            if self._closed:  # close() raced with this accept
                sock.close()
                return
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            server_handshake(sock, self.secret)
            sock.settimeout(self.silence)
        except (ChannelError, OSError) as exc:
            self.refused.append(f"{peer}: {exc}")
            log.warning("sparktrain refused a connection from %s: %s", peer, exc)
            sock.close()
            return
        _keepalive(sock)
        framed = _Framed(sock, self.secret, sends=b"s2c", receives=b"c2s")
        with self._lock:
            self._peers.append(framed)
            sent = (("grow", self._grow_sent), ("stop", self._stop_sent))
            late = [op for op, done in sent if done]
        for op in late:  # it connected after these went out: it must hear them too
            with contextlib.suppress(OSError):
                framed.send({"op": op})
        hello: dict[str, Any] | None = None
        said_bye = False
        why = "its process ended without a goodbye (killed, or its machine went away)"
        silent = False
        try:
            while True:
                message = framed.receive()
                kind = message.get("kind")
                hello = message if kind == "hello" else hello
                said_bye = said_bye or kind == "bye"
                if kind != "beat":
                    self.messages.put(message)
        except TimeoutError:
            silent = True
            why = (
                f"it sent nothing for {self.silence:g}s, heartbeats included (cut off by the "
                "network, or its machine froze); heartbeat_timeout= sets the bound"
            )
        except (ChannelError, OSError, EOFError, pickle.UnpicklingError) as exc:
            if isinstance(exc, ChannelError) and not self._closed:
                log.warning("sparktrain dropped a connection from %s: %s", peer, exc)
        finally:
            with self._lock:
                if framed in self._peers:
                    self._peers.remove(framed)
            sock.close()
            if hello is not None and not said_bye and not self._closed:
                lost = {"node": hello["node"], "host": hello["host"], "why": why, "silent": silent}
                self.messages.put({"kind": "lost", **lost})

    def broadcast(self, message: dict[str, Any]) -> None:
        """Send ``message`` to every connected agent (ignores agents that are gone)."""
        with self._lock:
            peers = list(self._peers)
            if message.get("op") == "stop":
                self._stop_sent = True
            if message.get("op") == "grow":
                self._grow_sent = True
        for peer in peers:
            with contextlib.suppress(OSError):
                peer.send(message)

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the accepting thread; close() alone does not
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            peers, self._peers = self._peers, []
        for peer in peers:
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
            peer.sock.close()


class ChannelClient:
    """An agent's end: sends logs and events, hears ``stop``."""

    def __init__(
        self, address: tuple[str, int], secret: bytes, *, silence: float | None = None
    ) -> None:
        """Connect and authenticate; raises :class:`ChannelError` on a wrong secret.

        ``silence``: seconds without a word from the driver after which this node is cut off
        (``None``: no bound, and no heartbeats).
        """
        self._sock = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT)
        try:
            client_handshake(self._sock, secret)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(SEND_TIMEOUT)
        _keepalive(self._sock)
        self._framed = _Framed(self._sock, secret, sends=b"c2s", receives=b"s2c")
        self.broken = False
        self.closed = False
        #: Why the channel broke before the driver said stop (the node then stops its ranks on
        #: its own: a lost node, not a stop), or ``None``.
        self.lost: str | None = None
        self._told_stop = False
        #: Called when the driver says the run is to grow back at its next checkpoint.
        self.on_grow: Callable[[], None] | None = None
        self.silence = silence
        self.heard = time.monotonic()
        if silence is not None:
            threading.Thread(target=self._beat, name="sparktrain-beat", daemon=True).start()

    def _beat(self) -> None:
        while not (self.closed or self.broken):
            self.send({"kind": "beat"})
            time.sleep(BEAT_EVERY)

    def deadline(self) -> float | None:
        """When this node is cut off if it hears nothing more from the driver (monotonic)."""
        return None if self.silence is None else self.heard + self.silence

    def send(self, message: dict[str, Any]) -> None:
        """Send one message; a broken channel is noted (the node then stops) and not raised."""
        if self.broken:
            return
        try:
            self._framed.send(message)
        except OSError as exc:
            self._break(f"sending to it failed: {exc}")

    def fileno(self) -> int:
        """Descriptor to wait on for the driver's messages."""
        return self._sock.fileno()

    def receive(self) -> Literal["stop", "busy"] | None:
        """Read the driver's message: ``"stop"`` for stop, a closed or a broken channel.

        ``grow`` (an elastic run's capacity returned) calls :attr:`on_grow` and is not a stop;
        ``busy`` (another node's rank builds an op) is returned for the agent's hang clock.
        """
        if self.broken:
            return "stop"
        try:
            op = self._framed.receive().get("op")
        except EOFError:
            self._break("the driver closed it")
            return "stop"
        except (ChannelError, OSError) as exc:
            self._break(str(exc) or type(exc).__name__)
            return "stop"
        self.heard = time.monotonic()
        self._told_stop = self._told_stop or op == "stop"
        if op == "grow" and self.on_grow is not None:
            self.on_grow()
        return op if op in ("stop", "busy") else None

    def _break(self, why: str) -> None:
        if not (self.broken or self._told_stop or self.closed):
            self.lost = f"its channel to the driver broke ({why})"
        self.broken = True

    def close(self) -> None:
        """Close the connection (and stop the heartbeats)."""
        self.closed = True
        self._sock.close()
