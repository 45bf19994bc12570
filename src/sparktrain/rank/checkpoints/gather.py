"""At the start of a restart, each node fetches the kept checkpoint files it lacks from a survivor.

With ``replicas=1`` a lost node's files survive on its neighbour only
(:mod:`~sparktrain.rank.checkpoints.memory`). With more than one survivor, another survivor
lacks them, and its ranks would read them from storage. So, before the training function runs
in a restarted attempt (and before it calls ``init_process_group``), the ranks say what their
nodes' memory holds, through the run's store; where a node lacks a file of the newest
checkpoint some survivor keeps, one rank of a holder sends it to one rank of that node, which
keeps it beside its own. Then every load finds the whole checkpoint in its node's memory.

Every rank computes the same plan from the same postings (:func:`plan`, pure); only the ranks
that send or receive make a gloo group of their own for it, and none when nothing is missing.
A node takes no more than its memory has room for (:func:`memory.free`); what it does not take
is read from storage. Fetching never fails a rank: a failure is said on stderr and the load
reads storage. Loading does not depend on it: it reads each file from the node's memory where
it is there (and the manifest's token says it is the published checkpoint's), else storage.
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparktrain.contract import env
from sparktrain.rank.checkpoints import memory

#: The run's store keys of the exchange (one attempt's: the restart count follows).
_PREFIX = "sparktrain-gather"


@dataclass(frozen=True)
class Transfer:
    """One file one node sends another: from the ``sender`` rank to the ``receiver`` rank."""

    sender: int
    receiver: int
    store: str  # the checkpoint directory's folder in a node's memory
    folder: str  # the checkpoint's: ``<step>-<token>``
    name: str
    size: int


def needed() -> bool:
    """Whether this rank takes part: a restart, with node memory, on more than one node.

    Not a rank that joins an in-place run: it takes the live state from its peers, and the
    attempt's ranks gathered (or not) long before it started.
    """
    return (
        not env.in_place_joining()
        and env.checkpoint_memory() is not None
        and env.restart_count() > 0
        and env.contract_world_size() > memory.node_ranks()
    )


def posting(folder: str) -> dict[str, Any]:
    """What this rank says of its node: the memory folder, its room, the files it holds."""
    held: dict[str, dict[str, dict[str, int]]] = {}
    base = Path(folder)
    for store in sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []:
        for kept in sorted(p for p in store.iterdir() if p.is_dir() and _kept(p)):
            files = {f.name: f.stat().st_size for f in sorted(kept.iterdir()) if _whole(f)}
            held.setdefault(store.name, {})[kept.name] = files
    return {"node": folder, "free": memory.free(base) if base.is_dir() else 0, "held": held}


def _kept(folder: Path) -> bool:
    return not folder.name.startswith(memory.WRITING)  # a write in flight is not published


def _whole(path: Path) -> bool:
    return path.is_file() and not path.name.endswith(".partial")  # one being written


def _step(folder: str) -> int:
    """The step of a kept checkpoint's folder (``<step>-<token>``; -1 for another name)."""
    step = folder.partition("-")[0]
    return int(step) if step.isdigit() else -1


def plan(postings: list[dict[str, Any]]) -> list[Transfer]:
    """The files to send, in the order every rank takes them, from every rank's posting.

    Per checkpoint directory, the newest checkpoint any node keeps (the most held among those
    of one step); every node lacking one of its files gets it from a holder (the holders take
    turns), while the node has room. A node is the ranks with one memory folder; its lowest rank
    sends and receives for it.
    """
    nodes: dict[str, int] = {}
    for rank, said in enumerate(postings):
        nodes.setdefault(said["node"], rank)
    room = {node: int(postings[rank]["free"]) for node, rank in nodes.items()}
    held = {node: postings[rank]["held"] for node, rank in nodes.items()}
    transfers: list[Transfer] = []
    for store in sorted({name for kept in held.values() for name in kept}):
        counts: dict[str, int] = {}
        for kept in held.values():
            for folder in kept.get(store, {}):
                counts[folder] = counts.get(folder, 0) + 1
        newest = max(counts, key=lambda folder: (_step(folder), counts[folder], folder))
        holders: dict[str, list[str]] = {}
        sizes: dict[str, int] = {}
        for node, kept in held.items():
            for name, size in kept.get(store, {}).get(newest, {}).items():
                holders.setdefault(name, []).append(node)
                sizes[name] = size
        for turn, name in enumerate(sorted(holders)):
            source = holders[name][turn % len(holders[name])]
            for node, receiver in nodes.items():
                if node in holders[name] or room[node] < sizes[name]:
                    continue
                room[node] -= sizes[name]
                transfers.append(
                    Transfer(nodes[source], receiver, store, newest, name, sizes[name])
                )
    return transfers


