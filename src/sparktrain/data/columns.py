"""Arrow columns to torch tensors, without a Python loop over the rows.

* Integer, floating and boolean columns become 1-D tensors (decimals become float64).
* Lists of numbers (``array<...>``, fixed-size lists) become 2-D tensors when every row of the
  chunk has the same length, and a list of 1-D tensors otherwise.
* Spark ML vectors (dense or sparse) become dense 2-D float64 tensors (scattered with numpy).
* Dates, timestamps, durations and times of day become 1-D int64 tensors: dates in days since
  1970-01-01, timestamps in nanoseconds since 1970-01-01 UTC (a time zone only says how they
  were shown), durations and times of day in nanoseconds.
* Binary and string columns become Python lists, for a ``transform=`` to decode or tokenise.

Anything else (maps, structs, ...) is refused by :func:`check_schema` before training starts,
naming the column. A null is an error naming the column and the row (file and position).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from sparktrain.ground.errors import ConfigError

_VECTOR_FIELDS = {"type", "size", "indices", "values"}


def pyarrow() -> Any:
    """The ``pyarrow`` module, or a :class:`ConfigError` with the install hint."""
    try:
        import pyarrow as pa
    except ImportError as exc:
        raise ConfigError(
            "streaming data needs pyarrow: pip install 'sparktrain[data]' (or [spark])"
        ) from exc
    return pa


def is_ml_vector(kind: Any) -> bool:
    """Whether an Arrow type is how Spark stores an ML ``Vector`` (a 4-field struct)."""
    pa = pyarrow()
    if not pa.types.is_struct(kind):
        return False
    return {kind.field(i).name for i in range(kind.num_fields)} == _VECTOR_FIELDS


def _is_number(kind: Any) -> bool:
    pa = pyarrow()
    types = pa.types
    return bool(
        types.is_integer(kind)
        or types.is_floating(kind)
        or types.is_boolean(kind)
        or types.is_decimal(kind)
    )


def _is_list(kind: Any) -> bool:
    pa = pyarrow()
    return bool(
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    )


def _is_text(kind: Any) -> bool:
    pa = pyarrow()
    return bool(
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
    )


def _is_time(kind: Any) -> bool:
    types = pyarrow().types
    return bool(
        types.is_date(kind) or types.is_timestamp(kind) or types.is_duration(kind)
        or types.is_time(kind)
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def kind_of(kind: Any) -> str | None:
    """``number``, ``time``, ``list``, ``vector`` or ``text`` for a supported type, or ``None``.

    Cached by type: it is asked for every column of every decoded chunk.
    """
    if _is_number(kind):
        return "number"
    if _is_time(kind):
        return "time"
    if _is_list(kind) and _is_number(kind.value_type):
        return "list"
    if is_ml_vector(kind):
        return "vector"
    if _is_text(kind):
        return "text"
    return None


def check_schema(schema: Any, columns: Sequence[str] | None, *, transform: bool) -> list[str]:
    """The columns to read, checked against ``schema``; a :class:`ConfigError` names a bad one."""
    names = list(schema.names)
    chosen = list(columns) if columns is not None else names
    missing = [c for c in chosen if c not in names]
    if missing:
        raise ConfigError(f"columns {missing} are not in the data; it has {names}.")
    for name in chosen:
        kind = schema.field(name).type
        found = kind_of(kind)
        if found is None:
            raise ConfigError(
                f"column {name!r} of type {kind} cannot become a tensor; leave it out with "
                "columns=[...], or encode it as numbers, arrays, ML vectors, strings or binary."
            )
        if found == "text" and not transform:
            raise ConfigError(
                f"column {name!r} holds {kind} values; pass transform= to turn them into tensors "
                "(decode images, tokenise text) or leave the column out with columns=[...]."
            )
    if not chosen:
        raise ConfigError("no columns to read: columns=[] selects nothing.")
    return chosen


def row_bytes(schema: Any, columns: Sequence[str]) -> int | None:
    """Bytes one row of ``columns`` takes as tensors, when every column has a fixed width."""
    pa = pyarrow()
    total = 0
    for name in columns:
        kind = schema.field(name).type
        width = 1
        if pa.types.is_fixed_size_list(kind):
            kind, width = kind.value_type, kind.list_size
        if kind_of(kind) not in ("number", "time"):
            return None
        total += width * (
            8
            if pa.types.is_decimal(kind) or kind_of(kind) == "time"
            else max(1, kind.bit_width // 8)
        )
    return total


def _numpy(array: Any) -> Any:
    """``array`` as numpy: a view when Arrow allows one, else a copy (booleans)."""
    try:
        return array.to_numpy(zero_copy_only=True)
    except pyarrow().ArrowInvalid:
        return array.to_numpy(zero_copy_only=False)


_quiet = False  # torch warns about a read-only array once per process: that once is ours


def _tensor(values: Any) -> Any:
    import torch

    global _quiet  # noqa: PLW0603 - a per-process fact
    if _quiet or values.flags.writeable:
        return torch.from_numpy(values)
    with warnings.catch_warnings():  # Arrow's buffers are owned here and never shared
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(values)
    _quiet = True
    return tensor


def _list_tensor(array: Any) -> Any:
    import torch

    pa = pyarrow()
    if pa.types.is_fixed_size_list(array.type):  # no nulls (checked): values, sliced, suffice
        width = array.type.list_size
        values = array.values.slice(array.offset * width, len(array) * width)
        return _tensor(_numpy(values)).reshape(len(array), width)
    lengths = np.diff(_numpy(array.offsets))  # value_lengths would import pyarrow.compute
    flat = _tensor(_numpy(array.flatten()))
    if len(lengths) and (lengths == lengths[0]).all():
        return flat.reshape(len(array), int(lengths[0]))
    if len(lengths) == 0:
        return flat.reshape(0, 0)
    return list(torch.split(flat, lengths.tolist()))


def _vector_tensor(array: Any) -> Any:
    """Dense float64 rows from Spark's vector struct (type 0 sparse, 1 dense)."""
    import torch

    rows = len(array)
    fields = {array.type.field(i).name: child for i, child in enumerate(array.flatten())}
    sparse = _numpy(fields["type"].fill_null(1)) == 0
    sizes = _numpy(fields["size"].fill_null(0))
    values = fields["values"]
    lengths = _numpy(values.value_lengths().fill_null(0)).astype(np.int64)
    width = int(max(sizes[sparse].max(initial=0), lengths[~sparse].max(initial=0)))
    out = np.zeros((rows, width), dtype=np.float64)
    flat = _numpy(values.flatten()).astype(np.float64, copy=False)
    row_of = np.repeat(np.arange(rows), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = np.arange(len(flat)) - starts
    if sparse.any():
        sparse_values = np.repeat(sparse, lengths)
        cols[sparse_values] = _numpy(fields["indices"].flatten())
    out[row_of, cols] = flat
    return torch.from_numpy(out)


def _as_int64(array: Any) -> Any:
    """A date, timestamp, duration or time array as int64 in the module doc's units."""
    pa = pyarrow()
    kind = array.type
    if pa.types.is_date(kind):
        days = array.cast(pa.date32())
        return days.view(pa.int32()).cast(pa.int64())
    if pa.types.is_timestamp(kind):
        nanos = array.cast(pa.timestamp("ns", tz=kind.tz))
    elif pa.types.is_duration(kind):
        nanos = array.cast(pa.duration("ns"))
    else:
        nanos = array.cast(pa.time64("ns"))
    return nanos.view(pa.int64())


def first_null(array: Any) -> int:
    """The position of ``array``'s first null (``-1`` when it has none)."""
    if array.null_count == 0:
        return -1
    return int(np.flatnonzero(_numpy(array.is_null()))[0])


def column_tensor(array: Any) -> Any:
    """One Arrow array without nulls as a tensor, or a list (ragged lists, text; module doc)."""
    kind = kind_of(array.type)
    if kind == "time":
        return _tensor(_numpy(_as_int64(array)))
    if kind == "number":
        if pyarrow().types.is_decimal(array.type):  # Spark's decimals: float64
            array = array.cast(pyarrow().float64())
        return _tensor(_numpy(array))
    if kind == "list":
        return _list_tensor(array)
    if kind == "vector":
        return _vector_tensor(array)
    return array.to_pylist()


def to_tensors(table: Any, *, where: str = "", offset: int = 0) -> dict[str, Any]:
    """Each column of ``table`` as a tensor (or a list, see the module doc), by name.

    Args:
        table: An Arrow table of supported columns (see :func:`check_schema`).
        where: Where the rows come from (a file), for the null error.
        offset: The position of ``table``'s first row in ``where``.
    """
    out: dict[str, Any] = {}
    for name in table.column_names:
        column = table[name]
        array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        null = first_null(array)
        if null >= 0:
            raise ConfigError(
                f"column {name!r} is null at row {offset + null} of {where or 'the data'}; "
                "fill or filter the nulls before training (for example df.na.drop())."
            )
        out[name] = column_tensor(array)
    return out
