"""``save``: stage the state, hand the write to the background writer, return.

The loop is blocked only while the state is staged (one copy of this rank's share of the
tensors into reused host buffers) and while the ranks exchange three numbers. The writer then
writes this rank's part, the ranks check that every part is written, rank 0 publishes the
checkpoint (its manifest last, then one rename) and prunes old ones. Formats, by the manifest's
``format``:

- ``parts``: a replicated state (DDP, or one process). The skeleton (everything that is not a
  tensor) is ``skeleton.pt``; each rank writes the tensors
  :func:`~sparktrain.rank.checkpoints.staging.assign` gives it (rank 0: the small ones too) as
  ``part-00001.bin`` (:mod:`~sparktrain.rank.checkpoints.parts`).
- ``dcp``: a sharded state (``sharded=True``: FSDP, ZeRO), written by every rank with
  ``torch.distributed.checkpoint``, so that it loads again at any world size
  (:mod:`~sparktrain.rank.checkpoints.sharded`).

Both jobs run the same phases (:mod:`~sparktrain.rank.checkpoints.phases`), then keep the
checkpoint in the node's memory (:mod:`~sparktrain.rank.checkpoints.memory`).
"""

from __future__ import annotations

import io
import operator
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Literal

from sparktrain.ground.errors import CheckpointError, GrowBack
from sparktrain.rank.checkpoints import coordinate, memory, parts, phases, staging
from sparktrain.rank.checkpoints import sharded as dcp_format
from sparktrain.rank.checkpoints.storage import storage_for
from sparktrain.rank.checkpoints.writer import WRITER, Job

_STAGER = staging.Stager()


