"""The files output: each part written once and atomically, and a killed run resumed.

The output folder holds a manifest (``_sparktrain_scoring.json``: the plan's fingerprint) and
one Parquet file per part, ``part-<index>.parquet``. A scorer writes a part under a temporary
name (a leading dot: every reader skips it) and renames it into place when it is whole, so a
part's file exists only complete. A run that finds the manifest of the same plan resumes: the
parts whose files exist are done and are not scored again; any other manifest is refused. When
every part is written, ``_SUCCESS`` is written (Parquet) or one Delta commit adds every part to
the table's log (Delta), so a Delta reader sees all the rows or none.

The driver calls :func:`prepare` and :func:`finish`; scorers call :func:`write_part` and
:func:`done_parts`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from sparktrain.data.sources import filesystem_of
from sparktrain.ground.errors import ConfigError

MANIFEST = "_sparktrain_scoring.json"
FORMATS = ("parquet", "delta")
_PART = re.compile(r"^part-(\d{5,})\.parquet$")


def part_name(index: int) -> str:
    """The file name of part ``index``."""
    return f"part-{index:05d}.parquet"


def _names(fs: Any, folder: str) -> list[str]:
    import pyarrow.fs as pafs

    info = fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
    return [i.base_name for i in info]


def done_parts(output: str, storage_options: Mapping[str, Any] | None = None) -> set[int]:
    """The indices of the parts whose files are in ``output``."""
    fs, folder = filesystem_of(output, storage_options)
    return {int(m.group(1)) for n in _names(fs, folder) if (m := _PART.match(n))}


def prepare(
    output: str,
    fingerprint: Mapping[str, Any],
    *,
    fmt: str,
    overwrite: bool,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[set[int], bool]:
    """Make ``output`` ready for the plan: the parts already done, and whether it is finished.

    Raises:
        ConfigError: ``output`` holds something else (another plan's parts, other files).
    """
    fs, folder = filesystem_of(output, storage_options)
    names = _names(fs, folder)
    foreign = [n for n in names if not _ours(n)]
    if foreign:
        raise ConfigError(
            f"output={output!r} holds files that are not a scoring's ({foreign[:3]}); choose "
            "an empty or new folder (overwrite=True deletes only a scoring's own files)."
        )
    if names and overwrite:
        for name in names:
            path = f"{folder}/{name}"
            if name == "_delta_log":
                fs.delete_dir(path)
            else:
                fs.delete_file(path)
        names = []
    if names:
        if MANIFEST not in names:
            raise ConfigError(
                f"output={output!r} holds parts but no {MANIFEST}; pass overwrite=True to "
                "delete them and score again, or choose another folder."
            )
        with fs.open_input_stream(f"{folder}/{MANIFEST}") as handle:
            found = json.loads(handle.read())
        wanted = {**fingerprint, "format": fmt}
        if found != wanted:
            changed = sorted(k for k in {**found, **wanted} if found.get(k) != wanted.get(k))
            raise ConfigError(
                f"output={output!r} holds the parts of another scoring (it differs in "
                f"{changed}); pass overwrite=True to score again from the start, or choose "
                "another folder."
            )
        finished = "_SUCCESS" in names or _committed(fs, folder)
        for name in names:  # a killed scorer's unfinished part
            if name.startswith(".part-"):
                fs.delete_file(f"{folder}/{name}")
        return {int(m.group(1)) for n in names if (m := _PART.match(n))}, finished
    fs.create_dir(folder, recursive=True)
    _write_atomic(fs, folder, MANIFEST, json.dumps({**fingerprint, "format": fmt}).encode())
    return set(), False


def _ours(name: str) -> bool:
    """Whether ``name`` is a file a scoring writes in its output folder."""
    return (
        name in (MANIFEST, "_SUCCESS", "_delta_log")
        or bool(_PART.match(name))
        or name.startswith((".part-", f".{MANIFEST}.", "._SUCCESS."))
    )


def _committed(fs: Any, folder: str) -> bool:
    """Whether the Delta commit that finishes a scoring is there."""
    import pyarrow.fs as pafs

    first = f"{folder}/_delta_log/{0:020d}.json"
    return bool(fs.get_file_info(first).type == pafs.FileType.File)


def check_format(fmt: str, schema: Any) -> None:
    """Refuse, before any scoring, an output that ``fmt`` cannot hold.

    Raises:
        ConfigError: An unknown format, deltalake missing, or a type Delta has no place for.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt!r} must be one of {list(FORMATS)}.")
    if fmt != "delta":
        return
    try:
        from deltalake import Schema
    except ImportError as exc:
        raise ConfigError("format='delta' needs deltalake: pip install 'sparktrain[data]'") from exc
    try:
        Schema.from_arrow(schema)
    except Exception as exc:
        raise ConfigError(
            f"the output's columns {schema} cannot be a Delta table's: {exc}; keep other "
            "columns, or write format='parquet'."
        ) from exc


