"""Batch inference over Spark DataFrames: :func:`predict`, and the UDF ``TorchModel`` uses.

On the driver the model is pickled once (an MLflow URI is loaded here first) and the output
type is found, by running the model on two rows, unless the caller knows it. The executors run
``scoring.score`` on Arrow batches (see that module for what happens there).

Where pyspark has Arrow UDFs (4.1 and later, classic and Connect) the prediction is a column
expression: only the input columns travel to Python and only the prediction comes back. On
older pyspark, and for DataFrames holding ML vectors (or any user-defined type) while Spark's
columnar UDF input is on (see :data:`COLUMNAR_INPUT`), ``mapInArrow`` carries every column
through Python and appends the prediction; the result is the same.
"""

from __future__ import annotations

import collections
import hashlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from sparktrain.errors import ConfigError
from sparktrain.spark import outputs
from sparktrain.spark.scoring import Scorer, Where, float_dtype, input_tensors, score

#: Use Arrow UDFs where pyspark has them (tests turn it off to run the mapInArrow path).
ARROW_UDF = True


def model_payload(model: Any) -> tuple[str, bytes]:
    """The model pickled for the executors, and its key."""
    import cloudpickle

    try:
        payload = cloudpickle.dumps(model)
    except Exception as exc:
        raise ConfigError(
            f"the model ({type(model).__name__}) cannot be pickled for the executors: {exc}. "
            "Define its class at the top level of a module or notebook cell."
        ) from exc
    return hashlib.sha256(payload).hexdigest()[:32], payload


def load_model(model: Any) -> Any:
    """``model`` itself, or for a string the PyTorch model of that MLflow URI (on the CPU)."""
    if not isinstance(model, str):
        if not callable(model):
            raise ConfigError(
                f"model={model!r} must be a torch module, a function of tensors, or an MLflow "
                "model URI such as 'runs:/<run id>/model'."
            )
        return model
    from sparktrain.tracking.driver import mlflow_module

    mlflow = mlflow_module()
    try:
        flavors = mlflow.models.get_model_info(model).flavors
    except Exception as exc:
        raise ConfigError(f"MLflow model {model!r} could not be read: {exc}") from exc
    if "pytorch" not in flavors:
        raise ConfigError(
            f"MLflow model {model!r} has the flavors {sorted(flavors)}, not pytorch; score it "
            "with mlflow.pyfunc.spark_udf."
        )
    return mlflow.pytorch.load_model(model, map_location="cpu")


def column_names(value: object, what: str) -> tuple[str, ...]:
    """One column name or a list of them, checked."""
    names = (value,) if isinstance(value, str) else value
    if (
        not isinstance(names, Sequence)
        or not names
        or not all(isinstance(n, str) and n for n in names)
    ):
        raise ConfigError(f"{what}={value!r} must be a column name or a list of column names.")
    return tuple(names)


def check_columns(df: Any, names: Sequence[str], what: str) -> None:
    """Refuse columns that ``df`` does not have, listing those it has."""
    missing = [n for n in names if n not in df.columns]
    if missing:
        raise ConfigError(f"{what} {missing} not in the DataFrame; it has {df.columns}.")


def _first_rows(df: Any, rows: int) -> Any:
    head = df.limit(rows)
    if hasattr(head, "toArrow"):
        return head.toArrow()
    import pyarrow as pa

    return pa.Table.from_batches(head._collect_as_arrow())  # pyspark 3.5


def sample_output(model: Any, df: Any, inputs: Sequence[str], rows: int = 2) -> tuple[Any, int]:
    """The model's output for the first rows of ``df`` (computed on the driver), and their count."""
    import torch

    table = _first_rows(df.select(*inputs), rows)
    if table.num_rows == 0:
        raise ConfigError(
            "the DataFrame is empty, so the model's output type cannot be found from its rows; "
            "predict on a DataFrame with rows."
        )
    arrays = [table.column(n).combine_chunks() for n in inputs]
    training = getattr(model, "training", None)
    if training is not None:
        model.eval()
    try:
        params = list(getattr(model, "parameters", list)())
        device = params[0].device if params else torch.device("cpu")
        widths: list[int | None] = [None] * len(inputs)
        tensors = input_tensors(arrays, inputs, widths, Where(None), float_dtype(model))
        with torch.inference_mode():
            return model(*[t.to(device) for t in tensors]), table.num_rows
    finally:
        if training:
            model.train()


#: Spark 4.3 feeds Arrow UDFs columnar batches when this is on (the default), and then fails
#: on any user-defined type in the rows (``UNSUPPORTED_DATATYPE ... UDT``): an ML vector column
#: read from Parquet breaks every pandas or Arrow UDF over that DataFrame.
COLUMNAR_INPUT = "spark.sql.execution.arrow.pythonUDF.columnarInput.enabled"


