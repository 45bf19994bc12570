"""One part scored where the model runs: its row groups read from the files, never from Spark.

This module runs in a rank of a launch or in one of Spark's Python workers. A part's row groups are
read with the data layer's reader (``read_unit``: only the columns needed, a chunk of rows at a
time), filtered, turned into the model's inputs (Arrow columns to tensors, or the user's
``preprocess``), run through the model (:mod:`sparktrain.inference.rank.batches`), and handed back
as Arrow record batches holding the kept columns and the prediction. Memory holds one chunk being
read and one being scored, whatever the size of the files.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from sparktrain.data.reader import read_unit
from sparktrain.ground.errors import ConfigError
from sparktrain.inference.rank import outputs
from sparktrain.inference.rank.batches import (
    Call,
    Where,
    add_note,
    float_dtype,
    input_tensors,
    loaded_model,
    prefetched,
    run_model,
)
from sparktrain.inference.rank.parts import PART_ROWS, Part, ScoringPlan

_ROW = "__sparktrain_row"


def device_for_rank(use_gpu: bool | None) -> Any:
    """A launched rank's device: its GPU (``cuda:LOCAL_RANK``) where it has one, else the CPU.

    Raises:
        ConfigError: ``use_gpu=True`` where torch sees no CUDA device.
    """
    import torch

    from sparktrain.contract.env import contract_int

    if use_gpu is False or not torch.cuda.is_available():
        if use_gpu:
            raise ConfigError(
                "use_gpu=True, but torch in this rank sees no CUDA device; install a CUDA build "
                "of torch, or pass use_gpu=False."
            )
        return torch.device("cpu")
    return torch.device("cuda", contract_int("LOCAL_RANK", 0) % torch.cuda.device_count())


def as_call(value: Any, where: str) -> Call:
    """What ``preprocess`` returned, as a forward pass's inputs."""
    import torch

    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict) and value:
        return (), dict(value)
    if isinstance(value, (tuple, list)) and value:
        return tuple(value), {}
    raise ConfigError(
        f"preprocess returned {type(value).__name__} for {where}; it must return a tensor, a "
        "tuple of tensors (the model's positional inputs) or a dict (its keyword inputs)."
    )


