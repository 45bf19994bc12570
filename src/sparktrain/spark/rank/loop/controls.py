"""Training controls of the built-in loop: the monitored metric, early stopping, LR schedules.

- **Early stopping** (``earlyStoppingPatience=N``): the fit stops after ``N`` epochs without the
  monitored metric (``monitor``, by default ``val_loss`` with validation rows and ``loss``
  without) improving by more than ``minDelta``; with ``restoreBestWeights`` (the default) the
  model returned is the best epoch's (the checkpoints hold the best weights beside the last).
- **Schedules** (``lrSchedule``): a name, stepped over the whole fit's optimizer steps
  (``cosine``, ``linear``, ``onecycle``, from ``learningRate``), per epoch (``exponential``:
  x0.9, ``step``: x0.1 every third of the epochs), or on the monitored metric (``plateau``); or
  a function ``schedule(optimizer)`` returning a torch LR scheduler (stepped once per epoch), or
  Lightning's dict ``{"scheduler": s, "interval": "step"}`` for a scheduler stepped per
  optimizer step. A ``ReduceLROnPlateau`` is stepped with the monitored metric.

Everything here is a plain value whose state goes into the fit's checkpoints.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.spark.rank.loop.metrics import HIGHER_IS_BETTER

SCHEDULES = ("cosine", "linear", "onecycle", "exponential", "step", "plateau")
MODES = ("auto", "min", "max")


def monitored(monitor: str | None, has_validation: bool) -> str:
    """The metric early stopping and ``plateau`` watch (``monitor``, or the default loss)."""
    return monitor or ("val_loss" if has_validation else "loss")


def mode_of(metric: str, mode: str) -> str:
    """``min`` or ``max``: ``mode``, or for ``auto`` what the metric's name says."""
    if mode != "auto":
        return mode
    bare = metric.removeprefix("val_")
    higher = bare in HIGHER_IS_BETTER or bare.rsplit("_", 1)[-1] in HIGHER_IS_BETTER
    return "max" if higher else "min"


def check_schedule(schedule: object) -> None:
    """Refuse an ``lrSchedule`` that is neither a known name nor a function."""
    if schedule is None or callable(schedule) or schedule in SCHEDULES:
        return
    raise ConfigError(
        f"unknown lrSchedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}, or pass a "
        "function schedule(optimizer) -> torch.optim.lr_scheduler.LRScheduler."
    )


@dataclass
class EarlyStopping:
    """The best value so far, its epoch and weights, and the epochs since it (checkpointed)."""

    metric: str
    mode: str
    patience: int
    min_delta: float = 0.0
    best: float | None = None
    best_epoch: int = -1
    waited: int = 0
    best_state: dict[str, Any] | None = field(default=None, repr=False)

    def update(self, epoch: int, record: Mapping[str, float], state: Any) -> bool:
        """Take the epoch's record; ``True`` when the fit should stop.

        Raises:
            ConfigError: The record has no monitored metric (the names it has are listed).
        """
        if self.metric not in record:
            raise ConfigError(
                f"monitor={self.metric!r} is not among the epoch's metrics "
                f"({', '.join(sorted(record))}); name one of them (val_ metrics need "
                "validation=)."
            )
        value = float(record[self.metric])
        if self.best is None or math.isnan(self.best) or self._improves(value):
            self.best, self.best_epoch, self.waited = value, epoch, 0
            self.best_state = _on_cpu(state() if callable(state) else state)
            return False
        self.waited += 1
        return self.patience > 0 and self.waited >= self.patience

    def _improves(self, value: float) -> bool:
        assert self.best is not None
        if math.isnan(value):
            return False
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta


def _on_cpu(state: Any) -> Any:
    """A copy of a state dict with its tensors on the CPU (kept for many epochs)."""
    if isinstance(state, Mapping):
        return {k: v.detach().cpu().clone() if hasattr(v, "detach") else copy.deepcopy(v)
                for k, v in state.items()}  # fmt: skip
    return copy.deepcopy(state)


@dataclass
class Schedule:
    """A torch LR scheduler and when it is stepped: ``step``, ``epoch`` or ``metric``."""

    scheduler: Any
    interval: str

    def after_step(self) -> None:
        """Step a per-step scheduler (after each optimizer step)."""
        if self.interval == "step":
            self.scheduler.step()

    def after_epoch(self, record: Mapping[str, float], metric: str) -> None:
        """Step a per-epoch scheduler, or a plateau one with the monitored metric."""
        if self.interval == "epoch":
            self.scheduler.step()
        elif self.interval == "metric" and metric in record:
            self.scheduler.step(record[metric])


def make_schedule(
    spec: object, optimizer: Any, *, total_steps: int, epochs: int, mode: str
) -> Schedule | None:
    """The :class:`Schedule` of the ``lrSchedule`` param (module doc), or ``None``."""
    from torch.optim import lr_scheduler as lr

    if spec is None:
        return None
    if callable(spec):
        return wrap_scheduler(spec(optimizer))
    steps = max(total_steps, 1)
    if spec == "cosine":
        return Schedule(lr.CosineAnnealingLR(optimizer, T_max=steps), "step")
    if spec == "linear":
        return Schedule(lr.LinearLR(optimizer, 1.0, 0.0, total_iters=steps), "step")
    if spec == "onecycle":
        peak = [group["lr"] for group in optimizer.param_groups]
        return Schedule(lr.OneCycleLR(optimizer, max_lr=peak, total_steps=steps), "step")
    if spec == "exponential":
        return Schedule(lr.ExponentialLR(optimizer, gamma=0.9), "epoch")
    if spec == "step":
        return Schedule(lr.StepLR(optimizer, step_size=max(epochs // 3, 1), gamma=0.1), "epoch")
    return Schedule(
        lr.ReduceLROnPlateau(optimizer, mode="max" if mode == "max" else "min"), "metric"
    )


def wrap_scheduler(made: Any) -> Schedule | None:
    """A scheduler a function (or ``configure_optimizers``) returned, as a :class:`Schedule`."""
    from torch.optim import lr_scheduler as lr

    if made is None:
        return None
    interval = "epoch"
    if isinstance(made, Mapping):
        interval = str(made.get("interval", "epoch"))
        made = made["scheduler"]
    if interval not in ("epoch", "step"):
        raise ConfigError(f"a scheduler's interval={interval!r} must be 'epoch' or 'step'.")
    if not hasattr(made, "step") or not hasattr(made, "state_dict"):
        raise ConfigError(
            f"lrSchedule returned {made!r}; it must return a torch.optim.lr_scheduler scheduler "
            "(or Lightning's dict {'scheduler': s, 'interval': 'step'})."
        )
    if isinstance(made, lr.ReduceLROnPlateau):
        interval = "metric"
    return Schedule(made, interval)
