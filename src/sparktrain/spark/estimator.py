"""``TorchEstimator``: train a PyTorch model on a DataFrame as a Spark ML ``Estimator``.

``fit(df)`` is a sparktrain launch like any other (the same backends, logs, errors, restarts,
progress bar and MLflow tracking): the driver checks the params and the columns, lays the ranks
out (``numProcesses``, ``localMode``/``backend``, ``useGpu``), has Spark write the needed columns
once to the data cache (``sparktrain.data``: the executors write, nothing is collected), and
every rank streams its share and runs ``sparktrain.spark.rank.training``. Rank 0's trained model
comes back as a :class:`~sparktrain.spark.TorchModel` that shares this estimator's uid and
column params, as Spark's own models do.
"""

from __future__ import annotations

import difflib
from typing import Any

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable
from typing_extensions import Unpack

from sparktrain.backends.registry import BackendName, for_local_mode
from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.options import NAMES, RunOptions, RunOptionsArgs, run_options
from sparktrain.spark import fitdata, inference
from sparktrain.spark.model import TorchModel
from sparktrain.spark.params import OBJECT_PARAMS, FitParams, set_given
from sparktrain.spark.persistence import StageReader, StageWriter
from sparktrain.spark.rank import tasks
from sparktrain.spark.rank.fitjob import FitJob
from sparktrain.spark.rank.training import run_fit
from sparktrain.spark.setters import FitSetters

_NUMBER_TYPES = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType",
                 "DecimalType", "BooleanType")  # fmt: skip


def _column_kind(kind: Any) -> str | None:
    """``number``, ``array`` or ``vector`` for a Spark type a model can take, else ``None``."""
    name = type(kind).__name__
    if name in _NUMBER_TYPES:
        return "number"
    if name == "VectorUDT":
        return "vector"
    if name == "ArrayType":
        inner = _column_kind(kind.elementType)
        return "array" if inner in ("number", "array") else None
    return None


def check_schema(df: Any, inputs: tuple[str, ...], labels: tuple[str, ...]) -> None:
    """Refuse input and label columns that are missing or cannot become tensors."""
    wanted = [*inputs, *labels]
    inference.check_columns(df, wanted, "columns")
    types = {f.name: f.dataType for f in df.schema.fields}
    for name in wanted:
        if _column_kind(types[name]) is None:
            raise ConfigError(
                f"column {name!r} is {types[name].simpleString()}; a model's inputs and labels "
                "must be numbers, arrays of numbers or ML vectors (assemble columns with "
                "pyspark.ml.feature.VectorAssembler, index strings with StringIndexer)."
            )


