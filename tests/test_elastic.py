"""Elastic runs on a LocalCluster: every node its own process group, killed with SIGKILL.

A real 2-node run trains a DDP model on streamed Parquet rows with a checkpoint every few steps.
Mid-epoch, node 1 is killed (agent, fork server and rank at once). The run goes on with one rank
from the latest checkpoint; a node is then added and the next checkpoint brings the run back to
two ranks. Each rank logs the ids it trained on by step, so the test can check that the epoch's
rows were trained on exactly once, counting each attempt's steps only up to the checkpoint the
next attempt resumed from (what came after was lost work, read again).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sparktrain
from conftest import wait_gone
from sparktrain import (
    CapacityError,
    ClusterConfigError,
    LocalCluster,
    TrainingFailedError,
    checkpoint,
    launch,
)
from sparktrain.driver import capacity

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = 240
BATCH = 4
EVERY = 5  # steps between checkpoints


def write_rows(folder: Path, rows: int = ROWS) -> str:
    folder.mkdir()
    ids = np.arange(rows, dtype=np.int64)
    table = pa.table({"id": ids, "x": np.random.default_rng(0).random(rows, dtype=np.float32)})
    pq.write_table(table, folder / "part-0.parquet", row_group_size=37)
    return str(folder)


def elastic_train(
    data_dir: str, ckpt_dir: str, log_dir: str, step_seconds: float, hold_from: int | None = None
) -> dict:
    """One epoch of DDP on the ids; checkpoints hold the model, optimizer and data state.

    ``hold_from``: on one rank, from that step on, each checkpoint waits (up to 240 s) until the
    driver has asked the run to grow back, so that the epoch cannot end before a returning node
    has started, however slow the machine (the checkpoint then brings the run back to full size).
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparktrain.data import from_parquet

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = from_parquet(data_dir, batch_size=BATCH, seed=3)
    step = 0
    seen: list[tuple[int, int]] = []

    def rescaled(old: int, new: int) -> None:
        seen.append((old, new))

    latest = checkpoint.load_latest(ckpt_dir, on_rescale=rescaled)
    if latest is not None:
        net.load_state_dict(latest.state["model"])
        optimizer.load_state_dict(latest.state["optimizer"])
        data.load_state_dict(latest.state["data"])
        step = latest.step
    accumulate = sparktrain.elastic.accumulation()
    attempt = sparktrain.restart_count()
    if rank == 0:
        Path(log_dir, f"attempt{attempt}-start.txt").write_text(f"{step} {world}")
    log = Path(log_dir, f"attempt{attempt}-rank{rank}.txt")
    with log.open("a") as out:
        for batch in data:
            step += 1
            loss = (model(batch["x"][:, None]) ** 2).mean() / accumulate
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.write(f"{step} {' '.join(str(int(i)) for i in batch['id'])}\n")
            out.flush()
            sparktrain.report(step=step, world=world)
            time.sleep(step_seconds)
            if step % EVERY == 0:
                if hold_from is not None and world == 1 and step >= hold_from:
                    _wait_for_growth(240)
                state = {
                    "model": net.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "data": data.state_dict(),
                }
                checkpoint.save(state, ckpt_dir, step=step)
    dist.destroy_process_group()
    return {"world": world, "accumulate": accumulate, "rescaled": seen, "step": step}


def _wait_for_growth(limit: float) -> None:
    """Wait until the driver's grow file exists (it asks the run to grow back), or ``limit``."""
    from sparktrain.contract.env import grow_file

    marker, deadline = grow_file(), time.monotonic() + limit
    while marker is not None and not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.2)


def data_and_logs(tmp_path: Path) -> tuple[str, Path]:
    """The epoch's rows, and an empty folder for the ranks' logs of the ids they trained on."""
    logs = tmp_path / "logs"
    logs.mkdir()
    return write_rows(tmp_path / "data"), logs


def committed_ids(log_dir: Path) -> list[int]:
    """The ids trained on, each attempt counted up to the step the next one resumed from."""
    starts = sorted(log_dir.glob("attempt*-start.txt"), key=lambda p: int(p.name[7:-10]))
    resumed = [int(p.read_text().split()[0]) for p in starts][1:]
    ids: list[int] = []
    for attempt in range(len(starts)):
        upto = resumed[attempt] if attempt < len(resumed) else None
        for path in sorted(log_dir.glob(f"attempt{attempt}-rank*.txt")):
            for line in path.read_text().splitlines():
                step, *rest = line.split()
                if upto is None or int(step) <= upto:
                    ids += [int(i) for i in rest]
    return ids


