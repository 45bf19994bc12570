"""A ZeRO-1 or ZeRO-2 engine's state as shards that load at any world size, with no gathering.

DeepSpeed's ZeRO-1/2 optimizer holds, on each rank, one flat fp32 partition per parameter
group and the optimizer's state over it (Adam's two moments); every module parameter has a
fragment in one or two ranks' partitions, at a known offset of the flattened parameter
(``param._hp_mapping``). :func:`zero_state` describes each parameter's fp32 master and state
as a 1-D sharded tensor over those fragments, views of the partitions themselves, so that
``checkpoint.save(state, directory, step, sharded=True)`` has every rank write its own
fragments (torch distributed checkpoint's format, staged asynchronously like any sharded
state). :func:`load_zero_state` describes the fragments of the current world the same way and
loads into them in place: torch distributed checkpoint reads each fragment from whichever saved
ones overlap it, so a checkpoint saved by 4 ranks loads on 2. The module's parameters are then
gathered from the partitions (DeepSpeed's own ``update_lp_params``).

ZeRO-3 is not covered: its parameters live as partitions of their own (``ds_tensor``) under
DeepSpeed's gathering hooks; it saves through DeepSpeed and
:func:`sparktrain.strategies.reshard.to_universal`. Runs inside a rank.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.rank.checkpoint import Checkpoint, latest_step, load_latest
from sparktrain.strategies import zero

#: The engine's counters that a resumed run continues from.
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")

# torch prefers DTensor to ShardedTensor, but a DTensor's shards cannot sit at the uneven offsets
# of DeepSpeed's fragments; torch's checkpoint code warns at every use (in the writer's thread
# too), so this one warning is silenced for the process, by its words.
warnings.filterwarnings(
    "ignore", message="Please use DTensor instead and we are deprecating ShardedTensor"
)


def _optimizer_of(model: zero.ZeroModel) -> Any:
    """The engine's ZeRO-1/2 optimizer, or a :class:`ConfigError` saying what to do instead."""
    stage = int(model.config.get("zero_optimization", {}).get("stage", 0))
    if stage not in (1, 2):
        raise ConfigError(
            f"a ZeRO-{stage} model's state is saved by DeepSpeed: call "
            "model.engine.save_checkpoint(directory, tag) on every rank, and load it at another "
            "world size through sparktrain.strategies.reshard.to_universal(...); "
            "sharded_state covers ZeRO-1 and ZeRO-2, whose parameters are whole on every rank"
        )
    if model.engine is None:
        raise ConfigError(
            "the ZeRO model has no engine yet: call sparktrain.strategies.prepare_optimizer("
            "optimizer, model) before sharded_state or load_sharded_state"
        )
    return model.engine.optimizer


def _sharded(
    name: str, numel: int, fragment: Any, where: list[dict[str, tuple[int, int] | None]]
) -> Any:
    """Parameter ``name`` (``numel`` elements): a 1-D sharded tensor of every rank's fragment."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard

    rank = dist.get_rank()
    device = "cpu" if fragment is None else fragment.device
    shards, local = [], []
    for owner, fragments in enumerate(where):
        span = fragments[name]
        if span is None:
            continue
        placement = f"rank:{owner}/{device if owner == rank else 'cpu'}"
        meta = ShardMetadata(shard_offsets=[span[0]], shard_sizes=[span[1]], placement=placement)
        shards.append(meta)
        if owner == rank:
            local.append(Shard(tensor=fragment.detach(), metadata=meta))
    properties = TensorProperties(dtype=torch.float32)
    whole = ShardedTensorMetadata(shards, torch.Size([numel]), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, whole)


def zero_state(model: zero.ZeroModel, optimizer: Any) -> dict[str, Any]:
    """This rank's fragments of a ZeRO-1/2 state, to save with ``sharded=True``; a collective.

    Args:
        model: What ``prepare_model(..., "zero1" | "zero2")`` returned, its engine built.
        optimizer: What ``prepare_optimizer`` returned for it.
    """
    import torch.distributed as dist

    del optimizer  # the engine holds the optimizer; kept for the same call as DDP's and FSDP's
    zopt = _optimizer_of(model)
    inner = zopt.optimizer
    if not inner.state:  # as torch does for a state dict: a step at learning rate 0
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(inner)
    zopt._lazy_init_hp_params_optimizer_state()
    named: list[tuple[str, Any]] = list(model.module.named_parameters())
    mine = {name: _span(param) for name, param in named}
    where: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(where, mine)
    flat = [group["params"][0] for group in inner.param_groups]
    keys = sorted(k for k, v in inner.state[flat[0]].items() if _flat_like(v, flat[0]))
    state: dict[str, Any] = {"fp32": {}, **{key: {} for key in keys}}
    for name, param in named:
        mapping = param._hp_mapping
        for key in ("fp32", *keys):
            fragment = None
            if mapping is not None:
                fragment = mapping.get_hp_fragment(None if key == "fp32" else key)
            state[key][name] = _sharded(name, param.numel(), fragment, where)
    groups = [
        {
            "hyper": {k: v for k, v in group.items() if k != "params"},
            "scalars": {k: v for k, v in inner.state[hp].items() if not _flat_like(v, hp)},
        }
        for group, hp in zip(inner.param_groups, flat, strict=True)
    ]
    engine = {counter: getattr(model.engine, counter, 0) for counter in ENGINE_COUNTERS}
    return {"zero": state, "groups": groups, "engine": engine}


def _span(param: Any) -> tuple[int, int] | None:
    mapping = param._hp_mapping
    if mapping is None:
        return None
    return (mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel)


def _flat_like(value: Any, flat: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.shape == flat.shape


def load_zero_state(
    model: zero.ZeroModel,
    optimizer: Any,
    directory: str | os.PathLike[str],
    *,
    on_rescale: Callable[[int, int], Any] | None = None,
) -> Checkpoint | None:
    """Load the newest :func:`zero_state` checkpoint into the engine, at any world size.

    A collective. Returns ``None`` (the engine untouched) when there is no checkpoint.
    """
    import torch

    zopt = _optimizer_of(model)
    if latest_step(directory) is None:
        return None
    state = zero_state(model, optimizer)  # this world's fragments: the load fills them in place
    loaded = load_latest(directory, into=state, on_rescale=on_rescale)
    inner = zopt.optimizer
    for group, saved in zip(inner.param_groups, state["groups"], strict=True):
        group.update(saved["hyper"])
        hp = group["params"][0]
        for key, value in saved["scalars"].items():
            mine = inner.state[hp].get(key)
            if isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor):
                mine.copy_(value)  # in place: Adam's step keeps its dtype and device
            else:
                inner.state[hp][key] = value
    for counter, value in state["engine"].items():
        setattr(model.engine, counter, value)
    zopt.update_lp_params()  # the module's parameters, gathered from the loaded partitions
    return loaded
