"""A Spark run's task slots, on the driver: counted, waited for while the cluster can grow, refused.

A barrier stage needs all its tasks running at once, so a run whose tasks outnumber the free
task slots cannot start. What happens then is decided by pure values, tested without Spark
(:func:`growth_from_conf`, :func:`wait_bound`, :func:`slot_decision`), and carried out by
:func:`wait_for_slots` and :func:`ensure_slots`:

- a cluster that cannot grow is refused after :data:`SLOT_WAIT_SECONDS`, the moment executors
  that are still registering get (as before: a session just made has not all its executors);
- a cluster that can grow (``spark.dynamicAllocation.enabled=true`` with ``maxExecutors`` unset
  or large enough, or a Databricks autoscaling cluster) is waited for up to
  :data:`GROW_WAIT_SECONDS` (the Spark conf :data:`GROW_WAIT_CONF` overrides it), with one line
  saying so; the slots are counted again every :data:`SLOT_STEP_SECONDS`, and a run still short
  at the end is refused with the same message, which says how long it waited.

The bound is a Spark conf, not an environment variable: it belongs to the cluster's settings, as
``spark.sparktrain.ignoreSsl`` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sparktrain.driver.monitor import say
from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.layout import ClusterFacts, LaunchPlan, asked_count, check_slots

#: How long to wait for executors to register when there are fewer slots than tasks.
SLOT_WAIT_SECONDS = 10.0
#: How long a run waits for a cluster that can grow to offer the slots its tasks need.
GROW_WAIT_SECONDS = 300.0
#: The Spark conf that overrides :data:`GROW_WAIT_SECONDS` (seconds).
GROW_WAIT_CONF = "spark.sparktrain.capacityWaitSeconds"
#: How often the slots are counted while a run waits for them.
SLOT_STEP_SECONDS = 0.5

_DYNAMIC = "spark.dynamicAllocation.enabled"
_MAX_EXECUTORS = "spark.dynamicAllocation.maxExecutors"
_SCALING = "spark.databricks.clusterUsageTags.clusterScalingType"
_MAX_WORKERS = "spark.databricks.clusterUsageTags.clusterMaxWorkers"
#: The Spark confs that say whether, and how far, a cluster can grow.
GROWTH_CONFS = (_DYNAMIC, _MAX_EXECUTORS, _SCALING, _MAX_WORKERS)

Decision = Literal["run", "wait", "fail"]


@dataclass(frozen=True, kw_only=True)
class Growth:
    """How a cluster may grow while a run waits for task slots.

    Attributes:
        why: The settings that let it grow, for messages.
        max_executors: The most executors it may have, or ``None`` when no bound is set.
    """

    why: str
    max_executors: int | None


def _count(conf: Mapping[str, str | None], key: str) -> int | None:
    raw = (conf.get(key) or "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"the Spark conf {key}={raw!r} must be a whole number.") from None


def growth_from_conf(conf: Mapping[str, str | None]) -> Growth | None:
    """Whether the cluster configured by ``conf`` can add executors (``None``: it cannot).

    Dynamic allocation (``spark.dynamicAllocation.enabled=true``, bounded by ``maxExecutors``
    when set), or a Databricks autoscaling cluster (``clusterScalingType`` is ``autoscaling``,
    or ``clusterMaxWorkers`` is set: its bound, one executor per worker).
    """
    if (conf.get(_SCALING) or "").strip().lower() == "autoscaling" or conf.get(_MAX_WORKERS):
        workers = _count(conf, _MAX_WORKERS)
        bound = f", {_MAX_WORKERS}={workers}" if workers is not None else ""
        return Growth(why=f"a Databricks autoscaling cluster{bound}", max_executors=workers)
    if (conf.get(_DYNAMIC) or "false").strip().lower() == "true":
        most = _count(conf, _MAX_EXECUTORS)
        bound = f", {_MAX_EXECUTORS}={most}" if most is not None else ""
        return Growth(why=f"{_DYNAMIC}=true{bound}", max_executors=most)
    return None


def reachable_slots(growth: Growth, *, slots: int, executors: int) -> int | None:
    """The most slots the cluster can reach, from the slots per executor now (``None``: no bound).

    Unknown (no bound) when the cluster sets no executor bound, or has no executor now to tell
    how many slots one gives.
    """
    if growth.max_executors is None or executors < 1:
        return None
    return growth.max_executors * (slots // executors)


@dataclass(frozen=True, kw_only=True)
class SlotWait:
    """How long a run short of task slots waits for them, and for what.

    Attributes:
        seconds: The longest wait.
        growth: How the cluster can grow; ``None`` when it cannot (the wait is then only for
            executors that are still registering).
        reach: The most slots a cluster that can grow, but not enough, may reach; ``None``
            when it can grow enough (the wait is then for the growth), or cannot grow.
    """

    seconds: float
    growth: Growth | None = None
    reach: int | None = None

    @property
    def for_growth(self) -> bool:
        """Whether the wait is for the cluster to grow."""
        return self.growth is not None and self.reach is None

    def note(self) -> str:
        """What a refusal after this wait says about it ("" on a cluster that cannot grow)."""
        if self.growth is None:
            return ""
        if self.reach is not None:
            return f" and can grow to {self.reach} at most ({self.growth.why})"
        return (
            f" after waiting {self.seconds:g}s for the cluster to grow ({self.growth.why}; "
            f"{GROW_WAIT_CONF} sets the wait)"
        )


def wait_bound(
    growth: Growth | None, *, slots: int, executors: int, tasks: int, grow_seconds: float
) -> SlotWait:
    """How long to wait for ``tasks`` slots: ``grow_seconds`` on a cluster that can grow enough.

    Otherwise :data:`SLOT_WAIT_SECONDS`, for executors still registering.
    """
    if growth is None:
        return SlotWait(seconds=SLOT_WAIT_SECONDS)
    reach = reachable_slots(growth, slots=slots, executors=executors)
    if reach is None or reach >= tasks:
        return SlotWait(seconds=grow_seconds, growth=growth)
    return SlotWait(seconds=SLOT_WAIT_SECONDS, growth=growth, reach=reach)


def slot_decision(*, slots: int, tasks: int, waited: float, bound: float) -> Decision:
    """``"run"`` when the tasks fit, ``"wait"`` while the bound is not reached, else ``"fail"``."""
    if slots >= tasks:
        return "run"
    return "wait" if waited < bound else "fail"


def wait_for_slots(
    count: Callable[[], int],
    tasks: int,
    *,
    bound: float,
    on_wait: Callable[[int], None] | None = None,
) -> int:
    """Count the slots until ``tasks`` fit or ``bound`` seconds have passed; the last count.

    ``on_wait`` is told the count once, when the first wait begins.
    """
    started = time.monotonic()
    slots = count()
    told = False
    while True:
        waited = time.monotonic() - started
        if slot_decision(slots=slots, tasks=tasks, waited=waited, bound=bound) != "wait":
            return slots
        if on_wait is not None and not told:
            on_wait(slots)
            told = True
        time.sleep(max(0.0, min(SLOT_STEP_SECONDS, bound - waited)))
        slots = count()


def slot_count(session: Any) -> int:
    """The tasks of the default resource profile the registered executors can run at once."""
    jsc = session.sparkContext._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def executor_count(session: Any) -> int:
    """The executors registered now (the driver left out)."""
    summaries = session.sparkContext._jsc.sc().statusStore().executorList(True)
    return sum(str(summaries.apply(i).id()) != "driver" for i in range(summaries.size()))


def grow_seconds(session: Any) -> float:
    """:data:`GROW_WAIT_SECONDS`, or the session's :data:`GROW_WAIT_CONF`."""
    raw = str(session.conf.get(GROW_WAIT_CONF, "") or "").strip()
    if not raw:
        return GROW_WAIT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ConfigError(f"the Spark conf {GROW_WAIT_CONF}={raw!r} must be seconds >= 0.")
    return seconds


def ensure_slots(session: Any, plan: LaunchPlan, facts: ClusterFacts, *, name: str) -> None:
    """Refuse ``plan`` when its tasks do not fit the free slots, after waiting where it helps.

    Raises:
        ClusterConfigError: The tasks still outnumber the slots; names both, the wait and the fix.
    """
    tasks, slots = plan.nodes, slot_count(session)
    if slots >= tasks:
        return
    growth = growth_from_conf({key: session.conf.get(key, None) for key in GROWTH_CONFS})
    wait = wait_bound(
        growth,
        slots=slots,
        executors=executor_count(session),
        tasks=tasks,
        grow_seconds=grow_seconds(session),
    )

    def tell(now: int) -> None:
        if wait.for_growth and wait.growth is not None:
            say(
                f"sparktrain: {name}={asked_count(plan)} needs {tasks} task slot(s) and the "
                f"cluster has {now}; waiting up to {wait.seconds:g}s for it to grow "
                f"({wait.growth.why})"
            )

    slots = wait_for_slots(lambda: slot_count(session), tasks, bound=wait.seconds, on_wait=tell)
    check_slots(plan, facts, slots, name=name, note=wait.note())
