"""The invariants ``chaos.py`` checks after every run, and the verdict on the run.

A run either *survived* (it succeeded, and its result is right), *failed right* (its error is
the one its fault should give, naming the rank, signal or infrastructure hit), or broke an
invariant: a hang, a process left running, a wrong result, a sample trained on twice or never
after a resume, a checkpoint loaded that did not match its digest, an error that does not name
its cause. The leftover check is ``chaos.py``'s (it needs the 10 s wait); the rest is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_plan import REMOTE, Run
from chaos_workloads import ROWS

from sparktrain import ClusterError, HangError, TrainingFailedError, TrainingTimeoutError

#: Largest difference allowed between a run's parameters and the one-process replay.
TOLERANCE = 1e-5


@dataclass
class Outcome:
    """What one run did."""

    run: Run
    seconds: float = 0.0
    result: Any = None  # the RunResult of a run that succeeded
    error: BaseException | None = None
    injected: str = ""  # what the fault hit; "" when the run ended first
    hung: bool = False  # the launch did not return within its timeout and margin
    violations: list[str] = field(default_factory=list)
    status: str = ""  # "survived", "failed right" or "violation"


def _model_problems(values: dict[int, Any], check_grads: bool) -> list[str]:
    first, second = values[0], values[1]
    problems = []
    if first["params"] != second["params"]:
        problems.append("the ranks ended with different parameters")
    off = max(abs(a - b) for a, b in zip(first["params"], first["replay"], strict=True))
    if off > TOLERANCE:
        problems.append(f"parameters differ from the uninterrupted replay by {off:.3g}")
    if check_grads and not (first["grads_ok"] and second["grads_ok"]):
        problems.append("DDP's gradients differ from the hand-reduced ones")
    return problems


def committed_ids(folder: Path) -> list[int]:
    """Sample ids trained on, each attempt counted up to the step the next one resumed from."""
    starts = sorted(folder.glob("start-a*"), key=lambda p: int(p.name[7:]))
    attempts = [int(p.name[7:]) for p in starts]
    resumed = [int(p.read_text().split()[0]) for p in starts][1:]
    ids: list[int] = []
    for i, attempt in enumerate(attempts):
        upto = resumed[i] if i < len(resumed) else None
        for path in sorted(folder.glob(f"ids-a{attempt}-r*.txt")):
            for line in path.read_text().splitlines():
                step, *rest = line.split()
                if upto is None or int(step) <= upto:
                    ids += [int(n) for n in rest]
    return ids


def _exactly_once(folder: Path) -> list[str]:
    ids = committed_ids(folder)
    if sorted(ids) == list(range(ROWS)):
        return []
    seen = set(ids)
    twice = sorted({i for i in ids if ids.count(i) > 1})
    never = sorted(set(range(ROWS)) - seen)
    return [f"samples not seen exactly once: twice {twice[:10]}, never {never[:10]}"]


def result_problems(run: Run, result: Any, folder: Path) -> list[str]:
    """What is wrong with a successful run's value (``[]``: right)."""
    values = dict(result.return_values)
    ranks = list(range(result.world_size)) if hasattr(result, "world_size") else [0, 1]
    if sorted(values) != ranks or any(v is None for v in values.values()):
        return [f"success, but the values came back from ranks {sorted(values)} (not {ranks})"]
    if run.workload in ("stream", "elastic"):
        steps = {v["step"] for v in values.values()}
        problems = [] if len(steps) == 1 else [f"ranks ended at different steps {steps}"]
        return problems + _exactly_once(folder)
    return _model_problems(values, check_grads=run.workload in ("ddp", "spark"))


def load_problems(folder: Path) -> list[str]:
    """Checkpoints loaded that did not match their digest, or that could not be read."""
    bad = []
    for path in sorted(folder.glob("loads-r*.txt")):
        for line in path.read_text().splitlines():
            if "CORRUPT" in line or "LOAD-ERROR" in line:
                bad.append(f"{path.stem}: attempt {line}")
    return bad


def _names_rank(error: TrainingFailedError, rank: int, *words: str) -> bool:
    culprit = error.culprit
    text = str(error)
    return culprit is not None and culprit.rank == rank and any(w in text for w in words)


def _right_error(run: Run, error: BaseException) -> bool:
    text, fault = str(error), run.fault
    remote = run.workload in REMOTE
    if isinstance(error, TrainingTimeoutError):
        return False
    if fault == "kill-rank":
        return isinstance(error, TrainingFailedError) and _names_rank(error, run.rank, "SIGKILL")
    if fault == "kill-forkserver":
        return isinstance(error, ClusterError) and "fork server" in text
    if fault == "kill-node":
        return isinstance(error, ClusterError) and ("node" in text or "executor" in text)
    if fault == "stop-rank":
        return isinstance(error, HangError) and f"rank {run.rank}: no stack" in text
    if fault == "disk-full":
        full = ("No space left", "write failed", "Errno 28")
        return isinstance(error, TrainingFailedError) and _names_rank(error, 0, *full)
    if fault == "drop-connection" and remote:
        return isinstance(error, ClusterError) and "node" in text
    if fault == "drop-connection":
        words = ("onnection", "reset", "abort", "closed", "Broken pipe")
        return isinstance(error, TrainingFailedError) and any(w in text for w in words)
    return False  # no fault, or a slow rank: nothing should fail


def _first_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def judge(outcome: Outcome, folder: Path) -> None:
    """Fill ``outcome.status`` and add its invariant violations (the leftovers are added later)."""
    run, error = outcome.run, outcome.error
    problems = list(outcome.violations)
    if outcome.hung:
        problems.append("hang: the launch did not return within its timeout and margin")
    problems += load_problems(folder)
    if run.fault == "kill-caller" and outcome.injected:
        pass  # nothing comes back from a killed caller: what counts is what it left (below)
    elif error is None and outcome.result is not None:
        problems += [f"wrong result: {p}" for p in result_problems(run, outcome.result, folder)]
    elif error is not None and not outcome.injected:
        problems.append(f"failed though no fault struck: {_first_line(error)}")
    elif error is not None and not _right_error(run, error):
        problems.append(f"error does not name its cause: {_first_line(error)}")
    outcome.violations = problems
    killed = run.fault == "kill-caller" and bool(outcome.injected)
    if problems:
        outcome.status = "violation"
    else:
        outcome.status = "survived" if error is None and not killed else "failed right"
