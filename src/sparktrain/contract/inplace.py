"""The keys of an in-place elastic run's store, as the driver and every rank name them.

The store (``torch.distributed.TCPStore``, hosted by the driver so that it outlives every rank)
holds, for generation ``g``: ``members/<g>`` (its ranks' first ranks, in order, JSON),
``abort/<g>`` (set by the first rank that sees a peer fail), ``state/<g>/<rank>`` (each
survivor's committed step count), and the group's own keys under the prefix ``g<g>``. Requests
to the running group (ranks to let go, ranks that join) are ``request/<k>``, numbered by the
counter ``request_slots``; ``joined/<rank>`` tells a joiner the generation it is in,
``gone/<rank>`` that a rank left on notice, and ``finished`` that the run read its data to the
end.

A sharded run (HSDP: each replica group shards the model, the groups replicate it) sets
``replica_size``: a generation's members are then its replica groups, ``replica_size`` first
ranks each, in order, and a group that lost a rank is dropped whole (its shards are incomplete).
Its other ranks wait to join again, as a new group, with a returning node (tickets
``join_tickets``, ``ticket/<t>``: ``replica_size`` consecutive tickets form a group).

Each rank says what its run keeps (``in_place_kind``: replicated, sharded or ZeRO) when it
starts its in-place loop, before its group forms: the driver decides a loss by it.

A ZeRO run (the optimizer state partitioned, one partition a rank) sets ``zero_node_ranks``: the
ranks of a node, which places each partition's copy on another node (:func:`copy_holder`), and
``zero_plans``: the members the partitions were cut for before the last cut and now (JSON).
"""

from __future__ import annotations

import json
from typing import Any

SLOTS = "request_slots"
FINISHED = "finished"
REPLICA_SIZE = "replica_size"
TICKETS = "join_tickets"
ZERO_NODE_RANKS = "zero_node_ranks"
KIND = "in_place_kind"  # "replicated", "sharded" or "zero": set by the first rank that starts
ZERO_PLANS = "zero_plans"


def members(generation: int) -> str:
    """The key of generation ``generation``'s members."""
    return f"members/{generation}"


def joined(rank: int) -> str:
    """The key that tells joining ``rank`` the generation it is let into."""
    return f"joined/{rank}"


def gone(rank: int) -> str:
    """The key a rank sets when it left the group on notice (its committed step count)."""
    return f"gone/{rank}"


def abort(generation: int) -> str:
    """The key that tells generation ``generation``'s ranks to leave their collective."""
    return f"abort/{generation}"


def replica_size(store: Any) -> int:
    """The ranks of a replica group in ``store``'s run (1: every rank holds the whole model)."""
    return int(store.get(REPLICA_SIZE)) if store.check([REPLICA_SIZE]) else 1


def replica_groups(group: list[int], size: int) -> list[list[int]]:
    """``group``'s replica groups: ``size`` consecutive members each (the last may be short)."""
    return [group[i : i + size] for i in range(0, len(group), size)]


def whole_groups(group: list[int], size: int) -> list[int]:
    """The members of ``group`` in whole replica groups (a short rest left out)."""
    return [m for replica in replica_groups(group, size) if len(replica) == size for m in replica]


def keep_whole(group: list[int], lost: set[int], size: int) -> tuple[list[int], list[int]]:
    """The members of ``group`` that go on after ``lost`` are gone, and those dropped.

    A replica group that lost a member is dropped whole, and so is a rest of fewer than ``size``
    members (an attempt that started short); their other members are returned second (alive,
    out of the group: they wait to join again).
    """
    kept: list[int] = []
    dropped: list[int] = []
    for replica in replica_groups(group, size):
        if lost & set(replica) or len(replica) < size:  # a rest of fewer ranks is no group
            dropped += [rank for rank in replica if rank not in lost]
        else:
            kept += replica
    return kept, dropped


def copy_holder(partition: int, world: int, node_ranks: int) -> int:
    """The place that holds a copy of ``partition``'s optimizer state in a ZeRO generation.

    Place ``i`` of a generation of ``world`` ranks owns partition ``i``; its copy is held by the
    same place on the next node (``node_ranks`` on), or by the next rank when one node holds
    every rank.
    """
    offset = node_ranks if world > node_ranks else 1
    return (partition + offset) % world


def zero_node_ranks(store: Any) -> int | None:
    """The ranks of a node in ``store``'s run if it is a ZeRO run (else ``None``)."""
    return int(store.get(ZERO_NODE_RANKS)) if store.check([ZERO_NODE_RANKS]) else None


def partitions_lost(plan: list[int], lost: set[int], node_ranks: int) -> list[int]:
    """The optimizer partitions cut for ``plan`` whose owner and copy are both in ``lost``."""
    world = len(plan)
    holders = [(plan[k], plan[copy_holder(k, world, node_ranks)]) for k in range(world)]
    return [k for k, (owner, copy) in enumerate(holders) if owner in lost and copy in lost]


def zero_plans(store: Any) -> list[list[int]]:
    """The plans a ZeRO run's ranks may hold their partitions for (before the last cut, now)."""
    return list(json.loads(store.get(ZERO_PLANS))) if store.check([ZERO_PLANS]) else []


def latest(store: Any, known: int) -> int:
    """The latest generation named in ``store``, looking on from ``known``."""
    while store.check([members(known + 1)]):
        known += 1
    return known


def post(store: Any, request: dict[str, list[int]]) -> None:
    """Ask the group to let ranks go (``leave``) or in (``join``) at its next step's end."""
    slot = int(store.add(SLOTS, 1)) - 1
    store.set(f"request/{slot}", json.dumps(request))


def posted(store: Any, seen: int) -> int:
    """How many requests are readable, in order, counting on from ``seen`` known ones."""
    slots = int(store.add(SLOTS, 0))
    while seen < slots and store.check([f"request/{seen}"]):
        seen += 1
    return seen


def request(store: Any, number: int) -> dict[str, list[int]]:
    """Request ``number`` (it is readable: :func:`posted` counted it)."""
    return dict(json.loads(store.get(f"request/{number}")))


def host_store(world_size: int, host: str = "127.0.0.1") -> tuple[Any, str]:
    """A store naming generation 0, listening on ``host`` only, at a free port.

    torch's ``TCPStore`` has no authentication of its own and, left to itself, listens on every
    interface. Here it listens on ``host`` alone (loopback for a run on this machine), and every
    key lives under a fresh secret prefix (128 bits): a stranger who connects can neither read
    nor set a key the run uses.

    Returns:
        The store (keys under the prefix), and what the ranks get to reach it:
        ``<secret>@<host>:<port>`` (read back by :func:`sparktrain.contract.env.in_place_store`).
    """
    import secrets
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, 0), family=family, backlog=1024)
    port = listener.getsockname()[1]
    server = dist.TCPStore(  # type: ignore[attr-defined]
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
        master_listen_fd=listener.detach(),
    )
    secret = secrets.token_hex(16)
    store = dist.PrefixStore(secret, server)  # type: ignore[attr-defined]
    store.set(members(0), json.dumps(list(range(world_size))))
    return store, f"{secret}@{host}:{port}"
