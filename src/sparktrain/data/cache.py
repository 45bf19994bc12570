"""A Spark DataFrame written as Parquet by the executors, once, and found again by its plan.

``materialise(df)`` asks Spark to write ``df`` (in parallel, nothing collected to the driver)
into ``<cache_dir>/<key>``, where ``key`` hashes the DataFrame's analysed plan and schema: a
second run over the same DataFrame reuses the files. The write goes to a hidden temporary
folder that is renamed into place once complete, so a crash never leaves a cache that looks
whole. The cache folder is, in this order: ``cache_dir=``, the Spark conf
``spark.sparktrain.data.cacheDir``, or (local mode only) a private folder of the temporary
directory.

Each entry records its owner (host, pid and start time). Entries in the default folder belong to
the process that wrote them and are removed when it exits; entries of a process that died
without exiting (SIGKILL, a crash) are swept by the next ``materialise``. Entries in a folder the
user named are kept until :func:`delete` removes them; only their unfinished writes are swept.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any

from sparktrain.ground import procfs
from sparktrain.ground.errors import ConfigError

CONF = "spark.sparktrain.data.cacheDir"
OWNER = "_sparktrain_owner.json"
_ROW_GROUP_BYTES = 32 * 1024 * 1024
_MINE: set[str] = set()


def cache_key(df: Any) -> str:
    """A hex key from ``df``'s plan (Spark's semantic hash and its plan text) and schema."""
    parts = [str(df.schema)]
    with contextlib.suppress(Exception):
        parts.append(str(df.semanticHash()))
    with contextlib.suppress(Exception):  # classic Spark: the analysed plan, literals included
        parts.append(df._jdf.queryExecution().analyzed().toString())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _default_dir(session: Any) -> str | None:
    master = ""
    with contextlib.suppress(Exception):
        master = session.conf.get("spark.master", "") or ""
    if master.startswith("local") or master == "":
        return os.path.join(tempfile.gettempdir(), f"sparktrain-cache-{os.getuid()}")
    return None


def cache_root(df: Any, given: str | os.PathLike[str] | None) -> tuple[str, bool]:
    """The cache folder for ``df``, and whether it is the private default (see the module doc)."""
    if given is not None:
        return os.fspath(given), False
    session = df.sparkSession
    with contextlib.suppress(Exception):
        conf = session.conf.get(CONF, None)
        if conf:
            return str(conf), False
    default = _default_dir(session)
    if default is None:
        raise ConfigError(
            "a DataFrame on a cluster is cached where every executor can read it: pass "
            f"cache_dir='dbfs:/...' (or s3://, abfss://, a shared mount) or set the Spark conf "
            f"{CONF}."
        )
    os.makedirs(default, mode=0o700, exist_ok=True)
    return default, True


def local_folder(path: str) -> str | None:
    """``path`` as a local folder (``dbfs:/x`` is Databricks' ``/dbfs/x`` mount), else ``None``."""
    if path.startswith("dbfs:/"):
        return "/dbfs/" + path[len("dbfs:/") :].lstrip("/")
    if "://" not in path:
        return os.path.abspath(path)
    return path[len("file://") :] if path.startswith("file://") else None


def _for_spark(path: str) -> str:
    """``path`` as Spark should write it: a local path as ``file://`` (not the default FS)."""
    return f"file://{os.path.abspath(path)}" if "://" not in path and ":/" not in path else path


def owner_alive(folder: Path) -> bool:
    """Whether the process that wrote ``folder``'s owner file lives (another host's: yes)."""
    try:
        owner = json.loads((folder / OWNER).read_text())
    except (OSError, ValueError):
        return False
    if owner.get("host") != socket.gethostname():
        return True  # another machine's: never judged from here
    return bool(procfs.start_ticks(int(owner["pid"])) == owner.get("start"))


def sweep(root: str, *, owned_only: bool) -> list[str]:
    """Remove entries under ``root`` (a local folder) whose writer died; their paths.

    ``owned_only`` sweeps whole entries of dead owners (the private default folder); otherwise
    only unfinished writes (hidden ``.tmp-`` folders) are swept.
    """
    removed: list[str] = []
    folder = Path(root)
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        unfinished = entry.name.startswith(".tmp-")
        if not entry.is_dir() or not (unfinished or owned_only):
            continue
        if unfinished and not (entry / OWNER).exists() and entry.stat().st_mtime > _recent():
            continue  # being created right now: its owner file is not written yet
        if not owner_alive(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def _recent() -> float:
    import time

    return time.time() - 60


def write_owner(folder: str) -> None:
    """Record this process as ``folder``'s owner (see :func:`owner_alive`)."""
    pid = os.getpid()
    owner = {"host": socket.gethostname(), "pid": pid, "start": procfs.start_ticks(pid)}
    Path(folder, OWNER).write_text(json.dumps(owner))


def _remove_mine() -> None:
    for path in list(_MINE):
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_mine)


def materialise(df: Any, given: str | os.PathLike[str] | None = None) -> str:
    """The folder holding ``df`` as Parquet: reused when present, written by Spark otherwise."""
    root, private = cache_root(df, given)
    key = cache_key(df)
    if private:  # the default folder is per process: another process's entry dies with it
        key = f"{key}-{os.getpid()}"
    final = f"{root.rstrip('/')}/{key}"
    local = local_folder(root)
    if local is None:  # an object store: no atomic rename; Spark's _SUCCESS marks it complete
        if not _remote_complete(final):
            _write(df, final, mode="overwrite")
        return final
    sweep(local, owned_only=private)
    if Path(local, key, "_SUCCESS").exists():
        return final
    tmp = Path(local, f".tmp-{key}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp, mode=0o700)
    write_owner(str(tmp))
    try:
        _write(df, _for_spark(f"{root.rstrip('/')}/{tmp.name}"), mode="append")
        try:
            os.rename(tmp, Path(local, key))
        except OSError:  # another run published the same DataFrame first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if private:
        _MINE.add(str(Path(local, key)))
    return final


def _write(df: Any, url: str, *, mode: str) -> None:
    df.write.mode(mode).option("parquet.block.size", _ROW_GROUP_BYTES).parquet(url)


def _remote_complete(folder: str) -> bool:
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(folder)
    except Exception:  # a scheme pyarrow does not open: let Spark decide by writing again
        return False
    return bool(fs.get_file_info(f"{path}/_SUCCESS").type == pafs.FileType.File)


def delete(df_or_path: Any, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Remove the cache of a DataFrame (or a folder that :func:`materialise` returned).

    Returns whether something was removed. Remote caches are removed through pyarrow's
    filesystem for the URL.
    """
    if isinstance(df_or_path, str | os.PathLike):
        folder = os.fspath(df_or_path)
    else:
        root, private = cache_root(df_or_path, cache_dir)
        key = cache_key(df_or_path) + (f"-{os.getpid()}" if private else "")
        folder = f"{root.rstrip('/')}/{key}"
    local = local_folder(folder)
    if local is not None:
        _MINE.discard(local)
        existed = Path(local).exists()
        shutil.rmtree(local, ignore_errors=True)
        return existed
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(folder)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return False
    fs.delete_dir(path)
    return True