class TorchEstimator(
    FitSetters, Estimator[TorchModel], FitParams, MLReadable["TorchEstimator"], MLWritable
):
    """Train a PyTorch model on a Spark DataFrame; ``fit`` returns a :class:`TorchModel`.

    Every param is a keyword here and has ``get``/``set`` methods (``setEpochs(5)``); the run
    options of every sparktrain front door (``timeout``, ``max_restarts``, ``mlflow``,
    ``progress``, ``data_cache_dir``, ...) are keywords too and go into ``runOptions``.

    Example::

        from pyspark.ml import Pipeline
        from pyspark.ml.feature import VectorAssembler
        from sparktrain.spark import TorchEstimator

        estimator = TorchEstimator(model=make_mlp(), loss="cross_entropy", epochs=3,
                                   numProcesses=2, featuresCol="features", labelCol="label")
        model = Pipeline(stages=[VectorAssembler(...), estimator]).fit(train)
        model.transform(test)   # adds prediction, rawPrediction, probability
    """

    @keyword_only
    def __init__(
        self,
        *,
        model: Any = None,
        loss: Any = None,
        optimizer: Any = "adam",
        learningRate: float = 1e-3,
        epochs: int = 1,
        batchSize: int = 64,
        featuresCol: str = "features",
        inputCols: list[str] | None = None,
        labelCol: str = "label",
        predictionCol: str = "prediction",
        probabilityCol: str = "probability",
        rawPredictionCol: str = "rawPrediction",
        task: str = "auto",
        numProcesses: int = 1,
        localMode: bool = False,
        useGpu: bool | None = None,
        backend: BackendName | None = None,
        strategy: str = "ddp",
        shuffle: bool = True,
        seed: int = 0,
        trainFn: Any = None,
        inferenceBatchSize: int = 1024,
        validation: float | str | None = None,
        metrics: Any = None,
        callbacks: list[Any] | None = None,
        valBatchSize: int | None = None,
        trainStepsPerEpoch: int | None = None,
        validationStepsPerEpoch: int | None = None,
        weightCol: str | None = None,
        labelCols: list[str] | None = None,
        lossWeights: list[float] | None = None,
        transformationFn: Any = None,
        backwardPassesPerStep: int = 1,
        earlyStoppingPatience: int = 0,
        monitor: str | None = None,
        monitorMode: str = "auto",
        minDelta: float = 0.0,
        restoreBestWeights: bool = True,
        lrSchedule: Any = None,
        store: str | None = None,
        runId: str | None = None,
        checkpointEvery: int = 0,
        runOptions: RunOptions | None = None,
        **options: Unpack[RunOptionsArgs],
    ) -> None:
        """Describe the training; the params are described on :class:`FitParams`.

        Raises:
            ConfigError: An unknown keyword (the closest param or run option is named) or a
                bad value.
        """
        super().__init__()
        self.setParams(**self._input_kwargs)  # type: ignore[attr-defined]  # keyword_only

    def setParams(self, **values: Any) -> TorchEstimator:
        """Set params and run options by name (what the constructor takes)."""
        self._check_names(values)
        options = {k: values.pop(k) for k in list(values) if k in NAMES}
        base = values.pop("runOptions", None) or self.getRunOptions()
        if options or base is not None:
            values["runOptions"] = run_options(base, **options)
        set_given(self, **values)
        self.check_outputs()
        tasks.check_loss(self.getLoss())
        tasks.check_optimizer(self.getOptimizer())
        return self

    def _check_names(self, values: dict[str, Any]) -> None:
        known = [p.name for p in self.params] + list(NAMES)
        unknown = [k for k in values if k not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"TorchEstimator has no param or run option {unknown[0]!r}{hint}; the params are "
                f"{', '.join(sorted(p.name for p in self.params))} and the run options "
                f"{', '.join(NAMES)}."
            )

    def _fit(self, dataset: Any) -> TorchModel:
        from sparktrain.driver.launch import prepare

        self.check_fit()
        inputs = self.input_columns()
        names = fitdata.labels(self, dataset)
        weight = self.getWeightCol() if self.isSet("weightCol") else None
        check_schema(dataset, (*inputs, *([weight] if weight else [])), names)
        task = tasks.resolve_task(self.getTask(), self.getLoss())
        options = self.getRunOptions() or RunOptions()
        backend = for_local_mode(self.getLocalMode(), self.getBackend())
        prepared = prepare(
            self.getNumProcesses(), use_gpu=self.getUseGpu(), backend=backend, options=options,
            name="numProcesses",
        )  # fmt: skip
        columns = list(dict.fromkeys([*inputs, *names, *([weight] if weight else [])]))
        data, val_data = fitdata.streams(self, dataset, columns, options.environment.data_cache_dir)
        folder = fitdata.run_folder(self, dataset, options.environment.data_cache_dir)
        try:
            job = FitJob(
                model=self.getModel(), loss=self.getLoss(), optimizer=self.getOptimizer(),
                learning_rate=self.getLearningRate(), epochs=self.getEpochs(), data=data,
                inputs=inputs, label=names[0] if names else None, task=task,
                strategy=self.getStrategy(), dist_backend=prepared.plan.dist_backend,
                seed=self.getSeed(), train_fn=self.getTrainFn(),
                params=self._logged_params(task),
                controls=fitdata.controls(self, names, val_data, folder),
            )  # fmt: skip
            outcome = prepared.run(run_fit, (job,)).value
        finally:
            folder.remove()  # a fit without a runId cannot be resumed by a later one
        model = TorchModel(outcome.model)
        model._resetUid(self.uid)
        self._copyValues(model)
        model._set(task=task)
        return model.trained(
            outcome.output, outcome.widths, outcome.history, outcome.mlflow_model_uri
        )

    def _logged_params(self, task: str) -> dict[str, Any]:
        """The params as MLflow parameters (objects by their type's name)."""
        values: dict[str, Any] = {"task": task}
        for param in self.params:
            if param.name in ("runOptions", "task") or not self.isDefined(param):
                continue
            value = self.getOrDefault(param)
            if value is not None and not isinstance(value, (str, int, float, bool, list)):
                value = getattr(value, "__name__", type(value).__name__)
            if value is not None:
                values[param.name] = value
        return values

    # -- persistence -----------------------------------------------------------------------------
    def write(self) -> StageWriter:
        """A writer that saves the params, the model and any functions (see ``persistence``)."""
        return StageWriter(self, self._objects)

    def _objects(self) -> dict[str, Any]:
        return {name: self.getOrDefault(name) for name in OBJECT_PARAMS if self.isSet(name)}

    @classmethod
    def read(cls) -> StageReader[TorchEstimator]:
        """A reader for estimators saved with :meth:`write`."""
        return StageReader(cls, _restore)


def _restore(stage: TorchEstimator, objects: dict[str, Any]) -> None:
    stage._set(**objects)
