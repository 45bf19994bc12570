"""Where rows come from: Parquet files, Delta tables, Arrow IPC files, as a list of units.

A :class:`Source` is small and picklable (file names, row counts, the schema, the filesystem, the
format), so it travels to every rank with the training function. Only footers are read here;
rows are read by the ranks, through the source's format (:mod:`sparktrain.data.formats`).
Paths are local paths, ``file://`` URLs, or any URL pyarrow opens (``s3://``, ``gs://``,
``abfss://``, ``hdfs://``), or that fsspec opens when pyarrow does not.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sparktrain.data.columns import pyarrow
from sparktrain.data.formats import ARROW_IPC, PARQUET, Format
from sparktrain.ground.errors import ConfigError

_GLOB = set("*?[")


@dataclass(frozen=True)
class Unit:
    """One row group of one file: the smallest piece a rank reads.

    Attributes:
        file: The file's path on the source's filesystem.
        row_group: The unit's index in the file (a row group, a record batch).
        rows: How many rows it holds.
        partition: Constant columns of the file (a Delta table's or a ``col=value`` folder's).
    """

    file: str
    row_group: int
    rows: int
    partition: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Source:
    """Row groups to stream, with their schema and filesystem.

    Attributes:
        name: What the user asked for (a path, a table and version), for messages.
        units: Every unit, in file order.
        schema: The Arrow schema every file shares (partition columns included).
        filesystem: The ``pyarrow.fs.FileSystem`` the files are on.
        format: How the files are read.
    """

    name: str
    units: tuple[Unit, ...]
    schema: Any
    filesystem: Any
    format: Format = PARQUET

    @property
    def rows(self) -> int:
        """How many rows the source holds."""
        return sum(unit.rows for unit in self.units)


def filesystem_of(path: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The filesystem of ``path`` and the path on it (pyarrow's, else fsspec's)."""
    pa = pyarrow()
    import pyarrow.fs as pafs

    if path.startswith("dbfs:/"):  # Databricks' DBFS, mounted at /dbfs on every node
        return pafs.LocalFileSystem(), "/dbfs/" + path[len("dbfs:/") :].lstrip("/")
    if "://" not in path:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    if not storage_options:
        try:
            fs, inner = pafs.FileSystem.from_uri(path)
            return fs, str(inner)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
            pass  # a scheme pyarrow does not know: try fsspec
    try:
        import fsspec  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ConfigError(
            f"pyarrow cannot open {path!r}; pip install fsspec (and its driver for "
            "that scheme) to read it"
        ) from exc
    fs, inner = fsspec.core.url_to_fs(path, **(storage_options or {}))
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), inner


def _data_file(path: str, base: str) -> bool:
    parts = os.path.relpath(path, base).split("/") if path != base else [os.path.basename(path)]
    return not any(p.startswith(("_", ".")) for p in parts) and not path.endswith(".crc")


def list_files(path: str, fs: Any) -> list[str]:
    """The Parquet files at ``path``: a file, a folder (recursively) or a glob pattern."""
    import pyarrow.fs as pafs

    parts = path.split("/")
    first_glob = next((i for i, p in enumerate(parts) if _GLOB & set(p)), None)
    base = path if first_glob is None else "/".join(parts[:first_glob]) or "/"
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.File and first_glob is None:
        return [path]
    if info.type != pafs.FileType.Directory:
        return []
    found = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    files = sorted(f.path for f in found if f.type == pafs.FileType.File)
    if first_glob is not None:
        files = [f for f in files if fnmatch.fnmatchcase(f, path)]
    return [f for f in files if _data_file(f, base)]


def _footer(fs: Any, file: str, kind: Format) -> tuple[Any, list[int]]:
    try:
        return kind.units(fs, file)
    except Exception as exc:
        raise ConfigError(f"{file!r} is not a readable {kind.name} file: {exc}") from exc


def from_files(
    name: str,
    fs: Any,
    files: Sequence[str],
    partitions: Sequence[Mapping[str, Any]] | None = None,
    partition_schema: Any = None,
    *,
    kind: Format = PARQUET,
) -> Source:
    """A :class:`Source` over ``files`` of format ``kind`` (footers read in parallel).

    Checks that every file has the same schema. ``partitions``: each file's constant columns
    (left out where a file holds the column itself), of ``partition_schema``.
    """
    pa = pyarrow()
    if not files:
        raise ConfigError(
            f"no {kind.name} files at {name!r}; check the path (a file, a folder or a "
            "glob such as 'data/*.parquet')."
        )
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        footers = list(pool.map(lambda f: _footer(fs, f, kind), files))
    schema = footers[0][0]
    for file, (other, _) in zip(files, footers, strict=True):
        if not other.equals(schema):
            raise ConfigError(
                f"{file!r} has schema {other} but {files[0]!r} has {schema}; "
                "every file of a dataset needs the same columns."
            )
    units: list[Unit] = []
    for index, (file, (_, groups)) in enumerate(zip(files, footers, strict=True)):
        given = (partitions[index] if partitions else {}).items()
        constants = tuple(sorted((k, v) for k, v in given if k not in schema.names))
        units.extend(Unit(file, g, rows, constants) for g, rows in enumerate(groups) if rows)
    if partition_schema is not None:
        extra = [f for f in partition_schema if f.name not in schema.names]
        schema = pa.schema(list(schema) + extra)
    source = Source(name, tuple(units), schema, fs, kind)
    if source.rows == 0:
        raise ConfigError(f"{name!r} holds no rows; there is nothing to train on.")
    return source


