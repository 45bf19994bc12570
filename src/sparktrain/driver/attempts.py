"""A run's attempts: restarts after failures, and, for an elastic run, shrinking and growing.

Every run is a sequence of attempts (:func:`run_attempts`). How an attempt ended decides the next
(:func:`sparktrain.launchplan.policy.decide`, pure values; this module carries it out):

- A Python exception raised by the training code is a bug. The run fails, or, with
  ``max_restarts=K``, starts again at the same size up to K times.
- A loss of infrastructure (a node, executor, Ray node or process gone; see
  :attr:`~sparktrain.ground.errors.TrainingFailedError.cause`) fails the run, or uses
  ``max_restarts``, unless the run is elastic (``min_processes``): then the next attempt runs on the
  ranks the backend can run now (:meth:`~sparktrain.backends.base.Backend.capacity`), if that is at
  least ``min_processes``, and the ranks resume from their latest ``sparktrain.checkpoint``. Fewer
  is a :class:`~sparktrain.ground.errors.CapacityError` at once, never a wait.
- While an elastic run is short of its full size (after a loss, or from the start when the
  capacity was short then) and ``grow_back`` is on, the driver looks at the capacity every
  :data:`~sparktrain.driver.capacity.GROW_CHECK_SECONDS`; once more ranks fit, it asks the
  ranks to stop at their next checkpoint (:class:`~sparktrain.ground.errors.GrowBack` in the ranks,
  :class:`~sparktrain.driver.results.GrowingBack` here: a value, not an error), and the next
  attempt runs as many ranks as fit, up to the full size.

Each change of size is a :class:`Rescale` in ``RunResult.rescales``, one line on stderr (with
the checkpoint step that rank 0 resumed from, once it reports it), and a ``world_size`` metric
in the run's MLflow run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Literal

from sparktrain.backends.base import Backend
from sparktrain.driver.capacity import below_floor, read_room
from sparktrain.driver.monitor import Monitor, say
from sparktrain.driver.results import LOST_NODE, GrowingBack, Rescale, RunResult
from sparktrain.ground.errors import (
    CapacityError,
    ClusterConfigError,
    ClusterError,
    TrainingFailedError,
)
from sparktrain.launchplan.layout import LaunchPlan
from sparktrain.launchplan.options import RunOptions
from sparktrain.launchplan.policy import Decision, Ended, Room, Tally, decide, ended_by

Attempt = Callable[[LaunchPlan, int], "RunResult | GrowingBack"]
#: The errors that end an attempt (any other is raised as it is: bad input, Ctrl-C).
ENDINGS = (TrainingFailedError, ClusterError, ClusterConfigError)


def run_attempts(
    backend: Backend,
    plan: LaunchPlan,
    options: RunOptions,
    attempt: Attempt,
    monitor: Monitor,
    *,
    name: str = "num_processes",
    on_start: Callable[[LaunchPlan, int], None] | None = None,
    target: int | None = None,
) -> RunResult:
    """Run attempts of ``plan`` until one succeeds, the restarts are used up, or capacity ends.

    After each attempt, :func:`~sparktrain.launchplan.policy.decide` says what comes next, and
    to which size a resize goes (from the backend's room, read when a resize is decided); this
    loop carries it out and says it on stderr.

    Args:
        backend: Where the nodes run (asked for its capacity by elastic runs).
        plan: The first attempt's layout (the full size, unless an elastic run started short:
            :func:`~sparktrain.driver.capacity.first_layout`).
        options: The run's policy (``max_restarts``, ``min_processes``, ``grow_back``...).
        attempt: Runs one attempt of a layout (``attempt(plan, number)``) and returns its
            result (or :class:`GrowingBack`) or raises its error.
        monitor: The run's monitor (rank 0's resume report completes a rescale's record).
        name: What the caller's front door calls the number of ranks, for messages.
        on_start: Called before each attempt with its layout and number (MLflow's metric).
        target: The run's full size (``plan``'s by default), which an elastic run grows toward.
    """
    full = plan.world_size if target is None else target
    run = _Attempts(backend, plan, full, options, _Rescales(monitor), name)
    while True:
        if on_start is not None:
            on_start(run.current, run.number)
        error: BaseException | None = None
        try:
            outcome = attempt(run.current, run.number)
        except ENDINGS as caught:
            error, outcome = caught, None
        if isinstance(outcome, RunResult):
            rescales = run.log.done() + outcome.rescales  # the attempt's own: in place
            return dataclasses.replace(outcome, attempts=run.number + 1, rescales=rescales)
        ended = ended_by(error, run.current.world_size) if error else run.grow_back()
        decision = decide(ended, run.tally(), options, run.read_room)
        if not run.carry_out(decision, error):
            assert error is not None
            raise error
        run.number += 1


@dataclasses.dataclass
class _Attempts:
    """One run's attempts so far: the layout of the next, the restarts used, the rescales."""

    backend: Backend
    plan: LaunchPlan  # the first attempt's
    target: int  # the full size
    options: RunOptions
    log: _Rescales
    name: str
    number: int = 0
    # restarts and the sizes that failed to form a group (the rescales are the log's)
    used: Tally = dataclasses.field(default_factory=Tally)
    current: LaunchPlan = dataclasses.field(init=False)  # the next attempt's layout
    # the layout of the size the last room fits, which a resize to that size runs
    fitted: LaunchPlan | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.current = self.plan

    def read_room(self) -> Room:
        """What fits now (for ``decide``), keeping the layout of the size it fits."""
        room, self.fitted = read_room(
            self.backend, self.current, self.target, self.options, name=self.name
        )
        return room

    def tally(self) -> Tally:
        return dataclasses.replace(self.used, rescales=len(self.log.entries))

    def grow_back(self) -> Ended:
        return Ended("grow back", self.current.world_size)

    def carry_out(self, decision: Decision, error: BaseException | None) -> bool:
        """Do what ``decision`` says; ``False`` when the run ends with ``error`` (said first).

        Raises:
            CapacityError: The decision is ``"below floor"``: fewer than ``min_processes`` ranks
                fit now.
        """
        self.used = decision.tally
        if decision.action in ("grow", "shrink"):
            assert self.fitted is not None and self.fitted.world_size == decision.size
            self.resize(decision, error)
        elif decision.action == "restart":
            assert error is not None
            say(
                f"sparktrain: {_first(error)}; restarting every rank "
                f"(attempt {self.used.restarts + 1} of {self.options.recovery.max_restarts + 1})",
                self.log.monitor,
            )
        elif decision.reason == "below floor":
            assert decision.room is not None
            why = "grow back" if error is None else self.why(error)
            text = below_floor(decision.room, self.backend, self.target, self.options, why)
            raise CapacityError(text)
        else:
            assert error is not None
            self.give_up(decision, error)
            return False
        return True

    def why(self, error: BaseException) -> str:
        """What was lost, in a few words, for the lines a shrink prints."""
        return _first(error) if isinstance(error, ClusterConfigError) else _loss(error)

    def resize(self, decision: Decision, error: BaseException | None) -> None:
        """Go on at the decided size: after a loss (shrink), or a grow-back stop (grow)."""
        ended = time.time()
        current, bigger = self.current, self.fitted
        assert bigger is not None
        if decision.action == "shrink":
            assert error is not None
            self.log.add("lost", self.why(error), current, bigger, ended)
        elif bigger.world_size != current.world_size:  # else the capacity went again: go on
            self.log.add("grew", _grown(current, bigger), current, bigger, ended)
        self.current = bigger

    def give_up(self, decision: Decision, error: BaseException) -> None:
        """Say why the run ends with ``error``, and count its attempts in it."""
        monitor, size = self.log.monitor, self.current.world_size
        if isinstance(error, TrainingFailedError) and decision.reason != "final":
            error.attempts = self.number + 1
        if decision.reason == "set-up":
            say(
                "sparktrain: the ranks failed to connect while their process group formed, "
                f"twice at {size} rank(s) with every node there: that is the network's set-up, "
                "not a lost node; not restarting or rescaling",
                monitor,
            )
        elif decision.reason == "rescales used":
            say(
                f"sparktrain: elastic: not going on: the run already changed size "
                f"{len(self.log.entries)} time(s), "
                f"max_rescales={self.options.recovery.max_rescales}",
                monitor,
            )


