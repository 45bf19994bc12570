"""A sharded state's checkpoint job (``save(..., sharded=True)``): DCP, every rank its shards.

The state is staged into CPU buffers kept from save to save (pinned where it lives on a GPU),
then written by every rank with ``torch.distributed.checkpoint`` on the checkpoint's own group,
so that it loads again at any world size. Once published, each rank keeps the files it wrote in
the node's memory (and sends them to its neighbour with ``replicas=1``), as the replicated
format does: read back from a local path's folder, or, for an object store, written to the
node's memory first, uploaded, and moved into place once published.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from sparktrain.rank.checkpoints import coordinate, memory, phases
from sparktrain.rank.checkpoints.storage import LocalStorage
from sparktrain.rank.checkpoints.writer import After, Job

_DCP_CACHE: dict[str, Any] = {}


def job(state: Any, target: phases.Target) -> Job:
    """Stage ``state`` (this rank's shards) now; the job writes, publishes and keeps it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    found = target.found
    assert found is not None
    key = str(sorted(_keys(state)))  # names, shapes and dtypes: a changed tensor gets a new buffer
    cached = _DCP_CACHE.get(key)
    if cached is None:
        _DCP_CACHE.clear()
        cached = _create_cpu_state_dict(state, pin_memory=_on_gpu(state))
        _DCP_CACHE[key] = cached
    staged = _copy_state_dict(state, cached, non_blocking=False)
    storage, step, token = target.storage, target.step, target.token
    first: list[Path | None] = [_writing(target, staged)]  # the node's memory, then storage

    def write_mine() -> None:
        local = first[0]
        if not all(coordinate.all_ok(found, local is not None)):  # all ranks alike, or none
            _drop(local)
            first[0] = None
        elif local is not None:
            try:
                dcp.save(staged, process_group=found.write, checkpoint_id=str(local))  # type: ignore[attr-defined]
            except Exception as exc:  # DCP tells every rank: every rank writes to storage
                _drop(local)
                first[0] = None
                memory.say_once(f"checkpoint step {step} is written to storage alone ({exc})")
            else:
                for path in sorted(local.iterdir()):  # then uploaded: storage has it whole
                    storage.write(step, token, path.name, _copy_of(path))
                return
        where = storage.dcp_writer(step, token)
        dcp.save(staged, process_group=found.write, **where)  # type: ignore[attr-defined]

    def remember() -> None:  # once published: this rank's files kept in the node's memory
        if isinstance(storage, LocalStorage):  # read back from the published folder
            folder = storage.readable(step)
            mine = sorted(folder.glob(f"__{found.rank}_*.distcp"))
            mine += [folder / ".metadata"] if target.rank == 0 else []
            copies: memory.Files = {path.name: _copy_of(path) for path in mine}
            memory.remember(target, copies, sum(path.stat().st_size for path in mine))
            return
        local = first[0]  # written there first: moved into place (every rank exchanges)
        try:
            moved: memory.Files = {p.name: p for p in sorted(local.iterdir())} if local else {}
            memory.remember(target, moved, 0)
        finally:
            _drop(local)

    def run() -> After:
        try:
            return phases.run(target, write_mine, {"format": "dcp", "token": token}, remember)
        except BaseException:
            _drop(first[0])
            raise

    return run


def _drop(folder: Path | None) -> None:
    """Remove a folder written to first (nothing for ``None``)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _writing(target: phases.Target, staged: Any) -> Path | None:
    """Where this rank writes its files first: its node's memory, for an object store.

    ``None`` (DCP writes to storage itself) for a local path (read back from there once
    published), without node memory, with ``in_memory=False``, or without room for the node's
    ranks' files.
    """
    if isinstance(target.storage, LocalStorage) or target.replicas < 0:
        return None
    need = _nbytes(staged)
    folder = None
    try:
        folder = memory.writing(target.storage, target.step, target.token, target.rank)
        if folder is not None:
            memory.room(folder, need * memory.node_ranks())
        return folder
    except OSError as exc:
        _drop(folder)
        memory.say_once(f"checkpoint step {target.step} is written to storage alone ({exc})")
        return None


def _copy_of(path: Path) -> Callable[[IO[bytes]], Any]:
    def fill(handle: IO[bytes]) -> None:
        with open(path, "rb") as source:
            shutil.copyfileobj(source, handle, 1 << 20)

    return fill


def _nbytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (a sharded tensor's local shards)."""
    if isinstance(state, dict):
        return sum(_nbytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(_nbytes(value) for value in state)
    if hasattr(state, "local_shards"):
        return sum(_nbytes(shard.tensor) for shard in state.local_shards())
    if hasattr(state, "to_local"):  # a DTensor: this rank's shard
        return _nbytes(state.to_local())
    if hasattr(state, "element_size") and hasattr(state, "numel"):
        return int(state.numel()) * int(state.element_size())
    return 0


def _keys(state: Any, prefix: str = "") -> list[str]:
    """Names, shapes and dtypes, and a DTensor's local shape (the staged buffers' key).

    An in-place ZeRO run cuts its partitions anew at the same global shape: its buffers must be
    made again.
    """
    if isinstance(state, dict):
        return [k for key, value in state.items() for k in _keys(value, f"{prefix}{key}.")]
    shape = getattr(state, "shape", None)
    if shape is None:
        return [prefix]
    local = tuple(state.to_local().shape) if hasattr(state, "to_local") else ""
    return [f"{prefix}:{tuple(shape)}:{local}:{getattr(state, 'dtype', '')}"]


def _on_gpu(state: Any) -> bool:
    import torch

    if isinstance(state, dict):
        return any(_on_gpu(value) for value in state.values())
    if hasattr(state, "local_shards"):  # a ShardedTensor (a ZeRO partition's fragments)
        return any(shard.tensor.is_cuda for shard in state.local_shards())
    return isinstance(state, torch.Tensor) and state.is_cuda
