"""A ZeRO engine's state as shards that load at any world size, with no gathering.

DeepSpeed's ZeRO optimizer holds, on each rank, flat fp32 partitions (one per parameter group,
or per sub-group under ZeRO-3) and the optimizer's state over them (Adam's two moments); every
module parameter has a fragment in one or more ranks' partitions, at a known offset of the
flattened parameter: ZeRO-1/2 say where (``param._hp_mapping``); under ZeRO-3 each parameter is
cut into equal partitions of its own (``param.ds_tensor``), rank ``r`` holding the ``r``-th.
:func:`zero_state` describes each parameter's fp32 master and state as a 1-D sharded tensor
over those fragments, views of the partitions themselves, so that
``checkpoint.save(state, directory, step, sharded=True)`` has every rank write its own
fragments (torch distributed checkpoint's format, staged asynchronously like any sharded
state). :func:`load_zero_state` describes the fragments of the current world the same way and
loads into them in place: torch distributed checkpoint reads each fragment from whichever saved
ones overlap it, so a checkpoint saved by 4 ranks loads on 2. The module's parameters are then
made from the loaded partitions (ZeRO-1/2: DeepSpeed's ``update_lp_params``; ZeRO-3: each
rank's parameter partitions copied from its fp32 ones, as DeepSpeed's own loading does).

Not covered: ZeRO-3 with its optimizer state swapped to NVMe (the partitions are not in memory
to be viewed). Runs inside a rank.
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


def _stage(model: zero.ZeroModel) -> int:
    return int(model.config.get("zero_optimization", {}).get("stage", 0))


def _optimizer_of(model: zero.ZeroModel) -> Any:
    """The engine's ZeRO optimizer, or a :class:`ConfigError` saying what to do instead."""
    stage = _stage(model)
    if stage not in (1, 2, 3):
        raise ConfigError(
            f"a ZeRO-{stage} model has no partitions to save as shards: sharded_state covers "
            "ZeRO-1, 2 and 3; save a ZeRO-0 model's full_state_dict with checkpoint.save"
        )
    if model.engine is None:
        raise ConfigError(
            "the ZeRO model has no engine yet: call sparktrain.strategies.prepare_optimizer("
            "optimizer, model) before sharded_state or load_sharded_state"
        )
    zopt = model.engine.optimizer
    if getattr(zopt, "swap_optimizer", False):
        raise ConfigError(
            "a ZeRO-3 model whose optimizer state is offloaded to NVMe "
            "(offload_optimizer.device='nvme') is saved by DeepSpeed: call "
            "model.engine.save_checkpoint(directory, tag) on every rank, and load it at another "
            "world size through sparktrain.strategies.reshard.to_universal(...); offload to "
            "'cpu' keeps the partitions in memory, where sharded_state can save them"
        )
    return zopt


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
        model: What ``prepare_model(..., "zero1" | "zero2" | "zero3")`` returned, its engine
            built.
        optimizer: What ``prepare_optimizer`` returned for it.
    """
    import torch.distributed as dist

    del optimizer  # the engine holds the optimizer; kept for the same call as DDP's and FSDP's
    zopt = _optimizer_of(model)
    inner = zopt.optimizer
    stage3 = _stage(model) == 3
    flats = _flats(zopt, stage3)
    if not inner.state:
        _init_state(zopt, stage3, [flat for group in flats for flat in group])
    if not stage3:
        zopt._lazy_init_hp_params_optimizer_state()
    named: list[tuple[str, Any]] = list(model.module.named_parameters())
    mine = {name: (_span3(zopt, param) if stage3 else _span(param)) for name, param in named}
    where: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(where, mine)
    first = next((flat for group in flats for flat in group), None)
    held = {} if first is None else inner.state[first]
    keys = sorted(key for key, value in held.items() if _flat_like(value, first))
    state: dict[str, Any] = {"fp32": {}, **{key: {} for key in keys}}
    for name, param in named:
        numel = param.ds_numel if stage3 else param.numel()
        for key in ("fp32", *keys):
            fragment = _fragment(zopt, param, None if key == "fp32" else key, mine[name], stage3)
            state[key][name] = _sharded(name, numel, fragment, where)
    groups = [
        {
            "hyper": {k: v for k, v in group.items() if k != "params"},
            "scalars": _scalars(inner, group_flats[0]) if group_flats else {},
        }
        for group, group_flats in zip(inner.param_groups, flats, strict=True)
    ]
    engine = {counter: getattr(model.engine, counter, 0) for counter in ENGINE_COUNTERS}
    return {"zero": state, "groups": groups, "engine": engine}


def _scalars(inner: Any, flat: Any) -> dict[str, Any]:
    return {k: v for k, v in inner.state[flat].items() if not _flat_like(v, flat)}


def _init_state(zopt: Any, stage3: bool, flats: list[Any]) -> None:
    """The optimizer's state before its first step: a step at learning rate 0 on zero gradients.

    As torch does for a state dict, but whatever gradients the partitions hold (DeepSpeed
    leaves some with the optimizer offloaded) are kept aside and put back.
    """
    import torch

    inner = zopt.optimizer
    grads = [flat.grad for flat in flats]
    rates = [group.get("lr") for group in inner.param_groups]
    if stage3:  # ZeRO-3 hands the optimizer its partitions only for its step
        zopt._set_fp32_optimizer_param_groups()
    try:
        for flat in flats:
            flat.grad = torch.zeros_like(flat)
        for group, rate in zip(inner.param_groups, rates, strict=True):
            if rate is not None:
                group["lr"] = torch.tensor(0.0) if isinstance(rate, torch.Tensor) else 0.0
        inner.step()
    finally:
        for group, rate in zip(inner.param_groups, rates, strict=True):
            if rate is not None:
                group["lr"] = rate
        for flat, grad in zip(flats, grads, strict=True):
            flat.grad = grad
        if stage3:
            zopt._clear_fp32_optimizer_param_groups()


def _flats(zopt: Any, stage3: bool) -> list[list[Any]]:
    """Each optimizer group's flat fp32 partitions (ZeRO-3 lists them only during its step)."""
    inner = zopt.optimizer
    if not stage3:
        return [list(group["params"]) for group in inner.param_groups]
    flats: list[list[Any]] = [[] for _ in inner.param_groups]
    for sub_group, flat in enumerate(zopt.fp32_partitioned_groups_flat):
        flats[zopt.sub_group_to_group_id[sub_group]].append(flat)
    return flats


