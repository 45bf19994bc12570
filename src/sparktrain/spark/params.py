"""The ``pyspark.ml`` Params of ``TorchEstimator`` and ``TorchModel``, and their checks.

Names follow Spark ML (``featuresCol``, ``labelCol``, ``batchSize``, ``learningRate``) so that
the stages sit in a ``Pipeline`` and a ``ParamGridBuilder`` like Spark's own; Spark's shared
params are used where they exist. Params whose values are Python objects (the model, a loss or
optimizer function, the training function, the run options) are listed in
:data:`OBJECT_PARAMS`: ML persistence pickles them, and writes the others as JSON.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (
    HasBatchSize,
    HasFeaturesCol,
    HasInputCols,
    HasLabelCol,
    HasLearningRate,
    HasPredictionCol,
    HasProbabilityCol,
    HasRawPredictionCol,
    HasSeed,
)

from sparktrain.backends.registry import BackendName, check_backend
from sparktrain.ground.errors import ConfigError
from sparktrain.spark.rank import tasks
from sparktrain.spark.trainparams import OBJECTS, TrainingParams

#: Params holding Python objects: pickled by ML persistence, not written as JSON.
OBJECT_PARAMS = ("model", "loss", "optimizer", "trainFn", "runOptions", *OBJECTS)


def _param(name: str, doc: str, converter: Any = TypeConverters.identity) -> Any:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


def set_given(stage: Params, **values: Any) -> None:
    """Set the params whose value differs from the default (what a caller chose).

    Spark ML stages mark as set only what the caller passed; with plain keyword defaults in the
    signature, a value equal to the default counts as not passed.
    """
    chosen = {}
    for name, value in values.items():
        default = stage._defaultParamMap.get(stage.getParam(name), None)
        plain = isinstance(value, (str, int, float, bool, list, tuple)) or value is None
        same = value is default or (plain and value == default)
        if not same:
            chosen[name] = value
    stage._set(**chosen)


def quoted(column: str) -> str:
    """``column`` quoted for ``functions.col`` (dots and backticks in names stay literal)."""
    return "`" + column.replace("`", "``") + "`"


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive whole number.")


class TorchParams(
    HasFeaturesCol, HasInputCols, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol
):
    """Params of both stages: the inputs, the added columns, and how predictions are computed."""

    task: Param[str] = _param(
        "task",
        "what the model predicts, which decides the columns transform adds: 'classification' "
        "(prediction, rawPrediction, probability), 'binary', 'regression' (prediction), 'raw' "
        "(the model's output as it is) or 'auto' (from the loss)",
        TypeConverters.toString,
    )
    inferenceBatchSize: Param[int] = _param(
        "inferenceBatchSize", "rows per forward pass in transform", TypeConverters.toInt
    )
    useGpu: Param[Any] = _param(
        "useGpu",
        "True: GPUs (one per rank in fit; the task's GPU in transform); False: CPU; None: GPUs "
        "where there are some",
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(task="auto", inferenceBatchSize=1024, useGpu=None)

    def getTask(self) -> str:
        """The task (see the ``task`` param)."""
        return self.getOrDefault(self.task)

    def getInferenceBatchSize(self) -> int:
        """Rows per forward pass in ``transform``."""
        return self.getOrDefault(self.inferenceBatchSize)

    def getUseGpu(self) -> bool | None:
        """Whether GPUs are used (``None``: where there are some)."""
        return self.getOrDefault(self.useGpu)  # type: ignore[no-any-return]

    def input_columns(self) -> tuple[str, ...]:
        """The columns passed to the model, in order: ``inputCols``, else ``featuresCol``."""
        if self.isDefined(self.inputCols) and self.getInputCols():
            return tuple(self.getInputCols())
        return (self.getFeaturesCol(),)

    def check_outputs(self) -> None:
        """Refuse bad values of the params that ``transform`` uses."""
        if self.getTask() not in tasks.TASKS:
            raise ConfigError(
                f"unknown task {self.getTask()!r}; choose one of: {', '.join(tasks.TASKS)}."
            )
        _positive("inferenceBatchSize", self.getInferenceBatchSize())
        if self.getUseGpu() not in (True, False, None):
            raise ConfigError(f"useGpu={self.getUseGpu()!r} must be True, False or None.")


class FitParams(TorchParams, TrainingParams, HasLabelCol, HasBatchSize, HasLearningRate, HasSeed):
    """The estimator's params: the model, its training, and where the ranks run."""

    model: Param[Any] = _param(
        "model", "the torch.nn.Module to train, or a function of no arguments that builds one"
    )
    loss: Param[Any] = _param(
        "loss",
        "loss name (cross_entropy, nll, bce_with_logits, mse, l1, smooth_l1, huber) or a "
        "function loss(output, label) -> tensor; a list of them, one per output (labelCols)",
    )
    optimizer: Param[Any] = _param(
        "optimizer",
        "optimizer name (adam, adamw, sgd, rmsprop, adagrad), a torch.optim class, or a "
        "function of the parameters that returns an optimizer",
    )
    epochs: Param[int] = _param("epochs", "passes over the data", TypeConverters.toInt)
    shuffle: Param[bool] = _param(
        "shuffle", "shuffle the rows each epoch", TypeConverters.toBoolean
    )
    numProcesses: Param[int] = _param(
        "numProcesses", "ranks (on GPUs: GPUs) that train", TypeConverters.toInt
    )
    localMode: Param[bool] = _param(
        "localMode",
        "True: the ranks run on the driver's machine; False: as barrier tasks on the executors",
        TypeConverters.toBoolean,
    )
    backend: Param[Any] = _param(
        "backend", "where the ranks run: 'local', 'spark', 'ray' (None: follow localMode)"
    )
    strategy: Param[str] = _param(
        "strategy",
        "how the model is spread over the ranks: ddp, fsdp, zero1, zero2, zero3, the offload "
        "variants, or auto (sparktrain.prepare_model)",
        TypeConverters.toString,
    )
    trainFn: Param[Any] = _param(
        "trainFn",
        "a function train(context) -> model that replaces the built-in loop (full control); "
        "it gets a sparktrain.spark.FitContext",
    )
    runOptions: Param[Any] = _param(
        "runOptions", "sparktrain.RunOptions of the launch (timeout, max_restarts, mlflow, ...)"
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            model=None,
            loss=None,
            optimizer="adam",
            epochs=1,
            batchSize=64,
            learningRate=1e-3,
            shuffle=True,
            seed=0,
            numProcesses=1,
            localMode=False,
            backend=None,
            strategy="ddp",
            trainFn=None,
            runOptions=None,
        )

    def getModel(self) -> Any:
        """The model, or the function that builds it."""
        return self.getOrDefault(self.model)

    def getLoss(self) -> Any:
        """The loss name or function."""
        return self.getOrDefault(self.loss)

    def getOptimizer(self) -> Any:
        """The optimizer name, class or function."""
        return self.getOrDefault(self.optimizer)

    def getEpochs(self) -> int:
        """Passes over the data."""
        return self.getOrDefault(self.epochs)

    def getShuffle(self) -> bool:
        """Whether rows are shuffled each epoch."""
        return self.getOrDefault(self.shuffle)

    def getNumProcesses(self) -> int:
        """The number of ranks."""
        return self.getOrDefault(self.numProcesses)

    def getLocalMode(self) -> bool:
        """Whether the ranks run on the driver's machine."""
        return self.getOrDefault(self.localMode)

    def getBackend(self) -> BackendName | None:
        """Where the ranks run (``None``: follow ``localMode``)."""
        return self.getOrDefault(self.backend)

    def getStrategy(self) -> str:
        """The strategy given to ``prepare_model``."""
        return self.getOrDefault(self.strategy)

    def getTrainFn(self) -> Any:
        """The training function, if any."""
        return self.getOrDefault(self.trainFn)

    def getRunOptions(self) -> Any:
        """The launch's run options."""
        return self.getOrDefault(self.runOptions)

    def check_fit(self) -> None:
        """Refuse bad values of the params that ``fit`` uses, naming the fix."""
        from sparktrain.spark.rank.loop.lightning import is_lightning
        from sparktrain.strategies import STRATEGIES

        self.check_outputs()
        model, train_fn = self.getModel(), self.getTrainFn()
        if model is None:
            raise ConfigError(
                "TorchEstimator needs model=: a torch.nn.Module, or a function that builds one."
            )
        if not callable(model):
            raise ConfigError(f"model={model!r} must be a torch.nn.Module or a function.")
        if train_fn is not None and not callable(train_fn):
            raise ConfigError(f"trainFn={train_fn!r} must be a function train(context) -> model.")
        lightning = is_lightning(model)
        if train_fn is None and self.getLoss() is None and not lightning:
            raise ConfigError(
                f"TorchEstimator needs loss= (one of {', '.join(tasks.LOSSES)}, or a function "
                "loss(output, label) -> tensor), a LightningModule as model=, or trainFn= for a "
                "loop of your own."
            )
        tasks.check_loss(self.getLoss())
        tasks.check_optimizer(self.getOptimizer())
        self.check_training()
        if lightning and self.training("metrics"):
            raise ConfigError(
                "metrics= does not apply to a LightningModule: log them with self.log(...) in its "
                "training_step and validation_step; they become the epoch's metrics."
            )
        for name in ("epochs", "batchSize", "numProcesses"):
            _positive(name, self.getOrDefault(name))
        if not self.getLearningRate() > 0:
            raise ConfigError(f"learningRate={self.getLearningRate()!r} must be positive.")
        if self.getStrategy() not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.getStrategy()!r}; choose one of: {', '.join(STRATEGIES)}"
            )
        if self.getBackend() is not None:
            check_backend(self.getBackend())
