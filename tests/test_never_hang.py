"""Never hang, never leak: back-to-back runs, ranks that linger after returning, dead callers.

The patterns are those of ``benchmarks/stress.py`` (which runs them by the thousand); here a
short version of each keeps CI honest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, alive, wait_gone
from sparktrain import launch
from sparktrain.ground import procfs
from sparktrain.rank import rundirs

sys.path.insert(0, str(ROOT / "benchmarks"))
import stress_patterns as patterns

RUN_TIMEOUT = 30.0
#: The heavy patterns' bound: each rank imports DeepSpeed or Lightning, which took up to 48 s a
#: launch on a loaded machine (load 10 on 2 cores); a hang never ends, so a generous bound
#: still tells one from a slow start.
HEAVY_TIMEOUT = 180.0


def _launch(fn: object, **options: object) -> object:
    return launch(fn, num_processes=2, use_gpu=False, timeout=RUN_TIMEOUT, **options)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_300_back_to_back_ddp_runs_all_return_and_leak_nothing() -> None:
    """The pattern that hung 1 run in 3: init, DDP, two steps, destroy, return; 300 times.

    Each run is bounded by ``timeout`` (a hang fails it); after them the caller holds no more
    file descriptors, threads or child processes than after the first run. The seconds each run
    took are printed (``-s``); ``benchmarks/stress.py`` measures them by the thousand.
    """
    _launch(patterns.destroy_then_return)  # the fork server is up and idle from here on
    fds, threads, children = _open_fds(), threading.active_count(), procfs.descendants(os.getpid())
    values, seconds = [], []
    for _ in range(300):
        started = time.monotonic()
        values.append(_launch(patterns.destroy_then_return).value)  # type: ignore[attr-defined]
        seconds.append(time.monotonic() - started)
    assert values == [patterns.VALUE] * 300
    assert wait_gone(sorted(set(procfs.descendants(os.getpid())) - set(children)), 5.0) == []
    assert _open_fds() <= fds
    assert threading.active_count() <= threads
    seconds.sort()
    print(f"300 back-to-back runs: median {seconds[150]:.3f} s, slowest {seconds[-1]:.3f} s")


@pytest.mark.parametrize("pattern", patterns.PLAIN[1:], ids=lambda p: p.name)
def test_every_plain_pattern_back_to_back(pattern: patterns.Pattern) -> None:
    outcomes = [patterns.outcome(pattern, lambda: _launch(pattern.fn)) for _ in range(15)]
    assert outcomes == ["ok"] * 15


@pytest.mark.slow
@pytest.mark.parametrize("pattern", patterns.HEAVY, ids=lambda p: p.name)
def test_fsdp_deepspeed_and_lightning_end_cleanly(pattern: patterns.Pattern) -> None:
    if "DeepSpeed" in pattern.name:
        pytest.importorskip("deepspeed")
    if "Lightning" in pattern.name:
        pytest.importorskip("lightning")
    run = lambda: launch(pattern.fn, num_processes=2, use_gpu=False, timeout=HEAVY_TIMEOUT)  # noqa: E731
    outcomes = [patterns.outcome(pattern, run) for _ in range(2)]
    assert outcomes == ["ok", "ok"]


def returns_then_lingers(how: str, pid_dir: str) -> int:
    """Return 7, but leave something that keeps the process from ever exiting."""
    import atexit
    import threading

    Path(pid_dir, os.environ["RANK"]).write_text(str(os.getpid()))
    if how == "thread":
        threading.Thread(target=time.sleep, args=(1000,), daemon=False).start()
    else:
        atexit.register(time.sleep, 1000)
    if how == "raise" and os.environ["RANK"] == "1":
        threading.Thread(target=time.sleep, args=(1000,), daemon=False).start()
        raise ValueError("rank 1 failed and lingers")
    return 7


@pytest.mark.parametrize("how", ["thread", "atexit"])
def test_rank_that_never_exits_is_killed_and_its_value_stands(
    how: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    result = _launch(returns_then_lingers, exit_grace=1.0, args=(how, str(tmp_path)))
    assert result.value == 7  # type: ignore[attr-defined]
    assert time.monotonic() - started < RUN_TIMEOUT / 2  # the grace period, not the timeout
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"sparktrain: rank {rank} returned, but its process was still running 1s" in err
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and wait_gone(pids, within=5.0) == []


def test_rank_that_fails_and_lingers_is_reported_as_the_culprit(tmp_path: Path) -> None:
    from sparktrain import TrainingFailedError

    with pytest.raises(TrainingFailedError) as caught:
        _launch(returns_then_lingers, exit_grace=1.0, args=("raise", str(tmp_path)))
    assert caught.value.culprit is not None and caught.value.culprit.rank == 1
    assert "rank 1 failed and lingers" in str(caught.value)
    assert wait_gone([int(p.read_text()) for p in tmp_path.iterdir()], within=5.0) == []


def test_bad_exit_grace_is_refused() -> None:
    from sparktrain import ConfigError

    with pytest.raises(
        ConfigError, match=r"exit_grace=0 must be a positive, finite number of seconds"
    ):
        launch(os.getpid, num_processes=1, use_gpu=False, exit_grace=0)


# -- the caller dies ------------------------------------------------------------------------

KILLED_WHILE_QUEUED = (
    patterns.SLEEPY_RANK
    + """
