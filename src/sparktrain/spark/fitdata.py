"""The driver's side of a fit's rows and checkpoints.

The validation split, the cached data sets every rank streams, the run folder, and the loop's
resolved controls:

- ``validation=0.2`` splits the rows with ``DataFrame.randomSplit([0.8, 0.2], seed)``, Spark's
  own deterministic split (the same rows for the same DataFrame and seed);
  ``validation="is_val"`` takes the rows where that boolean column is true.
- Both parts are written once to the data cache (``sparktrain.data``); each rank streams its
  share of the training rows, and reads the validation rows (in order, without shuffling)
  keeping every ``world_size``-th batch from its rank on, so that each row counts once.
- The run folder is ``<store>/<runId>``: ``store`` defaults to ``fits`` beside a shared data
  cache, or to a private temporary folder in local mode; a fit without a ``runId`` gets a
  fresh one, resumed by its own restarts and removed once the fit returns (or, when the
  caller died first, by the next fit that finds it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.spark.params import FitParams, quoted
from sparktrain.spark.rank import tasks
from sparktrain.spark.rank.fitjob import FitControls
from sparktrain.spark.rank.loop import metrics

#: The name of a run folder made for a fit without a ``runId`` starts so.
UNNAMED = "fit-"


@dataclass(frozen=True)
class RunFolder:
    """Where a fit checkpoints, and whether it is removed once the fit returns."""

    path: str | None
    temporary: bool

    def remove(self) -> None:
        """Remove the folder of a fit that named no ``runId``."""
        if self.temporary and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def run_folder(stage: FitParams, dataset: Any, cache_dir: str | None) -> RunFolder:
    """The fit's checkpoint folder (module doc)."""
    from sparktrain.data.cache import cache_root, local_folder

    store, run_id = stage.training("store"), stage.training("runId")
    if run_id is not None and (not isinstance(run_id, str) or not run_id or "/" in run_id):
        raise ConfigError(f"runId={run_id!r} must be a non-empty name without '/'.")
    if store is None:
        root, private = cache_root(dataset, cache_dir)
        if private:
            store = os.path.join(tempfile.gettempdir(), f"sparktrain-fits-{os.getuid()}")
            os.makedirs(store, mode=0o700, exist_ok=True)  # checkpoints are unpickled
        elif local_folder(root) is None and run_id is None:  # an object store: files cannot go
            print(f"sparktrain: the data cache {root} is not a folder of files, so this fit is "
                  "not checkpointed (a restart begins at epoch 0); pass store= for one that "
                  "every rank and the driver reach", file=sys.stderr)  # fmt: skip
            return RunFolder(None, temporary=False)
        else:
            store = f"{root.rstrip('/')}/fits"
    local = _local_folder(str(store))
    if run_id is not None:
        return RunFolder(os.path.join(local, run_id), temporary=False)
    return RunFolder(_unnamed(local), temporary=True)


def _unnamed(store: str) -> str:
    """A fresh run folder owned by this process; those of callers that died are removed."""
    from sparktrain.data.cache import OWNER, owner_alive, write_owner

    young = time.time() - 60  # a folder whose owner file is being written now
    with contextlib.suppress(OSError):
        for entry in Path(store).glob(f"{UNNAMED}*"):
            unowned = not (entry / OWNER).exists() and entry.stat().st_mtime > young
            if entry.is_dir() and not unowned and not owner_alive(entry):
                shutil.rmtree(entry, ignore_errors=True)
    folder = os.path.join(store, f"{UNNAMED}{uuid.uuid4().hex[:12]}")
    os.makedirs(folder, exist_ok=True)
    write_owner(folder)
    return folder


def _local_folder(store: str) -> str:
    from sparktrain.data.cache import local_folder

    local = local_folder(store)
    if local is None:
        raise ConfigError(
            f"store={store!r}: checkpoints are written with file operations; name a folder every "
            "rank and the driver reach as files (a local path, a shared mount, dbfs:/...)."
        )
    return local


