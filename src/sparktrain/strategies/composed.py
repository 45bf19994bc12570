"""``prepare_model(..., tp=N)``: tensor parallelism inside a node, FSDP2 over the replicas.

The order is torchtitan's: build the mesh, split the (whole, identically seeded) model's layers
over ``mesh["tp"]``, then shard what each rank holds over ``mesh["dp"]`` with ``fully_shard``,
layer by layer. FSDP2 reshards the tensor-parallel parameters onto the 2-D mesh itself, so
``full_state_dict``, ``log_model`` and ``sparktrain.checkpoint`` gather them as for FSDP alone.
"""

from __future__ import annotations

from typing import Any

from sparktrain.errors import ConfigError
from sparktrain.rank.env import contract_int
from sparktrain.strategies.mesh import MeshShape, build_mesh, mesh_shape
from sparktrain.strategies.tensor_parallel import apply_tensor_parallel

#: The strategies that compose with ``tp``.
COMPOSABLE = ("ddp", "fsdp")


def check_mesh(strategy: str, world_size: int, tp: object) -> MeshShape:
    """The mesh for ``strategy`` with ``tp`` on this run's layout, or the error naming the fix."""
    shape = mesh_shape(world_size, tp=tp, node_size=contract_int("LOCAL_WORLD_SIZE", 1))
    if strategy not in COMPOSABLE:
        raise ConfigError(
            f"strategy={strategy!r} does not compose with tp={shape.tp}: use strategy='fsdp' "
            "(FSDP2 over the data-parallel ranks, the ZeRO-3 equivalent) or 'ddp'."
        )
    if strategy == "ddp" and shape.dp > 1:
        raise ConfigError(
            f"strategy='ddp' with tp={shape.tp} leaves {shape.dp} data-parallel replicas, and "
            "DistributedDataParallel does not take tensor-parallel (DTensor) parameters. Use "
            "strategy='fsdp' (reshard_after_forward=False keeps it close to DDP's traffic), or "
            f"tp={world_size} for tensor parallelism alone."
        )
    return shape


def prepare_tensor_parallel(
    model: Any,
    strategy: str,
    where: Any,
    *,
    tp: object,
    plan: dict[str, Any] | None,
    shard: Any,
) -> Any:
    """Split ``model`` over ``tp`` ranks, then (``fsdp``) shard it over the replicas.

    Args:
        model: The whole module, built identically on every rank.
        strategy: ``"ddp"`` (tensor parallelism alone) or ``"fsdp"``.
        where: The rank's device.
        tp: Tensor-parallel degree.
        plan: The user's ``parallelize_plan``, or ``None`` for the built-in one.
        shard: ``fn(model, where, mesh)`` applying FSDP2 over ``mesh`` (prepare's ``_fsdp``).
    """
    import torch.distributed as dist

    shape = check_mesh(strategy, dist.get_world_size(), tp)
    if shape.tp == 1:
        raise ConfigError(
            "parallelize_plan was given with tp=1: pass tp=N (the ranks each layer is split "
            "over) as well, or drop the plan."
        )
    mesh = build_mesh(shape, where.type)
    model = model.to(where)
    apply_tensor_parallel(model, mesh["tp"], plan)
    if strategy == "fsdp":
        return shard(model, where, mesh["dp"])
    return model
