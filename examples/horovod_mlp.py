"""The seeds' Horovod example, run unchanged through sparktrain's HorovodRunner.

The 784-512-256-10 MLP with ``hvd.DistributedOptimizer``, ``hvd.broadcast_parameters`` and a
learning rate scaled by ``hvd.size()``. Horovod itself need not be installed: in the ranks that
``HorovodRunner`` starts, ``import horovod.torch as hvd`` gives ``sparktrain.horovod.torch``.
The import sits inside the function (as Databricks' examples do), so that this file also
imports on a driver without Horovod. Two seed lines differ: the device (CPU here when no GPU was
given) and the synthetic data (no download), shared with ``train_mlp.py``.

Run it with ``python examples/horovod_mlp.py`` (``np=-2``: two processes on this machine).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from train_mlp import make_dataset, make_model, mean_loss

from sparktrain import HorovodRunner


def train_hvd(epochs: int = 2, lr: float = 1e-3, batch_size: int = 64) -> nn.Module:
    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()
    use_gpu = torch.cuda.is_available() and "CUDA_VISIBLE_DEVICES" in os.environ
    if use_gpu:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if use_gpu else "cpu")
    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for batch_x, batch_y in loader:
            batch_x, batch_y = batch_x.to(device), batch_y.to(device)
            loss = loss_fn(model(batch_x), batch_y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        print(f"rank {rank} epoch {epoch} loss {total / batches:.4f}")
    return model


if __name__ == "__main__":
    hr = HorovodRunner(np=-2, driver_log_verbosity="all")
    trained_model = hr.run(train_hvd)
    data = make_dataset()
    print(
        f"loss before {mean_loss(make_model(), data):.3f}, after {mean_loss(trained_model, data):.3f}"
    )
