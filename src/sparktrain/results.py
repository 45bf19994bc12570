"""From how each rank ended to what the caller gets: a :class:`RunResult` or one error.

The culprit is the rank that failed first. Ranks report the time of their exception and the fork
server the time of a death by signal; a peer's "connection closed" error is a consequence, not a
cause, so such errors rank after any other failure whatever their time.
"""

from __future__ import annotations

import pickle
import re
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle

from sparktrain.agent import NodeOutcome
from sparktrain.errors import (
    ConfigError,
    HangError,
    RankFailure,
    SparkJobError,
    StackSite,
    TrainingFailedError,
    TrainingTimeoutError,
)
from sparktrain.worker import error_path, result_path

if TYPE_CHECKING:
    from sparktrain.layout import LaunchPlan

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
        nodes: Each node's report (host, ranks, GPUs), in node order.
        attempts: How many times the group was started (restarts + 1).
        stopped: Whether ``on_report`` stopped the run before its ranks ended (values are those
            of ranks that had returned by then).
    """

    return_values: Mapping[int, Any]
    world_size: int
    duration: float
    nodes: tuple[NodeReport, ...] = ()
    attempts: int = 1
    stopped: bool = False

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


@dataclass(frozen=True)
class NodeReport:
    """How one node's ranks ended, in a form that travels (from a Spark task to the driver).

    Attributes:
        node_rank: The node.
        host: Its host.
        ranks: The global ranks it ran.
        failures: Ranks that failed on their own (not stopped by us), by rank.
        stopped: Ranks stopped because of a failure elsewhere, a timeout or Ctrl-C.
        values: Pickled return values of the ranks asked for, by rank.
        running_at_timeout: Ranks still running when the timeout passed.
        gpus: GPU addresses the node's ranks owned.
        hung: Whether the node's ranks made no progress for ``hang_timeout``.
        hang_sites: Where each hung rank waited.
        hang_silent: Hung ranks that gave no stack.
        agent_error: Why the node agent itself failed (not a rank), if it did.
        setup_errors: Why the node's ranks were not started (bad GPU addresses, ...), as told
            by every node, so that all nodes agree.
    """

    node_rank: int
    host: str
    ranks: tuple[int, ...]
    failures: Mapping[int, RankFailure]
    stopped: tuple[int, ...]
    values: Mapping[int, bytes]
    running_at_timeout: tuple[int, ...] = ()
    gpus: tuple[str, ...] = ()
    setup_errors: tuple[str, ...] = ()
    agent_error: str | None = None
    hung: bool = False
    hang_sites: Mapping[int, StackSite] = field(default_factory=dict)
    hang_silent: tuple[int, ...] = ()


def node_report(
    outcome: NodeOutcome,
    run_dir: str,
    *,
    node_rank: int,
    host: str,
    tails: Mapping[int, tuple[str, ...]],
    keep: tuple[int, ...],
    gpus: tuple[str, ...] = (),
) -> NodeReport:
    """Read a node's failure records and return values after its agent finished."""
    failures: dict[int, RankFailure] = {}
    stopped: list[int] = []
    for rank, ended in outcome.exits.items():
        if ended.exit_code == 0:
            continue
        record = _read_record(run_dir, rank)
        if ended.stopped and (record is None or record["time"] >= (outcome.stop_time or 0.0)):
            stopped.append(rank)  # stopped by us, not a failure of its own
            continue
        failures[rank] = rank_failure(
            rank, host, ended.exit_code, ended.time, record=record, tail=tails.get(rank, ())
        )
    values = {}
    for rank in keep:
        path = result_path(run_dir, rank)
        if path.exists():
            values[rank] = path.read_bytes()
    return NodeReport(
        node_rank=node_rank,
        host=host,
        ranks=tuple(sorted(outcome.exits)),
        failures=failures,
        stopped=tuple(sorted(stopped)),
        values=values,
        running_at_timeout=outcome.running_at_timeout,
        gpus=gpus,
        hung=outcome.hung,
        hang_sites=dict(outcome.hang_sites),
        hang_silent=outcome.hang_silent,
    )


def finish(
    reports: Sequence[NodeReport],
    *,
    world_size: int,
    timeout: float | None,
    duration: float,
    hang_timeout: float | None = None,
    stopped: bool = False,
) -> RunResult:
    """Merge every node's report into the caller's result, or raise the run's one error.

    ``stopped``: the caller asked for the stop (``on_report``); ranks it ended are not failures.
    """
    setup = sorted({e for report in reports for e in report.setup_errors})
    if setup:
        raise ConfigError("the ranks were not started: " + "; ".join(setup))
    agents = [report.agent_error for report in reports if report.agent_error]
    if agents:
        raise SparkJobError("a node agent failed: " + "; ".join(agents))
    if stopped:
        values = {r: cloudpickle.loads(v) for report in reports for r, v in report.values.items()}
        return RunResult(values, world_size, duration, tuple(reports), stopped=True)
    failures = {r: f for report in reports for r, f in report.failures.items()}
    if any(report.hung or report.running_at_timeout for report in reports):
        # Nodes keep their own clocks: when one stops its ranks for a hang or a timeout, peers
        # on other nodes may fail with a connection error first. Those are victims, not causes.
        failures = {r: f for r, f in failures.items() if not _secondary(f)}
    if failures:
        culprit = culprit_of(failures)
        victims = {r for report in reports for r in report.stopped}
        victims |= {r for report in reports for r in report.failures}
        victims.discard(culprit.rank)
        raise TrainingFailedError(culprit, tuple(sorted(victims)), failures)
    if any(report.hung for report in reports):
        sites = {r: site for report in reports for r, site in report.hang_sites.items()}
        silent = tuple(sorted(r for report in reports for r in report.hang_silent))
        raise HangError(hang_timeout or 0.0, sites, silent)
    running = tuple(sorted(r for report in reports for r in report.running_at_timeout))
    if running:
        done = tuple(sorted(set(range(world_size)) - set(running)))
        raise TrainingTimeoutError(timeout or 0.0, running, done)
    values = {r: cloudpickle.loads(v) for report in reports for r, v in report.values.items()}
    nodes = tuple(sorted(reports, key=lambda report: report.node_rank))
    return RunResult(return_values=values, world_size=world_size, duration=duration, nodes=nodes)


def finish_plan(
    reports: Sequence[NodeReport], plan: LaunchPlan, *, started: float, stopped: bool
) -> RunResult:
    """:func:`finish` for a run of ``plan`` that began at ``started`` (``time.monotonic()``)."""
    return finish(
        reports,
        world_size=plan.world_size,
        timeout=plan.timeout,
        duration=time.monotonic() - started,
        hang_timeout=plan.hang_timeout,
        stopped=stopped,
    )
