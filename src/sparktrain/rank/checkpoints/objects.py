"""Checkpoints on an object store (``s3://``, ``gs://``, ``abfs://``), through fsspec.

An object store has no rename, so a checkpoint is published by its manifest: each rank writes
its files under ``step-00000042/<token>/`` (the save's token, the same on every rank), and rank
0 writes ``step-00000042/COMPLETE`` last, naming the token. One object is written whole or not
at all, so :meth:`ObjectStorage.steps` sees a checkpoint only once every part is there; a step
saved again (a resumed run) writes under a new token, and its manifest replaces the old one in
one write. Pruning removes a checkpoint's manifest first, then its files.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import IO, Any

from sparktrain.ground.errors import ConfigError
from sparktrain.rank.checkpoints.names import MANIFEST, NAME, step_name

#: scheme -> the package that gives fsspec that store.
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs",
            "abfss": "adlfs", "az": "adlfs", "memory": "fsspec"}  # fmt: skip


class ObjectStorage:
    """Checkpoints under a URL; publication is the manifest, written last."""

    def __init__(self, fs: Any, root: str, url: str, options: dict[str, Any]) -> None:
        self.fs, self.root, self.url, self.options = fs, root.rstrip("/"), url.rstrip("/"), options
        self._tokens: dict[int, str] = {}  # a load reads each manifest once

    @classmethod
    def at(cls, url: str, scheme: str, options: dict[str, Any]) -> ObjectStorage:
        """The store ``url`` names; a missing package is named with what to install."""
        package = PACKAGES.get(scheme, f"the fsspec implementation of {scheme}://")
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:
            raise ConfigError(
                f"checkpoint directory {url!r} needs fsspec and {package}: "
                f"pip install 'sparktrain[storage]' {package}"
            ) from None
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"checkpoint directory {url!r}: fsspec cannot open {scheme}:// ({exc}); "
                f"pip install {package}"
            ) from None
        return cls(fs, root, url, options)

    def location(self, step: int) -> str:
        """The checkpoint's URL."""
        return f"{self.url}/{step_name(step)}"

    def _data(self, step: int, token: str) -> str:
        return f"{self.root}/{step_name(step)}/{token}"

    def prepare(self, step: int, token: str) -> None:
        """Remove what crashed writes left (no other write is in flight now); nothing to make.

        That is every step folder without a manifest, and every token of a published step but
        the one its manifest names.
        """
        steps = set(self.steps())
        for path in self._list(self.root):
            match = NAME.match(path.rstrip("/").split("/")[-1])
            if match is None:
                continue
            if int(match.group(1)) not in steps:
                self._remove(path)
                continue
            named = self.manifest(int(match.group(1))).get("data")
            if not named:  # a manifest not read just now: leave the step as it is
                continue
            for inner in self._list(path):
                if inner.rstrip("/").split("/")[-1] not in (named, MANIFEST):
                    self._remove(inner)

    def write(self, step: int, token: str, name: str, fill: Callable[[IO[bytes]], Any]) -> int:
        """Write one object; it exists, whole, once ``close`` returns."""
        with self.fs.open(f"{self._data(step, token)}/{name}", "wb") as handle:
            fill(handle)
            size = int(handle.tell())
        return size

    def dcp_writer(self, step: int, token: str) -> dict[str, Any]:
        """DCP through its fsspec writer, under the token."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        path = f"{self.url}/{step_name(step)}/{token}"
        return {"storage_writer": FsspecWriter(path, **self.options)}

    def publish(self, step: int, token: str, manifest: dict[str, Any]) -> None:
        """Write the manifest, naming the token: the one write that publishes."""
        body = {"step": step, "time": time.time(), "data": token, **manifest}
        self.fs.pipe(f"{self.root}/{step_name(step)}/{MANIFEST}", json.dumps(body).encode())

    def discard(self, step: int, token: str) -> None:
        """Remove the token's files of a write that failed."""
        self._remove(self._data(step, token))

    def steps(self) -> list[int]:
        """Steps whose manifest exists, oldest first."""
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.glob(f"{self.root}/step-*/{MANIFEST}")
        except FileNotFoundError:
            return []
        steps = []
        for path in found:
            match = NAME.match(str(path).rstrip("/").split("/")[-2])
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest of a published checkpoint (``{}`` when unreadable)."""
        try:
            found = json.loads(self.fs.cat(f"{self.root}/{step_name(step)}/{MANIFEST}"))
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def _token(self, step: int) -> str:
        if step not in self._tokens:
            self._tokens[step] = str(self.manifest(step).get("data", ""))
        return self._tokens[step]

    def open(self, step: int, name: str) -> IO[bytes]:
        """Open a file of a published checkpoint (every file from the same manifest's token)."""
        token = self._token(step)
        return self.fs.open(f"{self._data(step, token)}/{name}", "rb")  # type: ignore[no-any-return]

    def files(self, step: int) -> dict[str, int]:
        """The files of a published checkpoint: name -> bytes."""
        path = self._data(step, self._token(step))
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        return {
            str(entry["name"]).rstrip("/").split("/")[-1]: int(entry.get("size") or 0)
            for entry in entries
            if entry.get("type") == "file"
        }

    def dcp_reader(self, step: int) -> dict[str, Any]:
        """DCP through its fsspec reader, under the manifest's token."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        path = f"{self.location(step)}/{self._token(step)}"
        return {"storage_reader": FsspecReader(path, **self.options)}

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep``: each older one loses its manifest, then its files.

        Runs beside the next save's write, so it removes published checkpoints only (the next
        save's :meth:`prepare` removes what crashed writes left).
        """
        steps = self.steps()
        for old in steps[:-keep] if keep > 0 else []:
            folder = f"{self.root}/{step_name(old)}"
            self._remove(f"{folder}/{MANIFEST}")
            self._remove(folder)

    def _list(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        try:
            return [str(p) for p in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []

    def _remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