def test_a_lost_node_shrinks_the_run_and_a_returned_one_grows_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data_dir, logs = data_and_logs(tmp_path)
    cluster = LocalCluster(nodes=2)
    events: list[str] = []

    def on_report(rank: int, record: dict[str, Any]) -> None:
        metrics = record.get("metrics") or {}
        step, world = record.get("step"), metrics.get("world")
        if rank == 0 and world == 2 and step == 8 and "killed" not in events:
            events.append("killed")
            assert cluster.kill_node(1) is not None  # mid-epoch, 3 steps after a checkpoint
        elif rank == 0 and world == 1 and step == 17 and "added" not in events:
            events.append("added")
            cluster.add_node()

    result = launch(
        elastic_train,
        (data_dir, str(tmp_path / "ckpt"), str(logs), 0.15, 20),  # growth comes by step 20
        num_processes=2,
        backend=cluster,
        min_processes=1,
        on_report=on_report,
        progress=False,
    )
    assert events == ["killed", "added"]
    assert [(r.cause, r.old_world_size, r.new_world_size) for r in result.rescales] == [
        ("lost", 2, 1),
        ("grew", 1, 2),
    ]
    lost, grew = result.rescales
    assert "node 1" in lost.detail and lost.resumed_step == 5
    assert grew.resumed_step is not None and grew.resumed_step % EVERY == 0
    assert grew.resumed_step > 17
    assert result.world_size == 2 and result.value["world"] == 2
    assert result.value["rescaled"] == [(1, 2)]  # on_rescale(old, new) in the grown attempt
    ids = committed_ids(logs)
    assert sorted(ids) == list(range(ROWS))  # the epoch's rows exactly once
    err = capfd.readouterr().err
    assert "sparktrain: elastic: lost" in err and "resumed on 1 rank(s) (was 2)" in err
    assert "from checkpoint step 5" in err
    assert cluster.node_pids() == {}


