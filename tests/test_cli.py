"""``sparktrain run``: same logs, errors and exit codes as the library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparktrain", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        timeout=120,
    )


def test_run_script_with_args(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import os, sys\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('args', sys.argv[1:], 'world', dist.get_world_size())\n"
        "dist.destroy_process_group()\n"
    )
    done = _run("run", "--nproc", "2", "train.py", "--", "--lr", "0.1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] args ['--lr', '0.1'] world 2" in done.stdout


def test_failure_exit_code_and_culprit(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(
        "import os\nif os.environ['RANK'] == '1':\n    raise RuntimeError('diverged')\n"
    )
    done = _run("run", "--nproc", "2", "bad.py", cwd=tmp_path)
    assert done.returncode == 1
    assert "rank 1 on" in done.stderr and "RuntimeError: diverged" in done.stderr
    assert "[rank 1] Traceback" in done.stderr  # the rank's own log shows it too


def test_bad_input_exit_code(tmp_path: Path) -> None:
    done = _run("run", "--nproc", "0", "missing.py", cwd=tmp_path)
    assert done.returncode == 2
    assert "is not an existing file" in done.stderr
    done = _run("run", "--log-ranks", "x", "--nproc", "1", "missing.py", cwd=tmp_path)
    assert done.returncode == 2


def test_help_lists_options() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sparktrain", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for option in (
        "--nproc",
        "--gpu",
        "--cpu",
        "--timeout",
        "--log-ranks",
        "--max-restarts",
        "--hang-timeout",
    ):
        assert option in done.stdout
