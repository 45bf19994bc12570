"""A run's attempts: restarts after failures, and, for an elastic run, shrinking and growing.

Every run is a sequence of attempts (:func:`run_attempts`). What ends an attempt decides the next:

- A Python exception raised by the training code is a bug. The run fails, or, with
  ``max_restarts=K``, starts again at the same size up to K times.
- A loss of infrastructure (a node, executor, Ray node or process gone; see
  :attr:`~sparktrain.errors.TrainingFailedError.cause`) fails the run, or uses ``max_restarts``,
  unless the run is elastic (``min_processes``): then the next attempt runs on the ranks the
  backend can run now (:meth:`~sparktrain.driver.backend.Backend.capacity`), if that is at least
  ``min_processes``, and the ranks resume from their latest ``sparktrain.checkpoint``. Fewer is
  a :class:`~sparktrain.errors.CapacityError` at once, never a wait.
- While an elastic run is short of its full size (after a loss, or from the start when the
  capacity was short then) and ``grow_back`` is on, the driver looks at the capacity every
  :data:`~sparktrain.driver.capacity.GROW_CHECK_SECONDS`; once more ranks fit, it asks the
  ranks to stop at their next checkpoint (:class:`~sparktrain.errors.GrowBack`), and the next
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

from sparktrain.driver.backend import Backend
from sparktrain.driver.capacity import fit
from sparktrain.driver.monitor import Monitor, say
from sparktrain.driver.results import LOST_NODE, Rescale, RunResult
from sparktrain.errors import (
    ClusterConfigError,
    ClusterError,
    GrowBack,
    TrainingFailedError,
    TrainingTimeoutError,
    failed_forming_group,
)
from sparktrain.launchplan.layout import LaunchPlan
from sparktrain.launchplan.options import RunOptions

Attempt = Callable[[LaunchPlan, int], RunResult]


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

    Args:
        backend: Where the nodes run (asked for its capacity by elastic runs).
        plan: The first attempt's layout (the full size, unless an elastic run started short:
            :func:`~sparktrain.driver.capacity.first_layout`).
        options: The run's policy (``max_restarts``, ``min_processes``, ``grow_back``...).
        attempt: Runs one attempt of a layout (``attempt(plan, number)``) and returns its
            result or raises its error.
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
        try:
            result = attempt(run.current, run.number)
            return dataclasses.replace(result, attempts=run.number + 1, rescales=run.log.done())
        except GrowBack:
            run.grow()
        except TrainingTimeoutError:
            raise
        except ClusterConfigError as error:
            # After a rescale, the capacity went again between the sizing and the start.
            entries = run.log.entries
            if not (options.elastic and entries) or len(entries) >= options.max_rescales:
                raise
            run.shrink(_first(error))
        except (TrainingFailedError, ClusterError) as error:
            if not run.recover(error):
                raise
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
    restarts: int = 0
    forming: set[int] = dataclasses.field(default_factory=set)  # sizes that failed to form once
    current: LaunchPlan = dataclasses.field(init=False)  # the next attempt's layout

    def __post_init__(self) -> None:
        self.current = self.plan

    def shrink(self, why: str) -> None:
        """Go on with as many ranks as fit now, after a loss."""
        ended = time.time()
        current, options = self.current, self.options
        smaller = fit(self.backend, current, self.target, options, name=self.name, why=why)
        self.log.add("lost", why, self.current, smaller, ended)
        self.current = smaller

    def grow(self) -> None:
        """Go on with as many ranks as fit now, up to the full size, after a grow-back stop."""
        ended = time.time()
        current, target = self.current, self.target
        bigger = fit(self.backend, current, target, self.options, name=self.name, why="grow back")
        if bigger.world_size != current.world_size:  # else the capacity went again: go on
            self.log.add("grew", _grown(current, bigger), current, bigger, ended)
        self.current = bigger

    def recover(self, error: TrainingFailedError | ClusterError) -> bool:
        """Shrink or restart after ``error``; ``False`` when it ends the run (say why first)."""
        options, monitor, size = self.options, self.log.monitor, self.current.world_size
        if isinstance(error, TrainingFailedError) and repeated_setup_fault(
            error, size, self.forming
        ):
            error.attempts = self.number + 1
            say(
                "sparktrain: the ranks failed to connect while their process group formed, "
                f"twice at {size} rank(s) with every node there: that is the network's set-up, "
                "not a lost node; not restarting or rescaling",
                monitor,
            )
            return False
        lost = options.elastic and error.cause == "infrastructure"
        if lost and len(self.log.entries) < options.max_rescales:
            self.shrink(_loss(error))
        elif self.restarts < options.max_restarts:
            self.restarts += 1
            say(
                f"sparktrain: {_first(error)}; restarting every rank "
                f"(attempt {self.restarts + 1} of {options.max_restarts + 1})",
                monitor,
            )
        else:
            if isinstance(error, TrainingFailedError):
                error.attempts = self.number + 1
            if lost:
                say(
                    f"sparktrain: elastic: not going on: the run already changed size "
                    f"{len(self.log.entries)} time(s), max_rescales={options.max_rescales}",
                    monitor,
                )
            return False
        return True


def repeated_setup_fault(error: TrainingFailedError, size: int, seen: set[int]) -> bool:
    """Whether ``error`` failed to form the process group a second time at ``size`` ranks.

    Such a failure (a connection refused in ``init_process_group``, every node still there) is
    noted in ``seen`` the first time, which may be a passing fault; the second time at the same
    size it is the set-up (a host name resolving to loopback, a firewall), which no restart and
    no rescale mends.
    """
    if error.culprit is None or not failed_forming_group(error.culprit):
        return False
    if size in seen:
        return True
    seen.add(size)
    return False


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


def _loss(error: TrainingFailedError | ClusterError) -> str:
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
