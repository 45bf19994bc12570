"""The seeds' DDP example: a 784-512-256-10 MLP trained on 2 processes with TorchDistributor.

Run it with ``python examples/train_mlp.py``. Every rank prints its progress, prefixed with its
rank; the trained model that comes back is rank 0's, unwrapped from DDP. Imports stay at the top
of the file: sparktrain ships the function by value and imports its modules in each rank.

The data are synthetic (no download): 784 features and 10 classes given by a fixed random linear
teacher, so the loss has somewhere to fall.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from sparktrain import TorchDistributor


def make_model(seed: int = 0) -> nn.Module:
    """The seeds' MLP, with deterministic initial weights."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def make_dataset(samples: int = 4096, seed: int = 1) -> TensorDataset:
    """Synthetic inputs labelled by a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 784, generator=generator)
    teacher = torch.randn(784, 10, generator=generator)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def mean_loss(model: nn.Module, dataset: TensorDataset) -> float:
    """Cross-entropy of ``model`` over the whole dataset."""
    x, y = dataset.tensors
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def train_fn(epochs: int = 3, lr: float = 1e-3, batch_size: int = 64) -> nn.Module:
    """Train the MLP with DDP; returns the DDP model (sparktrain hands back ``model.module``)."""
    use_gpu = torch.cuda.is_available() and "CUDA_VISIBLE_DEVICES" in os.environ
    dist.init_process_group("nccl" if use_gpu else "gloo")
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if use_gpu else "cpu")
    model = DDP(make_model().to(device), device_ids=[device] if use_gpu else None)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
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
        print(f"epoch {epoch} loss {total / batches:.4f} ({batches} batches)")
    dist.destroy_process_group()
    return model


if __name__ == "__main__":
    started = time.perf_counter()
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    trained = distributor.run(train_fn, epochs=3)
    data = make_dataset()
    print(
        f"trained {type(trained).__name__} in {time.perf_counter() - started:.1f}s: loss on "
        f"the data {mean_loss(make_model(), data):.3f} before, {mean_loss(trained, data):.3f} after"
    )
