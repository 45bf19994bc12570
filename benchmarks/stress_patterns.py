"""The ways users end a training function, as rank bodies for ``stress.py`` and the test suite.

Each pattern is a function every rank of a 2-rank launch calls, and a check of what the launch
returned (or raised). They are the shapes of the DDP tutorials, the README, FSDP, DeepSpeed and
Lightning programs: a rank that hangs in any of them is a bug of ours to find.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VALUE = 7


def _ddp(steps: int = 2) -> Any:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    return model


def destroy_then_return() -> int:
    """The DDP tutorial: init, train, destroy the group, return a number.

    The model stays in the frame until the function returns, so it is freed after the group was
    destroyed: the shape of the gloo teardown deadlock (docs/reliability.md).
    """
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = _ddp()
    dist.destroy_process_group()
    del model  # freed here, after the destroy, as at the function's return
    return VALUE


def return_without_destroy() -> int:
    """Init, train, return a number; the group is left to the launcher."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    _ddp()
    return VALUE


def return_ddp_model() -> Any:
    """The README's pattern: return the DDP-wrapped model (it comes back unwrapped)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return _ddp()


def raise_after_init() -> int:
    """Rank 1 raises after a step; the run must fail naming rank 1, not hang."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    _ddp()
    if dist.get_rank() == 1:
        raise ValueError("injected failure on rank 1")
    _ddp()
    return VALUE


def init_destroy_twice() -> int:
    """Two process groups one after the other in one function."""
    import torch.distributed as dist

    models = []
    for _ in range(2):
        dist.init_process_group("gloo")
        models.append(_ddp())  # each freed after its group was destroyed
        dist.destroy_process_group()
    return VALUE


def fsdp() -> int:
    """FSDP2 (``fully_shard``) over a CPU mesh, two steps, destroy, return."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    dist.destroy_process_group()
    return VALUE


def deepspeed_engine() -> int:
    """A DeepSpeed ZeRO-2 engine with a torch optimizer (nothing to compile), two steps."""
    import deepspeed
    import torch

    deepspeed.init_distributed("gloo")
    model = torch.nn.Linear(8, 2)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
    )
    for _ in range(2):
        loss = engine(torch.randn(4, 8)).sum()
        engine.backward(loss)
        engine.step()
    return VALUE


def lightning_fit() -> int:
    """``Trainer(strategy="ddp").fit`` on 2 CPU processes, a few steps."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x = torch.randn(64, 8)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
        max_steps=3,
        default_root_dir=tempfile.mkdtemp(prefix="stress-lightning-"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    return VALUE


def _is_value(result: Any) -> bool:
    return bool(result.value == VALUE)


def _is_linear(result: Any) -> bool:
    import torch

    return isinstance(result.value, torch.nn.Linear)


@dataclass(frozen=True)
class Pattern:
    """A rank body and what a correct launch of it gives.

    Attributes:
        name: Row label.
        fn: What every rank runs.
        check: Whether a returned :class:`~sparktrain.RunResult` is right (``None``: the run
            must fail).
        fails_on: For a run that must fail: the rank the error must name.
    """

    name: str
    fn: Callable[[], Any]
    check: Callable[[Any], bool] | None = _is_value
    fails_on: int | None = None


PLAIN = (
    Pattern("destroy, then return", destroy_then_return),
    Pattern("return without destroy", return_without_destroy),
    Pattern("return the DDP model", return_ddp_model, _is_linear),
    Pattern("raise after init (rank 1)", raise_after_init, None, fails_on=1),
    Pattern("init/destroy twice", init_destroy_twice),
)
HEAVY = (
    Pattern("FSDP2", fsdp),
    Pattern("DeepSpeed ZeRO-2 engine", deepspeed_engine),
    Pattern("Lightning Trainer.fit", lightning_fit),
)


#: A rank body that starts a child process, records both PIDs and its start time, and waits.
SLEEPY_RANK = """
import os, subprocess, sys, time
from pathlib import Path

def sleepy(folder):
    child = subprocess.Popen(["sleep", "1000"])
    record = f"{os.getpid()} {child.pid} {time.time()}"
    name = "rank-" + os.environ["RANK"]
    Path(folder, name + ".tmp").write_text(record)  # whole or absent, however it is killed
    os.replace(Path(folder, name + ".tmp"), Path(folder, name))
    time.sleep(1000)
"""
#: A caller script (``python caller.py FOLDER``) that launches it on 2 ranks, to be killed.
SLEEPY_CALLER = (
    SLEEPY_RANK
    + """
if __name__ == "__main__":
    from sparktrain import launch

    launch(sleepy, (sys.argv[1],), num_processes=2, use_gpu=False)
"""
)


def rank_records(folder: Any) -> list[tuple[int, int, float]]:
    """``(rank PID, child PID, start time)`` of each rank of a sleepy run that started."""
    from pathlib import Path

    records = []
    for path in Path(folder).glob("rank-*"):
        if path.suffix == ".tmp":
            continue
        rank_pid, child_pid, started = path.read_text().split()
        records.append((int(rank_pid), int(child_pid), float(started)))
    return records


def outcome(pattern: Pattern, launch: Callable[[], Any]) -> str:
    """Run one launch of ``pattern``: ``"ok"``, ``"hang"`` or ``"failure: <why>"``."""
    from sparktrain import TrainingFailedError, TrainingTimeoutError

    try:
        result = launch()
    except TrainingTimeoutError:
        return "hang"
    except TrainingFailedError as error:
        culprit = error.culprit
        if pattern.check is None and culprit is not None and culprit.rank == pattern.fails_on:
            return "ok"
        return f"failure: {str(error).splitlines()[0]}"
    if pattern.check is None:
        return "failure: the run succeeded but should have failed"
    return "ok" if pattern.check(result) else f"failure: wrong value {result.value!r}"
