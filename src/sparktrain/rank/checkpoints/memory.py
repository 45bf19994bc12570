"""Recovery from memory: the newest checkpoint's files kept in the node's host memory.

Where the node offers a memory folder (``SPARKTRAIN_CHECKPOINT_MEMORY``: on the local backend and
on a ``LocalCluster``, whose folders outlive the run's attempts; see
:mod:`sparktrain.node.memory`), every rank keeps the files it wrote of the newest checkpoint
there once it is published: its part (rank 0: the skeleton too), or its DCP files of a sharded
one saved to a local path (rank 0: the metadata too), under
``<folder>/<store>/<step>-<token>/``, where ``<store>`` names the checkpoint directory. With
``replicas=1`` it also sends them to the rank of its local rank on the next node, which keeps
them beside its own, so that a lost node's files survive on its neighbour.

A restart on several nodes first has each node fetch the files it lacks from a survivor's
memory (:mod:`~sparktrain.rank.checkpoints.gather`). It reads each file from its node's memory
where it is there (and was written by the published checkpoint's save: the token says so), and
from storage otherwise (a sharded one
through a folder of links, each to the node's copy or to storage's file). Rank 0 prints one
line saying which files came from where. Keeping and sending never fail a checkpoint: a failure
is said on stderr and the checkpoint stays in storage alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from sparktrain.contract import env

#: How many neighbours keep a copy of a rank's files by default: 1 in elastic runs, else 0.
ELASTIC_REPLICAS = 1


def node_ranks() -> int:
    """The ranks of this node (``LOCAL_WORLD_SIZE``, at least 1)."""
    return max(env.contract_int("LOCAL_WORLD_SIZE", 1), 1)


def replicas_for(replicas: int | None) -> int:
    """The number of copies to send: ``replicas``, or the default (1 in an elastic run)."""
    if replicas is None:
        return ELASTIC_REPLICAS if env.target_world_size() is not None else 0
    if isinstance(replicas, bool) or replicas not in (0, 1):
        raise ValueError(
            f"replicas={replicas!r}: pass 0 (this node's memory only) or 1 (also a neighbour "
            "node's); more copies are not supported"
        )
    return replicas


def _base(storage: Any) -> Path | None:
    """This node's folder for the checkpoints of ``storage``, or ``None`` without memory."""
    folder = env.checkpoint_memory()
    if folder is None or not os.path.isdir(folder):
        return None
    where = str(storage.location(0))
    return Path(folder) / hashlib.blake2b(where.encode(), digest_size=8).hexdigest()


def _here(storage: Any, step: int, token: str) -> Path | None:
    base = _base(storage)
    return None if base is None else base / f"{step:08d}-{token}"


#: What a rank keeps: a file's name -> what writes it, or the file in memory already (moved).
Files = Mapping[str, Callable[[IO[bytes]], Any] | Path]


def keep(storage: Any, step: int, token: str, files: Files, need: int) -> None:
    """Keep this rank's ``files`` of a published checkpoint in memory.

    The folders of older checkpoints of the same directory go first: one checkpoint is kept
    (and writes in flight of older steps, see :func:`writing`). ``need`` is about how many
    bytes the files take: without room for them (and some room left for others, see
    :func:`room`), nothing is written. A file given as a path (written to :func:`writing`'s
    folder) is moved into place.
    """
    here = _here(storage, step, token)
    if here is None:
        return
    try:
        here.parent.mkdir(exist_ok=True)  # never the node's folder: gone, it stays gone
        for other in here.parent.glob("*"):
            if other.name != here.name and _stale(other.name, step, token):
                shutil.rmtree(other, ignore_errors=True)
        room(here.parent, need)
        here.mkdir(exist_ok=True)
        for name, fill in files.items():
            if isinstance(fill, Path):
                os.replace(fill, here / name)
            else:
                write(here / name, fill)
    except OSError as exc:  # no room (a small /dev/shm), or the node's folder is gone
        for name in files:  # this rank's files only: its peers on the node keep theirs
            (here / name).unlink(missing_ok=True)
        say_once(f"checkpoint step {step} is not kept in memory ({exc}); a restart reads storage")


def _stale(name: str, step: int, token: str) -> bool:
    """Whether the folder ``name`` goes once ``step`` (saved under ``token``) is published.

    Every other kept checkpoint goes, and every write to memory first but those of this save
    (its ranks' on the node may still be moving their files into place) and of later steps.
    """
    if not name.startswith(WRITING):
        return True
    written, _, rest = name[len(WRITING) :].partition("-")
    if not written.isdigit() or int(written) < step:
        return True
    return int(written) == step and not rest.startswith(f"{token}-")


