"""From how each rank ended to what the caller gets: a :class:`RunResult` or one error.

The culprit is the rank that failed first. Ranks report the time of their exception and the fork
server the time of a death by signal; a peer's "connection closed" error is a consequence, not a
cause, so such errors rank after any other failure whatever their time.
"""

from __future__ import annotations

import pickle
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle

from sparktrain.agent import NodeOutcome
from sparktrain.errors import RankFailure, TrainingFailedError, TrainingTimeoutError
from sparktrain.worker import error_path, result_path

_SECONDARY = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|"
    r"connection refused|socket timeout|NCCL communicator was aborted|"
    r"ProcessGroupNCCL.*(abort|timeout)|gloo.*(closed|reset)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RunResult:
    """What a successful run returns.

    Attributes:
        return_values: Return values by rank: rank 0's, or every rank's with ``return_all=True``.
        world_size: Number of ranks that ran.
        duration: Seconds from the launch call to the last rank's exit.
    """

    return_values: Mapping[int, Any]
    world_size: int
    duration: float

    @property
    def value(self) -> Any:
        """Rank 0's return value."""
        return self.return_values.get(0)


def _signal_failure(
    rank: int, host: str, code: int, when: float, tail: tuple[str, ...]
) -> RankFailure:
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    message = f"killed by {name}"
    if -code == signal.SIGKILL:
        message += " (often the out-of-memory killer: check `dmesg` and the rank's memory use)"
    elif -code == signal.SIGSEGV:
        message += " (a segmentation fault in native code)"
    return RankFailure(rank, host, when, None, message, "", code, tail)


def rank_failure(
    rank: int,
    host: str,
    code: int,
    when: float,
    *,
    record: dict[str, Any] | None,
    tail: tuple[str, ...],
) -> RankFailure:
    """The failure report of one rank from its exit code and, if it wrote one, its record."""
    if record is not None:
        return RankFailure(
            rank,
            host,
            record["time"],
            record["exc_type"],
            record["message"],
            record["traceback"],
            code,
            tail,
        )
    if code < 0:
        return _signal_failure(rank, host, code, when, tail)
    message = f"exited with code {code} without a Python exception"
    return RankFailure(rank, host, when, None, message, "", code, tail)


def _secondary(failure: RankFailure) -> bool:
    return bool(_SECONDARY.search(failure.message))


def culprit_of(failures: Mapping[int, RankFailure]) -> RankFailure:
    """The rank that failed first, preferring causes over peers' connection errors."""
    return min(failures.values(), key=lambda f: (_secondary(f), f.time, f.rank))


def _read_record(run_dir: str, rank: int) -> dict[str, Any] | None:
    path = error_path(run_dir, rank)
    if not path.exists():
        return None
    record: dict[str, Any] = pickle.loads(path.read_bytes())
    return record


def collect(
    outcome: NodeOutcome,
    run_dir: str,
    *,
    world_size: int,
    host: str,
    tails: Mapping[int, tuple[str, ...]],
    timeout: float | None,
    duration: float,
    keep: tuple[int, ...],
) -> RunResult:
    """Turn a node's outcome into the caller's result, or raise the run's one error."""
    failures: dict[int, RankFailure] = {}
    for rank, ended in outcome.exits.items():
        if ended.exit_code == 0:
            continue
        record = _read_record(run_dir, rank)
        if ended.stopped and (record is None or record["time"] >= (outcome.stop_time or 0.0)):
            continue  # stopped by us, not a failure of its own
        failures[rank] = rank_failure(
            rank, host, ended.exit_code, ended.time, record=record, tail=tails.get(rank, ())
        )
    if failures:
        culprit = culprit_of(failures)
        victims = tuple(
            sorted(r for r, e in outcome.exits.items() if e.exit_code != 0 and r != culprit.rank)
        )
        raise TrainingFailedError(culprit, victims, failures)
    if outcome.timed_out:
        done = tuple(sorted(set(range(world_size)) - set(outcome.running_at_timeout)))
        raise TrainingTimeoutError(timeout or 0.0, outcome.running_at_timeout, done)
    values = {}
    for rank in keep:
        path = result_path(run_dir, rank)
        if path.exists():
            values[rank] = cloudpickle.loads(path.read_bytes())
    return RunResult(return_values=values, world_size=world_size, duration=duration)
