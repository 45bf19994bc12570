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
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.inference.models import run_sample
from sparktrain.inference.rank import outputs
from sparktrain.spark.rank.scoring import Scorer, score

#: Use Arrow UDFs where pyspark has them (tests turn it off to run the mapInArrow path).
ARROW_UDF = True


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
    table = _first_rows(df.select(*inputs), rows)
    if table.num_rows == 0:
        raise ConfigError(
            "the DataFrame is empty, so the model's output type cannot be found from its rows; "
            "predict on a DataFrame with rows."
        )
    return run_sample(model, table, tuple(inputs)), table.num_rows


#: Spark 4.3 feeds Arrow UDFs columnar batches when this is on (the default), and then fails
#: on any user-defined type in the rows (``UNSUPPORTED_DATATYPE ... UDT``): an ML vector column
#: read from Parquet breaks every pandas or Arrow UDF over that DataFrame.
COLUMNAR_INPUT = "spark.sql.execution.arrow.pythonUDF.columnarInput.enabled"


def holds_udt(kind: Any) -> bool:
    """Whether the Spark type ``kind`` is, or holds, a user-defined type (an ML vector)."""
    from pyspark.sql import types as T

    if isinstance(kind, T.UserDefinedType):
        return True
    if isinstance(kind, T.StructType):
        return any(holds_udt(f.dataType) for f in kind.fields)
    if isinstance(kind, T.ArrayType):
        return holds_udt(kind.elementType)
    if isinstance(kind, T.MapType):
        return holds_udt(kind.keyType) or holds_udt(kind.valueType)
    return False


def arrow_udf_usable(df: Any) -> bool:
    """Whether an Arrow UDF can score ``df`` (pyspark 4.1+, and no UDT that Spark trips on)."""
    from pyspark.sql import functions as F

    if not ARROW_UDF or not hasattr(F, "arrow_udf"):
        return False
    if not holds_udt(df.schema):
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
