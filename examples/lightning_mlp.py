"""A PyTorch Lightning ``Trainer(strategy="ddp")`` on 2 processes started by sparktrain.

Run it with ``python examples/lightning_mlp.py`` (needs ``pip install lightning``). sparktrain
starts the ranks; Lightning sees the torchelastic variables each rank carries, takes the job as
already launched and runs one rank per process: ``devices`` is the number of ranks per node,
``num_nodes`` the number of nodes (here 2 and 1; on Spark with one CPU rank per executor,
``devices=1, num_nodes=2``). The state dict that comes back is rank 0's; DDP keeps every rank's
equal.

The data are synthetic (no download): 10 classes given by a fixed random linear teacher.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparktrain import TorchDistributor


class MLP(L.LightningModule):
    """A 64-128-10 classifier."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Cross-entropy of one batch, logged (rank 0 prints it at the end of each epoch)."""
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        """Print the epoch's mean loss from rank 0."""
        if self.global_rank == 0:
            loss = float(self.trainer.callback_metrics["train_loss"])
            print(f"epoch {self.current_epoch} loss {loss:.4f}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam over every parameter."""
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def make_dataset(samples: int = 2048, seed: int = 1) -> TensorDataset:
    """Synthetic inputs labelled by a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 64, generator=generator)
    return TensorDataset(x, (x @ torch.randn(64, 10, generator=generator)).argmax(dim=1))


def fit(epochs: int, devices: int, num_nodes: int) -> dict[str, torch.Tensor]:
    """Runs in every rank: one Lightning rank per sparktrain rank."""
    torch.manual_seed(0)
    model = MLP()
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",  # "gpu" with use_gpu=True: each rank takes cuda:LOCAL_RANK
        devices=devices,
        num_nodes=num_nodes,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # Lightning adds the DistributedSampler itself.
    trainer.fit(model, DataLoader(make_dataset(), batch_size=64, shuffle=True))
    return model.state_dict()


if __name__ == "__main__":
    state = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(fit, 3, 2, 1)
    print(f"trained: {sum(v.numel() for v in state.values())} parameters back from rank 0")
