"""Is a DataFrame a plain scan of Parquet files? If so, which files, columns and filter.

``predict`` reads such a DataFrame's files in the Python workers instead of taking its rows
from the JVM. A plain scan is what Spark's optimised plan shows as a file relation of Parquet
files under, at most, a projection that keeps columns as they are and a filter that
:func:`arrow_filter` can evaluate on the rows as pyarrow reads them (comparisons of a column
with a literal number, string or boolean; ``IN``; ``IS [NOT] NULL``; ``AND``, ``OR``, ``NOT``).
Anything else (a join, a UDF, a computed column, a cast in a filter, another format, Spark
Connect, whose client does not see the plan) is named in the reason, and ``predict`` takes the
UDF path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparktrain.data.sources import Source
from sparktrain.ground.errors import ConfigError

_COMPARE = {
    "EqualTo": "__eq__",
    "LessThan": "__lt__",
    "LessThanOrEqual": "__le__",
    "GreaterThan": "__gt__",
    "GreaterThanOrEqual": "__ge__",
}
_LITERALS = ("integer", "long", "short", "byte", "float", "double", "boolean", "string")


class NotPlain(Exception):
    """The DataFrame is not a plain scan; the message says why (for the path's line)."""


@dataclass(frozen=True)
class Scan:
    """A plain scan: its Parquet files as a source, its columns, and its filter.

    Attributes:
        source: The files, as a ``sparktrain.data`` source.
        columns: The DataFrame's columns, in order.
        row_filter: ``(pyarrow expression, Spark's text of it, the columns it reads)``, or
            ``None``.
    """

    source: Source
    columns: tuple[str, ...]
    row_filter: tuple[Any, str, tuple[str, ...]] | None


def _kind(node: Any) -> str:
    return str(node.getClass().getSimpleName())


def _seq(seq: Any) -> list[Any]:
    return [seq.apply(i) for i in range(seq.size())]


def _value(literal: Any) -> Any:
    kind = str(literal.dataType().typeName())
    if kind not in _LITERALS:
        raise NotPlain(f"the filter compares with a {kind} literal")
    value = literal.value()
    if value is None:
        raise NotPlain("the filter compares with a null literal")
    return str(value.toString()) if kind == "string" else value


def _not_floating(attribute: Any) -> None:
    """Refuse a comparison on a float or double column (NaN: Spark's order is not IEEE's).

    Spark orders NaN above every number and has NaN = NaN; pyarrow compares as IEEE does.
    """
    kind = str(attribute.dataType().typeName())
    if kind in ("float", "double"):
        raise NotPlain(
            f"the filter compares the {kind} column {attribute.name()!r}, where Spark and "
            "pyarrow treat NaN differently"
        )


def arrow_filter(condition: Any, columns: set[str]) -> Any:
    """Spark's filter ``condition`` as a ``pyarrow.compute.Expression`` (adds to ``columns``).

    Raises:
        NotPlain: A part of the condition that pyarrow cannot evaluate as Spark would.
    """
    import pyarrow.compute as pc

    kind = _kind(condition)
    parts = _seq(condition.children())
    if kind in ("And", "Or"):
        left, right = (arrow_filter(p, columns) for p in parts)
        return left & right if kind == "And" else left | right
    if kind == "Not":
        return ~arrow_filter(parts[0], columns)
    if kind in ("IsNull", "IsNotNull") and _kind(parts[0]) == "AttributeReference":
        name = str(parts[0].name())
        columns.add(name)
        field = pc.field(name)
        return field.is_null() if kind == "IsNull" else field.is_valid()
    if kind in _COMPARE and len(parts) == 2:
        kinds = [_kind(p) for p in parts]
        if kinds == ["AttributeReference", "Literal"]:
            name, value, method = str(parts[0].name()), _value(parts[1]), _COMPARE[kind]
        elif kinds == ["Literal", "AttributeReference"]:
            flipped = {"__lt__": "__gt__", "__le__": "__ge__", "__gt__": "__lt__"}
            method = {**flipped, "__ge__": "__le__"}.get(_COMPARE[kind], _COMPARE[kind])
            name, value = str(parts[1].name()), _value(parts[0])
        else:
            raise NotPlain(f"the filter has {condition.sql()}, not a column against a literal")
        _not_floating(parts[0] if kinds[0] == "AttributeReference" else parts[1])
        columns.add(name)
        return getattr(pc.field(name), method)(value)
    if kind == "In" and parts and _kind(parts[0]) == "AttributeReference":
        if any(_kind(p) != "Literal" for p in parts[1:]):
            raise NotPlain(f"the filter has {condition.sql()}, not a list of literals")
        _not_floating(parts[0])
        name = str(parts[0].name())
        columns.add(name)
        import pyarrow as pa

        field = pc.field(name)  # null IN (...) is null, as in Spark (so NOT keeps it out too)
        found = field.isin([_value(p) for p in parts[1:]])
        return pc.if_else(field.is_valid(), found, pa.scalar(None, pa.bool_()))
    raise NotPlain(f"the filter has {condition.sql()}, which is evaluated by Spark only")


def _uri(path: str) -> str:
    """Hadoop's ``file:/a/b`` as ``file:///a/b``, which pyarrow reads as a local path."""
    if path.startswith("file:/") and not path.startswith("file://"):
        return "file://" + path[len("file:") :]
    return path


def _source(relation: Any) -> Source:
    from sparktrain.data import sources

    fmt = _kind(relation.fileFormat())
    if fmt != "ParquetFileFormat":
        name = fmt.removesuffix("FileFormat") or fmt
        raise NotPlain(f"it reads {name} files, and the files path reads Parquet only")
    files = [str(f) for f in relation.location().inputFiles()]
    if not files:
        raise NotPlain("it reads no files")
    roots = [_uri(str(p.toString())) for p in _seq(relation.location().rootPaths())]
    fs, _ = sources.filesystem_of(files[0])
    inner = [sources.filesystem_of(f)[1] for f in files]
    base = sources.filesystem_of(roots[0])[1] if len(roots) == 1 else ""
    partitions, schema = sources.hive_partitions(inner, base=base) if base else (None, None)
    label = roots[0] if len(roots) == 1 else f"{len(files)} Parquet files"
    try:
        return sources.from_files(label, fs, inner, partitions, schema)
    except ConfigError as why:  # files of different schemas, say: Spark reads them, we do not
        raise NotPlain(str(why)) from None


def plain_scan(df: Any) -> Scan:
    """``df`` as a :class:`Scan`.

    Raises:
        NotPlain: ``df`` is not a plain scan of Parquet files; the message says what it is.
    """
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        raise NotPlain("a Spark Connect client does not see the DataFrame's plan")
    node = jdf.queryExecution().optimizedPlan()
    condition = None
    while True:
        kind = _kind(node)
        if kind == "Project":
            computed = [
                e.sql() for e in _seq(node.projectList()) if _kind(e) != "AttributeReference"
            ]
            if computed:
                raise NotPlain(f"it computes {computed[0]}")
            node = node.child()
        elif kind == "Filter" and condition is None:
            condition = node.condition()
            node = node.child()
        elif kind == "LogicalRelation":
            if _kind(node.relation()) != "HadoopFsRelation":
                raise NotPlain(f"it reads {_kind(node.relation())}, not files")
            break
        else:
            raise NotPlain(f"its plan has a {kind} step")
    source = _source(node.relation())
    row_filter = None
    if condition is not None:
        columns: set[str] = set()
        expression = arrow_filter(condition, columns)
        row_filter = (expression, str(condition.sql()), tuple(sorted(columns)))
    missing = [c for c in df.columns if c not in source.schema.names]
    if row_filter is not None:
        missing += [c for c in row_filter[2] if c not in source.schema.names]
    if missing:
        raise NotPlain(f"its columns {sorted(set(missing))} are not in the files")
    return Scan(source, tuple(df.columns), row_filter)
