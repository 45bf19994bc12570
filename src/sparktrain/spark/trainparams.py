"""The params of ``TorchEstimator``'s built-in loop beyond the model and its optimizer.

Validation, metrics, early stopping, schedules, checkpoints, several outputs, sample weights.

Named after Horovod's estimator params in Spark ML's camelCase (``val_batch_size`` is
``valBatchSize``, ``sample_weight_col`` is ``weightCol``); docs/spark-ml.md maps every one.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasWeightCol

from sparktrain.ground.errors import ConfigError
from sparktrain.spark.rank.loop import controls, metrics


def _param(name: str, doc: str, converter: Any = TypeConverters.identity) -> Any:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


#: name -> (default, doc). Values are plain (JSON) unless listed in ``OBJECTS``.
TRAINING: dict[str, tuple[Any, str]] = {
    "validation": (None, "validation rows: a fraction (split by seed) or a boolean column"),
    "metrics": (None, "metric names (accuracy, f1, precision, recall, auc, mse, rmse, mae, r2) "
                "or functions metric(output, label) -> float, per epoch on train and validation"),
    "callbacks": (None, "functions callback(epoch, record) called on every rank at each epoch's "
                  "end; a true result stops the fit"),
    "valBatchSize": (None, "rows per validation batch (None: batchSize)"),
    "trainStepsPerEpoch": (None, "batches per epoch on each rank (None: all the rows)"),
    "validationStepsPerEpoch": (None, "validation batches per epoch on each rank (None: all)"),
    "labelCols": (None, "several label columns, one per output of the model"),
    "lossWeights": (None, "the weight of each output's loss (with labelCols)"),
    "transformationFn": (None, "a function of each batch dict, run in the data reader"),
    "backwardPassesPerStep": (1, "batches whose gradients are accumulated per optimizer step"),
    "earlyStoppingPatience": (0, "epochs without improvement before the fit stops (0: never)"),
    "monitor": (None, "the metric early stopping watches (None: val_loss, or loss)"),
    "monitorMode": ("auto", "min, max, or auto (max for accuracy-like metrics)"),
    "minDelta": (0.0, "the smallest change that counts as an improvement"),
    "restoreBestWeights": (True, "early stopping returns the best epoch's weights"),
    "lrSchedule": (None, "cosine, linear, onecycle, exponential, step, plateau, or a function "
                   "schedule(optimizer) -> LR scheduler"),
    "store": (None, "the folder of the fit's checkpoints (None: beside the data cache)"),
    "runId": (None, "the fit's name in the store: a fit with a runId resumes its checkpoint"),
    "checkpointEvery": (0, "optimizer steps between checkpoints inside an epoch (0: none)"),
}  # fmt: skip
#: The params above that hold Python objects (pickled by ML persistence).
OBJECTS = ("metrics", "callbacks", "transformationFn", "lrSchedule")


def _optional_positive(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive whole number or None.")


def _fraction_or_column(value: object) -> bool:
    if value is None or isinstance(value, str):
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1


class TrainingParams(HasWeightCol):
    """The built-in loop's params (``TRAINING``); ``getX`` for each, by name."""

    validation: Param[Any] = _param("validation", TRAINING["validation"][1])
    metrics: Param[Any] = _param("metrics", TRAINING["metrics"][1])
    callbacks: Param[Any] = _param("callbacks", TRAINING["callbacks"][1])
    valBatchSize: Param[Any] = _param("valBatchSize", TRAINING["valBatchSize"][1])
    trainStepsPerEpoch: Param[Any] = _param("trainStepsPerEpoch", TRAINING["trainStepsPerEpoch"][1])
    validationStepsPerEpoch: Param[Any] = _param(
        "validationStepsPerEpoch", TRAINING["validationStepsPerEpoch"][1]
    )
    labelCols: Param[Any] = _param("labelCols", TRAINING["labelCols"][1])
    lossWeights: Param[Any] = _param("lossWeights", TRAINING["lossWeights"][1])
    transformationFn: Param[Any] = _param("transformationFn", TRAINING["transformationFn"][1])
    backwardPassesPerStep: Param[int] = _param(
        "backwardPassesPerStep", TRAINING["backwardPassesPerStep"][1], TypeConverters.toInt
    )
    earlyStoppingPatience: Param[int] = _param(
        "earlyStoppingPatience", TRAINING["earlyStoppingPatience"][1], TypeConverters.toInt
    )
    monitor: Param[Any] = _param("monitor", TRAINING["monitor"][1])
    monitorMode: Param[str] = _param(
        "monitorMode", TRAINING["monitorMode"][1], TypeConverters.toString
    )
    minDelta: Param[float] = _param("minDelta", TRAINING["minDelta"][1], TypeConverters.toFloat)
    restoreBestWeights: Param[bool] = _param(
        "restoreBestWeights", TRAINING["restoreBestWeights"][1], TypeConverters.toBoolean
    )
    lrSchedule: Param[Any] = _param("lrSchedule", TRAINING["lrSchedule"][1])
    store: Param[Any] = _param("store", TRAINING["store"][1])
    runId: Param[Any] = _param("runId", TRAINING["runId"][1])
    checkpointEvery: Param[int] = _param(
        "checkpointEvery", TRAINING["checkpointEvery"][1], TypeConverters.toInt
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**{name: default for name, (default, _) in TRAINING.items()})

    def training(self, name: str) -> Any:
        """The value of the built-in loop's param ``name`` (one of ``TRAINING``)."""
        return self.getOrDefault(name)

    def check_training(self) -> None:
        """Refuse bad values of the loop's params, naming the fix."""
        validation = self.training("validation")
        if not _fraction_or_column(validation):
            raise ConfigError(
                f"validation={validation!r} must be a fraction between 0 and 1 (0.2: a fifth of "
                "the rows) or the name of a boolean column."
            )
        metrics.resolve(self.training("metrics"))
        for name in ("valBatchSize", "trainStepsPerEpoch", "validationStepsPerEpoch"):
            _optional_positive(name, self.training(name))
        _optional_positive("backwardPassesPerStep", self.training("backwardPassesPerStep"))
        for name in ("earlyStoppingPatience", "checkpointEvery"):
            value = self.training(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a whole number >= 0.")
        if self.training("monitorMode") not in controls.MODES:
            raise ConfigError(
                f"monitorMode={self.training('monitorMode')!r} must be one of "
                f"{', '.join(controls.MODES)}."
            )
        controls.check_schedule(self.training("lrSchedule"))
        callbacks = self.training("callbacks") or []
        if not isinstance(callbacks, (list, tuple)) or not all(callable(f) for f in callbacks):
            raise ConfigError("callbacks must be a list of functions callback(epoch, record).")
        transformation = self.training("transformationFn")
        if transformation is not None and not callable(transformation):
            raise ConfigError("transformationFn must be a function of a batch dict.")
        self._check_outputs()

    def _check_outputs(self) -> None:
        labels, weights = self.training("labelCols"), self.training("lossWeights")
        if weights is not None and len(weights) != len(labels or [None]):
            raise ConfigError(
                f"lossWeights has {len(weights)} value(s) and there are "
                f"{len(labels or [None])} label column(s); give one weight per label column."
            )
