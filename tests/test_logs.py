"""The log sink: rank prefixes, filters, partial lines, tails."""

from __future__ import annotations

import io

from sparktrain.node.logs import LogSink


def test_prefixes_and_partial_lines() -> None:
    out, err = io.StringIO(), io.StringIO()
    sink = LogSink(out=out, err=err)
    sink.feed(1, "stdout", b"epoch 3 lo")
    assert out.getvalue() == ""
    sink.feed(1, "stdout", b"ss 0.41\nnext")
    sink.close(1, "stdout")
    sink.feed(0, "stderr", b"warn\n")
    assert out.getvalue() == "[rank 1] epoch 3 loss 0.41\n[rank 1] next\n"
    assert err.getvalue() == "[rank 0] warn\n"


def test_filter_keeps_tails() -> None:
    out, err = io.StringIO(), io.StringIO()
    sink = LogSink(frozenset({0}), out=out, err=err, tail_lines=2)
    sink.feed(1, "stderr", b"a\nb\nc\n")
    sink.feed(0, "stdout", b"shown\n")
    assert out.getvalue() == "[rank 0] shown\n" and err.getvalue() == ""
    assert sink.tail(1) == ("b", "c")


def test_host_prefix() -> None:
    out = io.StringIO()
    sink = LogSink(prefix="[rank {rank} {host}] ", out=out)
    sink.set_host(2, "node-b")
    sink.feed(2, "stdout", b"x\n")
    assert out.getvalue() == "[rank 2 node-b] x\n"
