"""Lightning and the Hugging Face Trainer inside a launch: one rank each, no processes of their own.

Both frameworks look for an already-launched job (the torchelastic variables that
``sparktrain.contract.env`` sets) before they start processes themselves. Every rank reports its
pid and its children at the end of training, so a framework that spawned workers would show; the
weights must have moved, the loss fallen, and both ranks must end with the same weights.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

import sparktrain
from sparktrain.contract.env import RankEnv, rank_environ

# The Spark test's executors do not have tests/ on their path: ship this module by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_cpu_ranks_tell_accelerate_to_use_the_cpu() -> None:
    """Without ``ACCELERATE_USE_CPU``, Accelerate on a CPU rank falls back to single-process."""
    common = {
        "rank": 0,
        "local_rank": 0,
        "world_size": 2,
        "local_world_size": 2,
        "node_rank": 0,
        "nodes": 1,
        "master_addr": "127.0.0.1",
        "master_port": 29400,
        "run_id": "r",
        "threads": 1,
    }
    cpu = rank_environ({}, RankEnv(visible_devices=None, **common))  # type: ignore[arg-type]
    stale = {"ACCELERATE_USE_CPU": "true"}
    gpu = rank_environ(stale, RankEnv(visible_devices=("0", "1"), **common))  # type: ignore[arg-type]
    assert cpu["ACCELERATE_USE_CPU"] == "true" and cpu["TORCHELASTIC_RUN_ID"] == "r"
    assert "ACCELERATE_USE_CPU" not in gpu


def _processes() -> dict[str, Any]:
    """This rank's pid and every process below it (a framework's own workers would be here)."""
    import psutil

    me = psutil.Process(os.getpid())
    return {"pid": me.pid, "children": [c.pid for c in me.children(recursive=True)]}


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_ranks(values: dict[int, dict[str, Any]]) -> None:
    """Two ranks of one job, each trained, none spawned anything, both end with equal weights."""
    assert sorted(values) == [0, 1]
    for rank, v in values.items():
        seen = {k: x for k, x in v.items() if k not in ("before", "after")}
        assert (v["rank"], v["world_size"], v["framework_world_size"]) == (rank, 2, 2), seen
        assert v["children"] == [], f"rank {rank} started processes {v['children']}"
        assert v["loss_after"] < v["loss_before"], seen
        assert not _same(v["before"], v["after"]), f"rank {rank}: training left the weights"
    assert len({v["pid"] for v in values.values()}) == 2
    assert _same(values[0]["after"], values[1]["after"])


def lightning_fit(root: str, steps: int, devices: int, num_nodes: int) -> list[dict[str, Any]]:
    """Fit a small LightningModule with ``Trainer(strategy="ddp")``; every rank's record."""
    import lightning as L
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(int(os.environ["RANK"]))  # different starts: DDP must broadcast rank 0's
    model = Regression()

    def loss() -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(model.net(x), y).item()

    before, start = loss(), _state(model)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    record = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "framework_world_size": trainer.world_size,
        "node_rank": trainer.node_rank,
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "before": start,
        "after": _state(model),
        "loss_before": before,
        "loss_after": loss(),
        **_processes(),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    return everyone


def _lightning_ranks(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    values = {r["rank"]: r for r in records}
    _check_ranks(values)
    assert {r["environment"] for r in records} == {"TorchElasticEnvironment"}
    return values


def test_lightning_ddp_runs_one_rank_per_process(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    records = sparktrain.TorchDistributor(2, True, False).run(lightning_fit, str(tmp_path), 8, 2, 1)
    values = _lightning_ranks(records)
    assert [values[r]["node_rank"] for r in (0, 1)] == [0, 0]


@pytest.mark.spark
def test_lightning_on_two_spark_nodes(spark: object, tmp_path: Path) -> None:
    """One rank per executor: ``devices=1`` (ranks per node), ``num_nodes=2``."""
    pytest.importorskip("lightning")
    records = sparktrain.TorchDistributor(2, False, False).run(
        lightning_fit, str(tmp_path), 8, 1, 2
    )
    values = _lightning_ranks(records)
    assert [values[r]["node_rank"] for r in (0, 1)] == [0, 1]


def hf_train(root: str, steps: int) -> dict[str, Any]:
    """Train a tiny BERT (built from a config, no download) with ``transformers.Trainer``."""
    import torch.distributed as dist
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (64, 8), generator=g)
    labels = (ids[:, 0] >= 16).long()  # the first token decides the class
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]
    config = BertConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(int(os.environ["RANK"]))  # different starts: DDP must broadcast rank 0's
    model = BertForSequenceClassification(config)

    def loss() -> float:
        model.eval()
        with torch.no_grad():
            return float(model(input_ids=ids, labels=labels).loss)

    before, start = loss(), _state(model)
    args = TrainingArguments(
        output_dir=root,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        ddp_find_unused_parameters=False,  # nothing device- or launch-specific
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "framework_world_size": args.world_size,
        "parallel_mode": args.parallel_mode.value,
        "before": start,
        "after": _state(model),
        "loss_before": before,
        "loss_after": loss(),
        **_processes(),
    }


def test_hf_trainer_runs_one_rank_per_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    result = sparktrain.launch(
        hf_train, (str(tmp_path), 12), num_processes=2, use_gpu=False, return_all=True
    )
    values = dict(result.return_values)
    _check_ranks(values)
    assert {v["parallel_mode"] for v in values.values()} == {"distributed"}
