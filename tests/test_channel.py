"""The driver's channel: only this job's agents get in; rogue or silent peers are refused."""

from __future__ import annotations

import logging
import select
import socket
import time

import pytest

from sparktrain.contract.channel import ChannelClient, ChannelError, ChannelServer


def _wait(predicate, within: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_authenticated_agent_talks_both_ways() -> None:
    server = ChannelServer("127.0.0.1", b"s" * 32)
    try:
        client = ChannelClient(server.address, b"s" * 32)
        client.send({"kind": "log", "lines": ["hello"]})
        assert server.messages.get(timeout=5) == {"kind": "log", "lines": ["hello"]}
        server.broadcast({"op": "stop"})
        assert client.receive() == "stop"
        client.close()
    finally:
        server.close()


def test_wrong_secret_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    server = ChannelServer("127.0.0.1", b"right-secret-0123456789abcdef012")
    try:
        with caplog.at_level(logging.WARNING, "sparktrain.contract.channel"):
            with pytest.raises((ChannelError, OSError)):
                ChannelClient(server.address, b"wrong-secret-0123456789abcdef01")
            assert _wait(lambda: len(server.refused) == 1)
        assert "refused a connection" in caplog.text
        assert server.messages.empty()
    finally:
        server.close()


def test_rogue_bytes_and_silent_peers_do_not_block_agents() -> None:
    server = ChannelServer("127.0.0.1", b"k" * 32)
    try:
        silent = socket.create_connection(server.address)  # connects, never answers
        rogue = socket.create_connection(server.address)
        rogue.recv(32)
        rogue.sendall(b"\x00" * 64 + b"not a pickle")  # a wrong answer to the challenge
        assert _wait(lambda: len(server.refused) == 1)
        client = ChannelClient(server.address, b"k" * 32)  # still served while `silent` waits
        client.send({"kind": "bye"})
        assert server.messages.get(timeout=5) == {"kind": "bye"}
        assert server.messages.empty()
        for sock in (silent, rogue):
            sock.close()
        client.close()
    finally:
        server.close()


def test_close_stops_listening() -> None:
    server = ChannelServer("127.0.0.1", b"c" * 32)
    server.close()
    time.sleep(0.1)
    with socket.socket() as probe:
        assert probe.connect_ex(server.address) != 0


def test_late_agent_still_hears_stop() -> None:
    server = ChannelServer("127.0.0.1", b"l" * 32)
    try:
        server.broadcast({"op": "stop"})  # nobody connected yet
        client = ChannelClient(server.address, b"l" * 32)
        assert client.receive() == "stop"
        client.close()
    finally:
        server.close()


def test_late_agent_hears_grow_and_a_silent_end_is_lost() -> None:
    server = ChannelServer("127.0.0.1", b"g" * 32)
    try:
        server.broadcast({"op": "grow"})  # capacity returned before this node connected
        client = ChannelClient(server.address, b"g" * 32)
        grown: list[str] = []
        client.on_grow = lambda: grown.append("grow")
        assert client.receive() is None and grown == ["grow"]
        client.send({"kind": "hello", "node": 1, "host": "h1", "ranks": [1]})
        assert server.messages.get(timeout=5)["kind"] == "hello"
        client.close()  # gone without a bye: its process or machine went away
        lost = server.messages.get(timeout=5)
        assert lost["kind"] == "lost" and (lost["node"], lost["host"]) == (1, "h1")
        assert not lost["silent"] and "without a goodbye" in lost["why"]
        polite = ChannelClient(server.address, b"g" * 32)
        polite.send({"kind": "hello", "node": 0, "host": "h0", "ranks": [0]})
        polite.send({"kind": "bye", "node": 0})
        polite.close()
        assert [server.messages.get(timeout=5)["kind"] for _ in range(2)] == ["hello", "bye"]
        time.sleep(0.3)
        assert server.messages.empty()  # a node that said bye is not lost
    finally:
        server.close()


def test_a_silent_node_is_lost_and_a_node_that_hears_nothing_is_cut_off() -> None:
    """Heartbeats both ways: silence past the bound is a loss on one side, a cut-off on the
    other; a quiet node that still beats is neither."""
    server = ChannelServer("127.0.0.1", b"h" * 32, silence=2.0)
    try:
        client = ChannelClient(server.address, b"h" * 32, silence=2.0)
        client.send({"kind": "hello", "node": 1, "host": "h1", "ranks": [1]})
        assert server.messages.get(timeout=5)["kind"] == "hello"
        time.sleep(3.0)  # longer than the bound, but the client's beats keep it alive
        assert server.messages.empty()
        while select.select([client], [], [], 0)[0]:
            assert client.receive() is None  # the driver's beats: nothing for the agent
        deadline = client.deadline()
        assert deadline is not None and deadline > time.monotonic()
        client.closed = True  # its beats stop, as when the network between them goes down
        started = time.monotonic()
        lost = server.messages.get(timeout=10)
        assert lost["kind"] == "lost" and lost["silent"] and "sent nothing for 2s" in lost["why"]
        assert 1.0 < time.monotonic() - started < 4.0
        mute = ChannelClient(server.address, b"h" * 32, silence=1.5)
        time.sleep(2.0)  # nothing read: the driver's beats wait unread, as if cut off
        assert mute.deadline() is not None and mute.deadline() < time.monotonic()  # type: ignore[operator]
        mute.close()
        client._sock.close()
    finally:
        server.close()


def test_injected_frame_is_refused() -> None:
    import struct

    server = ChannelServer("127.0.0.1", b"i" * 32)
    try:
        client = ChannelClient(server.address, b"i" * 32)
        # bytes written on the authenticated stream without the secret's signature
        client._sock.sendall(struct.pack("!I", 3) + b"\x00" * 32 + b"bad")
        client.send({"kind": "after"})
        time.sleep(0.3)
        assert server.messages.empty()  # the connection was dropped at the forged frame
        client.close()
    finally:
        server.close()


def test_a_channel_that_breaks_before_a_stop_is_a_lost_node_and_a_stop_is_not() -> None:
    for stop_first in (True, False):
        server = ChannelServer("127.0.0.1", b"b" * 32)
        try:
            client = ChannelClient(server.address, b"b" * 32)
            client.send({"kind": "hello", "node": 0, "host": "h0", "ranks": [0]})
            assert server.messages.get(timeout=5)["kind"] == "hello"  # the server holds it
            if stop_first:
                server.broadcast({"op": "stop"})
                assert client.receive() == "stop"
        finally:
            server.close()  # drops every connection
        assert client.receive() == "stop"
        if stop_first:
            assert client.lost is None  # the driver said stop: the node stops, it is not lost
        else:
            assert client.lost is not None and "channel to the driver broke" in client.lost
        client.close()
