"""How the ranks agree on a checkpoint: two gloo groups of their own, and one small exchange.

The loop's own process group is never touched from the writer's thread (two threads issuing
collectives on one group can interleave differently on each rank). On the first save of a world
(and again after an in-place resize made a new one), every rank makes two gloo groups: one for
the loop's thread (:attr:`Groups.agree`: whether any rank's writer is busy, whether the driver
asked to grow, whether the states look alike), one for the writer's thread (:attr:`Groups.write`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from sparktrain.contract import env


@dataclass(frozen=True)
class Groups:
    """The checkpoint's groups of one world.

    Attributes:
        world: The default group they belong to.
        agree: For the loop's thread.
        write: For the writer's thread.
        rank: This rank in the world.
        size: The world's size.
    """

    world: Any
    agree: Any
    write: Any
    rank: int
    size: int


@dataclass(frozen=True)
class Agreed:
    """What every rank learnt from the exchange of one save.

    Attributes:
        busy: Some rank's writer is still writing the previous checkpoint.
        grow: The driver asked the run to grow back (some rank saw its marker).
        alike: Every rank's state has the same tensors' shapes and dtypes.
        token: Rank 0's name for this save's files (an object store writes under it).
    """

    busy: bool
    grow: bool
    alike: bool
    token: str


#: The groups of the newest world (one item at most).
_CURRENT: list[Groups] = []


def dist() -> Any:
    """``torch.distributed`` when a process group is up, else ``None``."""
    import torch.distributed as tdist

    return tdist if tdist.is_available() and tdist.is_initialized() else None


def groups() -> Groups | None:
    """This world's checkpoint groups, made on first use (a collective: every rank saves)."""
    tdist = dist()
    if tdist is None:
        return None
    from torch.distributed import distributed_c10d

    world = distributed_c10d._get_default_group()
    if not _CURRENT or _CURRENT[0].world is not world:
        timeout = world_timeout(world)  # the run's, not torch's 30-minute default
        agree = tdist.new_group(backend="gloo", timeout=timeout)
        write = tdist.new_group(backend="gloo", timeout=timeout)
        _CURRENT[:] = [Groups(world, agree, write, tdist.get_rank(), tdist.get_world_size())]
    return _CURRENT[0]


def world_timeout(world: Any) -> Any:
    """The default group's collective timeout (a ``timedelta``), or ``None``.

    ``None`` (torch's 30-minute default) only where its backend does not say: the checkpoint's
    groups wait as long as the run's, so a peer that hangs holds a writer no longer.
    """
    import torch

    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def stale() -> bool:
    """Whether groups were made for a world that is no longer the default group's."""
    if not _CURRENT:
        return False
    from torch.distributed import distributed_c10d

    return _CURRENT[0].world is not distributed_c10d._get_default_group()


def agree(found: Groups | None, *, busy: bool, grow: bool, signature: int) -> Agreed:
    """Exchange this rank's view (one all-gather of four numbers on the loop's group)."""
    token = secrets.randbits(62)
    if found is None or found.size == 1:
        return Agreed(busy=busy, grow=grow, alike=True, token=f"{token:016x}")
    import torch

    tdist = dist()
    mine = torch.tensor([int(busy), int(grow), signature, token], dtype=torch.int64)
    every = [torch.zeros(4, dtype=torch.int64) for _ in range(found.size)]
    tdist.all_gather(every, mine, group=found.agree)
    return Agreed(
        busy=any(int(t[0]) for t in every),
        grow=any(int(t[1]) for t in every),
        alike=len({int(t[2]) for t in every}) == 1,
        token=f"{int(every[0][3]):016x}",
    )


def all_ok(found: Groups | None, ok: bool) -> list[bool]:
    """Every rank's ``ok`` (on the writer's group): whether each one's part is written."""
    if found is None or found.size == 1:
        return [ok]
    import torch

    tdist = dist()
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(found.size)]
    tdist.all_gather(every, torch.tensor([int(ok)], dtype=torch.int64), group=found.write)
    return [bool(int(t[0])) for t in every]


def barrier(found: Groups | None) -> None:
    """Wait for every rank's writer (on the writer's group)."""
    if found is not None and found.size > 1:
        dist().barrier(group=found.write)


def grow_marker() -> bool:
    """Whether this rank sees the driver's request to grow back."""
    import os

    marker = env.grow_file()
    return marker is not None and os.path.exists(marker)


def rank_and_size() -> tuple[int, int]:
    """This rank and the world's size, from the process group or else the torch contract."""
    tdist = dist()
    if tdist is not None:
        return tdist.get_rank(), tdist.get_world_size()
    return env.contract_rank(), env.contract_world_size()
