"""Shared fixtures: process hygiene and helpers for real multi-process runs."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: Iterable[int], within: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``."""
    import psutil

    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


@pytest.fixture(autouse=True)
def no_leaked_ranks() -> Iterator[None]:
    """Fail a test that leaves any process of ours alive, except the warm fork servers."""
    from sparktrain import warm

    yield
    servers = {s.process.pid for s in warm._idle}
    leaked = [p for p in descendants(os.getpid()) - servers if alive(p)]
    leaked = [p for p in leaked if p not in servers and os.getppid() != p]
    still = wait_gone(leaked, within=5.0)
    assert not still, f"processes left running after the test: {still}"


@pytest.fixture
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put ``examples/`` on ``sys.path`` (the ranks inherit it)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return EXAMPLES


def python() -> str:
    """The interpreter running the tests (the ranks' too)."""
    return sys.executable
