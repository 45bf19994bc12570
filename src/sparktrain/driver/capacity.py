"""An elastic run's capacity: what fits now, at the start, after a loss, and while it is short.

The backend answers :meth:`~sparktrain.backends.base.Backend.capacity` (ranks that could run
now) and :meth:`~sparktrain.backends.base.Backend.layout` (a layout of a given size, or a
:class:`~sparktrain.ground.errors.ConfigError`); from those this module decides:

- :func:`first_layout`: the first attempt's layout. An elastic run whose full size does not fit
  at the start begins on the largest size that does (at least ``min_processes``), says so in one
  line, and grows toward the full size as capacity arrives.
- :func:`read_room`: after a loss or a grow-back stop, what fits now (a
  :class:`~sparktrain.launchplan.policy.Room`): ``decide`` picks the next size from it, or
  refuses below ``min_processes`` at once, not after a wait (:func:`below_floor` says why).
- :func:`watch_capacity`: while a run is short, whether more ranks fit now.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sparktrain.backends.base import Backend, Nodes
from sparktrain.driver.monitor import Monitor, say
from sparktrain.ground.errors import CapacityError, ClusterError, ConfigError
from sparktrain.launchplan.layout import LaunchPlan, check_count
from sparktrain.launchplan.options import RunOptions
from sparktrain.launchplan.policy import Room

#: While an elastic run is short of its full size: how often the driver looks at the capacity.
GROW_CHECK_SECONDS = 2.0
#: After a loss: the pause between two reads of the capacity that must agree, and the longest
#: the reads go on before the last one is taken as it is.
SETTLE_STEP = 0.5
SETTLE_SECONDS = 10.0
#: After a loss: how long reads below ``min_processes`` must agree before the run is refused.
#: (A moment, not two reads: Ray shows a removed placement group's resources free a little
#: after the removal.)
BELOW_FLOOR_SECONDS = 1.0


def read_room(
    backend: Backend, current: LaunchPlan, target: int, options: RunOptions, *, name: str
) -> tuple[Room, LaunchPlan | None]:
    """What fits now: the :class:`Room` a resize is decided from, and the layout of its size.

    The capacity, once settled (:func:`settled_capacity`), up to ``target``; the largest size
    from there down to ``min_processes`` (else ``target``) that the backend lays out.
    """
    floor = options.recovery.min_processes or target
    capacity = min(settled_capacity(backend, current, floor), target)
    found = largest_layout(backend, current, capacity, floor, name=name)
    room = Room(capacity=max(capacity, 0), fits=found.world_size if found else None)
    return room, found


def below_floor(room: Room, backend: Backend, target: int, options: RunOptions, why: str) -> str:
    """Why an elastic run cannot go on after ``why``: what ``room`` holds and what is missing."""
    floor = options.recovery.min_processes or target
    return (
        f"the elastic run cannot go on after {why}: {room.capacity} rank(s) can run now "
        f"on the {backend.name} backend, fewer than min_processes={floor} (the run's full size "
        f"is {target}); {floor - room.capacity} more rank(s) of capacity are missing. Add "
        "nodes or executors, or lower min_processes."
    )


def settled_capacity(backend: Backend, plan: LaunchPlan, floor: int) -> int:
    """The backend's capacity, once it has settled after a loss (never longer than a moment).

    Reads :data:`SETTLE_STEP` apart: two that agree on at least ``floor`` ranks stand; reads
    that agree below ``floor`` for :data:`BELOW_FLOOR_SECONDS` stand (the run is refused at
    once, not after a wait); after :data:`SETTLE_SECONDS` of changing reads the last one
    stands. Just after a loss, a cluster's view lags: Ray frees the lost attempt's resources a
    moment after its placement group is removed, and Spark drops a lost executor's slots when
    it notices.
    """
    started = time.monotonic()
    last, since = _capacity(backend, plan), started
    while True:
        time.sleep(SETTLE_STEP)
        now, at = _capacity(backend, plan), time.monotonic()
        if now != last:
            last, since = now, at
        elif now >= floor or at - since >= BELOW_FLOOR_SECONDS - 1e-3:
            return now
        if at - started > SETTLE_SECONDS:
            return now


def _capacity(backend: Backend, plan: LaunchPlan) -> int:
    try:
        return backend.capacity(plan)
    except Exception as exc:
        raise ClusterError(
            f"the elastic run could not ask the {backend.name} backend for its capacity after a "
            f"loss ({type(exc).__name__}: {exc}); check the cluster, then run again."
        ) from exc


def largest_layout(
    backend: Backend, plan: LaunchPlan, high: int, low: int, *, name: str = "num_processes"
) -> LaunchPlan | None:
    """The largest layout like ``plan`` of ``high`` down to ``low`` ranks, or ``None``.

    A size the backend cannot lay out (not a multiple of the ranks per node, nodes too unequal)
    is skipped for the next smaller one.
    """
    use_gpu = plan.device == "cuda"
    for size in range(high, low - 1, -1):
        try:
            return backend.layout(size, use_gpu=use_gpu, name=name)
        except ConfigError:
            continue
    return None


def watch_capacity(
    backend: Backend,
    plan: LaunchPlan,
    target: int,
    options: RunOptions,
    monitor: Monitor | None = None,
) -> Callable[[Nodes], None] | None:
    """For the follow loop: asks the nodes to grow back once more ranks fit (``None``: never)."""
    if options.elastic and options.recovery.grow_back and options.recovery.in_place:
        return _watch_in_place(backend, plan, target, monitor)
    if not options.elastic or not options.recovery.grow_back or plan.world_size >= target:
        return None
    state = {"next": time.monotonic() + GROW_CHECK_SECONDS, "asked": False}

    def tick(nodes: Nodes) -> None:
        now = time.monotonic()
        if state["asked"] or now < state["next"]:
            return
        state["next"] = now + GROW_CHECK_SECONDS
        try:
            high = min(backend.capacity(plan), target)
            more = largest_layout(backend, plan, high, plan.world_size + 1) is not None
        except Exception:  # a cluster that cannot answer now: ask again later
            return
        if more:
            state["asked"] = True
            say(
                "sparktrain: elastic: capacity returned; the ranks stop at their next "
                f"checkpoint to grow back from {plan.world_size} rank(s) toward {target}",
                monitor,
            )
            nodes.request_grow()

    return tick


def _watch_in_place(
    backend: Backend, plan: LaunchPlan, target: int, monitor: Monitor | None
) -> Callable[[Nodes], None]:
    """In place: start nodes that join the running group whenever more ranks fit than it has."""
    state = {"next": time.monotonic() + GROW_CHECK_SECONDS}

    def tick(nodes: Nodes) -> None:
        now = time.monotonic()
        world = nodes.in_place_world()
        if now < state["next"] or world is None or world >= target:
            return
        state["next"] = now + GROW_CHECK_SECONDS
        try:
            high = min(backend.capacity(plan), target)
        except Exception:  # a cluster that cannot answer now: ask again later
            return
        started = nodes.grow_in_place(high - world) if high > world else 0
        if started:
            say(
                f"sparktrain: elastic: capacity returned; {started} rank(s) start and join the "
                f"{world} in place (toward {target}), healed from a live peer",
                monitor,
            )

    return tick


def first_layout(
    backend: Backend, num_processes: object, *, use_gpu: object, options: RunOptions, name: str
) -> tuple[LaunchPlan, int]:
    """The first attempt's layout and the run's full size.

    A run that is not elastic starts at its full size (or the layout's error says why it
    cannot). An elastic run starts at the largest size, down to ``min_processes``, that both
    lays out and fits the backend's capacity now (Ray still lists a node that just went away,
    but no longer counts its CPUs free), with one line saying so when that is short of the full
    size; its ranks keep the full size's global batch (``sparktrain.elastic.accumulation``) and
    it grows back as capacity arrives.

    Raises:
        ConfigError: A bad value, or (not elastic) the full size does not fit.
        CapacityError: Not even ``min_processes`` ranks fit now; nothing was started.
    """
    try:
        plan = backend.layout(num_processes, use_gpu=use_gpu, name=name)
    except ConfigError:
        full = check_count(name, num_processes)  # a bad value is refused as it is
        options.check_ranks(full, name)
        if options.recovery.min_processes is None or options.recovery.min_processes >= full:
            raise
    else:
        full = plan.world_size
        options.check_ranks(full, name)
        if options.recovery.min_processes is None or options.recovery.min_processes >= full:
            return plan, full
    floor, why = options.recovery.min_processes, ""
    for size in range(full, floor - 1, -1):
        try:
            plan = backend.layout(size, use_gpu=use_gpu, name=name)
        except ConfigError as error:
            why = why or _first(error)
            continue
        have = _capacity(backend, plan)
        if have >= size:
            break
        why = why or f"{have} rank(s) of capacity on the {backend.name} backend"
    else:
        raise CapacityError(
            f"the elastic run cannot start: {full} rank(s) do not fit now ({why}), nor any size "
            f"down to min_processes={floor} on the {backend.name} backend. Add nodes or "
            "executors, or lower min_processes."
        )
    if size < full:
        after = (
            f"the run grows back toward {full} rank(s) as capacity arrives"
            if options.recovery.grow_back
            else "grow_back=False: it stays at this size"
        )
        say(
            f"sparktrain: elastic: {full} rank(s) do not fit now ({why}); starting on "
            f"{plan.describe()} (min_processes={floor}); {after}"
        )
    return plan, full


def _first(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__
