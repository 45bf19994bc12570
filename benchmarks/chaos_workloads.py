"""The rank bodies of ``chaos.py``: short, real 2-rank training that can say whether it was right.

Every body records its rank's PID (``pid-r<rank>-a<attempt>``, whole or absent) so that the
soak can find the process to hit, prints a line a step (progress for ``hang_timeout``) and
returns what the soak checks: the parameters it ends with and, on rank 0, the same training
replayed in one process from scratch (what an uninterrupted, correct run gives). Checkpoints
carry a SHA-256 of their state, written with it and verified on load; each load is recorded
(``loads-r<rank>.txt``: attempt, step, ``ok`` or ``CORRUPT``). The streaming bodies record the
sample ids of every step (``ids-a<attempt>-r<rank>.txt``) and the step each attempt resumed
from (``start-a<attempt>``), from which "every sample exactly once" is checked.

Executors cannot import this file: ``chaos.py`` registers it to be pickled by value.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

STEPS = 12  # optimizer steps of the model bodies
EVERY = 3  # steps between checkpoints
ROWS = 96  # rows of the streamed dataset: 12 batches of 4 per rank on 2 ranks
BATCH = 4


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _attempt() -> int:
    import sparktrain

    return int(sparktrain.restart_count())


def mark_started(folder: str, rank: int) -> None:
    """Record this rank's PID and start time for the attempt (read by the fault injector)."""
    _write_atomic(Path(folder, f"pid-r{rank}-a{_attempt()}"), f"{os.getpid()} {time.time()}")


def digest(obj: Any) -> str:
    """SHA-256 of a state: tensors by their bytes, containers in key order, the rest by repr."""
    import torch

    sha = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            sha.update(str((value.dtype, tuple(value.shape))).encode())
            sha.update(
                value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            )
        elif isinstance(value, dict):
            for key in sorted(value, key=repr):
                sha.update(repr(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            sha.update(b"[%d" % len(value))
            for item in value:
                feed(item)
        else:
            sha.update(repr(value).encode())

    feed(obj)
    return sha.hexdigest()


def save_checked(state: dict[str, Any], ckpt: str, step: int) -> None:
    """``sparktrain.checkpoint.save`` of ``state`` with its digest (every rank calls it)."""
    from sparktrain import checkpoint

    checkpoint.save({"state": state, "digest": digest(state)}, ckpt, step=step, keep=2)


def load_checked(ckpt: str, folder: str, rank: int) -> dict[str, Any] | None:
    """The latest checkpoint's state, its digest verified and the load recorded; or ``None``."""
    from sparktrain import checkpoint

    record = Path(folder, f"loads-r{rank}.txt")
    try:
        latest = checkpoint.load_latest(ckpt)
    except Exception as error:
        with record.open("a") as out:
            out.write(f"{_attempt()} ? LOAD-ERROR {type(error).__name__}: {error}\n")
        raise
    if latest is None:
        return None
    ok = digest(latest.state["state"]) == latest.state["digest"]
    with record.open("a") as out:
        out.write(f"{_attempt()} {latest.step} {'ok' if ok else 'CORRUPT'}\n")
    if not ok:
        raise RuntimeError(f"checkpoint step {latest.step} does not match its digest")
    return dict(latest.state["state"])


def _batch(step: int, rank: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x[:, :2].sum(1, keepdim=True) - x[:, 2:4]


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _flat(params: Any) -> list[float]:
    import torch

    return [float(v) for v in torch.cat([p.detach().reshape(-1) for p in params]).tolist()]


def replay(world: int, steps: int = STEPS, lr: float = 0.05) -> list[float]:
    """The training of the model bodies in one process: every step, the mean of the ranks' grads."""
    import torch

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        batches = [_batch(step, rank) for rank in range(world)]
        loss: Any = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches)
        (loss / world).backward()
        optimizer.step()
    return _flat(model.parameters())


def _grads_agree(model: Any, x: Any, y: Any, world: int) -> bool:
    """DDP's gradients against this rank's own ones all-reduced by hand (the gradient check)."""
    import torch
    import torch.distributed as dist

    params = list(model.parameters())
    local = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), params)
    for grad in local:
        dist.all_reduce(grad)
    return all(
        torch.allclose(p.grad, g / world, atol=1e-6) for p, g in zip(params, local, strict=True)
    )


