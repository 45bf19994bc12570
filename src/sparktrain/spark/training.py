"""Inside the ranks of ``TorchEstimator.fit``: the training loop, or the user's own.

Every rank gets the same :class:`FitJob` (the model, its loss and optimizer, and a
``sparktrain.data`` stream of the DataFrame that Spark wrote to the data cache) and reads its
own share of the rows. The built-in loop is the one a user would write: ``prepare_model`` for
the strategy, one optimizer step per batch, the epoch's mean loss over every rank reported to
the driver's progress bar, printed, and logged to MLflow when tracking is on. With
``trainFn``, the user's function gets a :class:`FitContext` and runs the loop instead.

Rank 0 returns a :class:`FitOutcome`: the trained model unwrapped to a plain module on the CPU
(gathered first for sharded strategies, on every rank), the spec of its output and of its
inputs (so that ``transform`` knows its result type without running anything), the loss per
epoch, and the MLflow model it logged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparktrain.contract.env import contract_rank
from sparktrain.inference import outputs
from sparktrain.spark import tasks

#: Rows of the training data kept as the MLflow input example (the model's signature).
EXAMPLE_ROWS = 5


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
    from sparktrain.spark import scoring

    return scoring.float_dtype(model)


def features(batch: dict[str, Any], names: Sequence[str], device: Any, dtype: Any) -> list[Any]:
    """The tensors of ``names`` in ``batch`` on ``device``, floating ones cast to ``dtype``."""
    out = []
    for name in names:
        tensor = batch[name]
        tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        out.append(tensor.to(device, non_blocking=True))
    return out


def _build(model: Any, seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)  # the same initial weights on every rank
    return model if isinstance(model, nn.Module) else model()


def _example(data: Any, inputs: Sequence[str]) -> dict[str, Any]:
    """The data's first rows, for the output spec and the MLflow signature."""
    from sparktrain.data import StreamingDataset

    first = StreamingDataset(
        data.source, batch_size=EXAMPLE_ROWS, columns=inputs, shuffle=False, rank=0, world_size=1
    )
    return next(iter(first))


def _plain(trained: Any) -> Any:
    """The trained model as a plain module on the CPU, a copy when it was on another device."""
    import copy

    from sparktrain import strategies
    from sparktrain.spark.loop.lightning import StepModule

    plain = strategies.plain_module(trained)
    if isinstance(plain, StepModule):
        plain = plain.lightning
    if any(p.device.type != "cpu" for p in plain.parameters()):
        plain = copy.deepcopy(plain).cpu()
    return plain.eval()


def run_fit(job: FitJob) -> FitOutcome | None:
    """Train on this rank's share; rank 0 returns the outcome, the others ``None``."""
    import torch
    import torch.distributed as dist

    from sparktrain import strategies, tracking

    if not dist.is_initialized():
        dist.init_process_group(job.dist_backend)
    device = strategies.device()
    model = _build(job.model, job.seed)
    tracking.log_params(job.params)
    history: list[dict[str, float]] = []
    if job.train_fn is not None:
        context = FitContext(
            model, job.data, job.epochs, job.learning_rate, job.strategy, job.inputs,
            job.label, device, job.controls.val_data, job.controls.run_dir,
        )  # fmt: skip
        trained = job.train_fn(context)
        if trained is None:
            from sparktrain.errors import ConfigError

            raise ConfigError("trainFn returned None; it must return the trained model.")
    else:
        from sparktrain.spark.loop.epochs import train

        trained, history = train(job, model, device)
    plain = _plain(trained)
    example = _example(job.data, job.inputs)
    inputs = features(example, job.inputs, torch.device("cpu"), float_dtype(plain))
    with torch.inference_mode():
        output = plain(*inputs)
    spec = outputs.describe(output, len(inputs[0]))
    widths = tuple(None if t.dim() == 1 else int(t[0].numel()) for t in inputs)
    signature = {"input_example": inputs[0]} if len(inputs) == 1 else {}
    uri = tracking.log_model(plain, **signature)
    if contract_rank() != 0:
        return None
    return FitOutcome(plain, spec, widths, tuple(history), uri)
