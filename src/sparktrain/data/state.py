"""A dataset's saved position: what ``state_dict()`` holds, and how a state is read back.

One state resumes every rank: at a step boundary every rank's state is the same (the batches
handed out per rank, at each world size of the epoch), so a checkpoint keeps one, and a list of
every rank's (all-gathered) is accepted too. The state also names the settings the order
depends on, and a state saved with other settings is refused, naming them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparktrain.data import remainder
from sparktrain.ground.errors import ConfigError

if TYPE_CHECKING:  # circle: a type only; the dataset saves and restores itself through these
    from sparktrain.data.dataset import StreamingDataset


@dataclass(frozen=True)
class Resume:
    """Where the next pass starts: the epoch, and the batches a DataLoader already took."""

    epoch: int = 0
    consumed: int = 0
    workers: int = 0
    loader_batch: int | None = None


def _settings(ds: StreamingDataset) -> dict[str, Any]:
    return {
        "seed": ds.seed,
        "batch_size": ds.batch_size,
        "rows": ds.source.rows,
        "shuffle": ds.shuffle,
        "shuffle_buffer": ds.shuffle_buffer,
        "uneven": ds.uneven,
        "drop_last": ds.drop_last,
    }


#: Settings that states saved before elastic resumption lack (compared only when present).
_OPTIONAL = ("shuffle", "shuffle_buffer", "uneven", "drop_last")


def saved(ds: StreamingDataset) -> dict[str, Any]:
    """``ds``'s position now (see ``StreamingDataset.state_dict``)."""
    resume, current = ds._resume, ds._pass
    now = current if current.consumed else resume
    return {
        "epoch": resume.epoch,
        "consumed": resume.consumed + current.consumed,
        "workers": now.workers,
        "loader_batch": now.loader_batch,
        "world_size": ds.group()[1],
        **_settings(ds),
        "legs": [leg.as_dict() for leg in ds._legs],
    }


def restore(
    ds: StreamingDataset, state: Mapping[str, Any]
) -> tuple[Resume, tuple[remainder.Leg, ...]]:
    """Where ``state`` resumes ``ds`` at this world size, and the epoch's earlier legs.

    Raises:
        ConfigError: ``state`` was saved with other settings (named), or is malformed.
    """
    expected = {k: v for k, v in _settings(ds).items() if k not in _OPTIONAL or k in state}
    wrong = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
    if wrong:
        detail = ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in wrong.items())
        raise ConfigError(
            f"the saved data state does not fit this dataset ({detail}); resume with the "
            "same data, seed, batch size, shuffle, shuffle_buffer, uneven and drop_last."
        )
    legs = tuple(remainder.Leg.from_dict(leg) for leg in state.get("legs") or ())
    now = remainder.Leg.from_dict(state, "current leg")
    epoch = int(state["epoch"])
    if now.world_size == ds.group()[1]:  # the same leg goes on
        return Resume(epoch, now.consumed, now.workers, now.loader_batch), legs
    return Resume(epoch), legs + ((now,) if now.consumed else ())  # a new leg


def one_of(states: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The state of all-gathered ones (every rank's is the same at a step boundary)."""
    if not states:
        raise ConfigError("load_state_dict([]): no state to resume from.")
    first = dict(states[0])
    differ = [i for i, s in enumerate(states) if dict(s) != first]
    if differ:
        raise ConfigError(
            f"the states of ranks {differ} differ from rank 0's: they were not saved at the same "
            "step. Save rank 0's state_dict() (one state resumes every rank) at a step boundary."
        )
    return first