def ddp_mlp(folder: str, ckpt: str) -> dict[str, Any]:
    """DDP on a tiny MLP, checkpointed every few steps, each step's gradients checked."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mark_started(folder, rank)
    model = _mlp()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start, grads_ok = 0, True
    saved = load_checked(ckpt, folder, rank)
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = int(saved["step"])
    for step in range(start, STEPS):
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        loss: Any = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        grads_ok = _grads_agree(model, x, y, world) and grads_ok
        optimizer.step()
        print(f"step {step + 1}", flush=True)
        time.sleep(0.1)
        if (step + 1) % EVERY == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            save_checked({**state, "step": step + 1}, ckpt, step + 1)
    replayed = replay(world) if rank == 0 else None
    return {"params": _flat(model.parameters()), "replay": replayed, "grads_ok": grads_ok}


def fsdp_mlp(folder: str, ckpt: str) -> dict[str, Any]:
    """FSDP2 (``fully_shard``) on the same MLP over a CPU mesh; the full parameters returned."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mark_started(folder, rank)
    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        loss: Any = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        print(f"step {step + 1}", flush=True)
        time.sleep(0.1)
    full = [p.full_tensor() for p in model.parameters()]
    return {"params": _flat(full), "replay": replay(world) if rank == 0 else None}


def deepspeed_zero(folder: str, ckpt: str) -> dict[str, Any]:
    """A DeepSpeed ZeRO-2 engine with a torch optimizer (nothing to compile) on the MLP."""
    import deepspeed
    import torch

    deepspeed.init_distributed("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mark_started(folder, rank)
    model = _mlp()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told: the replay does not
        "steps_per_print": 1_000_000,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        print(f"step {step + 1}", flush=True)
        time.sleep(0.1)
    return {"params": _flat(model.parameters()), "replay": replay(world) if rank == 0 else None}


def stream(data_dir: str, folder: str, ckpt: str, step_s: float, workers: int) -> dict[str, Any]:
    """DDP over streamed Parquet ids, the data position checkpointed with the model and resumed."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import sparktrain
    from sparktrain.data import from_parquet

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mark_started(folder, rank)
    torch.manual_seed(0)
    net = torch.nn.Linear(1, 1)
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = from_parquet(data_dir, batch_size=BATCH, seed=3)
    step, attempt = 0, _attempt()
    saved = load_checked(ckpt, folder, rank)
    if saved is not None:
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        data.load_state_dict(saved["data"])
        step = int(saved["step"])
    if rank == 0:
        _write_atomic(Path(folder, f"start-a{attempt}"), f"{step} {world}")
    batches = data.loader(num_workers=workers) if workers else data
    with Path(folder, f"ids-a{attempt}-r{rank}.txt").open("a") as out:
        for batch in batches:
            step += 1
            (model(batch["x"][:, None]) ** 2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            out.write(f"{step} {' '.join(str(int(i)) for i in batch['id'])}\n")
            out.flush()
            sparktrain.report(step=step, world=world)
            time.sleep(step_s)
            if step % EVERY == 0:
                state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
                save_checked({**state, "data": data.state_dict(), "step": step}, ckpt, step)
    return {"world": world, "step": step}


def write_dataset(folder: Path, rows: int = ROWS) -> str:
    """The streamed dataset: ``rows`` ids with a float column, in two files of small row groups."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    ids = np.arange(rows, dtype=np.int64)
    x = np.random.default_rng(0).random(rows, dtype=np.float32)
    half = rows // 2
    for part, cut in enumerate((slice(0, half), slice(half, rows))):
        table = pa.table({"id": ids[cut], "x": x[cut]})
        pq.write_table(table, folder / f"part-{part}.parquet", row_group_size=11)
    return str(folder)
