"""A sharded state's checkpoint job (``save(..., sharded=True)``): DCP, every rank its shards.

The state is staged into CPU buffers kept from save to save (pinned where it lives on a GPU),
then written by every rank with ``torch.distributed.checkpoint`` on the checkpoint's own group,
so that it loads again at any world size. Once published, where the directory is a local path,
each rank keeps the files it wrote in the node's memory (and sends them to its neighbour with
``replicas=1``), as the replicated format does.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from sparktrain.rank.checkpoints import memory, phases
from sparktrain.rank.checkpoints.storage import LocalStorage
from sparktrain.rank.checkpoints.writer import Job

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

    def write_mine() -> None:
        where = target.storage.dcp_writer(target.step, target.token)
        dcp.save(staged, process_group=found.write, **where)  # type: ignore[attr-defined]

    def remember() -> None:  # once published: this rank's files, read back from a local folder
        storage = target.storage
        if not isinstance(storage, LocalStorage):  # the same on every rank: nobody exchanges
            return
        folder = storage.readable(target.step)
        mine = sorted(folder.glob(f"__{found.rank}_*.distcp"))
        mine += [folder / ".metadata"] if target.rank == 0 else []
        files = {path.name: _copy_of(path) for path in mine}
        memory.remember(target, files, sum(path.stat().st_size for path in mine))

    manifest = {"format": "dcp", "token": target.token}
    return lambda: phases.run(target, write_mine, manifest, remember)


def _copy_of(path: Path) -> Callable[[IO[bytes]], Any]:
    def fill(handle: IO[bytes]) -> None:
        with open(path, "rb") as source:
            shutil.copyfileobj(source, handle, 1 << 20)

    return fill


def _keys(state: Any, prefix: str = "") -> list[str]:
    if isinstance(state, dict):
        return [k for key, value in state.items() for k in _keys(value, f"{prefix}{key}.")]
    shape = getattr(state, "shape", None)
    if shape is None:
        return [prefix]
    return [f"{prefix}:{tuple(shape)}:{getattr(state, 'dtype', '')}"]


def _on_gpu(state: Any) -> bool:
    import torch

    if isinstance(state, dict):
        return any(_on_gpu(value) for value in state.values())
    if hasattr(state, "local_shards"):  # a ShardedTensor (a ZeRO partition's fragments)
        return any(shard.tensor.is_cuda for shard in state.local_shards())
    return isinstance(state, torch.Tensor) and state.is_cuda