def test_a_node_gone_silent_is_lost_within_the_heartbeat_timeout(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A frozen node (every process SIGSTOPped: as a machine that hangs, or that the network cut
    off) closes nothing: only the missing heartbeats tell. The run shrinks within the bound."""
    data_dir, logs = data_and_logs(tmp_path)
    cluster = LocalCluster(nodes=2)
    frozen: list[float] = []

    def on_report(rank: int, record: dict[str, Any]) -> None:
        metrics = record.get("metrics") or {}
        if rank == 0 and metrics.get("world") == 2 and record.get("step") == 8 and not frozen:
            frozen.append(time.monotonic())
            assert cluster.freeze_node(1) is not None

    result = launch(
        elastic_train, (data_dir, str(tmp_path / "ckpt"), str(logs), 0.15), num_processes=2,
        backend=cluster, min_processes=1, heartbeat_timeout=3.0, on_report=on_report,
        progress=False,
    )  # fmt: skip
    assert frozen, "node 1 was never frozen"
    [lost] = result.rescales
    assert (lost.cause, lost.old_world_size, lost.new_world_size) == ("lost", 2, 1)
    assert lost.outcome == "restarted" and not lost.in_place
    assert "sent nothing for 3s" in lost.detail and "node 1" in lost.detail
    # Lost after the 3 s heartbeat timeout, never before; well within TCP's minutes (15 s: the
    # driver's loop on a 2-core machine loaded 3x over took 8.4 s once).
    assert 2.5 < lost.at - (time.time() - (time.monotonic() - frozen[0])) < 15.0
    assert sorted(committed_ids(logs)) == list(range(ROWS))  # exactly once
    assert cluster.nodes_up == [0]  # marked down: a new attempt does not use it
    assert cluster.node_pids() == {}
    assert "sparktrain: elastic: lost node 1" in capfd.readouterr().err


def test_an_elastic_run_starts_on_what_is_there_and_grows(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Capacity short at the start: the run begins on the node that is up and grows back."""
    data_dir, logs = data_and_logs(tmp_path)
    cluster = LocalCluster(nodes=2)
    assert cluster.kill_node(1) is None and cluster.nodes_up == [0]  # down before the run
    added: list[int] = []

    def on_report(rank: int, record: dict[str, Any]) -> None:
        world = (record.get("metrics") or {}).get("world")
        if rank == 0 and world == 1 and record.get("step") == 3 and not added:
            added.append(cluster.add_node())

    result = launch(
        elastic_train, (data_dir, str(tmp_path / "ckpt"), str(logs), 0.15, 5), num_processes=2,
        backend=cluster, min_processes=1, on_report=on_report, progress=False,
    )  # fmt: skip
    assert added == [1]
    assert [(r.cause, r.old_world_size, r.new_world_size) for r in result.rescales] == [
        ("grew", 1, 2)
    ]
    assert (logs / "attempt0-start.txt").read_text() == "0 1"  # began on one rank
    assert result.world_size == 2 and result.value["world"] == 2
    assert result.value["accumulate"] == 1 and result.value["rescaled"] == [(1, 2)]
    assert sorted(committed_ids(logs)) == list(range(ROWS))  # every row exactly once
    err = capfd.readouterr().err
    assert "sparktrain: elastic: 2 rank(s) do not fit now (num_processes=2 needs 2 node(s)" in err
    assert "starting on 1 ranks on 1 node, cpu (gloo) (min_processes=1); the run grows back" in err
    assert cluster.node_pids() == {}


def test_an_elastic_start_below_the_floor_is_refused_at_once() -> None:
    cluster = LocalCluster(nodes=3)
    cluster.kill_node(1)
    cluster.kill_node(2)
    with pytest.raises(CapacityError) as caught:
        launch(sleeps_then_returns, ("/nonexistent",), num_processes=3, backend=cluster,
               min_processes=2)  # fmt: skip
    text = str(caught.value)
    assert "the elastic run cannot start: 3 rank(s) do not fit now" in text
    assert "nor any size down to min_processes=2 on the local-cluster backend" in text
    with pytest.raises(ClusterConfigError, match="needs 3 node"):  # not elastic: as before
        launch(sleeps_then_returns, ("/nonexistent",), num_processes=3, backend=cluster)
    assert cluster.node_pids() == {}


def raises_on_rank_1() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("a bug in the training code")
    dist.barrier()


def test_a_python_exception_is_not_retried_elastically() -> None:
    with pytest.raises(TrainingFailedError) as caught:
        launch(raises_on_rank_1, num_processes=2, backend=LocalCluster(2), min_processes=1)
    error = caught.value
    assert error.cause == "training code" and error.attempts == 1
    assert "ValueError: a bug in the training code" in str(error)
    assert "cause: training code" in str(error)


def sleeps_then_returns(folder: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    Path(folder, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(30)
    return dist.get_world_size()


def test_below_the_floor_is_an_error_not_a_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = LocalCluster(nodes=2)

    def killer() -> None:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.kill_node(0)

    reads: list[float] = []
    settling: list[float] = []
    read, settle = cluster.capacity, capacity.settled_capacity

    def counted(plan: Any) -> int:
        reads.append(time.monotonic())
        return read(plan)

    def timed(*args: Any) -> int:  # from the loss seen (the sizing begins) to its answer
        started = time.monotonic()
        try:
            return settle(*args)
        finally:
            settling.append(time.monotonic() - started)

    monkeypatch.setattr(cluster, "capacity", counted)
    monkeypatch.setattr(capacity, "settled_capacity", timed)
    threading.Thread(target=killer, daemon=True).start()
    with pytest.raises(CapacityError) as caught:
        launch(sleeps_then_returns, (str(tmp_path),), num_processes=2, backend=cluster,
               min_processes=2)  # fmt: skip
    # Refused once the reads agree below the floor for a moment (3 reads, 1 s), never after the
    # 10 s a changing capacity may take to settle.
    assert len(reads) == 3 and len(settling) == 1 and settling[0] < 2.0
    text = str(caught.value)
    assert "1 rank(s) can run now" in text and "min_processes=2" in text
    assert "1 more rank(s) of capacity are missing" in text
    assert "node 0" in text  # what was lost
    ranks = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert wait_gone(ranks) == []  # the survivor was stopped, not left sleeping
    assert cluster.node_pids() == {}
