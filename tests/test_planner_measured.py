"""The planner's bytes per rank against the tensors 2 CPU ranks really hold after one step.

One launch of 2 gloo ranks trains the same small MLP for one step under DDP, ZeRO-1
(``ZeroRedundancyOptimizer`` + DDP) and ZeRO-3 (FSDP2 ``fully_shard``), with Adam and with SGD
with momentum, in fp32. Each rank sums the bytes of its parameters, their gradients and its
optimizer states (the local shard of a DTensor), and the planner must predict each sum within 5 %.
The layer sizes are even, so that every shard and every optimizer partition is the same size.
"""

from __future__ import annotations

from typing import Any

import pytest

from sparktrain import launch
from sparktrain.planner import plan

WIDTH, DEPTH = 256, 4
CASES = (
    ("ddp", "adam"),
    ("zero1", "adam"),
    ("zero3", "adam"),
    ("ddp", "sgd-momentum"),
    ("zero1", "sgd-momentum"),
    ("zero3", "sgd-momentum"),
)
TOLERANCE = 0.05


def build_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*(_layer() for _ in range(DEPTH)))


def _layer() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())


def _bytes(tensor: Any) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _optimizer(params: Any, name: str) -> Any:
    import torch

    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _train_one_step(strategy: str, optimizer: str) -> dict[str, int]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = build_model()
    if strategy == "zero3":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        wrapped = DistributedDataParallel(model)
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt_class = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
        extra = {} if optimizer == "adam" else {"momentum": 0.9}
        zero = ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=opt_class, lr=1e-3, **extra
        )
        opt, state = zero, zero.optim.state  # the local partition's optimizer
    else:
        opt = _optimizer(wrapped.parameters(), optimizer)
        state = opt.state
    torch.manual_seed(1)
    wrapped(torch.randn(8, WIDTH)).pow(2).mean().backward()
    opt.step()
    params = list(wrapped.parameters())
    return {
        "params": sum(_bytes(p) for p in params),
        "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _bytes(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ),
    }


def measure_all(cases: tuple[tuple[str, str], ...]) -> dict[tuple[str, str], dict[str, int]]:
    """Run on every rank: the bytes this rank holds after one step, per (strategy, optimizer)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {case: _train_one_step(*case) for case in cases}
    finally:
        dist.destroy_process_group()


def predicted(strategy: str, optimizer: str) -> dict[str, int]:
    """The planner's bytes per rank for the same model, counted from the module itself."""
    memory = (
        plan(
            build_model(),
            gpus_per_node=2,
            gpu_memory="1GB",
            precision="fp32",
            optimizer=optimizer,
        )
        .estimate(strategy)
        .memory
    )
    return {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer}


def table(measured: dict[int, dict[tuple[str, str], dict[str, int]]]) -> str:
    """Markdown table of predicted vs measured bytes per rank (as in docs/planner.md)."""
    lines = [
        "| strategy | optimizer | rank | predicted P+G+O | measured P+G+O | error |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for case in CASES:
        want = sum(predicted(*case).values())
        for rank in sorted(measured):
            got = sum(measured[rank][case].values())
            lines.append(
                f"| {case[0]} | {case[1]} | {rank} | {want:,} | {got:,} | "
                f"{(got - want) / want:+.4%} |"
            )
    return "\n".join(lines)


@pytest.fixture(scope="module")
def measured() -> dict[int, dict[tuple[str, str], dict[str, int]]]:
    result = launch(measure_all, (CASES,), num_processes=2, use_gpu=False, return_all=True)
    values: dict[int, dict[tuple[str, str], dict[str, int]]] = result.return_values
    print("\n" + table(values))
    return values


def test_both_ranks_reported(measured: dict[int, Any]) -> None:
    assert sorted(measured) == [0, 1]
    for rank in (0, 1):
        assert set(measured[rank]) == set(CASES)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_prediction_within_5_percent(
    measured: dict[int, dict[tuple[str, str], dict[str, int]]], case: tuple[str, str]
) -> None:
    want = predicted(*case)
    for rank in (0, 1):
        got = measured[rank][case]
        total_got, total_want = sum(got.values()), sum(want.values())
        assert abs(total_got - total_want) <= TOLERANCE * total_want, (rank, got, want)
        for kind in ("params", "grads", "optimizer"):  # each part, not only the sum
            assert abs(got[kind] - want[kind]) <= TOLERANCE * max(want[kind], 1), (rank, kind)


def test_sharding_really_happened(
    measured: dict[int, dict[tuple[str, str], dict[str, int]]],
) -> None:
    """Guards the check itself: the strategies held different amounts, as the paper says."""
    ddp, zero1, zero3 = (measured[0][(s, "adam")] for s in ("ddp", "zero1", "zero3"))
    assert zero1["params"] == ddp["params"] and zero1["grads"] == ddp["grads"]
    assert zero1["optimizer"] * 2 <= ddp["optimizer"] + 64  # half, give or take `step` scalars
    assert zero3["params"] * 2 == ddp["params"] and zero3["grads"] * 2 == ddp["grads"]