def _rows_per_call(call: Call, plan: ScoringPlan) -> int:
    """Rows per forward pass: ``batch_size``, or what fits ``batch_tokens`` at this length."""
    if plan.batch_tokens is None:
        return plan.batch_size
    lengths = [int(t.shape[1]) for t in [*call[0], *call[1].values()] if getattr(t, "ndim", 0) > 1]
    return max(1, plan.batch_tokens // max(lengths, default=1))


def as_float32(value: Any) -> Any:
    """Floating outputs as float32 (an autocast forward pass returns bf16 or fp16)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: as_float32(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(as_float32(v) for v in value)
    return value


def _filtered(table: Any, plan: ScoringPlan) -> tuple[Any, Any]:
    """The rows of ``table`` that pass the plan's filter, and their positions in ``table``."""
    if plan.row_filter is None:
        return table, None
    import pyarrow as pa

    numbered = table.append_column(_ROW, pa.array(np.arange(table.num_rows, dtype=np.int64)))
    kept = numbered.filter(plan.row_filter)
    return kept.drop_columns([_ROW]), np.asarray(kept.column(_ROW))


def _may_match(plan: ScoringPlan, file: str) -> set[int] | None:
    """The row groups of ``file`` whose statistics do not rule out the filter (``None``: all)."""
    if plan.row_filter is None or plan.source.format.name != "Parquet":
        return None
    import pyarrow.dataset as ds

    try:
        fragment = ds.ParquetFileFormat().make_fragment(file, filesystem=plan.source.filesystem)
        kept = fragment.split_by_row_group(plan.row_filter, schema=fragment.physical_schema)
        return {f.row_groups[0].id for f in kept}
    except Exception:  # a filter on a partition column, say: read every group
        return None


def _read(plan: ScoringPlan, unit: Any) -> Iterator[Any]:
    """A unit's chunks as Arrow tables; a read that fails is named by file and row group."""
    tables = read_unit(plan.source, unit, plan.read_columns, chunk=plan.batch_size)
    while True:
        try:
            table = next(tables)
        except StopIteration:
            return
        except (OSError, _arrow_error()) as exc:
            raise ConfigError(
                f"{unit.file}: row group {unit.row_group} could not be read: {exc}"
            ) from exc
        yield table


def _chunks(plan: ScoringPlan, part: Part, dtype: Any, hook: Any) -> Iterator[tuple[Any, ...]]:
    """The part's rows, a chunk at a time: (kept table, the model's call, where, rows)."""
    widths: list[int | None] = [None] * len(plan.inputs)
    matching: dict[str, set[int] | None] = {}
    for unit_index, start in zip(part.units, part.starts, strict=True):
        unit = plan.source.units[unit_index]
        if unit.file not in matching:
            matching[unit.file] = _may_match(plan, unit.file)
        groups = matching[unit.file]
        if groups is not None and unit.row_group not in groups:
            continue  # Parquet's statistics say no row of this group passes the filter
        offset = start
        for table in _read(plan, unit):
            read = table.num_rows
            rows, index = _filtered(table, plan)
            where = Where(None, offset, file=unit.file, index=index)
            if rows.num_rows:
                if hook is not None:
                    label = f"rows {offset} to {offset + read - 1} of {unit.file}"
                    try:
                        call = as_call(hook(rows.select(list(plan.inputs))), label)
                    except ConfigError:
                        raise
                    except Exception as exc:
                        add_note(exc, f"sparktrain: in preprocess, on {label}")
                        raise
                else:
                    columns = [rows.column(n).combine_chunks() for n in plan.inputs]
                    call = tuple(input_tensors(columns, plan.inputs, widths, where, dtype)), {}
                yield rows.select(list(plan.keep)), call, where, rows.num_rows
            offset += read


def _arrow_error() -> type[Exception]:
    import pyarrow as pa

    return pa.ArrowException  # type: ignore[no-any-return]


def score_part(plan: ScoringPlan, part: Part, device: Any) -> Iterator[Any]:
    """The part's output as Arrow record batches of :meth:`ScoringPlan.output_schema`."""
    import cloudpickle
    import pyarrow as pa
    import torch

    model = loaded_model(plan.model_key, plan.model, device)
    hook = cloudpickle.loads(plan.preprocess) if plan.preprocess else None
    schema = plan.output_schema()
    with torch.inference_mode():
        for kept, call, where, rows in prefetched(_chunks(plan, part, float_dtype(model), hook)):
            per_call = _rows_per_call(call, plan)
            try:
                output = run_model(model, call, per_call, device, plan.autocast)
            except Exception as exc:
                add_note(exc, f"sparktrain: in the model's forward pass, from {where.row(0)}")
                raise
            if plan.autocast:
                output = as_float32(output)
            predicted = outputs.to_arrow(output, plan.spec)
            if len(predicted) != rows:
                raise ConfigError(
                    f"the model returned {len(predicted)} rows for {rows} input rows "
                    f"(from {where.row(0)}); it must return one output per input row."
                )
            arrays = [kept.column(n).combine_chunks() for n in plan.keep]
            yield pa.RecordBatch.from_arrays([*arrays, predicted], schema=schema)


def coalesced(batches: Iterator[Any], rows: int, max_bytes: int = 64 << 20) -> Iterator[Any]:
    """``batches`` joined into record batches of ``rows`` rows or ``max_bytes``, the first reached.

    The last may be smaller. A consumer pays per batch: the JVM reading Arrow, a Parquet row
    group.
    """
    import pyarrow as pa

    held: list[Any] = []
    count = size = 0
    for batch in batches:
        held.append(batch)
        count += batch.num_rows
        size += batch.nbytes
        if count >= rows or size >= max_bytes:
            yield from pa.Table.from_batches(held).combine_chunks().to_batches()
            held, count, size = [], 0, 0
    if held:
        yield from pa.Table.from_batches(held).combine_chunks().to_batches()


def score_rank(
    plan: ScoringPlan, output: str, todo: tuple[int, ...], options: Any
) -> tuple[int, int, float]:
    """A rank's work: its share of the parts not yet written.

    Parts written by an earlier attempt (``max_restarts``) are skipped here too.

    Returns:
        Rows written, the rank's peak RSS in bytes, and the seconds from before its first read
        to after its last write (this rank's own clock: ranks on other hosts need not agree).
    """
    import time

    from sparktrain.contract.env import contract_int
    from sparktrain.inference.rank import files
    from sparktrain.rank.reporting import report

    rank, world = contract_int("RANK", 0), contract_int("WORLD_SIZE", 1)
    done = files.done_parts(output, options)
    mine = [i for i in todo[rank::world] if i not in done]
    device = device_for_rank(plan.use_gpu)
    started = time.monotonic()
    rows = 0
    for step, index in enumerate(mine, start=1):
        part = plan.parts[index]
        batches = coalesced(score_part(plan, part, device), PART_ROWS)  # a row group a part
        rows += files.write_part(output, index, plan.output_schema(), batches, options)
        report(step=step, total=len(mine), rows=rows)
    return rows, peak_rss(), time.monotonic() - started


def peak_rss() -> int:
    """This process's peak resident memory, in bytes (``ru_maxrss``)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