def _holds_udt(kind: Any) -> bool:
    from pyspark.sql import types as T

    if isinstance(kind, T.UserDefinedType):
        return True
    if isinstance(kind, T.StructType):
        return any(_holds_udt(f.dataType) for f in kind.fields)
    if isinstance(kind, T.ArrayType):
        return _holds_udt(kind.elementType)
    if isinstance(kind, T.MapType):
        return _holds_udt(kind.keyType) or _holds_udt(kind.valueType)
    return False


def arrow_udf_usable(df: Any) -> bool:
    """Whether an Arrow UDF can score ``df`` (pyspark 4.1+, and no UDT that Spark trips on)."""
    from pyspark.sql import functions as F

    if not ARROW_UDF or not hasattr(F, "arrow_udf"):
        return False
    if not _holds_udt(df.schema):
        return True
    try:
        columnar = str(df.sparkSession.conf.get(COLUMNAR_INPUT, "true")).lower()
    except Exception:  # a Spark without the setting
        return True
    return columnar == "false"


def with_scores(df: Any, scorer: Scorer, name: str) -> Any:
    """``df`` with the column ``name`` holding the scorer's output for each row."""
    from pyspark.sql import functions as F

    kind = outputs.spark_type(scorer.output)
    if arrow_udf_usable(df):

        def run(batches: Iterator[Any]) -> Iterator[Any]:
            return score(batches, scorer)

        iterator = F.ArrowUDFType.SCALAR_ITER  # type: ignore[attr-defined]
        with warnings.catch_warnings():  # the type is given, on purpose, instead of hints
            warnings.filterwarnings("ignore", "It is preferred to specify type hints")
            udf = F.arrow_udf(run, kind, iterator)  # type: ignore[attr-defined]
        return df.withColumn(name, udf(*scorer.inputs))
    from pyspark.sql.types import StructField, StructType

    schema = StructType([*df.schema.fields, StructField(name, kind)])

    def run_batches(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        held: collections.deque[Any] = collections.deque()

        def columns() -> Iterator[tuple[Any, ...]]:
            for batch in batches:
                held.append(batch)
                yield tuple(batch.column(n) for n in scorer.inputs)

        for scored in score(columns(), scorer):
            batch = held.popleft()
            yield pa.RecordBatch.from_arrays(
                [*batch.columns, scored], names=[*batch.schema.names, name]
            )

    return df.mapInArrow(run_batches, schema)


def positive(name: str, value: object) -> int:
    """A positive whole number, or a :class:`ConfigError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive whole number.")
    return value


def gpu_choice(value: object) -> bool | None:
    """``use_gpu``: ``True``, ``False`` or ``None``."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"use_gpu={value!r} must be True, False or None (the task's GPU).")
    return value


def predict(
    df: Any,
    model: Any,
    *,
    input_cols: str | Sequence[str],
    output_col: str = "prediction",
    batch_size: int = 1024,
    use_gpu: bool | None = None,
) -> Any:
    """``df`` with ``output_col`` added: the model's output for each row, computed in the executors.

    The model is loaded once in each of Spark's Python workers and reused across batches and
    tasks; columns become tensors without a loop over rows; with GPUs in the task's resources
    the model runs on the task's GPU.

    Args:
        df: A Spark DataFrame (classic or Connect).
        model: A ``torch.nn.Module`` (or any function of tensors), or an MLflow model URI of a
            PyTorch model (``runs:/<run id>/model``, ``models:/name/1``).
        input_cols: The column (or columns, passed to the model in order) holding its inputs:
            numbers, arrays of numbers or ML vectors. Floating inputs take the model's dtype.
        output_col: The column to add. Its type follows the model's output: a scalar for one
            value per row, an array for ``(N, k)``, a struct for a dict or tuple of tensors.
        batch_size: Rows per forward pass.
        use_gpu: ``True``: the task's GPU (an error without one); ``False``: the CPU; ``None``:
            the task's GPU when it has one and torch sees CUDA.

    Returns:
        A DataFrame; nothing runs until an action (``write``, ``count``, ``collect``).

    Raises:
        ConfigError: A bad argument, a missing column, or an output that Spark cannot hold.
    """
    inputs = column_names(input_cols, "input_cols")
    check_columns(df, inputs, "input_cols")
    if not isinstance(output_col, str) or not output_col:
        raise ConfigError(f"output_col={output_col!r} must be a column name.")
    if output_col in df.columns:
        raise ConfigError(
            f"output_col={output_col!r} is already a column of the DataFrame; choose another name."
        )
    batch_size = positive("batch_size", batch_size)
    use_gpu = gpu_choice(use_gpu)
    loaded = load_model(model)
    spec = outputs.describe(*sample_output(loaded, df, inputs))
    key, payload = model_payload(loaded)
    scorer = Scorer(
        key, payload, inputs, (None,) * len(inputs), batch_size, use_gpu, "raw", (), spec
    )
    return with_scores(df, scorer, output_col)
