"""A scoring's plan, made on the driver: the input as a source, every argument checked.

The model runs once here, on the first rows: its output's type, and any error, are found before
anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparktrain.data.sources import Source
from sparktrain.ground.errors import ConfigError
from sparktrain.inference.models import load_model, model_identity, model_payload, run_sample
from sparktrain.inference.rank import outputs
from sparktrain.inference.rank.batches import AUTOCAST
from sparktrain.inference.rank.parts import PART_ROWS, ScoringPlan, check_columns, plan_parts

#: Row groups read, at most, to find rows that pass a filter for the driver's sample.
SAMPLE_UNITS = 16


def as_source(data: Any, storage_options: Mapping[str, Any] | None = None) -> Source:
    """The :class:`~sparktrain.data.sources.Source` of a path, a Source or a streaming dataset.

    A folder with a ``_delta_log`` is a Delta table; another path is Parquet.
    """
    from sparktrain.data import sources

    if isinstance(data, Source):
        return data
    found = getattr(data, "source", None)
    if isinstance(found, Source):
        return found
    if isinstance(data, (str, os.PathLike)):
        text = os.fspath(data)
        fs, inner = sources.filesystem_of(text, storage_options)
        import pyarrow.fs as pafs

        if fs.get_file_info(f"{inner.rstrip('/')}/_delta_log").type == pafs.FileType.Directory:
            return sources.delta_source(text, storage_options=storage_options)
        return sources.parquet_source(text, storage_options=storage_options)
    raise ConfigError(
        f"cannot score {type(data).__name__}: pass a path (Parquet files or a Delta table), a "
        "sparktrain.data dataset or source, or (to sparktrain.spark.predict) a Spark DataFrame."
    )


def _names(value: object, what: str, *, empty: bool = False) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if names is None and empty:
        return ()
    if (
        not isinstance(names, Sequence)
        or (not names and not empty)
        or not all(isinstance(n, str) and n for n in names)
    ):
        raise ConfigError(f"{what}={value!r} must be a column name or a list of column names.")
    return tuple(names)


def positive(name: str, value: object, *, optional: bool = False) -> Any:
    """``value``, a positive whole number (or ``None`` when optional), else a ConfigError."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive whole number.")
    return value


def _sample_rows(
    source: Source, inputs: tuple[str, ...], row_filter: tuple[Any, str, tuple[str, ...]] | None
) -> Any:
    """Up to 2 of the first rows that pass the filter, as an Arrow table of ``inputs``.

    The first rows when none of the first :data:`SAMPLE_UNITS` row groups has one.
    """
    from sparktrain.data.reader import read_unit

    if row_filter is None:
        return next(read_unit(source, source.units[0], inputs, chunk=2))
    expression, _, columns = row_filter
    read = tuple(dict.fromkeys([*inputs, *columns]))
    for unit in source.units[:SAMPLE_UNITS]:
        for table in read_unit(source, unit, read, chunk=4096):
            kept = table.filter(expression)
            if kept.num_rows:
                return kept.slice(0, 2).select(list(inputs))
    return next(read_unit(source, source.units[0], inputs, chunk=2))


@dataclass(frozen=True, kw_only=True)
class ScoringArgs:
    """The arguments of ``score`` and ``predict`` that shape a plan, as the caller gave them.

    :func:`make_plan` checks them; the meaning of each is in
    :func:`sparktrain.inference.score`'s docstring.
    """

    input_cols: str | Sequence[str]
    keep_cols: str | Sequence[str] | None = None
    output_col: str = "prediction"
    preprocess: Callable[[Any], Any] | None = None
    batch_size: int = 1024
    batch_tokens: int | None = None
    rows_per_part: int | None = None
    use_gpu: bool | None = None
    autocast: str | None = None


def make_plan(
    source: Source,
    model: Any,
    args: ScoringArgs,
    *,
    row_filter: tuple[Any, str, tuple[str, ...]] | None = None,
) -> ScoringPlan:
    """Check every argument and make the plan (the model runs once, here, on the first rows).

    Raises:
        ConfigError: A bad argument, a missing column, or a model or ``preprocess`` that fails
            on the first rows.
    """
    inputs, keep, batch_size, batch_tokens, rows_per_part = _checked(source, args)
    loaded = load_model(model)
    first = _sample_rows(source, inputs, row_filter)
    sample = run_sample(loaded, first, inputs, preprocess=args.preprocess, autocast=args.autocast)
    spec = outputs.describe(sample, first.num_rows)
    key, payload = model_payload(loaded)
    hook = model_payload(args.preprocess)[1] if args.preprocess is not None else None
    expression, text, columns = row_filter or (None, "", ())
    return ScoringPlan(
        source=source,
        parts=plan_parts(source, rows_per_part),
        inputs=inputs,
        keep=keep,
        output_col=args.output_col,
        spec=spec,
        model_key=key,
        model_id=model_identity(loaded, payload),
        model=payload,
        preprocess=hook,
        batch_size=batch_size,
        batch_tokens=batch_tokens,
        use_gpu=args.use_gpu,
        autocast=args.autocast,
        row_filter=expression,
        filter_text=text,
        filter_columns=tuple(columns),
    )


def _checked(
    source: Source, args: ScoringArgs
) -> tuple[tuple[str, ...], tuple[str, ...], int, int | None, int]:
    """``args`` checked: the columns named, and the numbers positive.

    Returns:
        The input and kept columns, ``batch_size``, ``batch_tokens`` and ``rows_per_part`` (its
        default filled in).

    Raises:
        ConfigError: A bad argument, named with what to pass.
    """
    inputs = _names(args.input_cols, "input_cols")
    keep = _names(args.keep_cols, "keep_cols", empty=True)
    check_columns(source, inputs, "input_cols")
    check_columns(source, keep, "keep_cols")
    output_col, autocast, use_gpu = args.output_col, args.autocast, args.use_gpu
    if not isinstance(output_col, str) or not output_col or output_col in keep:
        raise ConfigError(
            f"output_col={output_col!r} must be a column name other than the kept columns {keep}."
        )
    if autocast not in (None, *AUTOCAST):
        raise ConfigError(f"autocast={autocast!r} must be None, 'bf16' or 'fp16'.")
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise ConfigError(f"use_gpu={use_gpu!r} must be True, False or None (the rank's GPU).")
    if args.preprocess is not None and not callable(args.preprocess):
        raise ConfigError(f"preprocess={args.preprocess!r} must be a function of an Arrow table.")
    return (
        inputs,
        keep,
        positive("batch_size", args.batch_size),
        positive("batch_tokens", args.batch_tokens, optional=True),
        positive("rows_per_part", args.rows_per_part or PART_ROWS),
    )
