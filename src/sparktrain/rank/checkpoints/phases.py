"""The writer's job of one checkpoint: the same three phases on every rank, whatever fails.

Rank 0 makes the temporary folder, every rank writes its part, rank 0 publishes; after each
phase the ranks exchange whether it went well (:func:`run`). Used by both formats' jobs
(:mod:`~sparktrain.rank.checkpoints.saving`, :mod:`~sparktrain.rank.checkpoints.sharded`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparktrain.ground.errors import PEERS_OWN_ERROR, CheckpointError
from sparktrain.rank.checkpoints import coordinate
from sparktrain.rank.checkpoints.storage import Storage
from sparktrain.rank.checkpoints.writer import After, Job


@dataclass(frozen=True)
class Target:
    """Where one checkpoint goes, and who writes it."""

    storage: Storage
    step: int
    keep: int
    found: coordinate.Groups | None
    rank: int
    size: int
    token: str
    replicas: int = 0  # -1: nothing in memory


def failed_job(target: Target, error: Exception) -> Job:
    """The job of a rank that could not stage: it fails the first phase, so every rank stops.

    The first, before any rank writes: a sharded write is itself collective (DCP), and a peer
    failing later would leave the others waiting in it.
    """

    def job() -> None:
        with contextlib.suppress(CheckpointError):  # the caller raises this rank's own error
            run(target, lambda: None, {}, unstaged=error)

    return job


def run(
    target: Target,
    write_mine: Callable[[], None],
    manifest: dict[str, Any],
    remember: Callable[[], None] | None = None,
    *,
    unstaged: Exception | None = None,
) -> After:
    """The writer's job, the same three phases on every rank whatever fails.

    Rank 0 makes the temporary folder (a rank that could not stage, ``unstaged``, fails there),
    every rank writes its part, rank 0 publishes; after each phase the ranks exchange whether
    it went well, so a failure anywhere stops every rank's job
    at the same point (a rank that failed raises its own error, the others name it). Returns
    what follows the publication: ``remember`` (the node's memory copy, made from the staged
    buffers; a failure there is said on stderr, never raised), then rank 0's pruning.
    """
    storage, step, rank, token = target.storage, target.step, target.rank, target.token

    def publish() -> None:
        storage.publish(step, token, {"world_size": target.size, **manifest})

    def prepare() -> None:
        if unstaged is not None:  # this rank could not stage its part
            raise unstaged
        storage.prepare(step, token)

    phases: list[tuple[str, Callable[[], None], bool]] = [
        ("stage its part or prepare the folder", prepare, rank == 0 or unstaged is not None),
        ("write its part", write_mine, True),
        ("publish it", publish, rank == 0),
    ]
    for what, action, mine in phases:
        error: BaseException | None = None
        if mine:
            try:
                action()
            except Exception as exc:
                error = exc
        try:
            every = coordinate.all_ok(target.found, error is None)
        except Exception as exc:  # a peer gone mid-exchange (gloo's own words kept)
            raise CheckpointError(
                f"checkpoint step {step} was not published: rank {rank} lost its peers after "
                f"it tried to {what}: {type(exc).__name__}: {exc}; the previous checkpoint is "
                "still the newest"
            ) from exc
        if all(every):
            continue
        if rank == 0 and what != "publish it":
            storage.discard(step, token)
        if error is not None:
            raise CheckpointError(
                f"checkpoint step {step} was not published: rank {rank} could not {what}: "
                f"{type(error).__name__}: {error}; the previous checkpoint is still the newest"
            ) from error
        failed = ", ".join(str(r) for r, good in enumerate(every) if not good)
        raise CheckpointError(
            f"checkpoint step {step} was not published: rank(s) {failed} could not {what}; "
            f"the previous checkpoint is still the newest {PEERS_OWN_ERROR}"
        )

    def kept() -> None:
        try:
            if remember is not None:
                remember()
        except Exception as exc:  # memory is a shortcut for restarts: storage has the checkpoint
            print(f"sparktrain: checkpoint step {step} is published but not kept in memory: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)  # fmt: skip

    return kept, (lambda: storage.prune(target.keep)) if rank == 0 else None
