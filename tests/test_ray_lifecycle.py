"""A Ray that sparktrain started ends with the launch, or with its caller however it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from sparktrain.backends.ray import procs
from sparktrain.ground import procfs

CALLER = """
import os, sys, time
from pathlib import Path
import ray
import sparktrain, sparktrain.ray

def rank():
    return os.getpid()

def hang(out):
    Path(out, "rank").write_text(str(os.getpid()))
    time.sleep(1000)

def session():
    return ray._private.worker._global_node.get_session_dir_path()

if __name__ == "__main__":
    out = sys.argv[2]
    if sys.argv[1] == "warm":
        sparktrain.launch(rank, backend="ray")  # a Ray of its own, stopped when it returns
        print("stopped after launch:", not ray.is_initialized(), flush=True)
        sparktrain.ray.start_local(num_cpus=2)
        print("session", session(), flush=True)
        sparktrain.launch(rank, backend="ray")
        print("warm after launch:", ray.is_initialized(), flush=True)
        time.sleep(1000)
    else:  # killed in the middle of a launch whose Ray it started
        sparktrain.launch(hang, (out,), backend="ray")
"""


def _caller(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )


def _wait_gone(found: set[procs.Proc], within: float) -> set[procs.Proc]:
    deadline = time.monotonic() + within
    left = procs.alive(found)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = procs.alive(left)
    return left


def _session_processes(session: str, caller: int) -> set[procs.Proc]:
    """The Ray session's processes (by its folder) and every process below the caller."""
    below = {(pid, procfs.start_ticks(pid) or 0) for pid in procfs.descendants(caller)}
    return procs.matching([session]) | below


def test_a_warm_ray_and_the_launch_ray_end_with_a_killed_caller(tmp_path: Path) -> None:
    caller = _caller(tmp_path, "warm")
    assert caller.stdout is not None
    try:
        assert caller.stdout.readline().strip() == "stopped after launch: True"
        session = caller.stdout.readline().split(" ", 1)[1].strip()
        assert caller.stdout.readline().strip() == "warm after launch: True"
        ray = _session_processes(session, caller.pid)
        assert len(ray) > 3  # GCS, raylet, workers, the keeper...
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        assert _wait_gone(ray | procs.matching([session]), within=20.0) == set()
    finally:
        caller.kill()
        caller.wait()


def test_a_caller_killed_in_a_ray_launch_leaves_no_ray(tmp_path: Path) -> None:
    caller = _caller(tmp_path, "hang")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "rank").exists():
            assert time.monotonic() < deadline and caller.poll() is None, "the rank never ran"
            time.sleep(0.1)
        sessions = {s for s in _sessions() if f"_{caller.pid}" in s}
        assert len(sessions) == 1, sessions
        ray = _session_processes(sessions.pop(), caller.pid)
        assert int((tmp_path / "rank").read_text()) in {pid for pid, _ in ray}
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        assert _wait_gone(ray, within=20.0) == set()
    finally:
        caller.kill()
        caller.wait()


def _sessions() -> list[str]:
    """Ray's session folders (``/tmp/ray/session_<date>_<time>_<micros>_<pid of the starter>``)."""
    root = Path("/tmp/ray")
    return [str(p) for p in root.glob("session_2*")] if root.exists() else []
