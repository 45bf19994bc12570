"""Nothing a run started outlives it, whoever is killed: the fork server, or its caller and it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import alive, wait_gone
from sparktrain import ClusterError, launch
from sparktrain.ground import proctree
from sparktrain.node import warm


def _start_and_wait(out: str) -> None:
    """A rank: starts a child and a detached grandchild in a new session, then waits forever."""
    rank = os.environ["RANK"]
    child = subprocess.Popen(["sleep", "1000"])
    detached = subprocess.Popen(["setsid", "sleep", "1001"])  # its own session: no group kill
    Path(out, f"kids-{rank}").write_text(f"{child.pid} {detached.pid}")
    Path(out, f"server-{rank}").write_text(str(os.getppid()))
    time.sleep(1000)


def _kill_server_when_ready(out: Path) -> None:
    deadline = time.monotonic() + 120
    while len(list(out.glob("kids-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(int((out / "server-0").read_text()), signal.SIGKILL)


@pytest.mark.parametrize("mark", ["cgroup", "environment"])
def test_fork_server_killed_from_outside_takes_what_ranks_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mark: str
) -> None:
    if mark == "cgroup" and proctree.Tree().cgroup is None:
        pytest.skip("no cgroup v2 folder this process may make children in")
    if mark == "environment":
        monkeypatch.setattr(proctree, "cgroup_home", lambda: None)
    warm.shutdown()  # a fresh fork server, marked as this test says
    killer = threading.Thread(target=_kill_server_when_ready, args=(tmp_path,), daemon=True)
    killer.start()
    with pytest.raises(ClusterError, match=r"fork server .* exited unexpectedly"):
        launch(_start_and_wait, (str(tmp_path),), num_processes=2, timeout=120)
    killer.join()
    started = [int(pid) for f in tmp_path.glob("kids-*") for pid in f.read_text().split()]
    assert len(started) == 4
    assert wait_gone(started, within=10.0) == []
    warm.shutdown()


def _dead_owner_tag() -> str:
    """A tree tag whose owner (a process that has exited) is gone."""
    owner = subprocess.Popen(["sleep", "30"])
    ticks = proctree.procfs.start_ticks(owner.pid)
    owner.kill()
    owner.wait()
    namespace = os.stat("/proc/self/ns/pid").st_ino
    return f"{namespace}.{owner.pid}.{ticks}.0bad"


def test_trees_of_a_dead_owner_are_swept_and_live_ones_are_not() -> None:
    mine = proctree.Tree()
    env = {**os.environ, proctree.TREE_VAR: _dead_owner_tag()}
    orphan = subprocess.Popen(["sleep", "1000"], env=env)
    live = subprocess.Popen(["sleep", "1000"], env=mine.environ(dict(os.environ)))
    try:
        wait = time.monotonic() + 5  # the exec has replaced the environment block
        while proctree.TREE_VAR not in Path(f"/proc/{orphan.pid}/environ").read_text():
            assert time.monotonic() < wait
            time.sleep(0.01)
        assert proctree.sweep_stale() >= 1
        orphan.wait(10)
        assert orphan.returncode == -signal.SIGKILL
        assert alive(live.pid)  # its owner (this process) lives: not swept
        mine.close()
        live.wait(10)
        assert live.returncode == -signal.SIGKILL
    finally:
        for proc in (orphan, live):
            proc.kill()
            proc.wait()
    if mine.cgroup is not None:
        assert not mine.cgroup.exists()


def test_a_stale_cgroup_is_killed_and_removed() -> None:
    home = proctree.cgroup_home()
    folder = None if home is None else home / f"sparktrain-{_dead_owner_tag()}"
    try:
        assert folder is not None
        folder.mkdir()
    except (AssertionError, OSError):
        pytest.skip("no cgroup v2 folder this process may make children in")
    inside = subprocess.Popen(
        [sys.executable, "-c", f"open('{folder}/cgroup.procs', 'w').write('0'); import time; "
         "print(1, flush=True); time.sleep(1000)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert inside.stdout is not None and inside.stdout.readline().strip() == b"1"
        assert inside.pid in {int(p) for p in (folder / "cgroup.procs").read_text().split()}
        proctree.sweep_stale()
        inside.wait(10)
        assert inside.returncode == -signal.SIGKILL
        assert not folder.exists()
    finally:
        inside.kill()
        inside.wait()
