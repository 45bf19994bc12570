"""The replica groups of a sharded in-place run (HSDP): this rank's group, and joining again.

A sharded in-place run (``launch(..., in_place=True)`` whose training function calls
:func:`sparktrain.elastic.mesh`) shards its model inside replica groups of consecutive ranks and
replicates it across the groups. This rank's process group (``torch.distributed``'s default
one) is its replica group, so ``fully_shard(model, mesh=mesh)`` shards inside the group as usual;
the reductions across groups are :class:`sparktrain.rank.inplace_sharded.ShardedInPlace`'s.

A group that lost a rank is dropped whole; its other ranks raise out of the training function
(from a collective inside the group, or :class:`Dropped` from ``step()``), and the rank's worker
asks :func:`rejoin_after` whether that is why: if so, the function runs again as a joiner. A
joiner takes a ticket; ``replica_size`` consecutive tickets form a new group, which asks in as a
whole and heals from a live replica.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sparktrain.contract import env
from sparktrain.contract.inplace import (
    FINISHED,
    KIND,
    REPLICA_SIZE,
    TICKETS,
    abort,
    latest,
    members,
    replica_groups,
    replica_size,
)
from sparktrain.ground.errors import ConfigError
from sparktrain.rank import process_groups

#: How often a waiting joiner looks at the store (seconds).
POLL_SECONDS = 0.05
#: How long a replica group's members wait for each other before forming it (seconds).
ARRIVAL_SECONDS = 60.0
#: How many times a rank may join again in one run (a bound, not a goal: a loop of failures
#: that each look like a lost peer ends as a failure).
MAX_REJOINS = 50


class Dropped(RuntimeError):
    """This rank's replica group lost a member: the rank leaves and joins again as a new group."""


@dataclass
class Layout:
    """This rank's replica group in a sharded in-place run.

    Attributes:
        store: The run's store (the driver's, keys under the run's secret).
        me: This rank's first rank (its name in ``members/<g>``).
        size: The ranks of a replica group.
        index: This rank's place in its group (which shard of each parameter it holds).
        group: The group's first ranks, in order.
        joining: The rank joins a running group.
        since: The latest generation when it was made (a joiner is let in at a later one).
        mesh: The device mesh of the group (``torch.distributed``'s default process group).
        finished: A joiner whose run ended before its group formed: it trains nothing.
        run: The rank's in-place loop once made (set by it).
    """

    store: Any
    me: int
    size: int
    index: int
    group: list[int]
    joining: bool
    since: int
    mesh: Any = None
    finished: bool = False
    run: Any = field(default=None, repr=False)


_ACTIVE: Layout | None = None
_REJOINS = 0


def in_place_store() -> Any:
    """The store of this rank's in-place run: the driver's, or the contract's (one attempt)."""
    from sparktrain.rank.stores import client_store, contract_store

    hosted = env.in_place_store()  # the driver's, which outlives every rank
    if hosted is None:
        store = contract_store()
        if env.contract_rank() == 0 and not store.check([members(0)]):
            store.set(members(0), json.dumps(list(range(env.contract_world_size()))))
        return store
    import torch.distributed as dist

    host, port, secret = hosted
    return dist.PrefixStore(secret, client_store(host, port, 600))  # type: ignore[attr-defined]