def parquet_source(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> Source:
    """A :class:`Source` over a Parquet file, folder or glob (see the module doc for URLs).

    Folders named ``column=value`` (Hive's and Spark's ``partitionBy`` layout) give their
    files that column, with that value.
    """
    return _file_source(path, storage_options, PARQUET)


def arrow_source(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> Source:
    """A :class:`Source` over Arrow IPC files (Feather v2): a file, a folder or a glob."""
    return _file_source(path, storage_options, ARROW_IPC)


def _file_source(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, kind: Format
) -> Source:
    text = os.fspath(path)
    fs, inner = filesystem_of(text, storage_options)
    files = list_files(inner, fs)
    partitions, schema = hive_partitions(files, base=_base_of(inner))
    return from_files(text, fs, files, partitions, schema, kind=kind)


def _base_of(path: str) -> str:
    parts = path.split("/")
    first_glob = next((i for i, p in enumerate(parts) if _GLOB & set(p)), len(parts))
    return "/".join(parts[:first_glob])


def hive_partitions(files: Sequence[str], *, base: str) -> tuple[list[dict[str, Any]] | None, Any]:
    """Each file's ``column=value`` folders under ``base`` as values, and their schema.

    A column is int64 when every value is a whole number, else a string; ``None`` when the
    files have no such folders (or not all the same columns).
    """
    import urllib.parse

    pa = pyarrow()
    found: list[dict[str, str]] = []
    for file in files:
        relative = file[len(base) :].strip("/").split("/")[:-1] if file.startswith(base) else []
        pairs = [part.split("=", 1) for part in relative if "=" in part]
        found.append({k: urllib.parse.unquote(v) for k, v in pairs})
        null = [f"{k}={v}" for k, v in pairs if v == "__HIVE_DEFAULT_PARTITION__"]
        if null:
            raise ConfigError(
                f"{file} lies in {null[0]}, Spark's folder for a null partition value, and a "
                "tensor cannot hold a null: filter those rows out (df.where(col.isNotNull())) "
                "before writing, or read the other folders only (a glob)."
            )
    names = list(found[0]) if found else []
    if not names or any(list(f) != names for f in found):
        return None, None
    fields, values = [], []
    for name in names:
        column = [f[name] for f in found]
        whole = all(v.lstrip("-").isdigit() for v in column)
        fields.append(pa.field(name, pa.int64() if whole else pa.string()))
        values.append([int(v) for v in column] if whole else column)
    partitions = [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]
    return partitions, pa.schema(fields)


def delta_source(
    path: str | os.PathLike[str],
    *,
    version: int | None = None,
    timestamp: Any = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Source:
    """A :class:`Source` over a Delta table at its latest, or a given, version or timestamp."""
    pa = pyarrow()
    try:
        from deltalake import DeltaTable
    except ImportError as exc:
        raise ConfigError(
            "reading Delta tables needs deltalake: pip install 'sparktrain[data]'"
        ) from exc
    text = os.fspath(path)
    if version is not None and timestamp is not None:
        raise ConfigError(f"give version={version!r} or timestamp={timestamp!r}, not both.")
    options = dict(storage_options or {})
    try:
        table = DeltaTable(text, version=version, storage_options=options or None)
        if timestamp is not None:
            table.load_as_version(timestamp)
    except Exception as exc:
        raise ConfigError(
            f"cannot open the Delta table {text!r} (version={version}, "
            f"timestamp={timestamp}): {exc}"
        ) from exc
    features = set(table.protocol().reader_features or [])
    mapping = table.metadata().configuration.get("delta.columnMapping.mode", "none")
    feature = "deletion vectors" if mapping == "none" else "column mapping"
    if "deletionVectors" in features or mapping != "none":
        raise ConfigError(
            f"the Delta table {text!r} uses {feature}, "
            "which are read through Spark: pass spark.read.format('delta').load(...) to "
            "from_dataframe instead."
        )
    actions = pa.table(table.get_add_actions(flatten=True))
    root = text.rstrip("/")
    paths = actions["path"].to_pylist()
    files = [p if "://" in p or p.startswith("/") else f"{root}/{p}" for p in paths]
    partition_names = list(table.metadata().partition_columns)
    schema = pa.schema(table.schema().to_arrow())
    values = [actions[f"partition.{n}"].to_pylist() for n in partition_names]
    partitions = (
        [dict(zip(partition_names, row, strict=True)) for row in zip(*values, strict=True)]
        if values
        else None
    )
    fs, _ = filesystem_of(root, storage_options)
    inner = [filesystem_of(f, storage_options)[1] for f in files]
    label = f"{text} (version {table.version()})"
    part_schema = pa.schema([schema.field(n) for n in partition_names]) if partition_names else None
    return from_files(label, fs, inner, partitions, part_schema)
