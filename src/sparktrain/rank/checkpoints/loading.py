"""``load_latest``: the newest published checkpoint, whatever format wrote it.

Only published checkpoints are seen (a write in flight or cut short is a temporary folder, or a
folder without its manifest). Formats: ``parts`` (the skeleton and each rank's part, joined
again), ``dcp`` (loaded in place into ``into`` with ``torch.distributed.checkpoint``, at any
world size) and the single ``state.pt`` of checkpoints written before saves were asynchronous.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparktrain.contract import env
from sparktrain.rank import reporting
from sparktrain.rank.checkpoints import coordinate, memory, parts, staging
from sparktrain.rank.checkpoints.names import MANIFEST
from sparktrain.rank.checkpoints.objects import ObjectStorage
from sparktrain.rank.checkpoints.storage import LocalStorage, Storage, storage_for
from sparktrain.rank.checkpoints.writer import WRITER

_LEGACY = "state.pt"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        step: The step it was saved at.
        state: What was saved (for ``sharded=True``, the state dict loaded in place).
        path: Its folder (its URL on an object store).
        world_size: The number of ranks that saved it (``None`` for checkpoints written before
            sparktrain recorded it).
        read: The bytes of its files this rank read, by where they came from: ``"memory"``
            (its node's, after a restart) or ``"storage"``.
    """

    step: int
    state: Any
    path: Path | str
    world_size: int | None = None
    read: dict[str, int] = field(default_factory=dict)


