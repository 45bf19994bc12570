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

import os
from collections.abc import Callable
from functools import partial
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


def mesh(replicas: int, *, timeout: float = 30.0) -> Any:
    """Form this rank's replica group for a sharded in-place run; return its device mesh.

    The ranks are divided into groups of consecutive ranks, the launch's ``num_processes /
    replicas`` each (put a group on one node, as HSDP does, by launching that many ranks per
    node; an attempt that started short has its whole groups, and the rest joins later). This
    rank's ``torch.distributed`` process group becomes its replica group (do not call
    ``init_process_group``): shard the model over the mesh with ``fully_shard(module,
    mesh=mesh)``, make its optimizer, and pass the mesh to :func:`in_place`, which reduces the
    gradients across the groups. A group that loses a rank is dropped whole; the run goes on
    with the others, and the group's other ranks run the training function again to join with
    a returning node (healed from a live replica, no checkpoint read). See docs/elastic.md,
    "In place for sharded models".

    Args:
        replicas: How many copies of the model the run keeps (a divisor of the run's ranks).
        timeout: The replica group's collective timeout (seconds).

    Raises:
        ConfigError: ``replicas`` does not divide the ranks, or a process group already exists.
    """
    from sparktrain.rank import replicas as groups

    return groups.mesh(replicas, timeout=timeout)


def in_place(
    model: Any,
    optimizer: Any,
    make_data: Callable[[int, int], Any],
    *,
    mesh: Any = None,
    replicas: int | None = None,
    zero: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 100,
) -> Any:
    """This rank's in-place elastic loop (``launch(..., min_processes=..., in_place=True)``).

    Forms the process group itself (do not call ``init_process_group``), starts every rank from
    rank 0's weights (a joining rank from its live peers'), and returns a
    :class:`sparktrain.rank.inplace.InPlace`: iterate its ``batches()``, call
    ``loss.backward()`` and then its ``step()``, which reduces the gradients, commits the step on
    every rank or none, and steps the optimizer (no DDP wrapper, no ``optimizer.step()``).
    ``make_data(rank, world_size)`` makes this rank's dataset at a size (a ``sparktrain.data``
    dataset: after a rescale the rest of the epoch is divided again from its state in memory).
    Use ``run.rank`` and ``run.world_size`` for this rank's place in the run now.

    With ``mesh`` (from :func:`mesh`) the model is sharded inside replica groups (HSDP with
    ``fully_shard``): the loop returned is a
    :class:`sparktrain.rank.inplace_sharded.ShardedInPlace`, used the same way. See
    docs/elastic.md, "In place".

    With ``replicas`` instead, this call makes the mesh (:func:`mesh`) and shards the plain
    ``model`` itself (``fully_shard`` on every layer that owns parameters, then the root), and
    makes the optimizer again over the sharded parameters (the loop's ``run.optimizer``):
    ``optimizer`` is then a torch optimizer made over the plain model (its class and settings
    are kept; one parameter group, no state yet) or a function that makes one from parameters.

    With ``zero=1`` or ``zero=2`` every rank keeps the whole model and the optimizer state is
    partitioned over the ranks (on gloo both stages all-reduce the gradient: its reduce-scatter
    cannot be left when a peer dies), each partition with a copy on another node: the loop is a
    :class:`sparktrain.rank.inplace_zero.ZeroInPlace`, whose optimizer (``run.optimizer``) is
    made again over the partitions as with ``replicas``. A loss re-divides the lost partitions
    from their copies, in place; ZeRO-3 (the parameters partitioned too) is ``replicas=``.

    With ``checkpoint_dir``, the loop also saves its state there every ``checkpoint_every``
    committed steps (asynchronously; an HSDP run from its first replica group, a ZeRO run
    each rank its own partition) and, on the
    restart path (a loss that left no live copy of some state), loads the newest one before
    its first step: weights, optimizer state, step count and data position, from the
    survivors' memory where they hold it, else from storage. Without it such a restart trains
    from the start. See :mod:`sparktrain.rank.inplace_keep`.

    Raises:
        ConfigError: Two of ``mesh``, ``replicas`` and ``zero``; a ``zero`` other than 1 or 2;
            an optimizer that cannot be made again; a bad ``checkpoint_dir`` or
            ``checkpoint_every``.
    """
    from sparktrain.rank.inplace_keep import Keeper
    from sparktrain.rank.replicas import in_place_store

    if sum(x is not None for x in (mesh, replicas, zero)) > 1:
        raise ConfigError(
            "sparktrain.elastic.in_place(...): pass one of mesh= (a model you sharded "
            "yourself), replicas= (HSDP: have it sharded here) and zero= (ZeRO-1/2)."
        )
    keeper = None if checkpoint_dir is None else Keeper(checkpoint_dir, checkpoint_every)
    if zero is not None:
        run: Any = _zero(model, optimizer, make_data, zero)
        joining = env.in_place_joining()
    elif replicas is not None or mesh is not None:
        from sparktrain.rank.inplace_sharded import ShardedInPlace
        from sparktrain.rank.replicas import active

        if replicas is not None:
            mesh, optimizer = _sharded_here(model, optimizer, replicas)
        layout = active(mesh)
        run = ShardedInPlace(model, optimizer, make_data, layout=layout)
        joining = layout.joining
    else:
        from sparktrain.rank.inplace import InPlace

        joining = env.in_place_joining()
        run = InPlace(
            model, optimizer, make_data, store=in_place_store(), me=env.contract_rank(),
            joining=joining,
        )  # fmt: skip
    if keeper is not None:
        if not joining and not run.left:
            keeper.resume(run)  # the attempt's first generation: the restart path's checkpoint
        run.keeper = keeper
    return run


