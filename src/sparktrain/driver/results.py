"""From how each rank ended to what the caller gets: a :class:`RunResult` or one error.

The culprit is the rank that failed first. Ranks report the time of their exception and the fork
server the time of a death by signal; a peer's "connection closed" error is a consequence, not a
cause, so such errors rank after any other failure whatever their time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sparktrain.contract.report import NodeReport
from sparktrain.ground.errors import (
    ClusterError,
    ConfigError,
    GrowBack,
    HangError,
    RankFailure,
    TrainingFailedError,
    TrainingTimeoutError,
    is_consequence,
)

_GROW_BACK = f"{GrowBack.__module__}.{GrowBack.__qualname__}"
#: How the error of a lost node starts (the nodes' own words follow).
LOST_NODE = "the run lost a node (the infrastructure failed, not a rank's code): "


@dataclass(frozen=True)
class GrowingBack:
    """An attempt whose ranks all stopped at a checkpoint to grow back: no error, no result.

    Attributes:
        world_size: The attempt's ranks.
        duration: Seconds the attempt took.
    """

    world_size: int
    duration: float


#: What an elastic rescale kept and what it reloaded (see :attr:`Rescale.outcome`).
Outcome = Literal["kept", "dropped group", "redivided", "healed", "restarted"]


@dataclass(frozen=True)
class Rescale:
    """One change of an elastic run's size.

    Attributes:
        cause: ``"lost"`` (capacity was lost), ``"grew"`` (capacity returned) or
            ``"preempted"`` (a node left on notice, in place: no step lost).
        detail: What was lost (which node or rank, and how), or what returned.
        old_world_size: Ranks before.
        new_world_size: Ranks after.
        at: Wall-clock time (seconds since the epoch) when the attempt that lost capacity
            ended, or when the ranks stopped at a checkpoint to grow.
        resumed_step: The checkpoint step rank 0 resumed from (``None`` if it did not call
            ``sparktrain.checkpoint.load_latest``).
        resume_seconds: From ``at`` to rank 0's resume (``None`` likewise).
        in_place: The survivors went on in place (``in_place=True``): no restart, no
            checkpoint read.
        outcome: What the run kept and what it reloaded: ``"kept"`` (in place, every
            survivor kept its state), ``"dropped group"`` (in place, sharded: the replica
            groups that lost a rank were dropped whole, the others kept their shards),
            ``"redivided"`` (in place, ZeRO: every survivor kept the parameters, and the
            optimizer partitions were divided anew, the lost ones from their live copies),
            ``"healed"`` (in place: the joiners healed from a live replica) or
            ``"restarted"`` (every rank started again from the newest checkpoint: the restart
            path, or a sharded run with no whole replica group left).
    """

    cause: Literal["lost", "grew", "preempted"]
    detail: str
    old_world_size: int
    new_world_size: int
    at: float
    resumed_step: int | None = None
    resume_seconds: float | None = None
    in_place: bool = False
    outcome: Outcome = "restarted"

    def describe(self) -> str:
        """The one line that tells a user what happened: what was kept, what was reloaded."""
        what = f"grew: {self.detail}" if self.cause == "grew" else f"{self.cause} {self.detail}"
        if not self.in_place:
            return f"sparktrain: elastic: {what}; {self.resumed()}"
        size = f"{self.new_world_size} rank(s)"
        if self.outcome == "healed":
            return (
                f"sparktrain: elastic: {what}; the {size} go on in place (was "
                f"{self.old_world_size}): the joiners healed from a live replica, no restart, "
                "no checkpoint read"
            )
        kept = {
            "dropped group": "the whole groups kept their shards",
            "redivided": "the parameters kept, the optimizer partitions divided anew (the lost "
            "ones from their live copies)",
        }.get(self.outcome, "no restart")
        lost = "the step in flight" if self.cause == "lost" else "no step"
        return (
            f"sparktrain: elastic: {what}; the {size} left go on in place (was "
            f"{self.old_world_size}): {kept}, no checkpoint read, {lost} lost"
        )

    def resumed(self) -> str:
        """Where and from which step the run went on."""
        step = (
            f"from checkpoint step {self.resumed_step}"
            if self.resumed_step is not None
            else "with no checkpoint loaded"
        )
        took = f", {self.resume_seconds:.1f} s later" if self.resume_seconds is not None else ""
        return f"resumed on {self.new_world_size} rank(s) (was {self.old_world_size}) {step}{took}"


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
        rescales: Every change of an elastic run's size, in order (see
            :mod:`sparktrain.driver.attempts`); ``world_size`` is the last attempt's.
    """

    return_values: Mapping[int, Any]
    world_size: int
    duration: float
    nodes: tuple[NodeReport, ...] = ()
    attempts: int = 1
    stopped: bool = False
    rescales: tuple[Rescale, ...] = ()

    @property
    def value(self) -> Any:
        """Rank 0's return value."""
        return self.return_values.get(0)


