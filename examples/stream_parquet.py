"""Stream a Parquet dataset into 2 DDP ranks, checkpoint every few steps, survive a killed rank.

Run it with ``python examples/stream_parquet.py`` (needs ``pip install 'sparktrain[data]'``).
It writes 20,000 synthetic rows (784 float32 features, a label from a fixed linear teacher) as
Parquet, then trains the seeds' MLP for 2 epochs on 2 ranks with ``sparktrain.data``: each rank
streams its share in shuffled windows, and every rank gets the same number of batches. With
``--kill-at 30`` rank 1 kills itself (SIGKILL) at step 30 of the first attempt; the run restarts
(``max_restarts=1``) from the last checkpoint, model and data position, and goes on with the
next unseen batch.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparktrain
from sparktrain import checkpoint
from sparktrain.data import StreamingDataset, from_parquet


def write_data(folder: Path, rows: int = 20_000, seed: int = 1) -> Path:
    """``rows`` synthetic rows as 4 Parquet files of ``features`` (784 float32) and ``label``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(seed)
    teacher = generator.standard_normal((784, 10)).astype(np.float32)
    for number, part in enumerate(np.array_split(np.arange(rows), 4)):
        x = generator.standard_normal((len(part), 784)).astype(np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 784)
        table = pa.table({"features": features, "label": (x @ teacher).argmax(axis=1)})
        pq.write_table(table, folder / f"part-{number}.parquet", row_group_size=1000)
    return folder


def train(dataset: StreamingDataset, out: str, epochs: int, kill_at: int) -> float:
    """DDP over the stream; a checkpoint (model, optimizer, the data's position) every 10 steps."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step, loss = 0, torch.tensor(0.0)
    saved = checkpoint.load_latest(out)
    if saved is not None:
        model.module.load_state_dict(saved.state["model"])
        optimizer.load_state_dict(saved.state["optimizer"])
        dataset.load_state_dict(saved.state["data"])  # one state resumes any world size
        step = saved.step
        print(f"resumed at step {step}, epoch {dataset.epoch}")
    while dataset.epoch < epochs:
        epoch = dataset.epoch
        for batch in dataset.loader(num_workers=1):
            loss = nn.functional.cross_entropy(model(batch["features"]), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 10 == 0:  # every rank handed out the same batches: rank 0's state is all
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "data": dataset.state_dict()}  # fmt: skip
                checkpoint.save(state, out, step=step)
            if step == kill_at and rank == 1 and sparktrain.restart_count() == 0:
                print(f"killing myself at step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
        print(f"epoch {epoch} done at step {step}: loss {loss.item():.3f}")
    return loss.item()


def main(argv: list[str] | None = None) -> sparktrain.RunResult:
    """Write the data, train, print the final loss; the run's result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=0, help="rank 1 dies at this step")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        path = write_data(Path(work, "data"), args.rows)
        dataset = from_parquet(path, batch_size=128, shuffle_buffer=4096)
        result = sparktrain.launch(
            train, (dataset, str(Path(work, "ckpt")), args.epochs, args.kill_at),
            num_processes=2, max_restarts=1,
        )  # fmt: skip
    print(f"final loss {result.value:.3f} after {result.attempts} attempt(s)")
    return result


if __name__ == "__main__":
    main()
