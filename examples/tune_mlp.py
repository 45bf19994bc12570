"""Search the seeds' MLP's learning rate and batch size with ``sparktrain.tune``.

Run it with ``python examples/tune_mlp.py`` (needs ``pip install 'sparktrain[tune]'``). Eight
trials of 2 DDP ranks each; rank 0 reports the epoch's mean loss, successive halving stops the
weak trials after 1 or 3 epochs, and the table of trials and the best configuration are printed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from train_mlp import make_dataset, make_model

import sparktrain
from sparktrain.tuning import choice, loguniform


def train(config: dict) -> float:
    dist.init_process_group("gloo")
    model = DDP(make_model())
    dataset = make_dataset(samples=2048)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    loss = float("nan")
    for epoch in range(1, config["epochs"] + 1):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in loader:
            batch_loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            batch_loss.backward()
            optimizer.step()
            total += torch.tensor([batch_loss.item(), 1.0])
        dist.all_reduce(total)
        loss = float(total[0] / total[1])
        sparktrain.report(step=epoch, loss=loss)  # rank 0's reports drive the scheduler
    return loss


if __name__ == "__main__":
    result = sparktrain.tune(
        train,
        {"lr": loguniform(1e-3, 0.3), "batch_size": choice([32, 64, 128]), "epochs": 9},
        num_trials=8,
        metric="loss",
        num_processes_per_trial=2,
        seed=0,
    )
    print(result.table())
    print(f"best: {result.best_config} loss {result.best_value:.4f}")
