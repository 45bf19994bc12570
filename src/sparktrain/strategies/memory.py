"""What a rank holds: bytes of its parameters and optimizer states, shards counted locally.

Parameters count their local part: an FSDP ``DTensor``'s shard, a ZeRO-3 parameter's
``ds_tensor``, a whole tensor otherwise. Optimizer states count the tensors of the torch
optimizer that actually steps (inside DeepSpeed's, for the ZeRO stages). Gradients are left out:
they live between backward and step only.
"""

from __future__ import annotations

from typing import Any


def _local(tensor: Any) -> Any:
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    if hasattr(tensor, "to_local"):
        return tensor.to_local()
    return tensor


def local_bytes(tensor: Any) -> int:
    """Bytes of the part of ``tensor`` this rank holds (its DTensor or ZeRO shard, else all)."""
    local = _local(tensor)
    return int(local.numel() * local.element_size())


def torch_optimizer(optimizer: Any) -> Any:
    """The innermost ``.optimizer`` (sparktrain's wrapper -> DeepSpeed's -> torch's)."""
    while getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    return optimizer


def held_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """``{"parameters": ..., "optimizer": ...}``: bytes this rank holds for ``model``."""
    import torch

    params = sum(local_bytes(p) for p in model.parameters())
    states = 0
    for state in torch_optimizer(optimizer).state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                states += local_bytes(value)
    return {"parameters": params, "optimizer": states}
