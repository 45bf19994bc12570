"""``prepare_model(..., tp=N, pp=M)``: a (pp, dp, tp) mesh, FSDP2 over the replicas.

The order is torchtitan's: build the mesh; cut the (whole, identically seeded) model into pipeline
stages (``pp``); split each stage's layers over ``mesh["tp"]``; shard what each rank holds over
``mesh["dp"]`` with ``fully_shard``, layer by layer. FSDP2 reshards the tensor-parallel
parameters onto the 2-D mesh itself, so ``full_state_dict``, ``log_model`` and
``sparktrain.checkpoint`` gather them as for FSDP alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparktrain.contract.env import contract_int
from sparktrain.ground.errors import ConfigError
from sparktrain.strategies.mesh import MeshShape, build_mesh, mesh_shape
from sparktrain.strategies.split import check_microbatches, check_schedule
from sparktrain.strategies.tensor_parallel import apply_tensor_parallel, check_plan

#: The strategies that compose with ``tp`` and ``pp``.
COMPOSABLE = ("ddp", "fsdp")


@dataclass(frozen=True)
class Pipelining:
    """How ``pp`` stages run: the schedule, micro-batches, stages a rank, where to cut."""

    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    split_points: list[str] | None = None


def check_mesh(strategy: str, world_size: int, tp: object, pp: object = 1) -> MeshShape:
    """The mesh for ``strategy`` with ``tp`` and ``pp`` on this run's layout, or the fix."""
    shape = mesh_shape(world_size, tp=tp, pp=pp, node_size=contract_int("LOCAL_WORLD_SIZE", 1))
    split = f"tp={shape.tp}" if shape.pp == 1 else f"tp={shape.tp}, pp={shape.pp}"
    if strategy not in COMPOSABLE:
        raise ConfigError(
            f"strategy={strategy!r} does not compose with {split}: use strategy='fsdp' "
            "(FSDP2 over the data-parallel ranks, the ZeRO-3 equivalent) or 'ddp'."
        )
    if strategy == "ddp" and shape.dp > 1:
        raise ConfigError(
            f"strategy='ddp' with {split} leaves {shape.dp} data-parallel replicas, and "
            "prepare_model composes DistributedDataParallel with neither tensor-parallel "
            "(DTensor) parameters nor pipeline stages. Use strategy='fsdp' "
            "(reshard_after_forward=False keeps it close to DDP's traffic), or "
            f"tp x pp = {world_size} for model parallelism alone."
        )
    return shape


def prepare_parallel(
    model: Any,
    strategy: str,
    where: Any,
    *,
    tp: object,
    pp: object,
    plan: dict[str, Any] | None,
    pipelining: Pipelining,
    shard: Any,
) -> Any:
    """Cut ``model`` into ``pp`` stages, split them over ``tp`` ranks, shard them (``fsdp``).

    Args:
        model: The whole module, built identically on every rank.
        strategy: ``"ddp"`` (model parallelism alone) or ``"fsdp"``.
        where: The rank's device.
        tp: Tensor-parallel degree.
        pp: Pipeline-parallel degree (stages across ranks).
        plan: The user's ``parallelize_plan``, or ``None`` for the built-in one.
        pipelining: The schedule and split of the stages (``pp`` > 1).
        shard: ``fn(model, where, mesh)`` applying FSDP2 over ``mesh`` (prepare's ``_fsdp``).
    """
    import torch.distributed as dist

    shape = check_mesh(strategy, dist.get_world_size(), tp, pp)
    if shape.tp == 1 and plan is not None:
        raise ConfigError(
            "parallelize_plan was given with tp=1: pass tp=N (the ranks each layer is split "
            "over) as well, or drop the plan."
        )
    if shape.pp > 1:
        key, per_rank = check_schedule(pipelining.schedule, pipelining.stages_per_rank)
        count = shape.pp if pipelining.microbatches is None else pipelining.microbatches
        microbatches = check_microbatches(key, count, shape.pp)
        if shape.tp > 1:
            check_plan(model, shape.tp, plan)
    mesh = build_mesh(shape, where.type)

    def prepare_part(part: Any) -> Any:
        if shape.tp > 1:
            apply_tensor_parallel(part.to(where), mesh["tp"], plan, part=shape.pp > 1)
        return shard(part, where, mesh["dp"]) if strategy == "fsdp" else part.to(where)

    if shape.pp == 1:
        return prepare_part(model)
    from sparktrain.strategies.pipeline import build_pipeline

    return build_pipeline(
        model,
        shape=shape,
        mesh=mesh,
        where=where,
        schedule=key,
        stages_per_rank=per_rank,
        microbatches=microbatches,
        split_points=pipelining.split_points,
        prepare_part=prepare_part,
    )
