"""``strategy="auto"``: ask :func:`sparktrain.plan` for this model on these GPUs and follow it.

Without the run's shape the planner weighs model states only and picks a data-parallel strategy
(:data:`AUTO_MAP` says how each runs with PyTorch's own wrappers). With ``plan_shape``
(``seq_len``, ``micro_batch``, ...) it weighs activations too and may recommend a tensor x
pipeline mesh, which runs as ``fsdp`` with ``tp``/``pp``.
"""

from __future__ import annotations

import logging
from typing import Any

from sparktrain.contract.env import contract_int
from sparktrain.errors import ConfigError

log = logging.getLogger("sparktrain.strategies")

#: How ``auto`` runs each planner recommendation with PyTorch's own wrappers.
AUTO_MAP: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "zero1": ("fsdp", {"reshard_after_forward": False}),
    "zero2": ("fsdp", {"reshard_after_forward": False}),
    "zero3": ("fsdp", {}),
    "zero2_offload": ("fsdp", {"reshard_after_forward": False, "cpu_offload": True}),
    "zero3_offload": ("fsdp", {"cpu_offload": True}),
    "zero3_offload_params": ("fsdp", {"cpu_offload": True}),
}


def choose(
    model: Any,
    gpu_memory: object,
    cpu_memory: object,
    precision: str | None,
    shape: dict[str, Any] | None,
) -> tuple[str, dict[str, Any]]:
    """The strategy name and its ``prepare_model`` options (``tp``/``pp`` for a mesh)."""
    from sparktrain.planner import plan
    from sparktrain.strategies.prepare import device, world

    dist = world()
    where = device()
    if gpu_memory is None:
        if where.type != "cuda":
            log.info("strategy='auto' on CPU ranks: ddp (no GPU memory to fit)")
            return "ddp", {}
        import torch

        gpu_memory = torch.cuda.get_device_properties(where).total_memory
    local = contract_int("LOCAL_WORLD_SIZE", 1)
    chosen = plan(
        model,
        gpus_per_node=local,
        nodes=max(1, dist.get_world_size() // local),
        gpu_memory=gpu_memory,  # type: ignore[arg-type]
        cpu_memory=cpu_memory,  # type: ignore[arg-type]
        precision="fp32" if precision is None else f"{precision}-mixed",  # type: ignore[arg-type]
        **(shape or {}),
    )
    mesh = _auto_mesh(chosen, model)
    if mesh is not None:
        name, options = "fsdp", {"tp": mesh.tp, "pp": mesh.pp}
        said, reasons = mesh.name, chosen.mesh_reasons
    elif chosen.recommended is None:
        raise ConfigError(
            "strategy='auto': no strategy fits this model on these GPUs:\n" + str(chosen)
        )
    else:
        name, options = AUTO_MAP[chosen.recommended]
        said, reasons = chosen.recommended, chosen.reasons
    if dist.get_rank() == 0:
        print(f"sparktrain: strategy='auto' chose {said} (runs as {name} {options})")
        for reason in reasons:
            print(f"  - {reason}")
    return name, options


def _auto_mesh(chosen: Any, model: Any) -> Any:
    """The mesh ``auto`` runs, or ``None`` for a data-parallel strategy.

    The planner's mesh when it splits the model; pipelines need an ``nn.Sequential``, so for
    other models the first mesh without stages that fits.
    """
    from torch import nn

    pick = chosen.recommended_mesh
    if pick is not None and pick.pp > 1 and not isinstance(model, nn.Sequential):
        pick = next((m for m in chosen.meshes if m.pp == 1 and m.fits_with_headroom), None)
    if pick is None or (pick.tp, pick.pp) == (1, 1):
        return None
    return pick