#: The start of a folder a rank writes a checkpoint's files into before it is published.
WRITING = ".writing-"


def writing(storage: Any, step: int, token: str, rank: int) -> Path | None:
    """A new folder in this node's memory for ``rank`` to write its files of ``step`` into.

    For a checkpoint whose storage is elsewhere (an object store): the rank writes there first,
    uploads, and once the checkpoint is published its files are kept by moving them (see
    :func:`keep`). ``None`` without node memory. This rank's folders of earlier writes (cut
    short) are removed.
    """
    base = _base(storage)
    if base is None:
        return None
    base.mkdir(exist_ok=True)
    for stale in base.glob(f"{WRITING}*-{rank}"):
        shutil.rmtree(stale, ignore_errors=True)
    folder = base / f"{WRITING}{step:08d}-{token}-{rank}"
    folder.mkdir()
    return folder


def remember(target: Any, files: Files, need: int) -> None:
    """Once ``target``'s checkpoint is published: :func:`keep` its ``files``, then exchange.

    ``target`` is the save's target (its storage, step, token, groups and ``replicas``: -1
    keeps nothing, 1 also sends the files to the next node). Every rank of the world takes its
    part in the exchange whatever failed in keeping, so no peer is left waiting.
    """
    if target.replicas < 0:
        return
    try:
        keep(target.storage, target.step, target.token, files, need)
    finally:
        if target.replicas > 0 and target.found is not None:
            exchange(target.found, target.storage, target.step, target.token, list(files))


#: What a node's memory folder leaves free on its file system: the larger of this and a tenth of
#: it (``/dev/shm`` is shared with data loaders and NCCL; a 64 MB one keeps nothing).
HEADROOM_BYTES = 64 << 20


