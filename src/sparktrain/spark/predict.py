""":func:`predict`: a Spark DataFrame scored by a PyTorch model, by the fastest path that applies.

Two paths, chosen per call and named in one line on stderr:

- **The files path**, when the input is files: a path, a ``sparktrain.data`` dataset or source,
  or a DataFrame that is a plain scan of Parquet files (:mod:`sparktrain.spark.scan`). Spark's
  Python workers read the row groups themselves and hand back the kept columns and the
  prediction (:mod:`sparktrain.spark.files_path`): the input never crosses from the JVM.
- **The UDF path** for every other DataFrame (a join, a UDF upstream, Spark Connect): an Arrow
  UDF over the input columns (:mod:`sparktrain.spark.inference`).

Both give the same rows and the same prediction column; docs/spark-ml.md, "Inference at scale".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.inference.models import load_model, model_payload
from sparktrain.inference.planning import ScoringArgs
from sparktrain.inference.rank import outputs
from sparktrain.spark.inference import (
    check_columns,
    column_names,
    gpu_choice,
    holds_udt,
    positive,
    sample_output,
    with_scores,
)
from sparktrain.spark.rank.scoring import Scorer

VIA = ("auto", "files", "udf")


def _say(line: str) -> None:
    print(f"sparktrain.spark.predict: {line}", file=sys.stderr, flush=True)


def _files_input(df: Any, via: str) -> tuple[Any, Any, str]:
    """``(source, scan or None, reason)``: the files to read, or ``None`` and why not."""
    from sparktrain.inference.planning import as_source
    from sparktrain.spark.scan import NotPlain, plain_scan

    if isinstance(df, (str, os.PathLike)) or _is_source(df) or _is_source(_attribute(df)):
        return as_source(df), None, "the input is files"
    if via == "udf":
        return None, None, "via='udf' was asked for"
    try:
        scan = plain_scan(df)
    except NotPlain as why:
        return None, None, f"the DataFrame is not a plain scan of Parquet files: {why}"
    return scan.source, scan, "the DataFrame is a plain scan of Parquet files"


def _attribute(df: Any) -> Any:
    """A streaming dataset's ``source`` (a DataFrame's ``.source`` would be a column)."""
    from sparktrain.data.dataset import StreamingDataset

    return df.source if isinstance(df, StreamingDataset) else None


def _is_source(value: Any) -> bool:
    from sparktrain.data.sources import Source

    return isinstance(value, Source)


def _active_spark() -> Any:
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        raise ConfigError(
            "predict on files needs a SparkSession to return a DataFrame: start one "
            "(SparkSession.builder.getOrCreate()), or write files with sparktrain.inference.score."
        )
    return spark


#: At most this many rows per Spark task of the files path: each task has a fixed cost in Spark
#: (1,000,000 rows in 20 tasks of 50,000 rows reached 0.77x of the no-Spark limit, in 4 tasks
#: 0.91x: ``benchmarks/inference.py --paths n,g``, one run each).
TASK_ROWS = 500_000


def _part_rows(spark: Any, rows: int) -> int:
    """Rows per part, one Spark task each: two per core of the cluster, at most ``TASK_ROWS``."""
    try:
        cores = int(spark.sparkContext.defaultParallelism)
    except Exception:  # Spark Connect has no SparkContext
        cores = int(spark.conf.get("spark.default.parallelism", "8") or 8)
    return max(1, min(TASK_ROWS, -(-rows // (2 * max(cores, 1)))))


def predict(
    df: Any,
    model: Any,
    *,
    input_cols: str | Sequence[str],
    output_col: str = "prediction",
    keep_cols: str | Sequence[str] | None = None,
    batch_size: int = 1024,
    use_gpu: bool | None = None,
    preprocess: Callable[[Any], Any] | None = None,
    batch_tokens: int | None = None,
    autocast: str | None = None,
    via: str = "auto",
) -> Any:
    """``df``'s rows (or ``keep_cols``) with ``output_col``: the model's output for each row.

    The model runs in Spark's Python workers, loaded once per worker; columns become tensors
    without a loop over rows; with GPUs in the task's resources the model runs on the task's
    GPU. Where ``df`` is files (a path, a ``sparktrain.data`` source, or a DataFrame that is a
    plain scan of Parquet files) the workers read the files themselves; otherwise the rows come
    through an Arrow UDF. One line on stderr says which path a call took and why.

    Args:
        df: A Spark DataFrame (classic or Connect), or Parquet files or a Delta table's folder
            (a path), or a ``sparktrain.data`` dataset or source.
        model: A ``torch.nn.Module`` (or any function of tensors), or an MLflow model URI of a
            PyTorch model (``runs:/<run id>/model``, ``models:/name/1``).
        input_cols: The column (or columns, passed to the model in order) holding its inputs:
            numbers, arrays of numbers or ML vectors. Floating inputs take the model's dtype.
        output_col: The column to add. Its type follows the model's output: a scalar for one
            value per row, an array for ``(N, k)``, a struct for a dict or tuple of tensors.
        keep_cols: The columns to return with the prediction (an id, say); ``None``: all of
            them, as ``df.withColumn`` would. Fewer columns return faster on the files path.
        batch_size: Rows per forward pass.
        use_gpu: ``True``: the task's GPU (an error without one); ``False``: the CPU; ``None``:
            the task's GPU when it has one and torch sees CUDA.
        preprocess: Files path only: a function of an Arrow table of ``input_cols`` returning
            the model's inputs (a tensor, a tuple, or a dict of keyword tensors), run in the
            workers (tokenising a text column, say).
        batch_tokens: With ``preprocess``: at most this many tokens per forward pass.
        autocast: ``"bf16"`` or ``"fp16"``: the forward pass in half precision (files path).
        via: ``"auto"``, or ``"files"`` (an error when the files path does not apply) or
            ``"udf"`` to choose the path.

    Returns:
        A DataFrame; nothing runs until an action (``write``, ``count``, ``collect``).

    Raises:
        ConfigError: A bad argument, a missing column, or an output that Spark cannot hold.
    """
    if via not in VIA:
        raise ConfigError(f"via={via!r} must be one of {list(VIA)}.")
    args = ScoringArgs(  # in the order of predict's signature
        input_cols=input_cols,
        output_col=output_col,
        keep_cols=keep_cols,
        batch_size=batch_size,
        use_gpu=use_gpu,
        preprocess=preprocess,
        batch_tokens=batch_tokens,
        autocast=autocast,
    )
    source, scan, reason = _files_input(df, via)
    if source is None:
        if via == "files":
            raise ConfigError(f"via='files', but {reason}; pass via='auto' to use the UDF path.")
        if preprocess is not None or autocast is not None or batch_tokens is not None:
            raise ConfigError(
                f"preprocess, autocast and batch_tokens need the files path, and {reason}; "
                "write the DataFrame to Parquet first, or compute the inputs in Spark."
            )
        _say(f"the UDF path (the rows come from Spark through Arrow): {reason}")
        return _udf_path(df, model, args)
    return _files_path(df, model, args, (source, scan, reason), via)


def _files_path(
    df: Any, model: Any, args: ScoringArgs, found: tuple[Any, Any, str], via: str
) -> Any:
    """The Spark workers read the files themselves (unless an ML vector is kept).

    Args:
        df: The input, as given.
        model: The model, as given.
        args: The arguments, as given.
        found: :func:`_files_input`'s answer: the source, the scan (or ``None``), and why.
        via: As given.

    Raises:
        ConfigError: ``output_col`` is a kept column, or a column is not in the input.
    """
    from sparktrain.inference.planning import make_plan
    from sparktrain.spark.files_path import scored_dataframe

    source, scan, reason = found
    columns = scan.columns if scan is not None else tuple(source.schema.names)
    keep = columns if args.keep_cols is None else column_names(args.keep_cols, "keep_cols")
    vectors = [
        k for k in keep if scan is not None and k in df.columns and holds_udt(df.schema[k].dataType)
    ]
    if vectors and via != "files":
        _say(
            f"the UDF path: the DataFrame is a plain scan, but it keeps {vectors[0]!r}, an ML "
            "vector (a user-defined type the files path does not rebuild); pass keep_cols "
            "without it for the files path"
        )
        return _udf_path(df, model, args)
    if args.output_col in keep:
        raise ConfigError(
            f"output_col={args.output_col!r} is already a column of the DataFrame; choose another "
            "name."
        )
    outside = [k for k in [*keep, *column_names(args.input_cols, "input_cols")] if k not in columns]
    if outside:
        raise ConfigError(f"columns {outside} not in the DataFrame; it has {list(columns)}.")
    spark = df.sparkSession if scan is not None else _active_spark()
    rows_per_part = _part_rows(spark, source.rows)
    plan = make_plan(
        source,
        model,
        replace(
            args, keep_cols=keep, rows_per_part=rows_per_part, use_gpu=gpu_choice(args.use_gpu)
        ),
        row_filter=scan.row_filter if scan is not None else None,
    )
    _say(
        f"the files path ({reason}): {len(plan.parts)} parts, {source.rows:,} rows of "
        f"{source.name}, read in the Python workers"
        + (f", rows where {plan.filter_text}" if plan.filter_text else "")
    )
    return scored_dataframe(spark, plan, df.schema if scan is not None else None)


def _udf_path(df: Any, model: Any, args: ScoringArgs) -> Any:
    """Today's Arrow UDF over the input columns."""
    inputs = column_names(args.input_cols, "input_cols")
    check_columns(df, inputs, "input_cols")
    output_col, keep_cols = args.output_col, args.keep_cols
    if not isinstance(output_col, str) or not output_col:
        raise ConfigError(f"output_col={output_col!r} must be a column name.")
    if output_col in df.columns:
        raise ConfigError(
            f"output_col={output_col!r} is already a column of the DataFrame; choose another name."
        )
    keep = None if keep_cols is None else column_names(keep_cols, "keep_cols")
    if keep is not None:
        check_columns(df, keep, "keep_cols")
    batch_size = positive("batch_size", args.batch_size)
    use_gpu = gpu_choice(args.use_gpu)
    loaded = load_model(model)
    spec = outputs.describe(*sample_output(loaded, df, inputs))
    key, payload = model_payload(loaded)
    scorer = Scorer(
        key, payload, inputs, (None,) * len(inputs), batch_size, use_gpu, "raw", (), spec
    )
    scored = with_scores(df, scorer, output_col)
    return scored if keep is None else scored.select(*keep, output_col)
