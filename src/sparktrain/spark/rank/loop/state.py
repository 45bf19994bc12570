"""A rank's fit in progress, and the checkpoints a fit resumes from.

A fit's checkpoints live in its run folder, ``<store>/<runId>`` (``store`` defaults to a
``fits`` folder beside the data cache; see ``sparktrain.spark.fitdata``), written with
:func:`sparktrain.checkpoint.save` (atomic; rank 0 writes, the others wait). Each holds the
model, the optimizer and the scheduler, the epoch and the data's place in it (for a checkpoint
taken every ``checkpointEvery`` steps), the history so far, and early stopping's best weights:
all a rank needs to go on as if nothing had happened, at this world size or another (an
elastic resize). Checkpoints need the whole state on rank 0: DDP and a single process (the
sharded strategies restart from epoch 0; a line says so).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from sparktrain.contract.env import contract_rank
from sparktrain.spark.rank.fitjob import FitJob
from sparktrain.spark.rank.loop import controls

#: Checkpoints kept in a run folder.
KEEP = 2


@dataclass
class Fit:
    """A rank's fit in progress: what is trained, and where it stands (checkpointed)."""

    job: FitJob
    wrapped: Any
    optimizer: Any
    device: Any
    schedule: controls.Schedule | None
    stopper: controls.EarlyStopping | None
    lightning: bool
    history: list[dict[str, float]] = field(default_factory=list)
    epoch: int = 0
    steps: int = 0  # batches trained over the whole fit
    updates: int = 0  # optimizer steps over the whole fit
    #: At a resume inside an epoch: the loss sum and batches before it over every rank (rank 0
    #: carries them, the others 0), and this rank's batches of the epoch before it.
    partial: tuple[float, int, int] = (0.0, 0, 0)
    checkpoints: bool = True
    stopped: bool = False  # early stopping or a callback ended it


def checkpointable(wrapped: Any) -> bool:
    """Whether rank 0 holds the whole model and optimizer state (DDP or one process)."""
    from sparktrain.strategies.base import made_by

    made = made_by(wrapped)
    return made is None or made.name == "ddp"


def _state(fit: Fit, partial: tuple[float, int, int], in_epoch: bool) -> dict[str, Any]:
    import torch

    stopper = fit.stopper
    return {
        "model": fit.wrapped.state_dict(),
        "optimizer": fit.optimizer.state_dict(),
        "schedule": fit.schedule.scheduler.state_dict() if fit.schedule else None,
        "epoch": fit.epoch,
        "steps": fit.steps,
        "updates": fit.updates,
        "data": fit.job.data.state_dict() if in_epoch else None,
        "partial": partial if in_epoch else (0.0, 0, 0),
        "history": list(fit.history),
        "stopped": fit.stopped,
        "stopper": None if stopper is None else {
            "best": stopper.best, "best_epoch": stopper.best_epoch, "waited": stopper.waited,
            "best_state": stopper.best_state,
        },
        "rng": torch.get_rng_state(),
    }  # fmt: skip


def save(
    fit: Fit, partial: tuple[float, int, int] = (0.0, 0, 0), *, in_epoch: bool = False
) -> None:
    """Checkpoint ``fit`` (every rank calls it): at an epoch's end, or inside the epoch.

    ``partial``: inside an epoch, this rank's loss sum and batches so far (with what a resume
    carried) and its batches of the epoch; the sums are added over every rank first.
    """
    from sparktrain.rank.checkpoint import save as save_checkpoint

    folder = fit.job.controls.run_dir
    if folder is None or not fit.checkpoints:
        return
    if in_epoch:  # the loss so far, over every rank, so that the epoch's mean survives a resume
        partial = (*_summed(partial[:2], fit.device), partial[2])
    # Blocking: a fit promises each epoch trained once, so a rank killed just after this
    # returns must find this checkpoint (an asynchronous one could still be in flight).
    save_checkpoint(_state(fit, partial, in_epoch), folder, fit.steps, keep=KEEP, blocking=True)


def _summed(partial: tuple[float, int], device: Any) -> tuple[float, int]:
    import torch
    import torch.distributed as dist

    values = torch.tensor([partial[0], float(partial[1])], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(values)
    return float(values[0]), round(float(values[1]))


def resume(fit: Fit) -> bool:
    """Load the newest checkpoint of the run folder into ``fit``; whether there was one."""
    import torch

    from sparktrain.rank.checkpoint import load_latest

    folder = fit.job.controls.run_dir
    fit.checkpoints = folder is not None and checkpointable(fit.wrapped)
    if folder is not None and not fit.checkpoints:
        print(f"sparktrain: strategy={fit.job.strategy!r} fits are not checkpointed; a restart "
              "begins at epoch 0", file=sys.stderr)  # fmt: skip
    if folder is None or not fit.checkpoints:
        return False
    found = load_latest(folder, weights_only=False)
    if found is None:
        return False
    state = found.state
    fit.wrapped.load_state_dict(state["model"])
    fit.optimizer.load_state_dict(state["optimizer"])
    if fit.schedule is not None and state["schedule"] is not None:
        fit.schedule.scheduler.load_state_dict(state["schedule"])
    fit.epoch, fit.steps, fit.history = state["epoch"], state["steps"], list(state["history"])
    fit.stopped = bool(state["stopped"])
    summed, batches, mine = state["partial"]
    first = contract_rank() == 0  # one rank carries the sums over every rank's batches
    fit.partial = (float(summed) if first else 0.0, int(batches) if first else 0, int(mine))
    fit.updates = int(state["updates"])
    if state["data"] is not None:
        fit.job.data.load_state_dict(state["data"])
    if fit.stopper is not None and state["stopper"] is not None:
        for name, value in state["stopper"].items():
            setattr(fit.stopper, name, value)
    torch.set_rng_state(state["rng"])
    print(f"resumed from checkpoint step {found.step}: epoch {fit.epoch}, "
          f"{len(fit.history)} epoch(s) done")  # fmt: skip
    return True
