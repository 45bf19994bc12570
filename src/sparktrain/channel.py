"""An authenticated TCP channel between the driver and its node agents (Spark tasks).

Each job has its own random secret. A connection proves it knows the secret with an HMAC
challenge-response in both directions before any message is read, under a handshake timeout,
so a rogue or silent connection is refused (and logged) without ever reaching the unpickler or
blocking the others. Messages are length-prefixed pickled dicts. Connections carry TCP
keepalive and have no idle timeout: a job that prints nothing for minutes keeps its channel.
"""

from __future__ import annotations

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
from typing import Any

log = logging.getLogger("sparktrain.channel")

HANDSHAKE_TIMEOUT = 10.0
_NONCE = 32
_HEADER = struct.Struct("!I")
_MAX_FRAME = 256 << 20


class ChannelError(ConnectionError):
    """The peer failed authentication, or the connection broke."""


def _mac(secret: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, label + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise ChannelError("connection closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one message."""
    data = pickle.dumps(message)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """Receive one message (only call on an authenticated socket)."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > _MAX_FRAME:
        raise ChannelError(f"frame of {size} bytes is too large")
    message: dict[str, Any] = pickle.loads(_recv_exact(sock, size))
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

    def __init__(self, host: str, secret: bytes) -> None:
        """Listen on ``host`` at a free port."""
        self.secret = secret
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self.refused: list[str] = []
        self._peers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="sparktrain-channel", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            server_handshake(sock, self.secret)
            sock.settimeout(None)
        except (ChannelError, OSError) as exc:
            self.refused.append(f"{peer}: {exc}")
            log.warning("sparktrain refused a connection from %s: %s", peer, exc)
            sock.close()
            return
        _keepalive(sock)
        with self._lock:
            self._peers.append(sock)
        try:
            while True:
                self.messages.put(recv_frame(sock))
        except (ChannelError, OSError, EOFError, pickle.UnpicklingError):
            pass
        finally:
            with self._lock:
                if sock in self._peers:
                    self._peers.remove(sock)
            sock.close()

    def broadcast(self, message: dict[str, Any]) -> None:
        """Send ``message`` to every connected agent (ignores agents that are gone)."""
        with self._lock:
            peers = list(self._peers)
        for sock in peers:
            with contextlib.suppress(OSError):
                send_frame(sock, message)

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._closed = True
        self._listener.close()
        with self._lock:
            peers, self._peers = self._peers, []
        for sock in peers:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class ChannelClient:
    """An agent's end: sends logs and events, hears ``stop``."""

    def __init__(self, address: tuple[str, int], secret: bytes) -> None:
        """Connect and authenticate; raises :class:`ChannelError` on a wrong secret."""
        self._sock = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT)
        try:
            client_handshake(self._sock, secret)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        _keepalive(self._sock)
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        """Send one message; a broken channel is ignored (the run goes on)."""
        with self._lock, contextlib.suppress(OSError):
            send_frame(self._sock, message)

    def fileno(self) -> int:
        """Descriptor to wait on for the driver's messages."""
        return self._sock.fileno()

    def stop_requested(self) -> bool:
        """Read the driver's message; ``True`` for ``stop`` or a closed channel."""
        try:
            return bool(recv_frame(self._sock).get("op") == "stop")
        except (ChannelError, OSError, EOFError):
            return True

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()
