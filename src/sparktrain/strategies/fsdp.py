"""``strategy="fsdp"``: PyTorch FSDP2 ``fully_shard``, layer by layer, then the root.

Runs inside a rank. Parameters, gradients and optimizer states are sharded over the ranks
(ZeRO-3); ``reshard_after_forward=False`` keeps the parameters gathered from forward to backward
(ZeRO-2's memory, DDP's traffic) and ``cpu_offload=True`` keeps shards and optimizer states in CPU
memory (the model then stays where it is: FSDP2 moves the shards itself). Which planner row prices
it follows from those two options, and ``auto`` runs every sharded row of the planner with it, so
that it needs no DeepSpeed. A sharded model is rebuilt from a weightless skeleton by
:func:`~sparktrain.strategies.plain_module`.
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from typing import Any, ClassVar

from sparktrain.planner.strategies import Strategy as PlannerRow
from sparktrain.strategies.base import Strategy, world
from sparktrain.strategies.options import PrepareOptions, Sharding


def shard(
    model: Any, where: Any, mesh: Any = None, *, precision: str | None, sharding: Sharding
) -> Any:
    """``fully_shard`` every layer of ``model`` that owns parameters, then the root, over ``mesh``.

    Args:
        model: The module (or one piece of a split model).
        where: The rank's device.
        mesh: The data-parallel mesh (default: every rank).
        precision: ``None``, ``"bf16"`` or ``"fp16"`` parameters, fp32 gradient reduction.
        sharding: Resharding after forward and CPU offload.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(where.type, (world().get_world_size(),))
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": sharding.reshard_after_forward,
    }
    if precision is not None:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if sharding.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=where.type == "cuda")
    else:
        model = model.to(where)
    for child in model.modules():  # shard each layer that owns parameters, then the root
        if child is not model and any(True for _ in child.parameters(recurse=False)):
            fully_shard(child, **options)
    return fully_shard(model, **options)


class FsdpStrategy(Strategy):
    """FSDP2 over every rank, or over the data-parallel ranks of a ``tp`` x ``pp`` layout."""

    name = "fsdp"
    #: ZeRO-1 runs as ZeRO-2 (FSDP shards gradients too: no more memory, DDP's traffic);
    #: every offload row runs with FSDP's CPU offload, which moves the parameters as well.
    auto_runs: ClassVar[dict[PlannerRow, dict[str, bool]]] = {
        "zero1": {"reshard_after_forward": False},
        "zero2": {"reshard_after_forward": False},
        "zero3": {},
        "zero2_offload": {"reshard_after_forward": False, "cpu_offload": True},
        "zero3_offload": {"cpu_offload": True},
        "zero3_offload_params": {"cpu_offload": True},
    }

    def priced_as(self, options: PrepareOptions) -> PlannerRow:
        """``zero3``; ``zero2`` without resharding; with CPU offload, their offload rows.

        FSDP2's CPU offload moves the parameters with the optimizer states, so resharding makes
        it ``zero3_offload_params``; without resharding the gathered model stays on the GPU from
        forward to backward, as ``zero2_offload`` counts it.
        """
        reshard, offload = options.sharding.reshard_after_forward, options.sharding.cpu_offload
        if offload:
            return "zero3_offload_params" if reshard else "zero2_offload"
        return "zero3" if reshard else "zero2"

    def needs_skeleton(self, options: PrepareOptions) -> bool:
        """Yes: the parameters are shards."""
        return True

    def settings(self, options: PrepareOptions) -> dict[str, Any]:
        """The strategy, ``fsdp_reshard_after_forward``, ``fsdp_cpu_offload`` and the layout."""
        sharding = {f"fsdp_{k}": v for k, v in asdict(options.sharding).items()}
        return {"strategy": self.name, **sharding, **options.parallel.settings()}

    def prepare_module(self, model: Any, options: PrepareOptions, where: Any) -> Any:
        """``model`` sharded in place over every rank."""
        return shard(model, where, precision=options.precision, sharding=options.sharding)

    def part_sharder(self, options: PrepareOptions) -> Any:
        """:func:`shard` with these options, for each piece of a split model."""
        return partial(shard, precision=options.precision, sharding=options.sharding)