def _span3(zopt: Any, param: Any) -> tuple[int, int] | None:
    """Where this rank's ZeRO-3 partition of ``param`` is in the flattened parameter."""
    if not param.requires_grad or zopt.get_param_id(param) not in zopt.grad_position:
        return None  # frozen, or not the optimizer's: no fp32 partition
    size = param.ds_tensor.ds_numel  # every rank's partition is this long, the last padded
    start = zopt._get_param_partition_rank(param) * size
    numel = min(size, param.ds_numel - start)
    return (start, numel) if numel > 0 else None


def _fragment(zopt: Any, param: Any, key: str | None, span: Any, stage3: bool) -> Any:
    """A view of this rank's fragment of ``param``'s fp32 master (``key=None``) or state."""
    if span is None:
        return None
    if stage3:
        partition, _group = zopt._get_fp32_opt_state_partition(param, False, key)
        return partition.narrow(0, 0, span[1])  # the padding is not the parameter's
    return param._hp_mapping.get_hp_fragment(key)


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
    flats = _flats(zopt, _stage(model) == 3)
    for group, saved, group_flats in zip(inner.param_groups, state["groups"], flats, strict=True):
        group.update(saved["hyper"])
        for hp in group_flats:  # ZeRO-3's sub-groups of a group share their scalars
            for key, value in saved["scalars"].items():
                mine = inner.state[hp].get(key)
                if isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor):
                    mine.copy_(value)  # in place: Adam's step keeps its dtype and device
                else:
                    inner.state[hp][key] = value
    for counter, value in state["engine"].items():
        setattr(model.engine, counter, value)
    if _stage(model) == 3:
        _partitions_from_fp32(zopt)
    else:
        zopt.update_lp_params()  # the module's parameters, gathered from the loaded partitions
    return loaded


def _partitions_from_fp32(zopt: Any) -> None:
    """ZeRO-3: each rank's parameter partitions from its loaded fp32 ones (as DeepSpeed loads)."""
    zopt.checkpoint_event_prologue()  # every parameter partitioned, the whole-kept ones too
    for fp32, partitions in zip(
        zopt.fp32_partitioned_groups_flat, zopt.fp16_partitioned_groups_flat, strict=True
    ):
        if fp32.numel() > 0:
            partitions.data.copy_(fp32.data)
    for flat, params in zip(
        zopt.fp16_partitioned_groups_flat, zopt.fp16_partitioned_groups, strict=True
    ):
        for partition, data in zip(params, zopt.unflatten(flat, params), strict=True):
            partition.data = data.data
    zopt.checkpoint_event_epilogue()  # parameters kept whole on every rank: gathered again
