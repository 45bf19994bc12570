"""Metrics of a fit: by name or as functions, over every rank's rows of an epoch.

``TorchEstimator(metrics=["accuracy", "f1"])`` computes each metric at every epoch's end, on
the training rows (named as given: ``accuracy``) and on the validation rows (``val_accuracy``).
A metric is computed once over the epoch's rows of every rank together (their outputs and
labels are gathered onto every rank), so it is exact, as a local evaluation of the same rows
would give, for any metric, ratios and ranks included; the cost is the epoch's outputs held in
memory (bound it with ``trainStepsPerEpoch``/``validationStepsPerEpoch``).

A metric function takes ``(output, label)``, the tensors of all the rows (the model's output,
and the labels as the loss sees them), and returns a number; its name in the history is its
``__name__`` (or the key, when ``metrics`` is a dict).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sparktrain.ground.errors import ConfigError

Metric = Callable[[Any, Any], float]


def _scores(output: Any) -> Any:
    """The positive class's score of a binary or two-class output, per row."""
    if output.dim() == 2 and output.shape[1] == 2:
        return output[:, 1] - output[:, 0]
    return output.reshape(-1)


def _classes(output: Any) -> Any:
    if output.dim() == 2 and output.shape[1] > 1:
        return output.argmax(dim=1)
    return (output.reshape(-1) > 0).long()  # one logit per row


def accuracy(output: Any, label: Any) -> float:
    """The fraction of rows whose predicted class is the label."""
    return float((_classes(output) == label.reshape(-1).long()).float().mean())


def _binary(output: Any) -> bool:
    """One logit per row, or two classes: the metrics are the positive class's."""
    return bool(output.dim() < 2 or output.shape[1] <= 2)


def _counts(output: Any, label: Any) -> tuple[Any, Any, Any, Any]:
    """Per class: true positives, predicted, actual, and the classes.

    Binary outputs count class 1; others the classes present in the predictions or the labels,
    as scikit-learn counts them.
    """
    import torch

    predicted, actual = _classes(output), label.reshape(-1).long()
    both = torch.cat([predicted, actual])
    classes = torch.tensor([1]) if _binary(output) else torch.unique(both)
    hits = torch.stack([((predicted == c) & (actual == c)).sum() for c in classes]).double()
    made = torch.stack([(predicted == c).sum() for c in classes]).double()
    real = torch.stack([(actual == c).sum() for c in classes]).double()
    return hits, made, real, classes


def precision(output: Any, label: Any) -> float:
    """Precision of the positive class (binary) or its mean over the classes (macro)."""
    hits, made, _, _ = _counts(output, label)
    return float((hits / made.clamp(min=1)).mean())


def recall(output: Any, label: Any) -> float:
    """Recall of the positive class (binary) or its mean over the classes (macro)."""
    hits, _, real, _ = _counts(output, label)
    return float((hits / real.clamp(min=1)).mean())


def f1(output: Any, label: Any) -> float:
    """F1 of the positive class (binary) or its mean over the classes (macro)."""
    hits, made, real, _ = _counts(output, label)
    return float((2 * hits / (made + real).clamp(min=1)).mean())


def auc(output: Any, label: Any) -> float:
    """Area under the ROC curve of a binary score (ties share their rank)."""
    import torch

    if not _binary(output):
        raise ConfigError(
            f"auc needs a binary score (one logit per row, or two classes); the model gives "
            f"{output.shape[1]} classes. Pass a function for a one-vs-rest AUC."
        )
    score, positive = _scores(output).double(), label.reshape(-1) > 0.5
    ordered, inverse = torch.unique(score, return_inverse=True)
    counts = torch.bincount(inverse, minlength=len(ordered)).double()
    ends = counts.cumsum(0)
    ranks = (ends - (counts - 1) / 2)[inverse]  # the mean rank of each tie
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _value(output: Any, label: Any) -> tuple[Any, Any]:
    return output.reshape(-1).double(), label.reshape(-1).double()


def mse(output: Any, label: Any) -> float:
    """The mean squared error."""
    out, lab = _value(output, label)
    return float(((out - lab) ** 2).mean())


def rmse(output: Any, label: Any) -> float:
    """The root of the mean squared error."""
    return float(mse(output, label) ** 0.5)


def mae(output: Any, label: Any) -> float:
    """The mean absolute error."""
    out, lab = _value(output, label)
    return float((out - lab).abs().mean())


def r2(output: Any, label: Any) -> float:
    """The coefficient of determination."""
    out, lab = _value(output, label)
    spread = ((lab - lab.mean()) ** 2).sum()
    return float(1 - ((out - lab) ** 2).sum() / spread) if spread > 0 else float("nan")


METRICS: dict[str, Metric] = {
    "accuracy": accuracy, "precision": precision, "recall": recall, "f1": f1, "auc": auc,
    "mse": mse, "rmse": rmse, "mae": mae, "r2": r2,
}  # fmt: skip
#: Metrics where larger is better (the others, and ``loss``, are better smaller).
HIGHER_IS_BETTER = frozenset(
    {"accuracy", "acc", "precision", "recall", "f1", "auc", "auroc", "r2", "map", "iou", "dice"}
)


def resolve(metrics: object) -> tuple[tuple[str, Metric], ...]:
    """``(name, function)`` for each metric of the ``metrics`` param.

    Raises:
        ConfigError: An unknown name (the names are listed), a value that is not a function,
            or two metrics with one name.
    """
    if metrics is None:
        return ()
    if isinstance(metrics, (str, bytes)) or callable(metrics):
        metrics = [metrics]
    items = list(metrics.items()) if isinstance(metrics, Mapping) else [
        (m if isinstance(m, str) else getattr(m, "__name__", ""), m) for m in metrics  # type: ignore[attr-defined]
    ]  # fmt: skip
    found: dict[str, Metric] = {}
    for name, given in items:
        metric = given
        if isinstance(given, str):
            if given not in METRICS:
                raise ConfigError(
                    f"unknown metric {given!r}; choose from {', '.join(METRICS)}, or pass a "
                    "function metric(output, label) -> float."
                )
            metric = METRICS[given]
        if not callable(metric) or not name or name == "<lambda>":
            raise ConfigError(
                f"metric {metric!r} needs a name and must be a function (output, label) -> "
                "float: pass a named function, or a dict {'name': function}."
            )
        if name == "loss":
            raise ConfigError("'loss' names the loss itself; give the metric another name.")
        if name in found:
            raise ConfigError(f"two metrics are named {name!r}; give them distinct names.")
        found[name] = metric
    return tuple(found.items())


def compute(
    named: Sequence[tuple[str, Metric]], output: Any, label: Any, prefix: str
) -> dict[str, float]:
    """Each metric over ``output`` and ``label`` (all the rows), named with ``prefix``."""
    if output.shape[0] == 0:  # no rows (a validation set smaller than the ranks, say)
        return {f"{prefix}{name}": float("nan") for name, _ in named}
    return {f"{prefix}{name}": float(metric(output, label)) for name, metric in named}


def gather(tensors: Sequence[Any]) -> list[Any]:
    """Each of ``tensors`` concatenated over every rank (in rank order), on every rank."""
    import torch
    import torch.distributed as dist

    mine = [t.detach().cpu() for t in tensors]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    found = [[rank[i] for rank in everyone if rank[i].numel()] for i in range(len(mine))]
    return [torch.cat(parts) if parts else mine[i] for i, parts in enumerate(found)]