def _spare(total: int) -> int:
    return max(HEADROOM_BYTES, total // 10)


def free(folder: Path) -> int:
    """The bytes ``folder``'s file system can still take, its headroom left free."""
    usage = shutil.disk_usage(folder)
    return max(usage.free - _spare(usage.total), 0)


def room(folder: Path, need: int) -> None:
    """Raise ``OSError`` unless ``need`` bytes fit in ``folder``'s file system with headroom."""
    usage = shutil.disk_usage(folder)
    spare = _spare(usage.total)
    if usage.free - need < spare:
        raise OSError(
            f"{need / 1e9:.2f} GB would leave less than {spare / 1e9:.2f} GB free of "
            f"{usage.total / 1e9:.2f} GB on {folder.parent}"
        )


def write(path: Path, fill: Callable[[IO[bytes]], Any]) -> None:
    """Write a file whole or not at all (a reader never takes a cut one for complete)."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as handle:
            fill(handle)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def exchange(found: Any, storage: Any, step: int, token: str, names: list[str]) -> None:
    """Send this rank's kept files to its neighbour node's rank; keep what the other one sends.

    Every rank of the world calls it (collectives of the checkpoint's writer group): rank ``r``
    sends to ``r + L`` and receives from ``r - L`` (``L`` ranks a node), so each node holds its
    own files and its previous node's. Where that would send to a rank of the same node (the
    ranks of a node not numbered in a row, after an in-place resize), no rank sends. Whatever
    fails on a rank, it still takes its part in every exchange, so no peer is left waiting.
    Nothing is exchanged where the nodes keep no memory (the same on every node of a run) or
    the world is one node.
    """
    import torch
    import torch.distributed as dist

    local = node_ranks()
    if env.checkpoint_memory() is None or found.size <= local:
        return
    nodes: list[Any] = [None] * found.size
    dist.all_gather_object(nodes, env.contract_int("NODE_RANK", 0), group=found.write)
    to, source = (found.rank + local) % found.size, (found.rank - local) % found.size
    if any(nodes[r] == nodes[(r + local) % found.size] for r in range(found.size)):
        return  # every rank sees the same list, so every rank returns here
    here = _here(storage, step, token)
    payload = torch.zeros(8, dtype=torch.uint8)  # nothing to send: the peer still hears so
    try:
        if here is not None:
            payload = _pack(here, names)
    except Exception as exc:  # never leave the peer waiting: it receives an empty payload
        say_once(f"checkpoint step {step}: not sent to the next node's memory ({exc})")
    sizes = torch.tensor([payload.numel(), 0], dtype=torch.int64)  # [what I send, I take it]
    theirs = torch.zeros(2, dtype=torch.int64)
    _swap(dist, found.write, (sizes[:1].clone(), to), (theirs[:1], source))
    received = None
    try:
        if here is not None:
            room(here, int(theirs[0]))
            received = torch.empty(int(theirs[0]), dtype=torch.uint8)
    except Exception as exc:
        say_once(f"checkpoint step {step}: rank {source}'s copy is not kept in memory ({exc})")
    taken = torch.tensor([int(received is not None)], dtype=torch.int64)
    _swap(dist, found.write, (taken, source), (theirs[1:], to))  # whether `to` takes mine
    sent = dist.isend(payload, to, group=found.write) if int(theirs[1]) else None
    if received is not None:
        dist.irecv(received, source, group=found.write).wait()  # type: ignore[union-attr]
    if sent is not None:
        sent.wait()
    if received is None or here is None:
        return
    try:
        for name, data in _unpack(received).items():
            write(here / name, lambda handle, data=data: handle.write(data))  # type: ignore[misc]
    except OSError as exc:
        for name in _unpack(received):
            (here / name).unlink(missing_ok=True)
        say_once(f"checkpoint step {step}: rank {source}'s copy is not kept in memory ({exc})")


def _swap(dist: Any, group: Any, send: tuple[Any, int], receive: tuple[Any, int]) -> None:
    """Send one tensor and receive another at once (every rank sends and receives)."""
    sent = dist.isend(send[0], send[1], group=group)
    dist.irecv(receive[0], receive[1], group=group).wait()
    sent.wait()


def _pack(here: Path, names: list[str]) -> Any:
    """``names`` of ``here`` as one byte tensor: an 8-byte length, a JSON index, the bytes."""
    import torch

    sizes: dict[str, int] = {}
    for name in names:
        with contextlib.suppress(OSError):
            sizes[name] = (here / name).stat().st_size
    header = json.dumps(sizes).encode()
    payload = torch.empty(8 + len(header) + sum(sizes.values()), dtype=torch.uint8)
    view = memoryview(payload.numpy())  # type: ignore[arg-type]
    view[: 8 + len(header)] = struct.pack("<Q", len(header)) + header
    offset = 8 + len(header)
    for name, size in sizes.items():
        with open(here / name, "rb") as handle:
            if handle.readinto(view[offset : offset + size]) != size:
                raise OSError(f"{here / name} changed while it was sent")
        offset += size
    return payload


def _unpack(payload: Any) -> dict[str, memoryview]:
    """The files :func:`_pack` packed (an empty payload holds none)."""
    view = memoryview(payload.numpy())
    if len(view) < 8:
        return {}
    (length,) = struct.unpack("<Q", view[:8])
    sizes = json.loads(bytes(view[8 : 8 + length]) or b"{}")
    files, offset = {}, 8 + length
    for name, size in sizes.items():
        files[name] = view[offset : offset + size]
        offset += size
    return files


def holds(storage: Any, step: int, token: str | None) -> bool:
    """Whether this node's memory has a folder for the checkpoint of ``step`` under ``token``."""
    here = None if not token else _here(storage, step, token)
    return here is not None and here.is_dir()


def held(storage: Any, step: int, token: str | None, name: str) -> Path | None:
    """The file ``name`` of the checkpoint of ``step`` written under ``token``, if in memory."""
    if not token:
        return None
    here = _here(storage, step, token)
    path = None if here is None else here / name
    return path if path is not None and path.is_file() else None


_SAID: set[str] = set()


def say_once(line: str) -> None:
    """Say on stderr that memory keeps nothing, once per process (not at every checkpoint)."""
    if not _SAID:
        print(f"sparktrain: {line} (said once)", file=sys.stderr, flush=True)
    _SAID.add(line)


def kept_bytes() -> int:
    """The bytes this node's memory folder holds now (0 without one)."""
    folder = env.checkpoint_memory()
    if folder is None:
        return 0
    return sum(p.stat().st_size for p in Path(folder).glob("*/*/*") if p.is_file())


def said(step: int, sources: dict[str, tuple[str, int]]) -> str:
    """The line saying where each file of a loaded checkpoint came from."""
    where: dict[str, list[str]] = {"memory": [], "storage": []}
    sizes = {"memory": 0, "storage": 0}
    for name, (source, size) in sources.items():
        where[source].append(name)
        sizes[source] += size
    parts = [
        f"{source}: {', '.join(names)} ({sizes[source] / 1e9:.2f} GB)"
        for source, names in where.items()
        if names
    ]
    return f"sparktrain: checkpoint step {step} loaded from {'; from '.join(parts)}"
