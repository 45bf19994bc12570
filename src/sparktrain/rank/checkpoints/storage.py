"""Where checkpoints live: a folder reached by path, or an object store's URL.

A :class:`LocalStorage` is a folder every rank reaches by the same path (a local disk for one
machine, a shared mount for several). A checkpoint is written into ``.step-00000042.tmp`` and
becomes ``step-00000042`` in one ``rename`` once its ``COMPLETE`` manifest is written and every
file is flushed: a crash at any moment leaves the previous checkpoints and, at worst, a
temporary folder that the next save removes. A URL (``s3://``, ``gs://``, ``abfs://``) is an
:class:`~sparktrain.rank.checkpoints.objects.ObjectStorage`, which has no rename: there the
manifest, written last, is the publication. :func:`storage_for` tells them apart; it never
takes a URL for a local folder called ``s3:``.

Every method takes the save's ``token`` (the same on every rank): an object store writes a
checkpoint's files under it, so that a step saved again never overwrites a published one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

from sparktrain.ground.errors import ConfigError
from sparktrain.rank.checkpoints.names import MANIFEST, NAME, step_name

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//|/)")


def storage_for(
    directory: str | os.PathLike[str], options: dict[str, Any] | None = None
) -> Storage:
    """The storage ``directory`` names (``options``: the object store's, such as credentials)."""
    text = os.fspath(directory)
    found = _URL.match(text) if isinstance(text, str) else None
    if found is None or (len(found.group(1)) == 1 and os.name == "nt"):  # C:/ is a path there
        return LocalStorage(Path(text))
    scheme = found.group(1).lower()
    if scheme == "file":
        return LocalStorage(Path(text.split(":", 1)[1].removeprefix("//")))
    if scheme == "dbfs":
        return _dbfs(text)
    from sparktrain.rank.checkpoints.objects import ObjectStorage

    return ObjectStorage.at(text, scheme, options or {})


def _dbfs(text: str) -> Storage:
    """``dbfs:/x`` is ``/dbfs/x`` where the Databricks file system is mounted (its nodes)."""
    mounted = Path("/dbfs") / text.split(":", 1)[1].lstrip("/")
    if Path("/dbfs").is_dir():
        return LocalStorage(mounted)
    raise ConfigError(
        f"checkpoint directory {text!r} is a dbfs: URL, which is read through its mount, "
        f"{mounted}, on Databricks' nodes, and /dbfs is not mounted here. Pass a folder every "
        "node reaches, or a Unity Catalog volume (/Volumes/...)."
    )


class Storage(Protocol):
    """What a checkpoint's writer and reader need of where checkpoints live."""

    def location(self, step: int) -> Any:
        """Where the checkpoint of ``step`` is once published."""

    def prepare(self, step: int, token: str) -> None:
        """Make ready for the files of ``step`` (one rank, before any writes)."""

    def write(self, step: int, token: str, name: str, fill: Callable[[IO[bytes]], Any]) -> int:
        """Write the file ``name`` of ``step`` durably with ``fill(handle)``; return its size."""

    def dcp_writer(self, step: int, token: str) -> dict[str, Any]:
        """The keyword arguments of ``torch.distributed.checkpoint.save`` for ``step``."""

    def publish(self, step: int, token: str, manifest: dict[str, Any]) -> None:
        """Make the checkpoint of ``step`` visible at once, its manifest last."""

    def discard(self, step: int, token: str) -> None:
        """Remove what a failed write of ``step`` left."""

    def steps(self) -> list[int]:
        """The steps of the published checkpoints, oldest first."""

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest of a published checkpoint (``{}`` when unreadable)."""

    def open(self, step: int, name: str) -> IO[bytes]:
        """Open the file ``name`` of the published checkpoint of ``step`` for reading."""

    def dcp_reader(self, step: int) -> dict[str, Any]:
        """The keyword arguments of ``torch.distributed.checkpoint.load`` for ``step``."""

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` checkpoints; remove what crashed writes left."""


class LocalStorage:
    """Checkpoints in a folder reached by path; publication is one ``rename``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def location(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is once published."""
        return self.root / step_name(step)

    def temp(self, step: int) -> Path:
        """The folder the ranks write the checkpoint of ``step`` into before publication."""
        return self.root / f".{step_name(step)}.tmp"

    def prepare(self, step: int, token: str) -> None:
        """Make an empty temporary folder for ``step`` (one rank, before any writes).

        Temporary folders of crashed writes go too: no other write is in flight now.
        """
        tmp = self.temp(step)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()

    def write(self, step: int, token: str, name: str, fill: Callable[[IO[bytes]], Any]) -> int:
        """Write the file ``name`` of ``step`` with ``fill(handle)``, flushed; return its size."""
        path = self.temp(step) / name
        with open(path, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
            return handle.tell()

    def dcp_writer(self, step: int, token: str) -> dict[str, Any]:
        """DCP writes into the temporary folder."""
        return {"checkpoint_id": str(self.temp(step))}

    def publish(self, step: int, token: str, manifest: dict[str, Any]) -> None:
        """Write the manifest last and make the checkpoint of ``step`` visible in one rename."""
        tmp, final = self.temp(step), self.location(step)
        body = {"step": step, "time": time.time(), **manifest}
        (tmp / MANIFEST).write_text(json.dumps(body))
        _fsync_tree(tmp)
        if final.exists():  # the same step saved again (a resumed run): replace it whole
            # Between the two renames (a crash there) the old version is read from its
            # ``.old`` folder: the step is never lost (see :meth:`readable`).
            old = self._old(step)
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)

    def discard(self, step: int, token: str) -> None:
        """Remove what a failed write of ``step`` left."""
        shutil.rmtree(self.temp(step), ignore_errors=True)

    def _old(self, step: int) -> Path:
        """Where a step saved again keeps its previous version while the new one moves in."""
        return self.root / f".{step_name(step)}.old"

    def readable(self, step: int) -> Path:
        """The complete folder of ``step``.

        The published one, or else the previous version that a crash between the two renames
        of a step saved again left in its ``.old`` folder.
        """
        final = self.location(step)
        if not (final / MANIFEST).is_file() and (self._old(step) / MANIFEST).is_file():
            return self._old(step)
        return final

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = set()
        for path in self.root.iterdir():
            name = path.name
            if name.startswith(".") and name.endswith(".old"):
                name = name[1:-4]  # the previous version of a step saved again
            match = NAME.match(name)
            if match and (path / MANIFEST).is_file():
                found.add(int(match.group(1)))
        return sorted(found)

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest of a published checkpoint (``{}`` when unreadable)."""
        try:
            found = json.loads((self.readable(step) / MANIFEST).read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def open(self, step: int, name: str) -> IO[bytes]:
        """Open a file of a published checkpoint."""
        return open(self.readable(step) / name, "rb")

    def dcp_reader(self, step: int) -> dict[str, Any]:
        """DCP reads the published folder."""
        return {"checkpoint_id": str(self.readable(step))}

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` checkpoints; remove what crashed writes left.

        Runs beside the next save's write, so it leaves every temporary folder alone (the next
        save's :meth:`prepare` removes those of crashed writes).
        """
        steps = self.steps()
        pruned = steps[:-keep] if keep > 0 else []
        for old in pruned:
            gone = self.root / f".{step_name(old)}.pruned"  # hidden at once, then removed
            with contextlib.suppress(OSError):
                os.rename(self.location(old), gone)
            shutil.rmtree(gone, ignore_errors=True)
        only = {
            self._old(s) for s in steps if s not in pruned and self.readable(s) != self.location(s)
        }
        for stale in self.root.glob(".step-*"):  # pruned or replaced folders (not .tmp ones)
            if not stale.name.endswith(".tmp") and stale not in only:
                shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(path)
