"""The strategy registry: names, the planner rows that price them, and the weightless skeleton."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sparktrain import ConfigError, launch
from sparktrain.planner import STRATEGIES as PLANNER_ROWS
from sparktrain.planner.bytemodel import byte_model
from sparktrain.planner.model import ModelSize
from sparktrain.planner.strategies import strategy_memory
from sparktrain.strategies import STRATEGIES, registry, zero
from sparktrain.strategies.options import Parallelism, PrepareOptions, Sharding
from sparktrain.strategies.skeleton import weightless_copy

NAMES = (
    "ddp",
    "fsdp",
    "zero1",
    "zero2",
    "zero3",
    "zero1_offload",
    "zero2_offload",
    "zero3_offload",
    "auto",
)
PLAIN = PrepareOptions()
# 1 B parameters in 100 equal layers: ZeRO-3 gathers one at a time.
SIZE = ModelSize(params=10**9, trainable_params=10**9, source="test", largest_layer_params=10**7)


def _gpu_bytes(row: Any) -> int:
    memory = strategy_memory(
        row, size=SIZE, bytes_model=byte_model("bf16-mixed", "adamw"), gpus_per_node=4, nodes=1
    )
    return memory.gpu_total


def test_the_registry_lists_every_name_in_order() -> None:
    assert registry.names() == NAMES == STRATEGIES
    assert [registry.get(name).name for name in NAMES] == list(NAMES)


@pytest.mark.parametrize("name", ["fdsp", "ZeRO3", None, 3])
def test_an_unknown_name_lists_the_choices(name: object) -> None:
    choices = ", ".join(NAMES)
    with pytest.raises(ConfigError) as raised:
        registry.get(name)
    assert str(raised.value) == f"unknown strategy {name!r}; choose one of: {choices}"


def test_each_strategy_is_priced_by_the_planner_row_of_its_memory() -> None:
    priced = {name: registry.get(name).priced_as(PLAIN) for name in NAMES}
    assert priced == {
        "ddp": "ddp",
        "fsdp": "zero3",
        "zero1": "zero1",
        "zero2": "zero2",
        "zero3": "zero3",
        "zero1_offload": "zero2_offload",
        "zero2_offload": "zero2_offload",
        "zero3_offload": "zero3_offload_params",
        "auto": None,  # the planner's recommendation, once resolved
    }
    model_bytes = byte_model("bf16-mixed", "adamw")
    for name, (stage, offload_optimizer, offload_params) in zero.STAGES.items():
        row = priced[name]
        assert row in PLANNER_ROWS
        memory = strategy_memory(
            row, size=SIZE, bytes_model=model_bytes, gpus_per_node=4, nodes=1
        )  # the row counts on the GPU what DeepSpeed leaves there
        assert (memory.optimizer == 0) == offload_optimizer, name
        assert (memory.params == 0) == offload_params, name
        assert (memory.params < model_bytes.param_bytes * SIZE.params) == (stage == 3), name


@pytest.mark.parametrize(
    ("reshard", "offload", "row"),
    [
        (True, False, "zero3"),
        (False, False, "zero2"),
        (False, True, "zero2_offload"),
        (True, True, "zero3_offload_params"),
    ],
)
def test_fsdp_is_priced_by_its_options(reshard: bool, offload: bool, row: str) -> None:
    sharding = Sharding(reshard_after_forward=reshard, cpu_offload=offload)
    assert registry.get("fsdp").priced_as(PrepareOptions(sharding=sharding)) == row


def test_auto_runs_each_planner_row_in_no_more_memory_than_the_row_counts() -> None:
    runs = registry.auto_map()
    assert tuple(runs) == PLANNER_ROWS or set(runs) == set(PLANNER_ROWS)
    shown = {row: (strategy.name, dict(sharding)) for row, (strategy, sharding) in runs.items()}
    assert shown == {  # as auto ran them before the registry (docs/strategies.md's table)
        "ddp": ("ddp", {}),
        "zero1": ("fsdp", {"reshard_after_forward": False}),
        "zero2": ("fsdp", {"reshard_after_forward": False}),
        "zero3": ("fsdp", {}),
        "zero2_offload": ("fsdp", {"reshard_after_forward": False, "cpu_offload": True}),
        "zero3_offload": ("fsdp", {"cpu_offload": True}),
        "zero3_offload_params": ("fsdp", {"cpu_offload": True}),
    }
    for row, (strategy, sharding) in runs.items():
        options = PrepareOptions(sharding=Sharding(**sharding))
        priced = strategy.priced_as(options)
        assert priced is not None
        assert _gpu_bytes(priced) <= _gpu_bytes(row), (row, priced)


def test_only_sharded_split_or_deepspeed_models_keep_a_skeleton() -> None:
    needs = {name: registry.get(name).needs_skeleton(PLAIN) for name in NAMES if name != "auto"}
    assert needs == {name: name != "ddp" for name in needs}
    split = PrepareOptions(parallel=Parallelism(tp=2))
    assert registry.get("ddp").needs_skeleton(split)


class _Allocations(TorchDispatchMode):
    """Records every op that produced a tensor off the meta device (a copy of real data)."""

    def __init__(self) -> None:
        super().__init__()
        self.real: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta" for t in outs):
            self.real.append(str(func))
        return out


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(50, 16), nn.BatchNorm1d(16), nn.Linear(16, 50))
    model[2].weight = model[0].weight  # tied, as language models tie input and output
    model[1].weight.requires_grad_(False)
    return model


def test_the_skeleton_copies_no_weight() -> None:
    model = _tied()
    with _Allocations() as control:
        copy.deepcopy(model)
    assert control.real  # the detector sees a weight copy when there is one
    with _Allocations() as seen:
        skeleton = weightless_copy(model)
    assert seen.real == []
    assert all(t.is_meta for t in (*skeleton.parameters(), *skeleton.buffers()))
    assert skeleton[2].weight is skeleton[0].weight  # still tied
    assert not skeleton[1].weight.requires_grad
    assert skeleton.state_dict().keys() == model.state_dict().keys()
    shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in skeleton.state_dict().items()} == shapes
    assert all(not t.is_meta for t in model.parameters())  # the original is untouched


def _prepare_and_count(strategy: str) -> dict[str, Any]:
    """Prepare an MLP with ``strategy`` on gloo, counting weight copies and skeletons."""
    import torch.distributed as dist

    import sparktrain.strategies as st
    from sparktrain.strategies import prepare

    dist.init_process_group("gloo")
    copies, skeletons = [], []
    original_copy = nn.Parameter.__deepcopy__

    def counting_copy(self: nn.Parameter, memo: dict[int, Any]) -> Any:
        copies.append(tuple(self.shape))
        return original_copy(self, memo)

    def counting_skeleton(model: nn.Module) -> nn.Module:
        skeletons.append(type(model).__name__)
        return weightless_copy(model)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    originals = list(model.parameters())
    nn.Parameter.__deepcopy__ = counting_copy  # type: ignore[method-assign]
    prepare.weightless_copy = counting_skeleton  # type: ignore[assignment]
    try:
        prepared = st.prepare_model(model, strategy)
    finally:
        nn.Parameter.__deepcopy__ = original_copy  # type: ignore[method-assign]
        prepare.weightless_copy = weightless_copy
    skeleton = getattr(prepared, "_sparktrain_skeleton", None)
    result = {
        "kind": type(prepared).__name__,
        "made_by": registry.strategy_of(prepared).name,
        "copies": copies,
        "skeletons": skeletons,
        "skeleton_on_meta": None
        if skeleton is None
        else all(p.is_meta for p in skeleton.parameters()),
        "same_parameters": all(
            a is b for a, b in zip(prepared.module.parameters(), originals, strict=True)
        )
        if strategy == "ddp"
        else None,
        "state": st.full_state_dict(prepared),
        "plain": st.plain_module(prepared).state_dict(),
    }
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_prepare_copies_no_weight_and_keeps_a_skeleton_only_where_needed(strategy: str) -> None:
    ranks = launch(
        _prepare_and_count, (strategy,), num_processes=2, use_gpu=False, return_all=True
    ).return_values
    for rank in (0, 1):
        got = ranks[rank]
        assert got["copies"] == []  # no parameter was deep-copied
        assert got["made_by"] == strategy
        plain, state = got["plain"], got["state"]
        assert plain.keys() == state.keys() and all(torch.equal(plain[k], state[k]) for k in state)
        if strategy == "ddp":
            assert got["kind"] == "DistributedDataParallel"
            assert got["skeletons"] == [] and got["skeleton_on_meta"] is None
            assert got["same_parameters"]  # DDP trains the user's own tensors
        else:
            assert got["kind"].startswith("FSDP")
            assert got["skeletons"] == ["Sequential"] and got["skeleton_on_meta"] is True


def _outside(_: int) -> dict[str, Any]:
    """A DDP module wrapped by the user: the plain PyTorch steps still serve it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import sparktrain.strategies as st

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    inner = nn.Linear(4, 2)
    model = DistributedDataParallel(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    same = st.prepare_optimizer(optimizer, model) is optimizer
    st.backward(model(torch.ones(3, 4)).sum(), optimizer)
    state = st.full_state_dict(model)
    result = {
        "same_optimizer": same,
        "grad": inner.weight.grad is not None,
        "state": sorted(state),
        "plain_is_inner": st.plain_module(model) is inner,
    }
    dist.destroy_process_group()
    return result


def test_models_wrapped_outside_prepare_model_take_the_plain_steps() -> None:
    got = launch(_outside, (0,), num_processes=2, use_gpu=False).value
    assert got == {
        "same_optimizer": True,
        "grad": True,
        "state": ["bias", "weight"],
        "plain_is_inner": True,
    }
    assert registry.strategy_of(zero.ZeroModel(nn.Linear(2, 2), {})).name.startswith("zero")