def save(
    state: Any,
    directory: str | os.PathLike[str],
    step: int,
    *,
    keep: int = 3,
    sharded: bool = False,
    blocking: bool = False,
    if_busy: Literal["wait", "skip"] = "wait",
    storage_options: dict[str, Any] | None = None,
    replicas: int | None = None,
    in_memory: bool = True,
) -> Path | str | None:
    """Save ``state`` as the checkpoint of ``step``; call it on every rank, with alike states.

    Returns once the state is staged: copied out of the live tensors, so the loop may change
    them at once. The checkpoint is written in the background and published (visible to
    :func:`~sparktrain.checkpoint.load_latest`) only when every rank's part is on disk.

    Args:
        state: What to save: usually ``{"model": model.state_dict(), "optimizer": ...,
            "epoch": epoch}``. Without ``sharded``, every rank's state must be the same
            (replicated, as with DDP): the ranks share the writing of its large tensors, and
            everything else comes from rank 0.
        directory: The checkpoint folder, reached by the same path on every node (a local
            disk for one machine, a shared mount, ``/dbfs/...``, a ``/Volumes/...`` volume), or
            an object store's URL: ``s3://``, ``gs://``, ``abfs://`` (fsspec and the store's
            package; ``dbfs:/x`` is read as ``/dbfs/x``).
        step: The step or epoch number; later checkpoints have larger steps.
        keep: How many complete checkpoints to keep (the oldest are removed).
        sharded: Each rank writes its own shards with ``torch.distributed.checkpoint`` (FSDP,
            ZeRO): the checkpoint loads at any world size.
        blocking: Return only once the checkpoint is published (as before 0.x's asynchronous
            saves).
        if_busy: When the previous checkpoint is still being written: ``"wait"`` for it, or
            ``"skip"`` this one (every rank skips together; ``None`` is returned).
        storage_options: For a URL, the fsspec file system's options (credentials, an
            endpoint), as ``fsspec.core.url_to_fs(directory, **storage_options)`` takes them.
        replicas: Where the node keeps the newest checkpoint in host memory (the local backend,
            a ``LocalCluster``): ``1`` also sends each rank's files to the next node, so that a
            restart after a lost node loads from the survivors' memory; ``0`` keeps each
            node's own files only. ``None``: 1 in an elastic run, else 0. A sharded state is
            kept where ``directory`` is a local path (not an object store's URL).
        in_memory: Keep the checkpoint in the node's memory at all (``False``: storage only,
            and a restart reads storage).

    Returns:
        The checkpoint's folder (a URL for an object store; published in the background unless
        ``blocking``), or ``None`` when skipped.

    Raises:
        CheckpointError: The previous checkpoint's write failed (it was not published).
        GrowBack: The driver asked this elastic run to grow back; the checkpoint is published.
    """
    step = _check(step, keep, if_busy)
    copies = memory.replicas_for(replicas) if in_memory else -1
    storage = storage_for(directory, storage_options)
    found = _groups()
    rank, size = coordinate.rank_and_size()
    flat = None if sharded else staging.flatten(state)
    if sharded and found is None:
        raise ValueError("save(..., sharded=True) needs an initialised process group")
    agreed = coordinate.agree(
        found,
        busy=WRITER.busy(),
        grow=coordinate.grow_marker(),
        signature=staging.signature(flat) if flat is not None else 0,
    )
    if agreed.busy and if_busy == "skip" and not agreed.grow:
        return None
    WRITER.settle()  # back-pressure: the buffers are the previous checkpoint's until it is kept
    target = phases.Target(storage, step, keep, found, rank, size, agreed.token, copies)
    try:
        job = (
            dcp_format.job(state, target)
            if flat is None
            else _parts_job(flat, target, agreed.alike)
        )
    except Exception as exc:  # this rank cannot stage: its writer still meets the others'
        WRITER.run(phases.failed_job(target, exc))
        raise CheckpointError(
            f"checkpoint step {step} was not published: rank {rank} could not stage its part: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if blocking or agreed.grow:
        WRITER.run(job)
    else:
        WRITER.submit(job)
    if agreed.grow:
        raise GrowBack(f"checkpoint step {step} is saved; the run grows back from it")
    where: Path | str = storage.location(step)
    return where


def wait(*, in_memory: bool = False) -> None:
    """Block until this rank's latest checkpoint is published; raise if its write failed.

    Args:
        in_memory: Also wait until the node keeps it in memory (and, with ``replicas=1``, its
            neighbour node too): a save makes that copy after the publication, and the next
            save waits for it anyway.
    """
    if in_memory:
        WRITER.settle()
    else:
        WRITER.wait()


def _check(step: int, keep: int, if_busy: str) -> int:
    try:
        whole = operator.index(step)  # an int, a numpy integer, a 0-dim integer tensor
    except TypeError:
        whole = -1
    if isinstance(step, bool) or whole < 0:
        raise ValueError(f"step={step!r} must be a whole number >= 0")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep={keep!r} must be a whole number >= 0 (0 keeps every checkpoint)")
    if if_busy not in ("wait", "skip"):
        raise ValueError(f"if_busy={if_busy!r} must be 'wait' or 'skip'")
    return whole


def _groups() -> coordinate.Groups | None:
    if coordinate.dist() is None:
        return None
    if coordinate.stale():  # a write of the world before a resize ends (or fails) first;
        WRITER.join()  # its failure belongs to that world, which the newcomers never saw
        WRITER.forget("the process group changed (an in-place resize)")
    return coordinate.groups()


def _parts_job(flat: staging.Flat, target: phases.Target, alike: bool) -> Job:
    import torch

    rank, step = target.rank, target.step
    writers = target.size if (target.found is not None and alike) else 1
    owners = staging.assign([staging.nbytes(t) for t in flat.tensors], writers)
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    staged = _STAGER.stage(flat.tensors, mine)
    skeleton = None
    if rank == 0:  # the rest of the state, as it is now (the loop may change it next)
        buffer = io.BytesIO()
        torch.save({"skeleton": flat.skeleton, "owners": owners}, buffer)
        skeleton = buffer.getvalue()
    elif target.found is None:
        return lambda: None  # no process group: rank 0 alone saves

    files: dict[str, Callable[[IO[bytes]], Any]] = {}
    if skeleton is not None:
        files["skeleton.pt"] = lambda handle: handle.write(skeleton)
    if staged or rank == 0:
        files[parts.name(rank)] = lambda out: parts.write(out, staged)
    storage, token = target.storage, target.token
    need = sum(staging.nbytes(t) for t in staged.values()) + len(skeleton or b"") + (1 << 16)

    def write_mine() -> None:
        for name, fill in files.items():
            storage.write(step, token, name, fill)

    manifest = {"format": "parts", "writers": writers, "token": token}
    kept = lambda: memory.remember(target, files, need)  # noqa: E731 - once published
    return lambda: phases.run(target, write_mine, manifest, kept)
