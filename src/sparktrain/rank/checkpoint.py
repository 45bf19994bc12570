"""Atomic checkpoints that a restarted run resumes from.

``save(state, directory, step)`` writes into a hidden temporary folder, flushes it to disk, adds a
``COMPLETE`` marker, then renames the folder to ``step-00000042`` in one ``rename``: a crash at
any moment leaves either the previous checkpoints only, or the new one whole. ``load_latest``
considers only complete folders. Rank 0 writes the full state by default (every rank calls
``save``; the others wait at a barrier so that no rank runs ahead of a checkpoint that is not on
disk yet); ``sharded=True`` writes each rank's shards with ``torch.distributed.checkpoint`` (FSDP).
The last ``keep`` checkpoints are kept.

In an elastic run (``min_processes``), a checkpoint is where the run may change size: each
checkpoint records the world size it was saved at, ``load_latest`` calls ``on_rescale(old,
new)`` when that differs from the current one (to scale the learning rate), and ``save`` raises
:class:`~sparktrain.ground.errors.GrowBack` in every rank, once the checkpoint is on disk, when the
driver has asked the run to grow back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparktrain.contract import env
from sparktrain.ground.errors import GrowBack
from sparktrain.rank import reporting

_NAME = re.compile(r"^step-(\d{8,})$")
_MARKER = "COMPLETE"
_STATE = "state.pt"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        step: The step it was saved at.
        state: What was saved (for ``sharded=True``, the state dict loaded in place).
        path: Its folder.
        world_size: The number of ranks that saved it (``None`` for checkpoints written before
            sparktrain recorded it).
    """

    step: int
    state: Any
    path: Path
    world_size: int | None = None


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


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


def _step_of(path: Path) -> int:
    found = _NAME.match(path.name)
    return int(found.group(1)) if found else -1


def _complete(path: Path) -> bool:
    return _NAME.match(path.name) is not None and (path / _MARKER).is_file()


def _publish(tmp: Path, final: Path, step: int, world_size: int) -> None:
    marker = {"step": step, "time": time.time(), "world_size": world_size}
    (tmp / _MARKER).write_text(json.dumps(marker))
    _fsync_tree(tmp)
    if final.exists():  # the same step saved again (a resumed run): replace it whole
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def _prune(directory: Path, keep: int) -> None:
    steps = sorted((p for p in directory.iterdir() if _complete(p)), key=_step_of)
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in directory.glob(".step-*"):  # temporary folders of writes that crashed
        shutil.rmtree(stale, ignore_errors=True)


def save(
    state: Any,
    directory: str | os.PathLike[str],
    step: int,
    *,
    keep: int = 3,
    sharded: bool = False,
) -> Path:
    """Save ``state`` as the checkpoint of ``step``; call it on every rank.

    Args:
        state: What to save: usually ``{"model": model.state_dict(), "optimizer": ...,
            "epoch": epoch}``.
        directory: The checkpoint folder (shared by every rank for ``sharded=True``).
        step: The step or epoch number; later checkpoints have larger steps.
        keep: How many complete checkpoints to keep (the oldest are removed).
        sharded: Each rank writes its own shards with ``torch.distributed.checkpoint``.

    Returns:
        The checkpoint's folder.
    """
    import torch

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a whole number >= 0")
    root = Path(directory)
    final = root / f"step-{step:08d}"
    dist = _dist()
    # Without a process group, the rank comes from the torch contract (RANK), so that only
    # rank 0 writes even when every rank calls save.
    rank = dist.get_rank() if dist else env.contract_rank()
    if sharded and dist is None:
        raise ValueError("save(..., sharded=True) needs an initialised process group")
    # Shards of every rank go to one shared folder; a full state to one private to its writer.
    tmp = root / (f".step-{step:08d}.tmp" if sharded else f".step-{step:08d}.tmp-{os.getpid()}")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if sharded:
        import torch.distributed.checkpoint as dcp

        if dist:
            dist.barrier()
        dcp.save(state, checkpoint_id=str(tmp))  # type: ignore[attr-defined]
    elif rank == 0:
        with open(tmp / _STATE, "wb") as handle:
            torch.save(state, handle)
    if dist:
        dist.barrier()
    if rank == 0:
        _publish(tmp, final, step, dist.get_world_size() if dist else env.contract_world_size())
        _prune(root, keep)
    if dist:
        dist.barrier()
    if _grow_requested(dist):
        raise GrowBack(f"checkpoint step {step} is saved; the run grows back from it")
    return final


def _grow_requested(dist: Any) -> bool:
    """Whether the driver asked this elastic run to grow back, agreed by every rank."""
    marker = env.grow_file()
    if marker is None:
        return False
    import torch

    here = os.path.exists(marker)
    if dist is None:
        return here
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    flag = torch.tensor([1 if here else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the nodes hear the driver at different times
    return bool(flag.item())


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The step of the newest complete checkpoint in ``directory``, or ``None``."""
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = [int(m.group(1)) for p in root.iterdir() if _complete(p) and (m := _NAME.match(p.name))]
    return max(steps) if steps else None


def load_latest(
    directory: str | os.PathLike[str],
    *,
    into: Any = None,
    map_location: Any = "cpu",
    weights_only: bool = True,
    on_rescale: Callable[[int, int], Any] | None = None,
) -> Checkpoint | None:
    """Load the newest complete checkpoint, or return ``None`` when there is none.

    Args:
        directory: The checkpoint folder.
        into: For sharded checkpoints, the state dict to load into, in place (as
            ``torch.distributed.checkpoint.load`` needs).
        map_location: Where tensors go (full checkpoints).
        weights_only: Refuse arbitrary pickled objects (``torch.load``'s safe mode); pass
            ``False`` for states holding other Python objects you trust.
        on_rescale: Called as ``on_rescale(old_world_size, new_world_size)`` when the
            checkpoint was saved by a different number of ranks than run now (an elastic run
            shrank or grew): scale the learning rate there if you prefer that to a constant
            global batch (see :func:`sparktrain.elastic.accumulation`).
    """
    import torch

    step = latest_step(directory)
    if step is None:
        return None
    path = Path(directory) / f"step-{step:08d}"
    saved_by = _saved_world_size(path)
    if into is not None:
        import torch.distributed.checkpoint as dcp

        dcp.load(into, checkpoint_id=str(path))  # type: ignore[attr-defined]
        state = into
    else:
        state = torch.load(path / _STATE, map_location=map_location, weights_only=weights_only)
    _resumed(step, saved_by, on_rescale)
    return Checkpoint(step=step, state=state, path=path, world_size=saved_by)


def _saved_world_size(path: Path) -> int | None:
    try:
        found = json.loads((path / _MARKER).read_text()).get("world_size")
    except (OSError, ValueError):
        return None
    return int(found) if isinstance(found, int) else None


def _resumed(step: int, saved_by: int | None, on_rescale: Callable[[int, int], Any] | None) -> None:
    """Tell the driver (and the user's hook) that this rank resumed from ``step``."""
    dist = _dist()
    now = dist.get_world_size() if dist else env.contract_world_size()
    rank = dist.get_rank() if dist else env.contract_rank()
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