def split(stage: FitParams, dataset: Any) -> tuple[Any, Any | None]:
    """The training rows and the validation rows (``None`` without ``validation``)."""
    validation = stage.training("validation")
    if validation is None:
        return dataset, None
    if isinstance(validation, str):
        if validation not in dataset.columns:
            raise ConfigError(
                f"validation={validation!r} is not a column; the DataFrame has "
                f"{', '.join(dataset.columns)}."
            )
        from pyspark.sql import functions as F

        column = F.coalesce(F.col(quoted(validation)).cast("boolean"), F.lit(False))
        return dataset.filter(~column), dataset.filter(column)
    train, val = dataset.randomSplit([1.0 - float(validation), float(validation)], stage.getSeed())
    return train, val


def streams(
    stage: FitParams, dataset: Any, columns: list[str], cache_dir: str | None
) -> tuple[Any, Any | None]:
    """The training and validation rows as ``sparktrain.data`` streams of ``columns``."""
    from sparktrain.data import from_dataframe

    train, val = split(stage, dataset)
    transform = stage.training("transformationFn")
    data = from_dataframe(
        train.select(*columns), cache_dir=cache_dir, batch_size=stage.getBatchSize(),
        shuffle=stage.getShuffle(), seed=stage.getSeed(), transform=transform,
    )  # fmt: skip
    if val is None:
        return data, None
    val_data = from_dataframe(
        val.select(*columns), cache_dir=cache_dir,
        batch_size=stage.training("valBatchSize") or stage.getBatchSize(), shuffle=False,
        transform=transform, rank=0, world_size=1,
    )  # fmt: skip
    return data, val_data


def labels(stage: FitParams, dataset: Any) -> tuple[str, ...]:
    """The label columns: ``labelCols``, else ``labelCol`` (none for a loop without labels)."""
    several = stage.training("labelCols")
    if several:
        return tuple(several)
    label = stage.getLabelCol()
    if stage.getTrainFn() is not None and label not in dataset.columns:
        return ()  # a loop of the user's own may not need labels
    return (label,)


def _tasks(stage: FitParams, losses: tuple[Any, ...]) -> tuple[Any, ...]:
    """Each output's task: the ``task`` param for one output, else what each loss implies."""
    if len(losses) == 1:
        return (tasks.resolve_task(stage.getTask(), losses[0]),)
    return tuple(tasks.resolve_task("auto", one) for one in losses)


def controls(
    stage: FitParams, names: tuple[str, ...], val_data: Any, folder: RunFolder
) -> FitControls:
    """The loop's :class:`FitControls` from the stage's params."""
    loss = stage.getLoss()
    losses = tuple(loss) if isinstance(loss, (list, tuple)) else (loss,) * len(names)
    if len(losses) != len(names):
        raise ConfigError(
            f"loss has {len(losses)} functions and there are {len(names)} label columns "
            f"({', '.join(names)}); give one loss per label column, or one for all."
        )
    weights = stage.training("lossWeights")
    return FitControls(
        val_data=val_data, metrics=metrics.resolve(stage.training("metrics")),
        callbacks=tuple(stage.training("callbacks") or ()),
        train_steps=stage.training("trainStepsPerEpoch"),
        val_steps=stage.training("validationStepsPerEpoch"),
        weight=stage.getWeightCol() if stage.isDefined("weightCol") and stage.getWeightCol()
        else None,
        labels=names, tasks=_tasks(stage, losses),
        losses=losses, loss_weights=tuple(float(w) for w in weights) if weights else None,
        accumulate=stage.training("backwardPassesPerStep"),
        patience=stage.training("earlyStoppingPatience"), monitor=stage.training("monitor"),
        mode=stage.training("monitorMode"), min_delta=stage.training("minDelta"),
        restore_best=stage.training("restoreBestWeights"),
        schedule=stage.training("lrSchedule"), run_dir=folder.path,
        checkpoint_every=stage.training("checkpointEvery"),
    )  # fmt: skip
