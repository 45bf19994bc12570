"""Inside a rank: no process group is ever destroyed, so its teardown can never deadlock the rank.

Torch (2.13 and earlier, gloo) can hang a process forever when a ``ProcessGroupGloo`` is
destroyed by the main thread: ``~ProcessGroupGloo`` joins its run-loop threads while holding the
GIL, and a run-loop thread that is dropping the last reference to a finished collective needs the
GIL too, because the collective's captured thread-local state holds a Python object (the
``contextvars.Context`` that ``torch.autograd`` stashes in thread-local storage during every
backward, so DDP's gradient all-reduces carry one). The destructor runs wherever the group's last
reference goes: after ``dist.destroy_process_group()`` that is often a DDP model's ``Reducer``,
freed when the training function returns (pytorch/pytorch#75097, #56297; docs/reliability.md has
the stacks and the measurements).

A rank is one run's process, and it ends with ``os._exit``, which runs no destructor. So the
fix is to keep every group alive until then: :func:`install` wraps ``destroy_process_group``
(both names users call: ``torch.distributed.destroy_process_group`` and
``torch.distributed.distributed_c10d.destroy_process_group``) so that the groups it unregisters
are first referenced here. The call still does everything else it did (NCCL communicators are
shut down, the group leaves the registry, a new ``init_process_group`` works), and the rank's
memory holds a few idle gloo threads until it exits.

The wrapper fixes one more teardown hazard. Destroying the default group resets torch's group
counter, so the next ``init_process_group`` in the same process names its group ``0`` again and
rendezvouses under the same keys of the rank's store, which still hold the first group's
addresses: a peer that reads them first connects to the old group (refused when it was
destroyed, accepted and then silent when it is kept) and the new group never forms. Ranks share
one store for their whole life, so the wrapper keeps the counter going instead: every group of a
rank has store keys of its own, and all ranks, which create their groups in the same order,
agree on the names.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

#: Called before the default group is destroyed (a checkpoint still being written ends first).
BEFORE_DESTROY: list[Callable[[], None]] = []

#: Every process group this rank unregistered (and the store rank 0 hosts), kept alive until
#: ``os._exit``.
KEPT: list[Any] = []


def name_from_zero() -> None:
    """Let the next group be named ``0``: for a group over a store prefix of its own.

    Ranks whose earlier groups differ in number (a survivor and a joiner) must name a new group
    alike, and the prefix keeps its keys apart from every earlier group's.
    """
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def _keep_registered() -> None:
    from torch.distributed import distributed_c10d

    known = {id(group) for group in KEPT}
    for group in list(distributed_c10d._world.pg_map):
        if id(group) not in known:
            KEPT.append(group)
            known.add(id(group))


def install() -> None:
    """Make ``destroy_process_group`` keep the groups it unregisters (once per rank process)."""
    if "torch.distributed" not in sys.modules:  # a rank that never imports torch needs nothing
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group
    if getattr(original, "_sparktrain_keeps_groups", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is getattr(dist.group, "WORLD", None):
            for hook in BEFORE_DESTROY:
                hook()
        _keep_registered()
        count = getattr(distributed_c10d._world, "group_count", None)
        original(group)
        if count is not None:  # torch resets it when the default group goes: keep counting
            distributed_c10d._world.group_count = max(count, distributed_c10d._world.group_count)

    destroy_process_group._sparktrain_keeps_groups = True  # type: ignore[attr-defined]
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
