"""What a run does after each attempt, as values: from how the attempt ended to the next step.

The attempt loop (:func:`sparktrain.driver.attempts.run_attempts`) runs an attempt, describes how
it ended as an :class:`Ended`, and asks :func:`decide`, which answers with a :class:`Decision`:
return the result, restart at the same size, shrink or grow to a size it names, or raise. A
resize carries its size, as Ray Train's ``ResizeDecision`` carries ``num_workers``: the loop only
carries it out. What the size is chosen from is a :class:`Room`, read from the backend
(:func:`sparktrain.driver.capacity.read_room`) only when a decision needs one; no process,
backend or clock is involved here (as Ray Train v2's failure and scaling policies), so every
case is unit-tested on its own (``tests/test_policy.py``).

The rules, in order:

1. A result is returned; ranks that stopped at a checkpoint to grow back grow.
2. A timeout is raised: the run had its time.
3. The capacity gone between an elastic run's sizing and its start shrinks again, while the run
   has rescaled before and has rescales left; otherwise it is raised.
4. A failure to form the process group, a second time at the same size, is the network's
   set-up: raised, since no restart or rescale mends it.
5. A loss of infrastructure in an elastic run shrinks, while rescales are left
   (``max_rescales``).
6. Anything else restarts at the same size while ``max_restarts`` allows; then it is raised.

A shrink or a grow goes to the largest size the room lays out, up to the run's full size and
down to ``min_processes``; where none does, the run is raised (``"below floor"``) at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from sparktrain.ground.errors import (
    ClusterConfigError,
    ClusterError,
    TrainingFailedError,
    TrainingTimeoutError,
    failed_forming_group,
)
from sparktrain.launchplan.options import RunOptions

#: How an attempt ended.
Kind = Literal["finished", "grow back", "failed", "capacity went", "timed out"]
#: What the run does next.
Action = Literal["return", "grow", "shrink", "restart", "raise"]
#: Why a run ends with its error: the error cannot be retried, the set-up fails the same way
#: twice, or the rescales or restarts are used up.
Reason = Literal["", "final", "set-up", "rescales used", "restarts used", "below floor"]


@dataclasses.dataclass(frozen=True)
class Ended:
    """How one attempt ended.

    Attributes:
        kind: Finished with a result, stopped to grow back, failed, could not start for want
            of the capacity it was sized for, or timed out.
        size: The attempt's number of ranks.
        cause: For a failure: ``"training code"`` or ``"infrastructure"``
            (:attr:`~sparktrain.ground.errors.TrainingFailedError.cause`).
        forming: The failure happened while the ranks' process group formed (a connection
            refused in ``init_process_group``).
    """

    kind: Kind
    size: int
    cause: str | None = None
    forming: bool = False


@dataclasses.dataclass(frozen=True)
class Tally:
    """What the run has used so far.

    Attributes:
        restarts: Restarts at the same size (``max_restarts`` bounds them).
        rescales: Changes of size, losses and growths (``max_rescales`` bounds them).
        forming: The sizes at which the process group failed to form once.
    """

    restarts: int = 0
    rescales: int = 0
    forming: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class Room:
    """What fits now, read from the backend when a decision needs a size.

    Attributes:
        capacity: The ranks that could run now (at most the run's full size).
        fits: The largest size, from ``capacity`` down to the run's floor (``min_processes``,
            else its full size), that the backend lays out; ``None`` when none does.
    """

    capacity: int
    fits: int | None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do after an attempt, and the tally after doing it.

    Attributes:
        action: ``"return"`` the result, ``"grow"`` or ``"shrink"`` to :attr:`size`,
            ``"restart"`` at the same size, or ``"raise"`` the attempt's error.
        tally: The counters with this decision counted (a rescale is counted by the loop once
            it has changed the size, since a growth that finds nothing more is none).
        reason: For ``"raise"``: why the run ends (``"below floor"``: :attr:`room` holds too few
            ranks for ``min_processes``).
        size: For ``"grow"`` and ``"shrink"``: the number of ranks the next attempt runs.
        room: What a resize (or a ``"below floor"``) was decided from.
    """

    action: Action
    tally: Tally
    reason: Reason = ""
    size: int | None = None
    room: Room | None = None


def decide(ended: Ended, tally: Tally, options: RunOptions, room: Callable[[], Room]) -> Decision:
    """The next step after ``ended``, given what the run used (``tally``) and its ``options``.

    ``room`` is called only when the decision is a resize (the backend is asked for its
    capacity then, not after every attempt).
    """
    if ended.kind == "finished":
        return Decision("return", tally)
    if ended.kind == "grow back":
        return _resize("grow", tally, room())
    if ended.kind == "timed out":
        return Decision("raise", tally, "final")
    rescales_left = tally.rescales < options.recovery.max_rescales
    if ended.kind == "capacity went":
        # it fitted when sized (the first attempt too): nodes went before it started
        again = options.elastic and rescales_left
        return _resize("shrink", tally, room()) if again else Decision("raise", tally, "final")
    if ended.forming:
        if ended.size in tally.forming:
            return Decision("raise", tally, "set-up")
        tally = dataclasses.replace(tally, forming=tally.forming | {ended.size})
    lost = options.elastic and ended.cause == "infrastructure"
    if lost and rescales_left:
        return _resize("shrink", tally, room())
    if tally.restarts < options.recovery.max_restarts:
        return Decision("restart", dataclasses.replace(tally, restarts=tally.restarts + 1))
    return Decision("raise", tally, "rescales used" if lost else "restarts used")


def _resize(action: Literal["grow", "shrink"], tally: Tally, room: Room) -> Decision:
    """Go to the largest size that fits, or raise when none reaches the floor."""
    if room.fits is None:
        return Decision("raise", tally, "below floor", room=room)
    return Decision(action, tally, size=room.fits, room=room)


def ended_by(error: BaseException, size: int) -> Ended:
    """How an attempt of ``size`` ranks that raised ``error`` ended.

    Raises:
        BaseException: ``error`` itself, when it is none of an attempt's endings (a
            ``ConfigError`` from bad input, ``KeyboardInterrupt``): no decision applies to it.
    """
    if isinstance(error, TrainingTimeoutError):
        return Ended("timed out", size)
    if isinstance(error, ClusterConfigError):
        return Ended("capacity went", size)
    if isinstance(error, TrainingFailedError):
        forming = error.culprit is not None and failed_forming_group(error.culprit)
        return Ended("failed", size, error.cause, forming)
    if isinstance(error, ClusterError):
        return Ended("failed", size, error.cause)
    raise error


__all__ = ["Action", "Decision", "Ended", "Kind", "Reason", "Room", "Tally", "decide", "ended_by"]
