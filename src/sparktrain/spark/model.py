"""``TorchModel``: a PyTorch model as a Spark ML ``Transformer``.

``TorchEstimator.fit`` returns one; any ``torch.nn.Module`` can be wrapped in one too
(``TorchModel(module, featuresCol="features", task="classification")``). ``transform(df)``
adds the columns of the model's task (``sparktrain.spark.rank.tasks``), computed in the executors
with the model loaded once per Python worker (``sparktrain.spark.rank.scoring``): a model from
``fit`` knows its output type and input widths; a wrapped module is run on two rows on the
driver first to learn them.
"""

from __future__ import annotations

import warnings
from typing import Any

from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from sparktrain.ground.errors import ConfigError
from sparktrain.inference.models import model_payload
from sparktrain.inference.rank import outputs
from sparktrain.spark import inference
from sparktrain.spark.params import TorchParams, quoted, set_given
from sparktrain.spark.persistence import StageReader, StageWriter
from sparktrain.spark.rank import tasks
from sparktrain.spark.rank.scoring import Scorer
from sparktrain.spark.setters import TorchSetters

_FIELD_PARAMS = (("prediction", "predictionCol"), ("raw", "rawPredictionCol"),
                 ("probability", "probabilityCol"))  # fmt: skip


class TorchModel(TorchSetters, Model, TorchParams, MLReadable["TorchModel"], MLWritable):
    """A trained PyTorch model whose ``transform`` adds its predictions to a DataFrame.

    Attributes:
        torch_model: The ``torch.nn.Module`` (a plain module on the CPU after ``fit``).
        history: The loss per epoch of the ``fit`` that made it (empty otherwise).
        mlflow_model_uri: The model ``fit`` logged to MLflow, when tracking was on.
    """

    def __init__(
        self,
        torch_model: Any = None,
        *,
        featuresCol: str = "features",
        inputCols: list[str] | None = None,
        predictionCol: str = "prediction",
        probabilityCol: str = "probability",
        rawPredictionCol: str = "rawPrediction",
        task: str = "auto",
        inferenceBatchSize: int = 1024,
        useGpu: bool | None = None,
    ) -> None:
        """Wrap ``torch_model``; the params are :class:`TorchEstimator`'s.

        ``task="auto"`` means ``"raw"`` for a wrapped module (the model's output as it is).
        """
        super().__init__()
        self.torch_model = torch_model
        self.history: tuple[dict[str, float], ...] = ()
        self.mlflow_model_uri: str | None = None
        self._output: outputs.Spec | None = None
        self._widths: tuple[int | None, ...] | None = None
        self._payload: tuple[str, bytes] | None = None
        set_given(
            self,
            featuresCol=featuresCol, inputCols=inputCols, predictionCol=predictionCol,
            probabilityCol=probabilityCol, rawPredictionCol=rawPredictionCol, task=task,
            inferenceBatchSize=inferenceBatchSize, useGpu=useGpu,
        )  # fmt: skip
        self.check_outputs()

    # -- set up by fit -------------------------------------------------------------------------
    def trained(
        self,
        output: outputs.Spec,
        widths: tuple[int | None, ...],
        history: tuple[dict[str, float], ...],
        mlflow_model_uri: str | None,
    ) -> TorchModel:
        """Record what ``fit`` learned about the model (its output, inputs, losses)."""
        self._output, self._widths = output, widths
        self.history, self.mlflow_model_uri = history, mlflow_model_uri
        return self

    def getHistory(self) -> dict[str, list[float]]:
        """The fit's metrics by name, one value per epoch (as Horovod's models give them).

        ``{"loss": [...], "val_loss": [...], "accuracy": [...], ...}``; ``history`` holds the same
        as one record per epoch.
        """
        names = list(dict.fromkeys(k for record in self.history for k in record if k != "epoch"))
        return {n: [record.get(n, float("nan")) for record in self.history] for n in names}

    # -- params ----------------------------------------------------------------------------------
    def setParams(self, **values: Any) -> TorchModel:
        """Set params by name (the setters, ``setPredictionCol(...)`` and so on, call this)."""
        self._set(**values)
        self.check_outputs()
        return self

    # -- transform -------------------------------------------------------------------------------
    def resolved_task(self) -> tasks.Task:
        """The task whose columns ``transform`` adds (``auto`` is ``raw`` here)."""
        task = self.getTask()
        return "raw" if task == "auto" else task  # type: ignore[return-value]

    def _fields(self, task: tasks.Task) -> list[tuple[str, str]]:
        """(field, column) pairs of the columns to add."""
        if task == "raw":
            return [("raw", self.getPredictionCol())]
        wanted = tasks.HEAD_FIELDS[task]
        pairs = [(f, self.getOrDefault(p)) for f, p in _FIELD_PARAMS if f in wanted]
        return [(f, column) for f, column in pairs if column]

    def _result(self, spec: outputs.Spec, task: tasks.Task, fields: list[str]) -> outputs.Spec:
        """The UDF's result type for ``task``, checked against the model's output ``spec``."""
        if task == "raw":
            return spec
        shape = spec.shape if isinstance(spec, outputs.Leaf) else None
        if task == "classification" and (shape is None or len(shape) != 1 or shape[0] < 2):
            raise ConfigError(
                f"task='classification' needs one logit per class; the model returns "
                f"{outputs.spark_type(spec).simpleString()} per row. Use task='raw' otherwise."
            )
        if task in ("binary", "regression") and shape != ():
            raise ConfigError(
                f"task={task!r} needs one value per row; the model returns "
                f"{outputs.spark_type(spec).simpleString()}. Use task='classification' or 'raw'."
            )
        width = shape[0] if task == "classification" and shape else 2
        kinds = {
            "prediction": outputs.Leaf("float64", ()),
            "raw": outputs.Leaf("float32", (width,)),
            "probability": outputs.Leaf("float32", (width,)),
        }
        return outputs.Struct(tuple((f, kinds[f]) for f in fields))

    def _transform(self, dataset: Any) -> Any:
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        self.check_outputs()
        if self.torch_model is None:
            raise ConfigError("this TorchModel has no torch_model; fit one or pass a module.")
        inputs = self.input_columns()
        inference.check_columns(dataset, inputs, "input columns")
        task = self.resolved_task()
        pairs = self._fields(task)
        if not pairs:
            warnings.warn(
                f"{self.uid}: transform adds nothing, as every output column param is ''.",
                stacklevel=2,
            )
            return dataset
        taken = [column for _, column in pairs if column in dataset.columns]
        if taken:
            raise ConfigError(f"output column {taken[0]!r} already exists in the DataFrame.")
        if self._output is None:
            self._output = outputs.describe(
                *inference.sample_output(self.torch_model, dataset, inputs)
            )
        if self._payload is None:
            self._payload = model_payload(self.torch_model)
        fields = [f for f, _ in pairs]
        scorer = Scorer(
            key=self._payload[0],
            payload=self._payload[1],
            inputs=inputs,
            widths=self._widths or (None,) * len(inputs),
            batch_size=self.getInferenceBatchSize(),
            use_gpu=self.getUseGpu(),
            task=task,
            fields=tuple(fields) if task != "raw" else (),
            output=self._result(self._output, task, fields),
        )
        hidden = f"__sparktrain_{self.uid}"
        scored = inference.with_scores(dataset, scorer, hidden)
        if task == "raw":
            return scored.withColumnRenamed(hidden, pairs[0][1])
        added = []
        for field, column in pairs:
            value = F.col(f"{hidden}.{field}")
            added.append((value if field == "prediction" else array_to_vector(value)).alias(column))
        return scored.select(*[F.col(quoted(c)) for c in dataset.columns], *added)

    # -- persistence -----------------------------------------------------------------------------
    def write(self) -> StageWriter:
        """A writer that saves the params and the torch model (see ``persistence``)."""
        return StageWriter(self, self._objects)

    def _objects(self) -> dict[str, Any]:
        return {
            "torch_model": self.torch_model,
            "output": self._output,
            "widths": self._widths,
            "history": self.history,
            "mlflow_model_uri": self.mlflow_model_uri,
        }

    @classmethod
    def read(cls) -> StageReader[TorchModel]:
        """A reader for models saved with :meth:`write`."""
        return StageReader(cls, _restore)


def _restore(model: TorchModel, objects: dict[str, Any]) -> None:
    model.torch_model = objects["torch_model"]
    model.trained(
        objects["output"], objects["widths"], objects["history"], objects["mlflow_model_uri"]
    )
