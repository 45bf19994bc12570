"""prepare_model / prepare_data_loader on 2 CPU ranks: one training loop for every strategy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparktrain import ConfigError, launch


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def train_with(strategy: str, steps: int, options: dict) -> dict:
    """The same loop for every strategy; returns losses, held bytes and the full state."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import sparktrain.strategies as st

    dist.init_process_group("gloo")
    model = st.prepare_model(_mlp(), strategy, **options)
    optimizer = st.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 256, generator=g)
    data = TensorDataset(x, (x @ torch.randn(256, 10, generator=g)).argmax(1))
    loader = st.prepare_data_loader(DataLoader(data, batch_size=32, shuffle=True))
    losses = []
    for _ in range(steps):
        for bx, by in loader:
            loss = nn.functional.cross_entropy(model(bx), by)
            optimizer.zero_grad()
            st.backward(loss, optimizer)
            optimizer.step()
        losses.append(float(loss))
    held = st.held_bytes(model, optimizer)
    state = st.full_state_dict(model)
    kind = type(model).__name__
    dist.destroy_process_group()
    return {"losses": losses, "held": held, "state": state, "kind": kind}


def _run(strategy: str, steps: int = 3, **options: object) -> dict[int, dict]:
    result = launch(
        train_with, (strategy, steps, options), num_processes=2, use_gpu=False, return_all=True
    )
    return dict(result.return_values)


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("ddp", {}),
        ("fsdp", {}),
        ("fsdp", {"reshard_after_forward": False}),
        ("fsdp", {"cpu_offload": True}),
        ("zero1", {}),
        ("zero2", {}),
        ("zero3", {}),
        ("zero2_offload", {}),
        ("fsdp", {"precision": "bf16"}),
        ("zero2", {"precision": "bf16"}),
    ],
)
def test_strategy_trains_and_states_agree(strategy: str, options: dict) -> None:
    ranks = _run(strategy, **options)
    for rank in (0, 1):
        assert ranks[rank]["losses"][-1] < ranks[rank]["losses"][0]
    assert _same_state(ranks[0]["state"], ranks[1]["state"])
    full = sum(v.numel() * 4 for v in ranks[0]["state"].values())  # fp32 parameters: P bytes
    held = ranks[0]["held"]
    if options.get("precision"):  # the byte split of mixed precision is the planner's business
        return
    # The ZeRO paper's split, N = 2: parameters whole or 1/N, Adam's two states 2P or 2P/N.
    sharded_params = strategy == "fsdp" or strategy.startswith("zero3")
    assert held["parameters"] == pytest.approx(full / 2 if sharded_params else full, rel=0.01)
    assert held["optimizer"] == pytest.approx(2 * full / (1 if strategy == "ddp" else 2), rel=0.01)


def test_auto_follows_the_planner(capfd: pytest.CaptureFixture[str]) -> None:
    from sparktrain.planner import plan

    assert plan(_mlp(), gpus_per_node=2, gpu_memory="40MB", precision="fp32").recommended == "ddp"
    assert plan(_mlp(), gpus_per_node=2, gpu_memory="25MB", precision="fp32").recommended == "zero1"
    roomy = _run("auto", 1, gpu_memory="40MB")
    tight = _run("auto", 1, gpu_memory="25MB")
    assert roomy[0]["kind"] == "DistributedDataParallel"
    assert tight[0]["kind"].startswith("FSDP")
    assert tight[0]["held"]["optimizer"] < roomy[0]["held"]["optimizer"]
    out = capfd.readouterr().out
    assert "strategy='auto' chose ddp" in out and "strategy='auto' chose zero1" in out


def _bad_strategy(name: str) -> None:
    import torch.distributed as dist

    import sparktrain.strategies as st

    dist.init_process_group("gloo")
    st.prepare_model(nn.Linear(2, 2), name)


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("fdsp", r"unknown strategy 'fdsp'; choose one of: ddp, fsdp, zero1, .*, auto"),
    ],
)
def test_bad_strategy_names(name: str, pattern: str) -> None:
    from sparktrain import TrainingFailedError

    with pytest.raises(TrainingFailedError, match=pattern):
        launch(_bad_strategy, (name,), num_processes=1, use_gpu=False)


def test_prepare_model_needs_a_process_group() -> None:
    import sparktrain.strategies as st

    with pytest.raises(ConfigError, match="init_process_group"):
        st.prepare_model(nn.Linear(2, 2), "ddp")


def _epochs() -> list[list[int]]:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import sparktrain.strategies as st

    dist.init_process_group("gloo")
    loader = st.prepare_data_loader(DataLoader(list(range(12)), batch_size=3, shuffle=True))
    return [[int(i) for batch in loader for i in batch] for _ in range(2)]


def test_data_loader_shards_and_reshuffles_every_epoch() -> None:
    ranks = launch(_epochs, num_processes=2, use_gpu=False, return_all=True).return_values
    for epoch in (0, 1):
        assert sorted(ranks[0][epoch] + ranks[1][epoch]) == list(range(12))
    assert ranks[0][0] != ranks[0][1]  # set_epoch was called: a new order