class _Rescales:
    """The rescales of one run, completed by rank 0's resume report."""

    def __init__(self, monitor: Monitor) -> None:
        self.entries: list[Rescale] = []
        self.monitor = monitor
        monitor.on_resumed = self._resumed

    def add(
        self,
        cause: Literal["lost", "grew"],
        detail: str,
        old: LaunchPlan,
        new: LaunchPlan,
        ended: float,
    ) -> None:
        self.entries.append(Rescale(cause, detail, old.world_size, new.world_size, ended))
        what = f"lost {detail}" if cause == "lost" else "growing back"
        say(
            f"sparktrain: elastic: {what}; restarting on {new.describe()} (was "
            f"{old.world_size} rank(s)) from the latest checkpoint",
            self.monitor,
        )

    def _resumed(self, step: int) -> None:
        if not self.entries or self.entries[-1].resumed_step is not None:
            return
        last = self.entries[-1]
        self.entries[-1] = dataclasses.replace(
            last, resumed_step=step, resume_seconds=time.time() - last.at
        )
        say(f"sparktrain: elastic: {self.entries[-1].resumed()}", self.monitor)

    def done(self) -> tuple[Rescale, ...]:
        return tuple(self.entries)


def _loss(error: BaseException) -> str:
    """What was lost, in a few words: the node and how, or the rank and how it died."""
    if isinstance(error, TrainingFailedError) and error.culprit is not None:
        culprit = error.culprit
        return f"rank {culprit.rank} on {culprit.host} ({culprit.summary()})"
    return _first(error).removeprefix(LOST_NODE)


def _first(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def _grown(old: LaunchPlan, new: LaunchPlan) -> str:
    return f"{new.world_size - old.world_size} more rank(s) fit"
