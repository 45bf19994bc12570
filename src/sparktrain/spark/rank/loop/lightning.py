"""A Lightning ``LightningModule`` as the model of ``TorchEstimator``, without a ``Trainer``.

``TorchEstimator(model=MyModule(), ...)`` with no ``loss``/``optimizer`` trains a
``LightningModule`` through its own hooks, in sparktrain's loop (which already holds the process
group, the data stream, checkpoints, early stopping and the progress bar, so no Lightning
``Trainer`` or strategy is started):

- ``configure_optimizers()`` gives the optimizer, and optionally a scheduler (an optimizer, a
  list of one, ``([optimizer], [scheduler])`` or ``{"optimizer": ..., "lr_scheduler": ...}``);
- ``training_step(batch, batch_idx)`` returns the loss (or ``{"loss": ...}``); the batch is a
  dict of column name to tensor, as Horovod's Lightning estimator gives;
- ``validation_step(batch, batch_idx)`` runs on the validation rows, under ``no_grad``;
- ``self.log(name, value)`` in either step becomes a metric of the epoch: the mean over every
  rank's batches (weighted by their rows), in ``model.history``, MLflow and the progress bar;
- ``forward`` is what the fitted ``TorchModel`` runs in ``transform``.

Lightning need not be imported to recognise a module: its class's ancestry is looked at.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn

from sparktrain.ground.errors import ConfigError

#: What a batch's forward in the loop asks of the module.
TRAIN, VALIDATE = "train", "validate"


def is_lightning(model: object) -> bool:
    """Whether ``model`` (an instance or a class) is a Lightning ``LightningModule``."""
    cls = model if isinstance(model, type) else type(model)
    return any(
        base.__name__ == "LightningModule" and base.__module__.split(".")[0].endswith("lightning")
        for base in cls.__mro__
    )


class StepModule(nn.Module):
    """Routes ``forward`` to the Lightning module's steps, so that DDP sees the step's forward."""

    def __init__(self, lightning: Any) -> None:
        """Wrap ``lightning`` (a ``LightningModule``)."""
        super().__init__()
        self.lightning = lightning

    def forward(self, batch: dict[str, Any], index: int, stage: str = TRAIN) -> Any:
        """The loss of ``training_step``, or ``validation_step``'s result."""
        if stage == TRAIN:
            return step_loss(self.lightning.training_step(batch, index))
        return self.lightning.validation_step(batch, index)


def on_device(batch: dict[str, Any], device: Any, dtype: Any) -> dict[str, Any]:
    """The batch's tensors on ``device``, floating ones in the module's ``dtype``.

    Vector columns arrive as float64; Horovod's estimator gives float32, as models expect.
    """
    return {
        name: (value.to(dtype) if value.is_floating_point() else value).to(device)
        if hasattr(value, "is_floating_point") else value
        for name, value in batch.items()
    }  # fmt: skip


def step_loss(result: Any) -> Any:
    """The loss tensor of a ``training_step`` result (``None`` skips the batch)."""
    if isinstance(result, Mapping):
        if "loss" not in result:
            raise ConfigError("training_step returned a dict without 'loss'; add the loss to it.")
        return result["loss"]
    return result


class Logged:
    """The values ``self.log`` received this epoch: sums weighted by each batch's rows."""

    def __init__(self) -> None:
        """Start empty."""
        self.sums: dict[str, float] = {}
        self.rows: dict[str, float] = {}
        self.batch_rows = 1
        self.muted = False  # a batch another rank counts (sharded models run every batch)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``self.log`` (other arguments are accepted and not used)."""
        if self.muted:
            return
        rows = float(kwargs.get("batch_size") or self.batch_rows)
        value = value.detach() if hasattr(value, "detach") else value
        self.sums[name] = self.sums.get(name, 0.0) + float(value) * rows
        self.rows[name] = self.rows.get(name, 0.0) + rows

    def log_dict(self, values: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Lightning's ``self.log_dict``."""
        for name, value in values.items():
            self.log(name, value, **kwargs)

    def means(self) -> dict[str, float]:
        """The mean of each name over every rank (a collective)."""
        import torch
        import torch.distributed as dist

        names = sorted(self.sums)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (self.sums, self.rows))
            names = sorted({n for sums, _ in everyone for n in sums})
            totals = torch.tensor(
                [[s.get(n, 0.0) for n in names] + [r.get(n, 0.0) for n in names]
                 for s, r in everyone], dtype=torch.float64,
            ).sum(0)  # fmt: skip
        else:
            totals = torch.tensor(
                [self.sums[n] for n in names] + [self.rows[n] for n in names], dtype=torch.float64
            )
        count = len(names)
        return {n: float(totals[i] / totals[count + i].clamp(min=1)) for i, n in enumerate(names)}


@contextmanager
def logging_into(module: Any, logged: Logged) -> Iterator[Logged]:
    """``module.log`` and ``log_dict`` write into ``logged`` while inside."""
    module.log, module.log_dict = logged.log, logged.log_dict
    try:
        yield logged
    finally:
        del module.log, module.log_dict


def optimizers(module: Any) -> tuple[Any, Any]:
    """The optimizer and the scheduler (or ``None``) ``configure_optimizers`` returns.

    Raises:
        ConfigError: None, or several optimizers (the loop steps one).
    """
    made: Any = module.configure_optimizers()
    scheduler: Any = None
    if isinstance(made, Mapping):
        made, scheduler = made.get("optimizer"), made.get("lr_scheduler")
    elif isinstance(made, (list, tuple)) and len(made) == 2 and isinstance(made[0], (list, tuple)):
        made, schedulers = made
        scheduler = schedulers[0] if schedulers else None
    if isinstance(made, (list, tuple)):
        if len(made) != 1:
            raise ConfigError(
                f"configure_optimizers returned {len(made)} optimizers; the estimator's loop "
                "steps one (use trainFn= for a loop with several)."
            )
        made = made[0]
    if made is None or not hasattr(made, "step"):
        raise ConfigError(f"configure_optimizers returned {made!r}; return a torch optimizer.")
    return made, scheduler
