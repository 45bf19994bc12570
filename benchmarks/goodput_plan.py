"""The goodput benchmark's pure parts: the failure schedule, and what the ranks' logs say.

A schedule is drawn once from a seed and played against every side alike: losses arrive as a
Poisson process (exponential gaps of mean ``mean_between`` seconds from the run's start), each
a SIGKILL or, for a share of them, a notice (``sparktrain.preempt``, then the node goes); the
node returns ``back_after`` seconds later. Which node goes is drawn too (``pick``, a number in
[0, 1) that chooses among the nodes up then, never the first: it hosts torchrun's store).

The ranks log each step: ``P <step> <generation> <time> <ids>`` before it and ``C <step>
<generation> <time> <world>`` once committed (in place; torchft's side logs both at the commit
and ``D <step> 0 <time>`` for a step not committed), or ``R <step>`` at an attempt's
resume and ``C <step> <generation> <time> <world> <ids>`` after each step (the restart path,
the generation being the attempt). What counts as trained: in place, the batches of the
generation each step committed in (the latest, where a restart trained a step again: its
generations are logged after the earlier attempt's); on the restart path, each attempt's steps
up to the step the next attempt resumed from.

The reader pads (``uneven="pad"``, its default): where what a generation reads of the epoch does
not divide among its ranks, the last rank's share wraps to the share's start, so a generation
that reads to the epoch's end trains up to ``world - 1`` rows a second time, both times in that
generation. Those are counted apart (:meth:`Trained.padded`); a row trained twice in two
generations, or more often in one than padding explains, is a duplicate.
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Fault:
    """One loss of the schedule, ``at`` seconds after the run started."""

    at: float
    kind: str  # "kill" or "notice"
    back_after: float
    pick: float


def schedule(
    seed: int, seconds: float, mean_between: float, back_after: float, notice_share: float
) -> list[Fault]:
    """The losses of a run of ``seconds`` (see the module's docstring)."""
    draw = random.Random(seed)
    faults, at = [], 0.0
    while True:
        at += draw.expovariate(1.0 / mean_between)
        if at >= seconds:
            return faults
        kind = "notice" if draw.random() < notice_share else "kill"
        faults.append(Fault(round(at, 2), kind, back_after, draw.random()))


def choose(pick: float, up: list[int]) -> int | None:
    """The node a fault takes among those ``up`` (the first one never); ``None``: none."""
    candidates = sorted(up)[1:]
    return candidates[int(pick * len(candidates))] if candidates else None


@dataclass
class Trained:
    """What a side's logs say: the rows trained, and the committed steps' times."""

    rows: list[int] = field(default_factory=list)
    steps: int = 0  # committed steps that count (each trained its batch once)
    #: generation (or attempt) -> the rows it trained, and its largest world size
    legs: dict[int, list[int]] = field(default_factory=dict)
    worlds: dict[int, int] = field(default_factory=dict)
    #: (generation or attempt, step) -> (the first rank's commit time, world size)
    commits: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)
    resumes: int = 0
    dropped: int = 0  # in place: steps attempted in a generation and committed in none
    #: each step that counts -> when it committed (in the generation or attempt that counts)
    counted: dict[int, float] = field(default_factory=dict)

    def commit(self, generation: int, step: int, at: float, world: int) -> None:
        """A rank committed ``step`` in ``generation`` at ``at`` (the earliest rank counts)."""
        key = (generation, step)
        if key not in self.commits or at < self.commits[key][0]:
            self.commits[key] = (at, world)
        self.worlds[generation] = max(world, self.worlds.get(generation, 0))

    def train(self, generation: int, ids: list[int]) -> None:
        """``generation`` trained the rows ``ids`` (a committed step's batch)."""
        self.steps += 1
        self.rows += ids
        self.legs.setdefault(generation, []).extend(ids)

    def padded(self) -> int:
        """Rows trained twice by the reader's padding: repeats inside one generation, at most
        its world size minus one (see the module's docstring)."""
        return sum(
            min(len(ids) - len(set(ids)), self.worlds.get(g, 1) - 1) for g, ids in self.legs.items()
        )

    def duplicated(self) -> int:
        """Rows trained more than once, beyond the reader's padding."""
        return len(self.rows) - len(set(self.rows)) - self.padded()

    def missing(self, total: int) -> int:
        """Rows of the dataset never trained."""
        return total - len(set(self.rows))

    def step_seconds(self, world: int) -> float | None:
        """The median time between two committed steps at full size (the fault-free step)."""
        gaps = [
            self.commits[(g, s + 1)][0] - at
            for (g, s), (at, size) in self.commits.items()
            if size == world and (g, s + 1) in self.commits
        ]
        return statistics.median(gaps) if gaps else None


def _lines(logs: Path) -> list[list[str]]:
    return [
        line.split()
        for path in sorted(logs.glob("*.txt"))
        for line in path.read_text().splitlines()
    ]


