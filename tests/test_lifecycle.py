"""Everything we start, we stop: when the caller exits, is killed, or gets Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import alive, descendants, wait_gone

CALLER = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even under nohup
from pathlib import Path
from sparktrain import launch

def hang(pid_dir):
    Path(pid_dir, os.environ["RANK"]).write_text(str(os.getpid()))
    time.sleep(300)

if __name__ == "__main__":
    print("caller", os.getpid(), flush=True)
    try:
        launch(hang, (sys.argv[1],), num_processes=2, use_gpu=False)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


def _start_caller(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int], list[int]]:
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    pids = tmp_path / "pids"
    pids.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pids)],
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2:
        assert time.monotonic() < deadline, "ranks did not start"
        assert proc.poll() is None, "caller died"
        time.sleep(0.05)
    time.sleep(0.2)  # both ranks are inside hang()
    ranks = [int(p.read_text()) for p in pids.iterdir()]
    helpers = sorted(descendants(proc.pid) - set(ranks))
    return proc, ranks, helpers


def test_caller_killed_leaves_nothing(tmp_path: Path) -> None:
    proc, ranks, helpers = _start_caller(tmp_path)
    assert all(alive(p) for p in ranks) and helpers  # the fork server
    proc.kill()
    proc.wait()
    assert wait_gone(ranks + helpers, within=10.0) == []


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    proc, ranks, _ = _start_caller(tmp_path)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in out
    assert wait_gone(ranks, within=1.0) == []


def test_fork_server_exits_with_the_caller(tmp_path: Path) -> None:
    script = tmp_path / "once.py"
    script.write_text(
        "import os\n"
        "from sparktrain import launch\n"
        "from sparktrain.node import warm\n"
        "if __name__ == '__main__':\n"
        "    launch(os.getpid, num_processes=1, use_gpu=False)\n"
        "    print(*[s.process.pid for s in warm._idle])\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=60
    )
    servers = [int(p) for p in out.stdout.split()]
    assert len(servers) == 1
    assert wait_gone(servers, within=10.0) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_fork_server_ignores_stray_signals(sig: int) -> None:
    from sparktrain import launch
    from sparktrain.node import warm

    launch(os.getpid, num_processes=1, use_gpu=False)
    server = warm._idle[0]
    os.kill(server.process.pid, sig)
    time.sleep(0.2)
    assert server.alive
    launch(os.getpid, num_processes=1, use_gpu=False)
    assert warm._idle[0] is server  # the same warm server served the next run
