"""What a model returns, as a Spark type and as Arrow arrays, without a loop over the rows.

For a batch of N rows a model returns a tensor of shape ``(N, ...)``, or a dict, tuple or list
of such tensors. Its :data:`Spec` (the shape of one row and the dtype) decides the column:

- one value per row (shape ``(N,)`` or ``(N, 1)``): a scalar column (``float``, ``double``,
  ``int``, ``bigint``, ``boolean``);
- ``(N, k)``: ``array<...>``; ``(N, a, b)``: ``array<array<...>>``, and so on;
- a dict: ``struct<name: ...>`` in the dict's order; a tuple or list: ``struct<_0: ..., ...>``.

The Arrow arrays share the tensors' memory where the dtype allows: the values buffer is the
tensor's, and list offsets are computed, not built row by row. Half-precision outputs become
``float`` (Spark has no half type); small integers become ``int``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from sparktrain.ground.errors import ConfigError

#: torch dtype name -> (Spark SQL type, the dtype the values are cast to first, if any).
_TYPES: dict[str, tuple[str, str | None]] = {
    "float32": ("float", None),
    "float64": ("double", None),
    "float16": ("float", "float32"),
    "bfloat16": ("float", "float32"),
    "int64": ("bigint", None),
    "int32": ("int", None),
    "int16": ("int", "int32"),
    "int8": ("int", "int32"),
    "uint8": ("int", "int32"),
    "bool": ("boolean", None),
}


@dataclass(frozen=True)
class Leaf:
    """One tensor per batch: ``dtype`` (torch's name) and the shape of one row."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Struct:
    """Several tensors per batch, one field each, in order."""

    fields: tuple[tuple[str, Leaf | Struct], ...]


Spec: TypeAlias = Leaf | Struct


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _named(output: Any) -> list[tuple[str, Any]] | None:
    if isinstance(output, Mapping):
        return [(str(k), v) for k, v in output.items()]
    if isinstance(output, (tuple, list)):
        return [(f"_{i}", v) for i, v in enumerate(output)]
    return None


def describe(output: Any, rows: int) -> Spec:
    """The :data:`Spec` of ``output``, the model's result for a batch of ``rows`` rows.

    Raises:
        ConfigError: The output is not tensors, or not one result per input row.
    """
    named = _named(output)
    if named is not None:
        if not named:
            raise ConfigError("the model returned an empty dict/tuple; it must return tensors.")
        return Struct(tuple((name, describe(value, rows)) for name, value in named))
    if not hasattr(output, "shape") or not hasattr(output, "dtype"):
        raise ConfigError(
            f"the model returned a {type(output).__name__}; for predictions it must return a "
            "tensor, or a dict, tuple or list of tensors."
        )
    if output.dim() == 0 or output.shape[0] != rows:
        got = "a single value" if output.dim() == 0 else f"{output.shape[0]} rows"
        raise ConfigError(
            f"the model returned {got} for a batch of {rows} rows; it must return one result "
            "per input row (a tensor whose first dimension is the batch)."
        )
    name = _dtype_name(output)
    if name not in _TYPES:
        raise ConfigError(
            f"the model returned {name} values, which Spark cannot hold; return one of "
            f"{', '.join(_TYPES)}."
        )
    shape = tuple(int(d) for d in output.shape[1:])
    return Leaf(name, () if shape == (1,) else shape)


def spark_type(spec: Spec) -> Any:
    """The Spark SQL type (a ``pyspark.sql.types.DataType``) of a column holding ``spec``."""
    from pyspark.sql import types as T

    if isinstance(spec, Struct):
        return T.StructType([T.StructField(n, spark_type(s)) for n, s in spec.fields])
    simple = {
        "float": T.FloatType(),
        "double": T.DoubleType(),
        "int": T.IntegerType(),
        "bigint": T.LongType(),
        "boolean": T.BooleanType(),
    }
    kind: Any = simple[_TYPES[spec.dtype][0]]
    for _ in spec.shape:
        kind = T.ArrayType(kind, containsNull=False)
    return kind


_ARROW = {"float": "float32", "double": "float64", "int": "int32", "bigint": "int64"}


def arrow_type(spec: Spec) -> Any:
    """The Arrow type of ``spec``'s arrays."""
    pa = _pyarrow()
    if isinstance(spec, Struct):
        return pa.struct([pa.field(n, arrow_type(s)) for n, s in spec.fields])
    kind = _TYPES[spec.dtype][0]
    result = pa.bool_() if kind == "boolean" else getattr(pa, _ARROW[kind])()
    for _ in spec.shape:
        result = pa.list_(result)
    return result


def _pyarrow() -> Any:
    import pyarrow

    return pyarrow


def _leaf_array(tensor: Any, spec: Leaf) -> Any:
    pa = _pyarrow()
    if getattr(tensor, "ndim", 1) == 0:
        raise ConfigError(
            "the model returned a single value (a 0-dimensional tensor) for a batch; it must "
            "return one value per row, shape (N, ...) (a .squeeze() on a batch of one row "
            "does this: use .squeeze(-1))."
        )
    found = (_dtype_name(tensor), tuple(int(d) for d in tensor.shape[1:]))
    if found[0] != spec.dtype or found[1] not in (spec.shape, (1,) if spec.shape == () else None):
        raise ConfigError(
            f"the model returned {found[0]} values of shape {list(found[1])} per row, but "
            f"{spec.dtype} of shape {list(spec.shape)} in the first batch; a model must return "
            "the same shape and dtype for every batch."
        )
    cast = _TYPES[spec.dtype][1]
    if cast is not None:
        import torch

        tensor = tensor.to(getattr(torch, cast))
    values = np.ascontiguousarray(tensor.detach().cpu().numpy()).reshape(-1)
    array = pa.array(values)
    rows = int(tensor.shape[0])
    for depth in range(len(spec.shape) - 1, -1, -1):  # innermost dimension first
        count = rows * int(np.prod(spec.shape[:depth], dtype=np.int64))
        width = spec.shape[depth]
        if count * width >= 2**31:
            raise ConfigError(
                f"one Arrow batch of predictions holds {count * width} values; lower the rows "
                "per batch so that it holds fewer than 2**31 (batch_size on the files path; "
                "spark.sql.execution.arrow.maxRecordsPerBatch on the UDF path)."
            )
        offsets = pa.array(np.arange(0, count * width + 1, width, dtype=np.int32))
        array = pa.ListArray.from_arrays(offsets, array)
    return array


def to_arrow(output: Any, spec: Spec) -> Any:
    """``output`` (the model's result for one batch) as an Arrow array of type ``spec``."""
    if isinstance(spec, Struct):
        named = _named(output)
        names = [n for n, _ in spec.fields]
        if named is None or [n for n, _ in named] != names:
            raise ConfigError(
                f"the model returned {type(output).__name__} where the first batch gave the "
                f"fields {names}; a model must return the same structure for every batch."
            )
        pa = _pyarrow()
        arrays = [to_arrow(v, s) for (_, v), (_, s) in zip(named, spec.fields, strict=True)]
        return pa.StructArray.from_arrays(arrays, names=names)
    return _leaf_array(output, spec)