def read_in_place(logs: Path) -> Trained:
    """In place: each step's batches from the generation it committed in."""
    pending: dict[tuple[int, int], list[int]] = {}
    committed: dict[int, int] = {}
    trained = Trained()
    for kind, step, generation, at, *rest in _lines(logs):
        key = (int(step), int(generation))
        if kind == "P":
            pending.setdefault(key, []).extend(int(i) for i in rest)
        elif kind == "C":  # a later attempt's commit (after a restart) replaces an earlier one
            committed[int(step)] = max(int(generation), committed.get(int(step), -1))
            trained.commit(int(generation), int(step), float(at), int(rest[0]))
    for step, generation in committed.items():
        trained.train(generation, pending.get((step, generation), []))
        trained.counted[step] = trained.commits[(generation, step)][0]
    trained.dropped = sum(1 for step, generation in pending if committed.get(step) != generation)
    # torchft logs a step it did not commit as ``D`` (it tries the batch again): the most any
    # one group logged
    trained.dropped += max(
        (sum(1 for line in path.read_text().splitlines() if line.startswith("D "))
         for path in logs.glob("*.txt")),
        default=0,
    )  # fmt: skip
    return trained


def read_restarts(logs: Path) -> Trained:
    """The restart path: each attempt's steps up to the next attempt's resume step."""
    trained = Trained()
    resumed: dict[int, int] = {}
    steps: dict[int, dict[int, list[int]]] = {}
    for path in sorted(logs.glob("*.txt")):
        attempt = int(path.name.split("-")[0].removeprefix("attempt"))
        for line in path.read_text().splitlines():
            words = line.split()
            if words[0] == "R":
                resumed[attempt] = int(words[1])
            else:
                step, at, world = int(words[1]), float(words[3]), int(words[4])
                steps.setdefault(attempt, {}).setdefault(step, []).extend(int(i) for i in words[5:])
                trained.commit(attempt, step, at, world)
    order = sorted(steps)
    trained.resumes = max(0, len(resumed) - 1)
    for index, attempt in enumerate(order):
        later = [resumed.get(a, 0) for a in order[index + 1 :]]
        upto = min(later) if later else None
        for step, ids in steps[attempt].items():
            if upto is None or step <= upto:
                trained.train(attempt, ids)
                trained.counted[step] = trained.commits[(attempt, step)][0]
    return trained


def goodput(trained: Trained, wall: float, step: float | None) -> float | None:
    """Committed steps x the fault-free step time / the wall time (a step at any world size)."""
    if step is None or wall <= 0:
        return None
    return trained.steps * step / wall


#: A gap between two counted steps longer than this many fault-free steps is a stall.
STALL_STEPS = 3


def spent(  # noqa: PLR0917 - what one side's run says
    trained: Trained, began: float, wall: float, step: float | None,
    losses: Sequence[float] = (), starts: Sequence[tuple[float, float]] = (),
) -> dict[str, float]:  # fmt: skip
    """Where the wall time not spent on counted steps went, in seconds.

    ``start``: from the launch to the first counted step's commit (start-up, and any restart
    before a step that counts); ``end``: from the last counted commit to the launch's return.
    Between them, each gap between two counted steps costs its excess over the fault-free
    ``step``: ``at_loss`` where the gap holds a loss (one of ``losses``, absolute times: the
    recovery and the step dropped), ``starting`` where it overlaps a returning node's start-up
    (``starts``: from its start to its joining) and is longer than :data:`STALL_STEPS` steps
    (the joiner's imports take the CPU the ranks train on where nodes share a machine),
    ``stalls`` the other long gaps, ``slow`` the rest (negative where steps at fewer ranks are
    faster). With the counted steps x ``step`` they add up to ``wall`` (less one step).
    """
    times = sorted(trained.counted.values())
    if step is None or not times:
        return {}
    parts = {"start": times[0] - began, "at_loss": 0.0, "starting": 0.0, "stalls": 0.0,
             "slow": 0.0, "end": began + wall - times[-1]}  # fmt: skip
    for a, b in itertools.pairwise(times):
        if any(a <= t < b for t in losses):
            part = "at_loss"
        elif b - a <= STALL_STEPS * step:
            part = "slow"
        elif any(a < end and b > start for start, end in starts):
            part = "starting"
        else:
            part = "stalls"
        parts[part] += b - a - step
    return parts


def node_starts(
    began: float, struck: list[dict], rescales: list[list], back_after: float, lead: float
) -> tuple[list[float], list[tuple[float, float]]]:
    """The losses' absolute times (a notice's when it was given: its node leaves at the step's
    end), and each returning node's start-up: from its start (``back_after`` after its machine
    went, which is ``lead`` after a notice) to the first ``grew`` rescale after that
    (``rescales``: ``[cause, old, new, in_place, at]``; none after it: no start-up counted)."""
    losses, starts = [], []
    grew = sorted(r[4] for r in rescales if r[0] == "grew" and len(r) > 4)
    for s in struck:
        if "node" not in s:
            continue
        losses.append(began + s["at"])
        start = began + s["at"] + (lead if s["kind"] == "notice" else 0.0) + back_after
        end = next((g for g in grew if g >= start), None)
        if end is not None:
            starts.append((start, end))
    return losses, starts


def full_size(
    trained: Trained, world: int, batch: int, wall: float, step: float | None
) -> float | None:
    """The same at full size: rows trained / (``world`` x ``batch``) steps, so that a step at
    fewer ranks counts for the share of the rows it trained (the capacity out counts as lost)."""
    if step is None or wall <= 0:
        return None
    return len(set(trained.rows)) / (world * batch) * step / wall
