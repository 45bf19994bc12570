"""What every rank of a ``TorchEstimator.fit`` is given, and what rank 0 gives back.

:class:`FitJob` is the same on every rank: the model, its loss and optimizer, the loop's
controls (:class:`FitControls`) and a ``sparktrain.data`` stream of the DataFrame Spark wrote to
the data cache. A ``trainFn`` gets a :class:`FitContext`; rank 0 returns a :class:`FitOutcome`.
The built-in loop (:mod:`sparktrain.spark.rank.loop`) and the fit's entry
(:mod:`sparktrain.spark.rank.training`) both use these values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparktrain.inference.rank import outputs
from sparktrain.spark.rank import tasks


@dataclass(frozen=True)
class FitControls:
    """The built-in loop's settings beyond the model (the estimator's params, resolved).

    Attributes:
        val_data: The validation rows (every rank reads them all, and uses its share).
        metrics: ``(name, function)`` of each metric.
        callbacks: Functions ``callback(epoch, record)``; a true result stops the fit.
        train_steps, val_steps: Batches per epoch per rank (``None``: all).
        weight: The sample weight column.
        labels, tasks, losses: Per output: the label column, its task and its loss.
        loss_weights: Per output, its weight in the loss (``None``: 1 each).
        accumulate: Batches per optimizer step.
        patience, monitor, mode, min_delta, restore_best: Early stopping (``patience=0``: off).
        schedule: The ``lrSchedule`` param.
        run_dir: The run's checkpoint folder (``None``: no checkpoints).
        checkpoint_every: Steps between checkpoints inside an epoch (0: epoch ends only).
    """

    val_data: Any = None
    metrics: tuple[tuple[str, Any], ...] = ()
    callbacks: tuple[Any, ...] = ()
    train_steps: int | None = None
    val_steps: int | None = None
    weight: str | None = None
    labels: tuple[str, ...] = ()
    tasks: tuple[Any, ...] = ()
    losses: tuple[Any, ...] = ()
    loss_weights: tuple[float, ...] | None = None
    accumulate: int = 1
    patience: int = 0
    monitor: str | None = None
    mode: str = "auto"
    min_delta: float = 0.0
    restore_best: bool = True
    schedule: Any = None
    run_dir: str | None = None
    checkpoint_every: int = 0


@dataclass(frozen=True)
class FitJob:
    """What every rank of a fit is given (built by the estimator on the driver)."""

    model: Any
    loss: Any
    optimizer: Any
    learning_rate: float
    epochs: int
    data: Any
    inputs: tuple[str, ...]
    label: str | None
    task: tasks.Task
    strategy: str
    dist_backend: str
    seed: int
    train_fn: Callable[[FitContext], Any] | None
    params: dict[str, Any] = field(default_factory=dict)
    controls: FitControls = field(default_factory=FitControls)


@dataclass(frozen=True)
class FitOutcome:
    """What rank 0 returns to the driver.

    Attributes:
        model: The trained model, a plain module on the CPU.
        output: The spec of the model's output for a batch.
        widths: Values per row of each input column (``None`` for scalar columns).
        history: One record per epoch of the built-in loop: ``epoch``, ``loss``, the metrics
            and the validation ones (``val_loss``, ...).
        mlflow_model_uri: The model logged to MLflow, when tracking was on.
    """

    model: Any
    output: outputs.Spec
    widths: tuple[int | None, ...]
    history: tuple[dict[str, float], ...]
    mlflow_model_uri: str | None


@dataclass
class FitContext:
    """What a ``trainFn`` gets: everything the built-in loop would use.

    The process group is initialised before ``trainFn`` is called. Return the trained model
    (wrapped or not); every rank must return (sharded models are gathered from every rank).

    Attributes:
        model: The model, built, on the CPU, not yet wrapped (use ``sparktrain.prepare_model``).
        data: This rank's share of the DataFrame: a ``sparktrain.data.StreamingDataset`` whose
            batches are dicts of column name to tensor (``len(data)`` batches per epoch).
        epochs: The ``epochs`` param.
        learning_rate: The ``learningRate`` param.
        strategy: The ``strategy`` param.
        inputs: The input columns, in the order the model takes them.
        label: The label column.
        device: This rank's device.
        validation: The validation rows (with ``validation=``), as a
            ``sparktrain.data.StreamingDataset`` that every rank reads whole (take every
            ``world_size``-th batch from your rank on to read each row once), else ``None``.
        run_dir: The fit's checkpoint folder (``<store>/<runId>``), for
            ``sparktrain.checkpoint.save``/``load_latest``: a restarted fit finds it again.
    """

    model: Any
    data: Any
    epochs: int
    learning_rate: float
    strategy: str
    inputs: tuple[str, ...]
    label: str | None
    device: Any
    validation: Any = None
    run_dir: str | None = None

    def features(self, batch: dict[str, Any], dtype: Any = None) -> list[Any]:
        """The batch's input tensors on this rank's device (floating ones cast to ``dtype``)."""
        return features(batch, self.inputs, self.device, dtype or float_dtype(self.model))


def float_dtype(model: Any) -> Any:
    """The floating dtype of ``model``'s parameters (what its inputs are cast to)."""
    from sparktrain.spark.rank import scoring

    return scoring.float_dtype(model)


def features(batch: dict[str, Any], names: Sequence[str], device: Any, dtype: Any) -> list[Any]:
    """The tensors of ``names`` in ``batch`` on ``device``, floating ones cast to ``dtype``."""
    out = []
    for name in names:
        tensor = batch[name]
        tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        out.append(tensor.to(device, non_blocking=True))
    return out