def _zero(model: Any, optimizer: Any, make_data: Callable[[int, int], Any], zero: object) -> Any:
    """``in_place(..., zero=)``: the ZeRO-1/2 loop, or a clear error for another stage."""
    from sparktrain.rank.inplace_zero import ZeroInPlace

    if zero == 3:
        raise ConfigError(
            "sparktrain.elastic.in_place(..., zero=3): ZeRO-3 partitions the parameters too, with "
            "no copy of a partition on another rank, so a lost rank's parameters exist only in a "
            "checkpoint. Keep a sharded model in place with replicas= (HSDP: FSDP2 shards inside "
            "replica groups), or leave in_place out (the restart path)."
        )
    if isinstance(zero, bool) or zero not in (1, 2):
        raise ConfigError(
            f"sparktrain.elastic.in_place(..., zero={zero!r}): zero is the ZeRO stage, 1 (the "
            "optimizer state partitioned) or 2 (the gradients too; on gloo it runs as 1)."
        )
    from sparktrain.rank.replicas import in_place_store

    make_optimizer = _optimizer_maker(optimizer, "zero")  # checked before anything forms
    return ZeroInPlace(
        model,
        make_optimizer,
        make_data,
        stage=int(zero),
        store=in_place_store(),
        me=env.contract_rank(),
        node_ranks=env.contract_int("LOCAL_WORLD_SIZE", 1),
        joining=env.in_place_joining(),
    )


def _sharded_here(model: Any, optimizer: Any, replicas: int) -> tuple[Any, Any]:
    """``in_place(..., replicas=)``: the mesh, the model sharded over it, the optimizer again."""
    import torch

    from sparktrain.strategies.fsdp import shard
    from sparktrain.strategies.options import Sharding

    remade = _optimizer_maker(optimizer, "replicas")
    made = mesh(replicas)
    shard(model, torch.device("cpu"), made, precision=None, sharding=Sharding())
    return made, remade(model.parameters())


def _optimizer_maker(optimizer: Any, option: str) -> Callable[[Any], Any]:
    """How to make ``optimizer`` again over other parameters (checked before anything forms).

    ``option`` is the ``in_place`` argument that asks for it, as errors name it.
    """
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        if callable(optimizer):
            return optimizer  # type: ignore[no-any-return]
        raise ConfigError(
            f"sparktrain.elastic.in_place(..., {option}=...): optimizer={optimizer!r} is neither "
            "a torch optimizer nor a function that makes one from parameters, such as "
            "lambda params: torch.optim.AdamW(params, lr=1e-3)."
        )
    kind = type(optimizer).__name__
    over = "partitions" if option == "zero" else "sharded parameters"
    if len(optimizer.param_groups) != 1 or optimizer.state:
        raise ConfigError(
            f"sparktrain.elastic.in_place(..., {option}=...): the {kind} has "
            f"{len(optimizer.param_groups)} parameter groups"
            + (" and a state already" if optimizer.state else "")
            + f"; it is made again over the {over} from its class and settings, "
            "which keeps one group and no state. Pass a function that makes it from "
            "parameters instead, such as lambda params: torch.optim.AdamW(params, lr=1e-3)."
        )
    return partial(type(optimizer), **_settings(optimizer))


def _settings(optimizer: Any) -> dict[str, Any]:
    """The optimizer's settings that its class takes (AdamW's defaults name one it does not)."""
    import inspect

    taken = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in taken}


__all__ = ["accumulation", "in_place", "mesh", "target_world_size", "world_size"]
