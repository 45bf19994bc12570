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


@dataclass(frozen=True)
class FitOutcome:
    """What rank 0 returns to the driver.

    Attributes:
        model: The trained model, a plain module on the CPU.
        output: The spec of the model's output for a batch.
        widths: Values per row of each input column (``None`` for scalar columns).
        history: One record per epoch of the built-in loop (``epoch``, ``loss``).
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
    """

    model: Any
    data: Any
    epochs: int
    learning_rate: float
    strategy: str
    inputs: tuple[str, ...]
    label: str | None
    device: Any

    def features(self, batch: dict[str, Any], dtype: Any = None) -> list[Any]:
        """The batch's input tensors on this rank's device (floating ones cast to ``dtype``)."""
        return _features(batch, self.inputs, self.device, dtype or _float_dtype(self.model))


def _float_dtype(model: Any) -> Any:
    from sparktrain.spark.scoring import float_dtype

    return float_dtype(model)


def _features(batch: dict[str, Any], names: Sequence[str], device: Any, dtype: Any) -> list[Any]:
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


def _loop(job: FitJob, model: Any, device: Any) -> tuple[Any, list[dict[str, float]]]:
    import torch
    import torch.distributed as dist

    from sparktrain import strategies, tracking
    from sparktrain.rank.reporting import report

    dtype = _float_dtype(model)
    wrapped = strategies.prepare_model(model, job.strategy)
    optimizer = tasks.make_optimizer(job.optimizer, wrapped.parameters(), job.learning_rate)
    optimizer = strategies.prepare_optimizer(optimizer, wrapped)
    loss_fn = tasks.loss_function(job.loss)
    data, history = job.data, []
    steps, total_steps = 0, job.epochs * len(data)
    for epoch in range(job.epochs):
        data.set_epoch(epoch)
        total, batches = torch.zeros((), device=device), 0
        for batch in data:
            output = wrapped(*_features(batch, job.inputs, device, dtype))
            label = batch[job.label].to(device, non_blocking=True)
            loss = loss_fn(output, tasks.labels(label, job.task, output, str(job.label)))
            optimizer.zero_grad(set_to_none=True)
            strategies.backward(loss, optimizer)
            optimizer.step()
            total, batches, steps = total + loss.detach(), batches + 1, steps + 1
            report(step=steps, total=total_steps)
        print(f"epoch {epoch} loss {float(total) / max(batches, 1):.4f} ({batches} batches)")
        summed = torch.stack([total, torch.tensor(float(batches), device=device)])
        dist.all_reduce(summed)
        mean = float(summed[0] / summed[1].clamp(min=1))
        history.append({"epoch": float(epoch), "loss": mean})
        report(step=steps, total=total_steps, epoch=epoch, loss=mean)
        tracking.log_metrics({"loss": mean}, step=epoch)
    return wrapped, history


def _example(data: Any, inputs: Sequence[str]) -> dict[str, Any]:
    """The data's first rows, for the output spec and the MLflow signature."""
    from sparktrain.data import StreamingDataset

    first = StreamingDataset(
        data.source, batch_size=EXAMPLE_ROWS, columns=inputs, shuffle=False, rank=0, world_size=1
    )
    return next(iter(first))


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
            job.label, device,
        )  # fmt: skip
        trained = job.train_fn(context)
        if trained is None:
            from sparktrain.errors import ConfigError

            raise ConfigError("trainFn returned None; it must return the trained model.")
    else:
        trained, history = _loop(job, model, device)
    plain = strategies.plain_module(trained).cpu().eval()
    example = _example(job.data, job.inputs)
    features = _features(example, job.inputs, torch.device("cpu"), _float_dtype(plain))
    with torch.inference_mode():
        output = plain(*features)
    spec = outputs.describe(output, len(features[0]))
    widths = tuple(None if t.dim() == 1 else int(t[0].numel()) for t in features)
    signature = {"input_example": features[0]} if len(features) == 1 else {}
    uri = tracking.log_model(plain, **signature)
    if contract_rank() != 0:
        return None
    return FitOutcome(plain, spec, widths, tuple(history), uri)