def _check_replicas(replicas: object, world: int) -> int:
    """``world // replicas``; a clear error for a count that does not divide the world."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(
            f"sparktrain.elastic.mesh(replicas={replicas!r}): replicas must be a whole number >= 1 "
            "(the model's copies; each is sharded over world_size / replicas ranks)."
        )
    if world % replicas:
        raise ConfigError(
            f"sparktrain.elastic.mesh(replicas={replicas}): the run's {world} ranks do not divide "
            f"into {replicas} replica groups; pick a divisor of {world}, or launch a multiple of "
            f"{replicas} ranks."
        )
    return world // replicas


def group_size(replicas: int, world: int, target: int) -> int:
    """The ranks of a replica group in an attempt of ``world`` ranks of a run of ``target``.

    One replica: every rank of the attempt. Else the launch's full size over ``replicas`` (what
    a shard needs stays the same: an attempt that started short has whole groups and a rest,
    which joins when a node returns), or one group of all when fewer ranks are up than that.
    """
    size = _check_replicas(replicas, target)
    if replicas == 1:
        return world
    return size if world >= size else world


def _tickets(store: Any, me: int, size: int) -> tuple[list[int], int, str] | None:
    """A joiner's group: its members, this rank's place, the group's tag; ``None``: run ended.

    The group's members decide its fate once, for all of them (``compare_set`` on the group's
    key): formed when its tickets are all taken, abandoned when one of them saw the run end
    first. A member that went its own way while another formed the group would leave that one
    waiting for it in ``init_process_group``.
    """
    ticket = int(store.add(TICKETS, 1)) - 1
    store.set(f"ticket/{ticket}", str(me))
    first = ticket - ticket % size
    keys, fate = [f"ticket/{t}" for t in range(first, first + size)], f"fate/{first}"
    while True:
        if store.check(keys):
            decided = store.compare_set(fate, "", "formed")
            break
        if store.check([FINISHED]):
            decided = store.compare_set(fate, "", "abandoned")
            break
        time.sleep(POLL_SECONDS)
    if (decided.decode() if isinstance(decided, bytes) else decided) != "formed":
        return None
    return [int(store.get(k)) for k in keys], ticket - first, f"shard/join/{first}"


def _arrive(store: Any, tag: str, group: list[int], me: int) -> None:
    """Wait for the group's members before its ``init_process_group``.

    That call would wait for a lost member until its timeout; here :class:`Dropped` comes at once
    when the driver names a generation without one of them (a node lost while the ranks start).
    """
    store.set(f"{tag}/arrived/{me}", "1")
    keys = [f"{tag}/arrived/{m}" for m in group]
    deadline = time.monotonic() + ARRIVAL_SECONDS
    while not store.check(keys) and time.monotonic() < deadline:  # then the group's own wait
        if _left_out(store, group):
            raise Dropped(f"a member of replica group {group} was lost before the group formed")
        time.sleep(POLL_SECONDS)


def _left_out(store: Any, group: list[int]) -> bool:
    """Whether the latest generation (after the first) lacks a member of ``group``."""
    newest = latest(store, 0)
    return newest > 0 and not set(group) <= set(json.loads(store.get(members(newest))))


def mesh(replicas: int, *, timeout: float = 30.0) -> Any:
    """Form this rank's replica group and return its device mesh (see :func:`in_place`)."""
    global _ACTIVE  # noqa: PLW0603 - the rank's one sharded run
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise ConfigError(
            "sparktrain.elastic.mesh() forms the rank's process group itself (its replica "
            "group); call it instead of init_process_group, once per training function."
        )
    store, me = in_place_store(), env.contract_rank()
    joining = env.in_place_joining() or _REJOINS > 0
    since = latest(store, 0)
    finished = False
    if not joining:
        # A group's size is the launch's full size over ``replicas``: an attempt that started
        # short (a node lost while it started) has whole groups and a rest, which joins.
        first = json.loads(store.get(members(0)))
        size = group_size(replicas, len(first), env.target_world_size() or len(first))
        store.set(REPLICA_SIZE, str(size))
        store.set(KIND, "sharded")  # the driver drops whole groups from now on
        place = first.index(me)
        group = replica_groups(first, size)[place // size]
        index, tag = place % size, f"shard/0/{place // size}"
        joining = len(group) < size
    if joining:
        size = replica_size(store)
        formed = _tickets(store, me, size)
        if formed is None:  # the run ended first: a group of one, which trains nothing
            finished, group, index, tag = True, [me], 0, f"shard/alone/{me}/{time.time_ns()}"
        else:
            group, index, tag = formed
    process_groups.name_from_zero()  # the tag is this group's own: named alike by its ranks
    layout = Layout(store, me, size, index, group, joining, since, finished=finished)
    _ACTIVE = layout  # before the group forms: a member lost meanwhile, rejoin_after decides
    if not joining:  # a first group: its members are in generation 0
        _arrive(store, tag, group, me)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(tag, store),  # type: ignore[attr-defined]
        rank=index,
        world_size=len(group),
        timeout=timedelta(seconds=timeout),
    )
    layout.mesh = init_device_mesh("cpu", (len(group),))
    return layout.mesh


def active(device_mesh: Any) -> Layout:
    """The layout :func:`mesh` made ``device_mesh`` for; a clear error for any other mesh."""
    if _ACTIVE is None or _ACTIVE.mesh is not device_mesh:
        raise ConfigError(
            "sparktrain.elastic.in_place(..., mesh=...) takes the mesh that "
            "sparktrain.elastic.mesh(replicas=...) returned in this training function (it knows "
            "the replica groups); shard the model over that mesh with fully_shard."
        )
    return _ACTIVE


def _dropped(layout: Layout, timeout: float) -> bool:
    """After a failure inside the group: whether the driver named a generation without this rank.

    The rank tells its generation's other ranks to leave their collectives (its ``abort`` key),
    then waits up to ``timeout`` for the next generation.
    """
    run, store = layout.run, layout.store
    if run is None:  # failed in mesh(): its group did not form (a member lost meanwhile)
        if layout.joining or _left_out(store, layout.group):
            return True  # a joiner is in no generation yet: it takes a new ticket
        generation = latest(store, layout.since)  # others' collectives are not its to abort
    else:
        generation = run.generation
        store.set(abort(generation), "1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.check([members(generation + 1)]):
            return layout.me not in json.loads(store.get(members(generation + 1)))
        if store.check([FINISHED]):
            return False
        time.sleep(POLL_SECONDS)
    return False


def rejoin_after(error: BaseException) -> bool:
    """Whether the training function should run again, as a joiner, after raising ``error``.

    ``True`` when this rank's replica group was dropped (a peer lost, or leaving on notice):
    the rank's process group is gone and the next :func:`mesh` joins anew. ``False`` for any
    other error, and outside a sharded in-place run.
    """
    global _ACTIVE, _REJOINS
    layout = _ACTIVE
    if layout is None or not isinstance(error, RuntimeError) or _REJOINS >= MAX_REJOINS:
        return False
    timeout = layout.run.timeout if layout.run is not None else 30.0
    if not isinstance(error, Dropped) and not _dropped(layout, timeout):
        return False
    import sys

    import torch.distributed as dist

    print(
        f"sparktrain: rank {layout.me}: its replica group {layout.group} was dropped "
        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); it "
        "joins again as a new group, healed from a live replica",
        file=sys.stderr,
        flush=True,
    )
    if layout.run is not None:
        layout.run.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _ACTIVE, _REJOINS = None, _REJOINS + 1
    return True
