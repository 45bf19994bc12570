"""An in-place run's own checkpoint: ``in_place(..., checkpoint_dir=..., checkpoint_every=N)``.

In place, a loss costs no checkpoint read while a live copy of every piece of the state is
left. Where none is (every replica group of an HSDP run lost a rank, the only group of a plain
FSDP run lost one, every rank lost), the run goes back to its restart path, and this is what it
resumes from: without it, the restart trains from the start.

Every ``checkpoint_every`` committed steps the loop saves, through
:func:`sparktrain.checkpoint.save` (asynchronous: the loop pays one copy of the state into host
buffers, and the write, the publication and the node memory copies run in the background):

* DDP's layout (``replicated``): every rank of the generation, each its share of the large
  tensors (the model's and optimizer's state, alike on every rank);
* HSDP (``sharded``): the first replica group alone, its shards with
  ``torch.distributed.checkpoint`` (a replica group holds every shard once);
* ZeRO-1/2: every rank, its own partition of the parameters and of the optimizer's state
  (:mod:`~sparktrain.rank.zero_keep`; the copies are not written);

with ``run`` (the committed step count and the data's state) beside them. A step whose commit
changed the group (a loss, a notice, a joiner) saves nothing: the ranks of the generation
after it did not all commit it in one generation; the next multiple saves. A save that fails
(a peer lost while the ranks agree) is said on stderr and the loop goes on: the loss is the
next step's to recover from.

On the restart (every rank starting the training function again, none joining), each rank
loads the newest published checkpoint before its first step: the model's weights, the
optimizer's state, the step count and the data's position, at any world size (resharded by
``torch.distributed.checkpoint``; a ZeRO run then hands each partition's copy to its holder),
from the survivors' memory where they hold it and from storage otherwise; rank 0 says which.
A joining rank heals from its live peers as before and reads nothing.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from sparktrain.ground.errors import CheckpointError, ConfigError
from sparktrain.rank import zero_keep

#: What the saved state names the run's own counts by.
RUN = "run"


def _check(directory: object, every: object) -> tuple[str, int]:
    if not isinstance(directory, str | os.PathLike):
        raise ConfigError(
            f"sparktrain.elastic.in_place(..., checkpoint_dir={directory!r}): pass a folder every "
            "node reaches (a shared mount, /dbfs/..., an object store's URL), or leave it out."
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(
            f"sparktrain.elastic.in_place(..., checkpoint_every={every!r}): pass the committed "
            "steps between two checkpoints, a whole number >= 1 (say 100)."
        )
    return os.fspath(directory), every


class Keeper:
    """Saves an in-place run's state every ``every`` committed steps; loads it on a restart.

    Args:
        directory: The checkpoint folder (as :func:`sparktrain.checkpoint.save` takes it).
        every: Committed steps between two checkpoints.
        keep: How many checkpoints to keep.
    """

    def __init__(self, directory: object, every: object, keep: int = 2) -> None:
        self.directory, self.every = _check(directory, every)
        self.keep = keep
        self.saved_at = -1  # the step of this rank's last save (or the one resumed from)

    # -- the restart -----------------------------------------------------------------------------
    def resume(self, run: Any) -> None:
        """Load the newest checkpoint into ``run`` (a rank of the attempt's first generation)."""
        from sparktrain.rank.checkpoint import latest_step, load_latest

        if latest_step(self.directory) is None:  # (it waits for this process's own saves)
            return  # before the state is made: torch would step a fresh optimizer at lr 0
        if _zero(run):
            state = {**zero_keep.target(run), RUN: ""}
            if load_latest(self.directory, into=state) is None:
                return
            zero_keep.adopt(run, state)
        elif self._sharded(run):
            state = self._sharded_state(run)
            state[RUN] = ""
            if load_latest(self.directory, into=state) is None:
                return
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(
                run.model,
                run.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        else:
            loaded = load_latest(self.directory)
            if loaded is None:
                return
            state = loaded.state
            run.model.load_state_dict(state["model"])
            run.optimizer.load_state_dict(state["optim"])
        counts = json.loads(state[RUN])
        run.steps, run.data_state = int(counts["steps"]), counts["data"]
        self.saved_at = run.steps

    # -- the loop --------------------------------------------------------------------------------
    def after_step(self, run: Any, generation: int) -> None:
        """Save if ``run`` committed a multiple of ``every`` in ``generation``, its current one.

        A step whose commit changed the group (a loss, a notice, a joiner) saves nothing.
        """
        steps = run.steps
        if steps % self.every or steps == self.saved_at or run.left or run.generation != generation:
            return
        self.saved_at = steps
        sharded = self._sharded(run)
        if sharded and run.members.index(run.me) >= run.layout.size:
            return  # the first replica group holds every shard once: it alone saves
        from sparktrain.rank.checkpoint import save, wait

        try:  # the previous save's failure: a rank that could not stage said it at once, its
            wait()  # peers say it here, so that every rank goes into the next save alike
        except CheckpointError as error:
            _say(run, steps - self.every, error)
        try:
            if _zero(run):
                state, sharded = zero_keep.state(run), True
            elif sharded:
                state = self._sharded_state(run)
            else:
                state = {"model": run.model.state_dict(), "optim": run.optimizer.state_dict()}
            state[RUN] = json.dumps({"steps": steps, "data": run.data_state})
            save(state, self.directory, steps, keep=self.keep, sharded=sharded)
        except (RuntimeError, CheckpointError) as error:  # a peer lost while the ranks agreed
            _say(run, steps, error)

    def finish(self, run: Any) -> None:
        """At the loop's end: wait for the last save; its failure is said, not raised."""
        from sparktrain.rank.checkpoint import wait

        try:
            wait()
        except CheckpointError as error:
            _say(run, run.steps - run.steps % self.every, error)

    @staticmethod
    def _sharded(run: Any) -> bool:
        """An HSDP run (its replica group's layout)."""
        return getattr(run, "layout", None) is not None

    @staticmethod
    def _sharded_state(run: Any) -> dict[str, Any]:
        from sparktrain.strategies.reshard import sharded_state

        return sharded_state(run.model, run.optimizer)


class _NoKeeper:
    """An in-place run without ``checkpoint_dir``: nothing to save."""

    def after_step(self, run: Any, generation: int) -> None:
        """Nothing."""

    def finish(self, run: Any) -> None:
        """Nothing."""


#: What an in-place run without its own checkpoint keeps.
NO_KEEPER = _NoKeeper()


def _zero(run: Any) -> bool:
    """A ZeRO run (its optimizer partitions)."""
    return getattr(run, "parts", None) is not None


def _say(run: Any, step: int, error: BaseException) -> None:
    print(
        f"sparktrain: rank {run.me}: the in-place checkpoint of step {step} was not saved "
        f"({type(error).__name__}: {error}); the run goes on",
        file=sys.stderr,
        flush=True,
    )
