"""Where an ``nn.Sequential`` is cut into pipeline stages. Pure: numbers and names in, names out.

A stage is a run of consecutive children. Without split points the cut balances the stages'
parameter counts (the memory each stage's GPUs hold): the contiguous partition whose largest part
is smallest. Split points name the children that start a new stage, as
``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING`` does. The children keep their names,
so every stage's ``state_dict`` keys are the whole model's (checkpoints and ``full_state_dict``
need no renaming).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from itertools import pairwise

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.partition import balanced_bounds

#: The schedules ``prepare_model(pp=...)`` takes, by our name, with torch's class name.
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved1f1b": "Interleaved1F1B",
    "loopedbfs": "LoopedBFS",
    "interleavedzerobubble": "InterleavedZeroBubble",
}
#: Schedules that run several stages on each rank (``stages_per_rank`` >= 2).
MULTI_STAGE = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble")


def check_schedule(schedule: object, stages_per_rank: object) -> tuple[str, int]:
    """The schedule's key and the stages each rank runs, or the error naming the choices."""
    key = str(schedule).lower().replace("-", "").replace("_", "")
    if not isinstance(schedule, str) or key not in SCHEDULES:
        raise ConfigError(
            f"schedule={schedule!r} is not a pipeline schedule; choose one of: "
            f"{', '.join(SCHEDULES)}."
        )
    if stages_per_rank is None:
        stages_per_rank = 2 if key in MULTI_STAGE else 1
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int):
        raise ConfigError(f"stages_per_rank={stages_per_rank!r} must be a positive integer.")
    if key in MULTI_STAGE and stages_per_rank < 2:
        raise ConfigError(
            f"schedule={schedule!r} interleaves several stages on each rank: use "
            "stages_per_rank=2 or more, or schedule='1f1b' for one stage a rank."
        )
    if key not in MULTI_STAGE and stages_per_rank != 1:
        raise ConfigError(
            f"schedule={schedule!r} runs one stage a rank, not {stages_per_rank}: use "
            "schedule='interleaved1f1b' for several, or stages_per_rank=1."
        )
    return key, stages_per_rank


def check_microbatches(key: str, microbatches: object, pp: int) -> int:
    """The micro-batch count, checked against the schedule (1F1B needs one per stage at least)."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches={microbatches!r} must be a positive integer, e.g. {pp}.")
    if key != "gpipe" and microbatches < pp:
        raise ConfigError(
            f"schedule={key!r} needs at least one micro-batch per pipeline rank: microbatches="
            f"{microbatches} < pp={pp}. Use microbatches >= {pp} (more shrinks the bubble), or "
            "schedule='gpipe'."
        )
    if key in MULTI_STAGE and microbatches % pp:
        raise ConfigError(
            f"schedule={key!r} runs micro-batches in rounds of pp={pp}: microbatches="
            f"{microbatches} is not a multiple of {pp}. Use microbatches="
            f"{pp * max(1, microbatches // pp)}."
        )
    return microbatches


def split_children(
    names: Sequence[str],
    sizes: Sequence[int],
    stages: int,
    split_points: Sequence[str] | None = None,
) -> list[list[str]]:
    """The children's names of each of ``stages`` stages, in order.

    Args:
        names: The ``nn.Sequential``'s children, in order.
        sizes: Their parameter counts (the balance when there are no split points).
        stages: How many stages (``pp * stages_per_rank``).
        split_points: Children that begin a stage (``stages - 1`` of them), or ``None``.

    Raises:
        ConfigError: More stages than children, or split points that are not children, out of
            order, or not ``stages - 1`` of them.
    """
    if stages > len(names):
        raise ConfigError(
            f"{stages} pipeline stages need at least {stages} layers, but the model has "
            f"{len(names)} (children of its nn.Sequential: {', '.join(names)}). Use fewer stages "
            "(pp, stages_per_rank) or split the model into more children."
        )
    if split_points is None:
        return [list(names[a:b]) for a, b in balanced_bounds(sizes, stages)]
    points = list(split_points)
    for point in points:
        if point not in names:
            close = difflib.get_close_matches(str(point), list(names), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"split_points names {point!r}, which is no child of the model's nn.Sequential "
                f"(its children: {', '.join(names)}).{hint}"
            )
    starts = [names.index(p) for p in points]
    if len(points) != stages - 1:
        raise ConfigError(
            f"{stages} stages need {stages - 1} split points (the children that begin stages "
            f"2 to {stages}), not {len(points)}: {points}."
        )
    if starts != sorted(set(starts)) or 0 in starts:
        raise ConfigError(
            f"split_points={points} must name distinct children after the first, in the "
            "model's order."
        )
    cuts = [0, *starts, len(names)]
    return [list(names[a:b]) for a, b in pairwise(cuts)]
