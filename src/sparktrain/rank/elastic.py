"""What a rank of an elastic run needs to keep its training the same (``sparktrain.elastic``).

An elastic run (``launch(..., num_processes=4, min_processes=2)``) may go on with fewer ranks
than it was launched with after losing a node, and grow back later (see ``docs/elastic.md``).
By default the global batch stays the one the run was launched with: each rank accumulates
gradients over :func:`accumulation` batches before an optimizer step, so that ``ranks x
accumulation x batch size`` stays constant. A user who prefers to keep one batch per step and
scale the learning rate instead passes ``on_rescale`` to
:func:`sparktrain.checkpoint.load_latest`, called with the old and new world sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparktrain.contract import env
from sparktrain.ground.errors import ConfigError


def target_world_size() -> int:
    """The number of ranks the run was launched with (this attempt's size outside elastic runs)."""
    return env.target_world_size() or world_size()


def world_size() -> int:
    """The number of ranks running now."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return env.contract_world_size()


def accumulation(base: int = 1) -> int:
    """Batches each rank accumulates per optimizer step, to keep the launch's global batch.

    ``base`` is the accumulation the run uses at its full size. With the full size a multiple of
    the current size (8 -> 4 -> 2 -> 1), the global batch is exactly the same; otherwise this
    rounds up (8 ranks -> 3: 3 batches each, 9/8 of the global batch), which keeps the
    per-rank memory the same and errs on the larger batch.

    Raises:
        ConfigError: ``base`` is not a whole number >= 1.
    """
    if isinstance(base, bool) or not isinstance(base, int) or base < 1:
        raise ConfigError(f"accumulation(base={base!r}): base must be a whole number >= 1.")
    return -(-base * target_world_size() // world_size())


def in_place(model: Any, optimizer: Any, make_data: Callable[[int, int], Any]) -> Any:
    """This rank's in-place elastic loop (``launch(..., min_processes=..., in_place=True)``).

    Forms the process group itself (do not call ``init_process_group``), starts every rank from
    rank 0's weights (a joining rank from its live peers'), and returns a
    :class:`sparktrain.rank.inplace.InPlace`: iterate its ``batches()``, call
    ``loss.backward()`` and then its ``step()``, which reduces the gradients, commits the step on
    every rank or none, and steps the optimizer (no DDP wrapper, no ``optimizer.step()``).
    ``make_data(rank, world_size)`` makes this rank's dataset at a size (a ``sparktrain.data``
    dataset: after a rescale the rest of the epoch is divided again from its state in memory).
    See docs/elastic.md, "In place".
    """
    import json

    from sparktrain.rank.inplace import InPlace
    from sparktrain.rank.stores import client_store, contract_store

    me = env.contract_rank()
    hosted = env.in_place_store()  # the driver's, which outlives every rank
    if hosted is not None:
        import torch.distributed as dist

        host, port, secret = hosted
        store = dist.PrefixStore(secret, client_store(host, port, 600))  # type: ignore[attr-defined]
    else:
        store = contract_store()
        if me == 0:
            store.set("members/0", json.dumps(list(range(env.contract_world_size()))))
    return InPlace(model, optimizer, make_data, store=store, me=me, joining=env.in_place_joining())


__all__ = ["accumulation", "in_place", "target_world_size", "world_size"]