def _secondary(failure: RankFailure) -> bool:
    return is_consequence(failure.message)


def culprit_of(failures: Mapping[int, RankFailure]) -> RankFailure:
    """The rank that failed first, preferring causes over peers' connection errors."""
    return min(failures.values(), key=lambda f: (_secondary(f), f.time, f.rank))


def finish(
    reports: Sequence[NodeReport],
    *,
    world_size: int,
    timeout: float | None,
    duration: float,
    hang_timeout: float | None = None,
    stopped: bool = False,
    timed_out: bool = False,
) -> RunResult | GrowingBack:
    """Merge every node's report into the caller's result, or raise the run's one error.

    The decision, in order: ranks not started (bad setup on a node, every node agreeing) is a
    :class:`ConfigError`; a node lost is a :class:`ClusterError`; a stop the caller asked for
    is a result marked ``stopped``; ranks that stopped at a checkpoint to grow back are
    :class:`GrowingBack`; a rank's own failure is a :class:`TrainingFailedError`
    naming the culprit and the victims; then a hang, then a timeout; else the values.

    Args:
        reports: Every node's report.
        world_size: Ranks in the run.
        timeout: The run's ``timeout``, for the message of a timeout.
        duration: Seconds the attempt took.
        hang_timeout: The run's ``hang_timeout``, for the message of a hang.
        stopped: The caller asked for the stop (``on_report``); ranks it ended are not
            failures.
        timed_out: The driver stopped the nodes when the call's ``timeout`` passed (its
            :class:`~sparktrain.driver.follow.Deadline`); the ranks it stopped were running.
    """
    setup = sorted({e for report in reports for e in report.setup_errors})
    if setup:
        raise ConfigError("the ranks were not started: " + "; ".join(setup))
    agents = [report.agent_error for report in reports if report.agent_error]
    if agents:
        raise ClusterError(LOST_NODE + "; ".join(agents))
    if stopped:
        return RunResult(_values(reports), world_size, duration, tuple(reports), stopped=True)
    failures = {r: f for report in reports for r, f in report.failures.items()}
    running = {r for report in reports for r in report.running_at_timeout}
    if timed_out:
        running |= {r for report in reports for r in report.stopped}
    if running or any(report.hung for report in reports):
        # Nodes keep their own clocks: when one stops its ranks for a hang or a timeout, peers
        # on other nodes may fail with a connection error first. Those are victims, not causes:
        # they were running too.
        running |= {r for r, f in failures.items() if _secondary(f)}
        failures = {r: f for r, f in failures.items() if r not in running}
    if _growing(failures):
        return GrowingBack(world_size, duration)
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
    if running:
        ran = {r for report in reports for r in report.ranks} or set(range(world_size))
        done = tuple(sorted(ran - running))
        raise TrainingTimeoutError(timeout or 0.0, tuple(sorted(running)), done)
    nodes = tuple(sorted(reports, key=lambda report: report.node_rank))
    return RunResult(_values(reports), world_size=world_size, duration=duration, nodes=nodes)


def _growing(failures: Mapping[int, RankFailure]) -> bool:
    """Whether the ranks stopped to grow back.

    Some raised ``GrowBack``; the others failed only because their peers left (a connection
    error, or killed while stopping).
    """
    grow = [f for f in failures.values() if f.exc_type == _GROW_BACK]
    others = [f for f in failures.values() if f.exc_type != _GROW_BACK]
    return bool(grow) and all(_secondary(f) or f.exc_type is None for f in others)


def _values(reports: Sequence[NodeReport]) -> dict[int, Any]:
    import cloudpickle

    return {r: cloudpickle.loads(v) for report in reports for r, v in report.values.items()}
