"""What a task means: its losses, how labels become tensors, and the columns a model adds.

A :class:`~sparktrain.spark.TorchEstimator` trains for one task, and its
:class:`~sparktrain.spark.TorchModel` adds the columns Spark ML's own models of that task add,
so that Spark's evaluators work on them unchanged:

- ``classification``: the model returns one logit per class. ``prediction`` is the class index
  (a double, as Spark's classifiers give), ``rawPrediction`` the logits and ``probability`` their
  softmax (both vectors).
- ``binary``: one logit per row. ``prediction`` is 0.0 or 1.0, ``rawPrediction`` ``[-z, z]``
  and ``probability`` ``[1 - p, p]``, as Spark's binary classifiers give.
- ``regression``: one value per row, the ``prediction`` (a double).
- ``raw``: the model's output as it is, whatever its shape (see ``outputs``).

``task="auto"`` follows the loss: cross-entropy and NLL are classification, BCE-with-logits is
binary, MSE, L1, smooth L1 and Huber are regression, any other loss is raw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from sparktrain.ground.errors import ConfigError

Task = Literal["classification", "binary", "regression", "raw"]
TASKS: tuple[str, ...] = ("auto", "classification", "binary", "regression", "raw")

#: Loss name -> (the task it implies, the name of its function in torch.nn.functional).
LOSSES: dict[str, tuple[Task, str]] = {
    "cross_entropy": ("classification", "cross_entropy"),
    "nll": ("classification", "nll_loss"),
    "bce_with_logits": ("binary", "binary_cross_entropy_with_logits"),
    "mse": ("regression", "mse_loss"),
    "l1": ("regression", "l1_loss"),
    "smooth_l1": ("regression", "smooth_l1_loss"),
    "huber": ("regression", "huber_loss"),
}
#: The torch.nn loss modules that imply a task.
_LOSS_MODULES: dict[str, Task] = {
    "CrossEntropyLoss": "classification",
    "NLLLoss": "classification",
    "BCEWithLogitsLoss": "binary",
    "MSELoss": "regression",
    "L1Loss": "regression",
    "SmoothL1Loss": "regression",
    "HuberLoss": "regression",
}
OPTIMIZERS: dict[str, str] = {
    "adam": "Adam",
    "adamw": "AdamW",
    "sgd": "SGD",
    "rmsprop": "RMSprop",
    "adagrad": "Adagrad",
}


def check_loss(loss: object) -> None:
    """Refuse a loss that is neither a known name nor a function (nor a list of them)."""
    if isinstance(loss, (list, tuple)):
        for one in loss:
            check_loss(one)
        return
    if loss is None or callable(loss):
        return
    if loss not in LOSSES:
        raise ConfigError(
            f"unknown loss {loss!r}; choose one of: {', '.join(LOSSES)}, or pass a function "
            "loss(output, label) -> tensor."
        )


def check_optimizer(optimizer: object) -> None:
    """Refuse an optimizer that is neither a known name nor a function or class."""
    if callable(optimizer):
        return
    if optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}, or pass "
            "a function of the parameters (lambda p: torch.optim.SGD(p, lr=0.1)) or a "
            "torch.optim class."
        )


def resolve_task(task: str, loss: object) -> Task:
    """``task``, or for ``"auto"`` the task the loss implies (module doc)."""
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}.")
    if task != "auto":
        return task  # type: ignore[return-value]
    if isinstance(loss, (list, tuple)):
        return "raw"  # several outputs: transform gives them as they are
    if isinstance(loss, str):
        return LOSSES[loss][0]
    return _LOSS_MODULES.get(type(loss).__name__, "raw")


def loss_function(loss: object) -> Callable[[Any, Any], Any]:
    """The function ``loss(output, label)`` for a name or a callable."""
    if isinstance(loss, str):
        import torch.nn.functional as F

        return getattr(F, LOSSES[loss][1])  # type: ignore[no-any-return]
    return loss  # type: ignore[return-value]


def weighted_loss(loss: object, output: Any, target: Any, weight: Any = None) -> Any:
    """``loss(output, target)``; with ``weight`` (one per row), the weighted mean over rows.

    Raises:
        ConfigError: A loss function that returns one number where per-row values are needed.
    """
    if weight is None:
        return loss_function(loss)(output, target)
    if isinstance(loss, str):
        import torch.nn.functional as F

        per = getattr(F, LOSSES[loss][1])(output, target, reduction="none")
    else:
        per = loss(output, target)  # type: ignore[operator]
        if per.dim() == 0:
            raise ConfigError(
                "weightCol needs a loss per row: make the loss function return one value per "
                "row (reduction='none'), or use a named loss."
            )
    per = per.reshape(len(weight), -1).mean(dim=1)
    weight = weight.to(per.dtype)
    return (per * weight).sum() / weight.sum().clamp(min=1e-12)


def make_optimizer(optimizer: object, parameters: Any, learning_rate: float) -> Any:
    """A torch optimizer over ``parameters`` from a name, a class or a function."""
    import torch

    if isinstance(optimizer, str):
        return getattr(torch.optim, OPTIMIZERS[optimizer])(parameters, lr=learning_rate)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer(parameters, lr=learning_rate)  # type: ignore[call-arg]
    return optimizer(parameters)  # type: ignore[operator]


def labels(values: Any, task: Task, output: Any, column: str) -> Any:
    """The label tensor the loss of ``task`` expects next to ``output``.

    Raises:
        ConfigError: Classification labels that are not class indices of the output.
    """
    import torch

    if task == "classification":
        classes = output.shape[-1]
        bad = (values < 0) | (values >= classes) | (values != values.floor())
        if bool(bad.any()):
            value = values[bad][0].item()
            raise ConfigError(
                f"label column {column!r} holds {value}, which is not a class index of a model "
                f"with {classes} outputs; labels must be 0, 1, ..., {classes - 1} (index string "
                "labels with pyspark.ml.feature.StringIndexer)."
            )
        return values.to(torch.long)
    if not values.is_floating_point() and task == "raw":
        return values
    values = values.to(output.dtype)
    if values.dim() == 1 and output.dim() == 2 and output.shape[1] == 1:
        values = values.unsqueeze(1)
    return values


#: The fields each task's UDF returns besides the raw output, and their Spark types.
HEAD_FIELDS: dict[str, tuple[str, ...]] = {
    "classification": ("prediction", "raw", "probability"),
    "binary": ("prediction", "raw", "probability"),
    "regression": ("prediction",),
}


def head(output: Any, task: Task, fields: tuple[str, ...]) -> dict[str, Any]:
    """The columns ``task`` adds, computed from a batch's ``output`` (module doc).

    Raises:
        ConfigError: The output's shape does not suit the task.
    """
    import torch

    if not isinstance(output, torch.Tensor):
        raise ConfigError(
            f"task={task!r} needs the model to return one tensor; it returned "
            f"{type(output).__name__}. Use task='raw' for other outputs."
        )
    output = output.float()
    if task == "classification":
        if output.dim() != 2 or output.shape[1] < 2:
            raise ConfigError(
                f"task='classification' needs one logit per class (a batch of shape [N, "
                f"classes]); the model returned {list(output.shape)}."
            )
        raw = output
        probability = torch.softmax(output, dim=1)
        prediction = output.argmax(dim=1).double()
    else:
        if output.dim() > 2 or (output.dim() == 2 and output.shape[1] != 1):
            raise ConfigError(
                f"task={task!r} needs one value per row; the model returned "
                f"{list(output.shape)}. Use task='classification' or 'raw'."
            )
        value = output.reshape(-1)
        if task == "regression":
            return {"prediction": value.double()}
        raw = torch.stack([-value, value], dim=1)
        positive = torch.sigmoid(value)
        probability = torch.stack([1 - positive, positive], dim=1)
        prediction = (value > 0).double()
    found = {"prediction": prediction, "raw": raw, "probability": probability}
    return {name: found[name] for name in fields}
