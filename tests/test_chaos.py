"""The chaos soak (``benchmarks/chaos.py``): its schedule, its checks, and one short soak.

The schedule is pure and deterministic by seed; the exactly-once count and the error rules are
checked on made-up folders and errors; and a soak of three runs (a rank SIGKILLed, the caller
SIGKILLed, the checkpoint disk filled; about 20 s) must end with no invariant violated.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import chaos_checks as checks  # noqa: E402
import chaos_plan as plan  # noqa: E402
import chaos_workloads  # noqa: E402

from sparktrain import ClusterError, HangError, RankFailure, TrainingFailedError  # noqa: E402


def test_the_schedule_is_the_seeds() -> None:
    first = plan.plan(7, 40)
    assert plan.plan(7, 40) == first
    assert plan.plan(7, 10) == first[:10]  # a shorter soak runs a prefix of the same schedule
    assert plan.plan(8, 40) != first
    assert [run.index for run in first] == list(range(1, 41))


def test_every_kind_comes_once_a_round_on_a_workload_it_applies_to() -> None:
    kinds = list(plan.FAULTS)
    runs = plan.plan(3, 3 * len(kinds))
    for start in range(0, len(runs), len(kinds)):
        assert sorted(r.fault for r in runs[start : start + len(kinds)]) == sorted(kinds)
    for run in runs:
        assert run.workload in plan.FAULTS[run.fault]
        window = plan.FROM_LAUNCH[run.fault] if run.from_launch else plan.WINDOW[run.workload]
        assert 0.0 <= run.moment <= window
        assert run.rank in (0, 1) and run.max_restarts in (0, 1, 2)
        assert 2 <= len(run.pauses) <= 5 and all(0.1 <= p <= 1.5 for p in run.pauses)


def test_kinds_without_a_workload_are_left_out() -> None:
    assert plan.kinds(["fsdp2"], ["disk-full", "kill-node", "kill-rank"]) == ["kill-rank"]
    assert {r.fault for r in plan.plan(1, 20, ["ddp"], ["kill-node", "kill-rank"])} == {"kill-rank"}
    with pytest.raises(ValueError, match="no fault kind"):
        plan.plan(1, 1, ["fsdp2"], ["kill-node"])


def _write(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)


def test_exactly_once_counts_each_attempt_up_to_the_next_resume(tmp_path: Path) -> None:
    rows = chaos_workloads.ROWS
    half = rows // 2
    # Attempt 0 trained steps 1-2 (ids 0..7 and 48..55 at 4 a step per rank) and step 3, lost:
    # attempt 1 resumed from step 2 and trained the rest.
    _write(tmp_path, "start-a0", "0 2")
    _write(tmp_path, "start-a1", "2 2")
    lines = {0: [], 1: []}  # type: dict[int, list[str]]
    for step in range(1, half // 4 + 1):
        for rank in (0, 1):
            ids = range(rank * half + (step - 1) * 4, rank * half + step * 4)
            lines[rank].append(f"{step} {' '.join(map(str, ids))}")
    for rank in (0, 1):
        _write(tmp_path, f"ids-a0-r{rank}.txt", "\n".join(lines[rank][:3]))  # step 3 is lost
        _write(tmp_path, f"ids-a1-r{rank}.txt", "\n".join(lines[rank][2:]))  # redone
    assert sorted(checks.committed_ids(tmp_path)) == list(range(rows))
    assert checks._exactly_once(tmp_path) == []
    _write(tmp_path, "start-a1", "3 2")  # had it resumed from 3, step 3 would count twice
    assert "twice" in checks._exactly_once(tmp_path)[0]


def _failure(rank: int, message: str, code: int | None = None) -> RankFailure:
    return RankFailure(rank, "vm", 1.0, None, message, exit_code=code)


def test_an_error_must_name_the_fault() -> None:
    kill = plan.Run(1, "kill-rank", "ddp", 0.5, 1, 0, 1.0, (0.2,))
    killed = TrainingFailedError(_failure(1, "killed by SIGKILL", -9), (0,), {})
    assert checks._right_error(kill, killed)
    other = TrainingFailedError(_failure(0, "killed by SIGKILL", -9), (1,), {})
    assert not checks._right_error(kill, other)  # names the wrong rank
    server = plan.Run(2, "kill-forkserver", "ddp", 0.5, 0, 0, 1.0, (0.2,))
    assert checks._right_error(server, ClusterError("sparktrain's fork server (pid 9) exited"))
    assert not checks._right_error(server, killed)
    stop = plan.Run(3, "stop-rank", "ddp", 0.5, 1, 0, 1.0, (0.2,))
    assert checks._right_error(stop, HangError(6.0, {}, (1,)))
    assert not checks._right_error(plan.Run(4, "none", "ddp", 0.5, 1, 0, 1.0, (0.2,)), killed)


@pytest.mark.slow
def test_a_short_soak_keeps_every_invariant() -> None:
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "chaos.py"),
        "--runs=3",
        "--seed=2",
        "--no-spark",
        "--workloads=ddp",
        "--faults=kill-rank,kill-caller,disk-full",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "3 runs, 2 ranks each" in done.stdout
    assert "Leftover processes at the end of the soak: 0" in done.stdout