if __name__ == "__main__":
    from sparktrain import launch
    from sparktrain.node import warm

    sent = []
    spawn = warm.ForkServer.spawn

    def spawn_then_die(self, key, request, fds):
        spawn(self, key, request, fds)
        sent.append(key)
        if len(sent) == 2:  # both spawns queued; the server is still importing torch
            print(self.process.pid, flush=True)
            os.kill(os.getpid(), 9)

    warm.ForkServer.spawn = spawn_then_die
    launch(sleepy, (sys.argv[1],), num_processes=2, use_gpu=False)
"""
)


def test_caller_killed_with_spawns_queued_starts_no_rank(tmp_path: Path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(KILLED_WHILE_QUEUED)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, str(script), str(pid_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == -signal.SIGKILL, out.stderr
        server = int(out.stdout.split()[0])
        assert wait_gone([server], within=30.0) == []  # it finished importing, then left
        time.sleep(0.5)
        assert patterns.rank_records(pid_dir) == []  # no rank ever ran user code


@pytest.mark.parametrize("delay", [0.05, 0.4, 1.0, 2.5])
def test_caller_killed_at_any_moment_leaves_nothing(delay: float, tmp_path: Path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(patterns.SLEEPY_CALLER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    caller = subprocess.Popen([sys.executable, str(script), str(pid_dir)])
    time.sleep(delay)
    caller.kill()
    killed_at = time.time()
    caller.wait()
    time.sleep(3.0)  # a server still importing torch would have forked by now
    records = patterns.rank_records(pid_dir)
    survivors = [pid for rank, child, _ in records for pid in (rank, child)]
    assert wait_gone(survivors, within=10.0) == []
    # A rank checks its caller just before user code: none starts once the caller is gone
    # (the slack covers the instant between that check and the rank's first line).
    assert all(started < killed_at + 0.2 for _, _, started in records), (records, killed_at)


def test_a_dead_callers_run_directory_is_swept_by_the_next_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = tmp_path / "tmp"  # so that no other launch on this machine sweeps it first
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    script = tmp_path / "caller.py"
    script.write_text(patterns.SLEEPY_CALLER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    caller = subprocess.Popen(
        [sys.executable, str(script), str(pid_dir)], env={**os.environ, "TMPDIR": str(private)}
    )
    deadline = time.monotonic() + 60
    while len(patterns.rank_records(pid_dir)) < 2:
        assert time.monotonic() < deadline and caller.poll() is None
        time.sleep(0.05)
    left = list(private.glob(f"sparktrain-run-{caller.pid}-*"))
    assert len(left) == 1
    caller.kill()
    caller.wait()
    ranks = [pid for rank, child, _ in patterns.rank_records(pid_dir) for pid in (rank, child)]
    assert wait_gone(ranks, within=10.0) == []
    assert left[0].exists()  # SIGKILL runs no finally
    launch(os.getpid, num_processes=1, use_gpu=False)
    assert not left[0].exists()
    mine = Path(rundirs.make("run"))  # a live owner's directory: never swept
    try:
        launch(os.getpid, num_processes=1, use_gpu=False)
        assert mine.exists()
    finally:
        mine.rmdir()


def test_sweep_keeps_live_owners_and_removes_reused_pids(tmp_path: Path) -> None:
    me, start = os.getpid(), procfs.start_ticks(os.getpid())
    live = tmp_path / f"sparktrain-run-{me}-{start}-abc"
    reused = tmp_path / f"sparktrain-run-{me}-{(start or 0) + 1}-abc"  # same PID, other process
    dead = tmp_path / "sparktrain-task-999999999-5-abc"
    foreign = tmp_path / "sparktrain-run-notours"
    for folder in (live, reused, dead, foreign):
        folder.mkdir()
        (folder / "payload.pkl").write_bytes(b"x")
    removed = rundirs.sweep(str(tmp_path))
    assert sorted(removed) == sorted([str(reused), str(dead)])
    assert live.exists() and foreign.exists()


def test_rank_children_outside_its_group_die_with_the_run(tmp_path: Path) -> None:
    """A process a rank started in its own session (a daemon) is killed when the run ends."""
    launch(start_daemon, (str(tmp_path),), num_processes=1, use_gpu=False, timeout=RUN_TIMEOUT)
    daemon = int((tmp_path / "daemon").read_text())
    assert wait_gone([daemon], within=5.0) == [], "the daemon outlived the run"
    assert not alive(daemon)


def start_daemon(folder: str) -> None:
    """Start ``sleep`` in a new session (out of the rank's group) and return at once."""
    child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    Path(folder, "daemon").write_text(str(child.pid))


@pytest.mark.spark
def test_back_to_back_ddp_runs_never_hang_on_spark(spark: object) -> None:
    import cloudpickle

    cloudpickle.register_pickle_by_value(patterns)  # executors cannot import benchmarks/
    values = [
        _launch(patterns.destroy_then_return, backend="spark").value  # type: ignore[attr-defined]
        for _ in range(15)
    ]
    assert values == [patterns.VALUE] * 15