def run(
    rank: int,
    size: int,
    connect: Callable[[], Any],
    timeout_s: float,
    lost: Callable[[], bool] = lambda: False,
) -> None:
    """This rank's part: post, plan, then send and receive its transfers (never raises).

    ``connect()`` gives a client of the run's store; ``timeout_s`` bounds each wait on a peer;
    ``lost()`` says that the run has lost a rank since the attempt began (an in-place run goes
    on without it, so the others stop waiting for its posting at once).
    """
    folder = env.checkpoint_memory()
    if folder is None:
        return
    try:
        import torch.distributed as dist

        board = dist.PrefixStore(f"{_PREFIX}/{env.restart_count()}/", connect())  # type: ignore[attr-defined]
        board.set(f"held/{rank}", json.dumps(posting(folder)))
        postings = _postings(board, size, timeout_s, lost)
        _move(plan(postings), rank, board, Path(folder), timeout_s)
    except Exception as exc:
        print(f"sparktrain: this node's memory did not fetch the checkpoint files it lacks "
              f"({type(exc).__name__}: {exc}); a load reads them from storage",
              file=sys.stderr, flush=True)  # fmt: skip


def _postings(
    board: Any, size: int, timeout_s: float, lost: Callable[[], bool]
) -> list[dict[str, Any]]:
    """Every rank's posting; an error when a rank is lost first or ``timeout_s`` passes."""
    keys = [f"held/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout_s
    while not board.check(keys):
        if lost():
            raise RuntimeError("a rank of the run was lost before it posted what its node holds")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank posted what its node holds in {timeout_s:.0f} s")
        time.sleep(0.05)
    return [json.loads(board.get(key)) for key in keys]


def _move(transfers: list[Transfer], rank: int, board: Any, folder: Path, timeout_s: float) -> None:
    """Send and receive this rank's transfers, in the plan's order, on a group of their own."""
    import torch.distributed as dist

    from sparktrain.rank.process_groups import KEPT

    involved = sorted({t.sender for t in transfers} | {t.receiver for t in transfers})
    if rank not in involved:
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("group/", board)  # type: ignore[attr-defined]
    group = dist.ProcessGroupGloo(prefixed, involved.index(rank), len(involved), timeout)
    KEPT.append(group)  # never destroyed: the rank ends with os._exit
    taken: dict[tuple[str, str], int] = {}
    for tag, move in enumerate(transfers):
        if rank == move.sender:
            _send(group, involved.index(move.receiver), tag, folder, move)
        elif rank == move.receiver:
            data = _receive(group, involved.index(move.sender), tag, move)
            if data is not None and _keep(folder, move, data):
                taken[move.store, move.folder] = taken.get((move.store, move.folder), 0) + 1
    for (store, kept), count in taken.items():
        step = _step(kept)
        for older in (folder / store).iterdir():  # older steps go, as keep does (one of the
            if _kept(older) and _step(older.name) < step:  # same step may be the one
                shutil.rmtree(older, ignore_errors=True)  # published: the load's token says)
        got = sum(m.size for m in transfers if m.receiver == rank and m.folder == kept) / 1e9
        print(f"sparktrain: checkpoint step {step}: {count} file(s) ({got:.2f} GB) this node "
              "lacked came from another node's memory", file=sys.stderr, flush=True)  # fmt: skip


def _send(group: Any, to: int, tag: int, folder: Path, move: Transfer) -> None:
    """Send one file: a header (1: it follows, 0: unreadable), then its bytes."""
    import torch

    payload = torch.empty(move.size, dtype=torch.uint8)
    try:
        with open(folder / move.store / move.folder / move.name, "rb") as handle:
            ok = handle.readinto(memoryview(payload.numpy())) == move.size  # type: ignore[arg-type]
            ok = ok and handle.read(1) == b""
    except OSError:
        ok = False
    group.send([torch.tensor([int(ok)], dtype=torch.int64)], to, tag).wait()
    if ok and move.size:
        group.send([payload], to, tag).wait()


def _receive(group: Any, source: int, tag: int, move: Transfer) -> Any:
    """The file's bytes (a tensor), or ``None`` when the sender could not read it."""
    import torch

    header = torch.zeros(1, dtype=torch.int64)
    group.recv([header], source, tag).wait()
    if not int(header[0]):
        return None
    payload = torch.empty(move.size, dtype=torch.uint8)
    if move.size:  # an empty file has no bytes to send
        group.recv([payload], source, tag).wait()
    return payload


def _keep(folder: Path, move: Transfer, data: Any) -> bool:
    """Write one received file into the node's memory, whole or not at all."""
    where = folder / move.store / move.folder
    try:
        where.mkdir(parents=True, exist_ok=True)
        memory.write(where / move.name, lambda handle: handle.write(memoryview(data.numpy())))
    except OSError as exc:
        print(f"sparktrain: {move.name} of checkpoint {move.folder} is not kept in memory "
              f"({exc}); a load reads it from storage", file=sys.stderr, flush=True)  # fmt: skip
        return False
    return True


__all__ = ["Transfer", "needed", "plan", "posting", "run"]
