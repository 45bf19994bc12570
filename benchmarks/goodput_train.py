"""The goodput benchmark's training loops: a small transformer language model on token rows.

Each row of the dataset is an id; its tokens are drawn from a generator seeded by the id, so
every side trains the same rows on the same tokens. The model (an embedding, two transformer
encoder layers, a head: about 30k parameters) trains next-token prediction with AdamW; a sleep
of ``step_seconds`` after each step stands for the rest of a real step. The loops log as
:mod:`goodput_plan` reads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VOCAB, LENGTH, WIDTH = 64, 16, 32


def model() -> Any:
    """The transformer, the same weights on every rank and side."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
                for _ in range(2)
            )
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Tiny()


def loss_of(net: Any, ids: Any) -> Any:
    """Next-token loss on the rows ``ids`` (their tokens drawn from each id)."""
    import torch

    tokens = torch.stack(
        [torch.randint(0, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(int(i)))
         for i in ids]
    )  # fmt: skip
    logits = net(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def logged_steps(  # noqa: PLR0917 - the restart loops' one shape
    log: Path, generation: int, step: int, world: int, parts: tuple[Any, Any, Any],
    step_seconds: float,
) -> Iterator[int]:  # fmt: skip
    """Train the rest of the data reader from ``step`` on, one committed step at a time, logged
    as :func:`goodput_plan.read_restarts` reads; yields each step's number after its sleep.

    ``parts``: the DDP model, its optimizer, the data reader.
    """
    ddp, optimizer, data = parts
    with log.open("a") as out:
        out.write(f"R {step}\n")
        out.flush()
        for rows in data:
            step += 1
            loss_of(ddp, rows["id"]).backward()
            optimizer.step()
            optimizer.zero_grad()
            ids = " ".join(str(int(i)) for i in rows["id"])
            out.write(f"C {step} {generation} {time.time():.6f} {world} {ids}\n")
            out.flush()
            time.sleep(step_seconds)
            yield step


def train_in_place(  # noqa: PLR0917 - one tuple of arguments from launch
    data_dir: str, log_dir: str, replicas: int, step_seconds: float, batch: int, zero: int = 0,
    ckpt_dir: str = "", every: int = 50,
) -> int:  # fmt: skip
    """In place: DDP's layout (``replicas=0``), HSDP (``replicas`` replica groups) or the
    optimizer state partitioned (``zero``: the ZeRO stage). ``ckpt_dir``: the in-place
    checkpoint every ``every`` steps, which a restart (no live copy of a shard) resumes from.
    A generation is logged as ``1_000_000 * attempt + generation``."""
    import torch

    import sparktrain
    from sparktrain.data import from_parquet

    mesh = sparktrain.elastic.mesh(replicas=replicas) if replicas else None
    net = model()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def make_data(rank: int, world: int) -> Any:
        return from_parquet(data_dir, batch_size=batch, seed=3, rank=rank, world_size=world)

    kept = {"checkpoint_dir": ckpt_dir, "checkpoint_every": every} if ckpt_dir else {}
    run = sparktrain.elastic.in_place(
        net, optimizer, make_data, mesh=mesh, zero=zero or None, **kept
    )
    attempt = 1_000_000 * sparktrain.restart_count()
    with Path(log_dir, f"rank{run.me}-{os.getpid()}.txt").open("a") as out:
        for rows in run.batches():
            loss_of(net, rows["id"]).backward()
            step, generation = run.steps + 1, attempt + run.generation
            ids = " ".join(str(int(i)) for i in rows["id"])
            out.write(f"P {step} {generation} {time.time():.6f} {ids}\n")
            out.flush()
            if run.step():
                out.write(f"C {step} {generation} {time.time():.6f} {run.world_size}\n")
                out.flush()
            sparktrain.report(step=run.steps, world=run.world_size)
            time.sleep(step_seconds)
    return run.steps


def train_restart(  # noqa: PLR0917 - one tuple of arguments from launch
    data_dir: str, ckpt_dir: str, log_dir: str, step_seconds: float, batch: int, every: int
) -> int:
    """The restart path: DDP, ``sparktrain.checkpoint`` every ``every`` steps, resumed."""
    import torch
    import torch.distributed as dist
    from _common import resume
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparktrain
    from sparktrain import checkpoint
    from sparktrain.data import from_parquet

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    ddp = DDP(net)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    data = from_parquet(data_dir, batch_size=batch, seed=3)
    step = start = resume(ckpt_dir, net, optimizer, data)
    attempt = sparktrain.restart_count()
    log = Path(log_dir, f"attempt{attempt}-rank{rank}-{os.getpid()}.txt")
    for step in logged_steps(log, attempt, start, world, (ddp, optimizer, data), step_seconds):
        sparktrain.report(step=step, world=world)
        if step % every == 0:
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "data": data.state_dict()}  # fmt: skip
            checkpoint.save(state, ckpt_dir, step=step)
    checkpoint.wait()
    dist.destroy_process_group()
    return step