def _write_atomic(fs: Any, folder: str, name: str, data: bytes) -> None:
    temporary = f"{folder}/.{name}.{uuid.uuid4().hex}"
    with fs.open_output_stream(temporary) as handle:
        handle.write(data)
    fs.move(temporary, f"{folder}/{name}")


def write_part(
    output: str,
    index: int,
    schema: Any,
    batches: Iterable[Any],
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """Write part ``index`` from ``batches`` atomically; the rows written."""
    import pyarrow.parquet as pq

    fs, folder = filesystem_of(output, storage_options)
    temporary = f"{folder}/.{part_name(index)}.{uuid.uuid4().hex}"
    rows = 0
    try:
        with fs.open_output_stream(temporary) as handle, pq.ParquetWriter(handle, schema) as out:
            for batch in batches:
                if batch.num_rows:
                    out.write_batch(batch)
                    rows += batch.num_rows
        fs.move(temporary, f"{folder}/{part_name(index)}")
    except BaseException:
        import contextlib

        with contextlib.suppress(OSError):
            fs.delete_file(temporary)
        raise
    return rows


def finish(
    output: str,
    parts: int,
    schema: Any,
    *,
    fmt: str,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """Mark ``output`` complete (``_SUCCESS``, or the Delta commit); the rows it holds.

    Raises:
        ConfigError: A part's file is missing (the run did not write every part).
    """
    import pyarrow.parquet as pq

    fs, folder = filesystem_of(output, storage_options)
    missing = sorted(set(range(parts)) - done_parts(output, storage_options))
    if missing:
        raise ConfigError(
            f"output={output!r} lacks the parts {missing[:10]}; run the same scoring again to "
            "write them (the others are kept). If the ranks ran on other machines, output must "
            "be a folder they all share (a URL, or a shared mount)."
        )
    files = [f"{folder}/{part_name(i)}" for i in range(parts)]
    counts = [pq.ParquetFile(f, filesystem=fs).metadata.num_rows for f in files]
    if fmt == "delta":
        _commit_delta(
            output,
            files=files,
            counts=counts,
            schema=schema,
            fs=fs,
            options=storage_options,
        )
    else:
        _write_atomic(fs, folder, "_SUCCESS", b"")
    return sum(counts)


def _commit_delta(
    output: str,
    *,
    files: list[str],
    counts: list[int],
    schema: Any,
    fs: Any,
    options: Mapping[str, Any] | None,
) -> None:
    """One Delta commit that creates the table at ``output`` with every part in it."""
    try:
        from deltalake import transaction
    except ImportError as exc:
        raise ConfigError("format='delta' needs deltalake: pip install 'sparktrain[data]'") from exc
    actions = []
    for file, rows in zip(files, counts, strict=True):
        info = fs.get_file_info(file)
        actions.append(
            transaction.AddAction(
                path=file.rsplit("/", 1)[1],
                size=int(info.size),
                partition_values={},
                modification_time=int((info.mtime_ns or time.time_ns()) // 1_000_000),
                data_change=True,
                stats=json.dumps({"numRecords": rows}),
            )
        )
    from deltalake import Schema

    transaction.create_table_with_add_actions(
        output,
        Schema.from_arrow(schema),
        actions,
        mode="error",
        storage_options=dict(options) if options else None,
    )
