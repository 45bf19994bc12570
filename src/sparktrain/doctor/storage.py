"""Can every node write the checkpoint directory? A small file written, read back, removed.

A run whose nodes cannot all write its checkpoint directory fails at its first save, minutes
or hours in; an elastic restart on a cluster without shared storage has nothing to resume
from. ``sparktrain doctor --checkpoint-dir DIR`` asks the question before the run:

- here, on the caller's machine (``checkpoint.here``): ``DIR`` is a path or an object store's
  URL (``s3://``, ``gs://``, ``abfs://``), read the way ``sparktrain.checkpoint.save`` reads it;
- with ``--probe`` on a Spark session, from every task of the probe's barrier stage too
  (``checkpoint.nodes``): a local path that only the driver's machine has, or credentials that
  only the driver holds, show up there.

Design choices:
- The probe file has a name of its own (host, process, random) under ``DIR/.sparktrain-doctor``,
  so probes from many tasks never collide and a checkpoint's own names are never touched.
- A local path is written with plain file calls and fsynced; a URL through fsspec, as saves do.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Sequence
from typing import Any

from sparktrain.doctor.verdicts import Check, Finding

#: The folder under the checkpoint directory that probes write into (removed when empty).
PROBE_FOLDER = ".sparktrain-doctor"


def write_probe(directory: str, options: dict[str, Any] | None = None) -> str:
    """Write, read back and remove a small file under ``directory``; ``""`` or what failed.

    Args:
        directory: The checkpoint directory: a path, or an object store's URL.
        options: The object store's fsspec options (``storage_options`` of ``save``).
    """
    from sparktrain.rank.checkpoints.objects import ObjectStorage
    from sparktrain.rank.checkpoints.storage import LocalStorage, storage_for

    body = secrets.token_bytes(64)
    name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        storage = storage_for(directory, options)
        if isinstance(storage, LocalStorage):
            _local_probe(os.fspath(storage.root), name, body)
        elif isinstance(storage, ObjectStorage):
            _object_probe(storage.fs, storage.root, name, body)
    except Exception as exc:  # the finding: any failure to write, read or remove
        return f"{type(exc).__name__}: {exc}".strip()
    return ""


def _local_probe(root: str, name: str, body: bytes) -> None:
    folder = os.path.join(root, PROBE_FOLDER)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    try:
        with open(path, "wb") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        with open(path, "rb") as handle:
            if handle.read() != body:
                raise OSError(f"{path} reads back other bytes than were written")
    finally:
        if os.path.exists(path):
            os.remove(path)
        with contextlib.suppress(OSError):  # another probe's file is still there
            os.rmdir(folder)


def _object_probe(fs: Any, root: str, name: str, body: bytes) -> None:
    path = f"{root}/{PROBE_FOLDER}/{name}"
    try:
        with fs.open(path, "wb") as handle:
            handle.write(body)
        with fs.open(path, "rb") as handle:
            if handle.read() != body:
                raise OSError(f"{path} reads back other bytes than were written")
    finally:
        if fs.exists(path):
            fs.rm(path)


FIX = (
    "use a directory every node reaches by the same name with write access: a shared mount "
    "(NFS, /dbfs/..., a /Volumes/... volume) or an object store's URL (s3://, gs://, abfs://) "
    "with credentials on every node"
)


def here_check(directory: str, options: dict[str, Any] | None = None) -> Check:
    """Whether this machine can write the checkpoint directory."""
    failed = write_probe(directory, options)
    facts: dict[str, Any] = {"directory": directory}
    if failed:
        finding = Finding("error", f"cannot write checkpoints to {directory}: {failed}", FIX)
    else:
        finding = Finding("ok", f"{directory} is writable here (a file written, read, removed)")
    return Check.judged("checkpoint.here", finding, facts)


def nodes_verdict(directory: str, rows: Sequence[dict[str, str]]) -> Check:
    """The verdict on the probe tasks' writes (each row's ``checkpoint``: ``""`` or an error)."""
    hosts = sorted({r["host"] for r in rows})
    failed = [r for r in rows if r["checkpoint"]]
    facts: dict[str, Any] = {"directory": directory, "hosts": hosts}
    if failed:
        facts["failed"] = {r["host"]: r["checkpoint"] for r in failed}
        first = failed[0]
        finding = Finding(
            "error",
            f"{len(failed)} of {len(rows)} task(s) cannot write checkpoints to {directory}: "
            f"on {first['host']}: {first['checkpoint']}",
            FIX,
        )
    else:
        finding = Finding(
            "ok", f"{directory} is writable from every task ({len(rows)}) on {', '.join(hosts)}"
        )
    return Check.judged("checkpoint.nodes", finding, facts)