def latest_step(
    directory: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> int | None:
    """The step of the newest published checkpoint in ``directory``, or ``None``.

    A checkpoint this process is still writing is waited for first (a process sees its own saves).
    """
    WRITER.join()
    steps = storage_for(directory, storage_options).steps()
    return steps[-1] if steps else None


def load_latest(
    directory: str | os.PathLike[str],
    *,
    into: Any = None,
    map_location: Any = "cpu",
    weights_only: bool = True,
    on_rescale: Callable[[int, int], Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Checkpoint | None:
    """Load the newest published checkpoint, or return ``None`` when there is none.

    A checkpoint this process is still writing is waited for first.

    Args:
        directory: The checkpoint folder, or an object store's URL (as ``save`` takes it).
        into: For sharded checkpoints, the state dict to load into, in place (as
            ``torch.distributed.checkpoint.load`` needs).
        map_location: Where tensors go (replicated checkpoints).
        weights_only: Refuse arbitrary pickled objects (``torch.load``'s safe mode); pass
            ``False`` for states holding other Python objects you trust.
        on_rescale: Called as ``on_rescale(old_world_size, new_world_size)`` when the
            checkpoint was saved by a different number of ranks than run now (an elastic run
            shrank or grew): scale the learning rate there if you prefer that to a constant
            global batch (see :func:`sparktrain.elastic.accumulation`).
        storage_options: For a URL, the fsspec file system's options (as ``save`` takes them).
    """
    storage = storage_for(directory, storage_options)
    WRITER.join()  # a process sees its own saves
    steps = storage.steps()
    if not steps:
        return None
    step = steps[-1]
    manifest = storage.manifest(step)
    path = storage.location(step)
    _check_map_location(map_location)
    if manifest.get("format") == "parts" and into is not None:
        raise ValueError(
            f"checkpoint {path} holds a replicated state (saved without sharded=True): "
            "call load_latest without into= and load the returned state yourself"
        )
    if manifest.get("format") == "dcp" or into is not None:
        if into is None:
            raise ValueError(
                f"checkpoint {path} is sharded (saved with sharded=True): pass into=<your "
                "state dict> to load it in place, at this run's world size"
            )
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        # A sharded tensor with no shard on this rank (a ZeRO fragment held elsewhere) stays a
        # key of its own: dropped, torch would take the checkpoint for one older than 2.4 and
        # look up every other key in that format.
        planner = DefaultLoadPlanner(flatten_sharded_tensors=False)
        with _dcp_files(storage, step, manifest.get("token")) as (where, files):
            dcp.load(into, planner=planner, **where)  # type: ignore[attr-defined]
        files.said()
        state, read = into, files.read_bytes()
    elif manifest.get("format") == "parts":
        state, read = _load_parts(storage, step, manifest, map_location, weights_only)
    elif isinstance(storage, LocalStorage):  # written before saves were asynchronous
        import torch

        legacy = storage.readable(step) / _LEGACY
        state = torch.load(legacy, map_location=map_location, weights_only=weights_only)
        read = {"storage": legacy.stat().st_size}
    else:
        raise ValueError(f"checkpoint {path} has a manifest of no known format: {manifest}")
    saved_by = manifest.get("world_size")
    saved_by = saved_by if isinstance(saved_by, int) else None
    _resumed(step, saved_by, on_rescale)
    return Checkpoint(step=step, state=state, path=path, world_size=saved_by, read=read)


def _check_map_location(map_location: Any) -> None:
    import torch

    if map_location is not None and not isinstance(map_location, str | torch.device):
        raise ValueError(
            f"map_location={map_location!r}: pass a device ('cpu', 'cuda:0', a torch.device) "
            "or None (the CPU); a dict or a function is not supported"
        )


class _Files:
    """The files of one published checkpoint, and where each came from.

    Each is read from the node's memory where it holds the file (and it reads well), else
    from storage.
    """

    def __init__(self, storage: Storage, step: int, token: Any) -> None:
        self.storage, self.step = storage, step
        self.token = token if isinstance(token, str) else None
        self.sources: dict[str, tuple[str, int]] = {}

    def read(
        self, name: str, from_memory: Callable[[Path], Any], read: Callable[[Any], Any]
    ) -> Any:
        """``from_memory(path)`` of the kept copy, else ``read(handle)`` of storage's."""
        kept = memory.held(self.storage, self.step, self.token, name)
        if kept is not None:
            try:
                value = from_memory(kept)
                self.sources[name] = ("memory", kept.stat().st_size)
                return value
            except (OSError, ValueError, RuntimeError, EOFError) as exc:  # storage has it whole
                print(f"sparktrain: {kept} is unreadable ({type(exc).__name__}: {exc}); reading "
                      f"{name} from storage", file=sys.stderr, flush=True)  # fmt: skip
        with self.storage.open(self.step, name) as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(0)
            self.sources[name] = ("storage", size)
            return read(handle)

    def said(self) -> None:
        """Rank 0's line: which files came from memory, which from storage."""
        if coordinate.rank_and_size()[0] != 0:
            return
        line = memory.said(self.step, self.sources)
        if env.checkpoint_memory() is not None:
            print(line, file=sys.stderr, flush=True)
        elif env.restart_count() > 0:
            print(f"{line} (the nodes here keep no checkpoint in memory across attempts: their "
                  "processes end with each attempt)", file=sys.stderr, flush=True)  # fmt: skip

    def read_bytes(self) -> dict[str, int]:
        """The bytes read from each place."""
        read: dict[str, int] = {}
        for source, size in self.sources.values():
            read[source] = read.get(source, 0) + size
        return read


@contextlib.contextmanager
def _dcp_files(storage: Storage, step: int, token: Any) -> Iterator[tuple[dict[str, Any], _Files]]:
    """Where ``torch.distributed.checkpoint`` reads a sharded checkpoint, and what from where.

    With a node memory: a folder of links, each to the node's copy where it holds one, else to
    storage's file (a local folder's checkpoint); on an object store, only where the node holds
    every file. Otherwise the checkpoint in storage as it is.
    """
    files = _Files(storage, step, token)
    if env.checkpoint_memory() is None:
        yield storage.dcp_reader(step), files
        return
    if isinstance(storage, LocalStorage):
        stored = {path.name: path for path in storage.readable(step).iterdir()}
    elif isinstance(storage, ObjectStorage) and memory.holds(storage, step, files.token):
        names = storage.files(step)  # memory holds all of them, or storage is read
        kept = {name: memory.held(storage, step, files.token, name) for name in names}
        if not names or None in kept.values():
            yield storage.dcp_reader(step), files
            return
        stored = {name: path for name, path in kept.items() if path is not None}
    else:
        yield storage.dcp_reader(step), files
        return
    with tempfile.TemporaryDirectory(prefix="sparktrain-dcp-") as view:
        for name, path in sorted(stored.items()):
            held = memory.held(storage, step, files.token, name)
            Path(view, name).symlink_to(held or path)
            if name != MANIFEST:
                source = "memory" if held is not None else "storage"
                files.sources[name] = (source, (held or path).stat().st_size)
        yield {"checkpoint_id": view}, files


def _load_parts(
    storage: Storage, step: int, manifest: dict[str, Any], map_location: Any, weights_only: bool
) -> tuple[Any, dict[str, int]]:
    """The state, and the bytes read from memory and from storage."""
    import torch

    files = _Files(storage, step, manifest.get("token"))

    def load(handle: Any) -> Any:
        return torch.load(handle, map_location=map_location, weights_only=weights_only)

    def load_kept(path: Path) -> Any:
        with open(path, "rb") as handle:
            return load(handle)

    head = files.read("skeleton.pt", load_kept, load)
    tensors: dict[int, Any] = {}
    for rank in sorted(set(head["owners"]) | {0}):
        try:  # a part in memory is mapped, not copied: its pages are in memory already
            tensors.update(files.read(parts.name(rank), parts.mapped, parts.read))
        except FileNotFoundError:
            continue
    if map_location is not None and str(map_location) != "cpu":
        tensors = {i: t.to(map_location) for i, t in tensors.items()}
    missing = [i for i in range(len(head["owners"])) if i not in tensors]
    if missing:
        raise FileNotFoundError(
            f"checkpoint {storage.location(step)} lacks {len(missing)} tensor(s) its manifest "
            f"lists (the part files of ranks {sorted({head['owners'][i] for i in missing})}): "
            "restore them or remove the folder to resume from the checkpoint before it"
        )
    files.said()
    return staging.unflatten(head["skeleton"], tensors), files.read_bytes()


def _resumed(step: int, saved_by: int | None, on_rescale: Callable[[int, int], Any] | None) -> None:
    """Tell the driver (and the user's hook) that this rank resumed from ``step``."""
    rank, now = coordinate.rank_and_size()
    if rank == 0 and env.target_world_size() is not None:
        reporting.report(**{reporting.RESUMED_METRIC: step})
        reporting.flush()
        if saved_by is not None and saved_by != now:
            print(
                f"sparktrain: resumed from checkpoint step {step}, saved by {saved_by} "
                f"rank(s), on {now} rank(s)",
                file=sys.stderr,
                flush=True,
            )
    if on_rescale is not None and saved_by is not None and saved_by != now:
        on_rescale(saved_by, now)