def train_torchrun(  # noqa: PLR0917 - the worker's command line, one loop
    data_dir: str, ckpt_dir: str, log_dir: str, step_seconds: float, batch: int, every: int
) -> int:
    """torchrun's side: DDP, DCP ``async_save`` every ``every`` steps, resumed from the newest.

    As torchtitan does it: the model and optimizer through ``get_state_dict``/``set_state_dict``
    and DCP (its background save on a gloo group of its own), the data reader's position saved
    by rank 0 beside it; a checkpoint counts once its ``done`` marker is written, after the save
    finished on every rank. Each rendezvous round is a generation, named by rank 0's clock.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparktrain.data import from_parquet

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    saver = dist.new_group(backend="gloo")
    net = model()
    ddp = DDP(net)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    data = from_parquet(data_dir, batch_size=batch, seed=3)
    done = sorted(int(p.parent.name) for p in Path(ckpt_dir).glob("*/done"))
    step = done[-1] if done else 0
    if step:
        folder = Path(ckpt_dir, str(step))
        model_state, optim_state = get_state_dict(net, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(net, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
        data.load_state_dict(torch.load(folder / "data.pt", weights_only=False))
    names = [time.time_ns()]
    dist.broadcast_object_list(names, src=0)
    generation = names[0]
    pending: list[tuple[Any, Path]] = []

    def finish() -> None:
        for future, folder in pending:
            future.result()
            if rank == 0:
                (folder / "done").touch()
        pending.clear()

    log = Path(log_dir, f"attempt{generation}-rank{rank}-{os.getpid()}.txt")
    parts, start = (ddp, optimizer, data), step
    for step in logged_steps(log, generation, start, world, parts, step_seconds):
        if step % every == 0:
            finish()
            folder = Path(ckpt_dir, str(step))
            if rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(data.state_dict(), folder / "data.pt")
            model_state, optim_state = get_state_dict(net, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            future = dcp.async_save(state, checkpoint_id=str(folder), process_group=saver)
            pending.append((future, folder))
    finish()
    dist.destroy_process_group()
    return step


def train_raytrain(config: dict[str, Any]) -> None:
    """Ray Train's side: DDP on the group Ray Train formed, a checkpoint every ``every`` steps.

    Rank 0 writes the model, optimizer and data reader's state into a folder and reports it as a
    ``ray.train.Checkpoint`` (every rank reports, as Ray Train asks); a new worker group, after a
    loss or a resize, resumes from the latest one Ray Train kept. Each group start is a
    generation, named by rank 0's clock.
    """
    import tempfile

    import ray.train
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparktrain.data import from_parquet

    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    ddp = DDP(net)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    data = from_parquet(config["data"], batch_size=config["batch"], seed=3)
    step = 0
    saved = ray.train.get_checkpoint()
    if saved is not None:
        with saved.as_directory() as folder:
            state = torch.load(Path(folder, "state.pt"), weights_only=False)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.load_state_dict(state["data"])
        step = state["step"]
    names = [time.time_ns()]
    dist.broadcast_object_list(names, src=0)
    log = Path(config["logs"], f"attempt{names[0]}-rank{rank}-{os.getpid()}.txt")
    parts, seconds, start = (ddp, optimizer, data), config["step_seconds"], step
    for step in logged_steps(log, names[0], start, world, parts, seconds):
        if step % config["every"] == 0:
            with tempfile.TemporaryDirectory() as folder:
                checkpoint = None
                if rank == 0:
                    state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                             "data": data.state_dict(), "step": step}  # fmt: skip
                    torch.save(state, Path(folder, "state.pt"))
                    checkpoint = ray.train.Checkpoint.from_directory(folder)
                    Path(config["saved"], str(step)).touch()  # one file a checkpoint
                ray.train.report({"step": step}, checkpoint=checkpoint)


if __name__ == "__main__":  # torchrun's worker: data ckpt logs step_seconds batch every
    import sys

    data_dir, ckpt_dir, log_dir, seconds, rows, every = sys.argv[1:7]
    train_torchrun(data_dir, ckpt_dir, log_dir, float(seconds), int(rows), int(every))
