"""An in-place run's own checkpoint (``in_place(..., checkpoint_dir=...)``): what the restart
path resumes from when a loss leaves no live copy of some state.

The HSDP runs log as ``tests/test_inplace_sharded.py`` describes; a restart's generations are
logged after the earlier attempt's, so the committed steps of the run's lineage are those of
each step's latest attempt, and the survivors' weights must equal a one-process replay of them.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from tests.test_inplace_sharded import (
    BATCH,
    _assert_like_one_process,
    _committed_steps,
    _launch,
    _model,
    _table,
)


def test_a_lost_shard_resumes_from_the_in_place_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """One replica group of 2 shards over 2 nodes, a checkpoint every 2 steps: node 1 is killed
    at step 5, no live copy of its shard is left, and the restart (1 rank) loads the newest
    checkpoint (from node 0's memory: its own files and node 1's copy where the exchange ended
    before the kill; else from storage, and it says which) instead of training from the start:
    every row once, the weights a one-process replay of the committed lineage."""
    from sparktrain import LocalCluster

    _table(tmp_path)
    cluster = LocalCluster(nodes=2)
    killed: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 5 and not killed:
            killed.append(time.time())
            cluster.kill_node(1)

    result = _launch(tmp_path, cluster, 2, 1, on_report, ckpt=str(tmp_path / "ckpt"))
    assert killed and result.attempts == 2 and result.world_size == 1
    (restart,) = result.rescales
    assert (restart.in_place, restart.outcome) == (False, "restarted")
    assert restart.resumed_step in (2, 4), restart  # the newest published when node 1 went
    err = capfd.readouterr().err
    # node 0 holds its files and, once the exchange after the publication ended, node 1's
    said = re.search(rf"checkpoint step {restart.resumed_step} loaded from (memory|storage)", err)
    assert said, err
    assert f"from checkpoint step {restart.resumed_step}" in err
    steps = _committed_steps(tmp_path / "logs")
    resumed = [s for s, g in _lineage(tmp_path / "logs").items() if g >= 1000]
    assert min(resumed) == restart.resumed_step + 1  # the restart trained on from there
    end = json.loads((tmp_path / "logs" / "end0.json").read_text())
    assert end["world"] == 1 and end["steps"] == len(steps)
    _assert_like_one_process(tmp_path / "logs", [end])
    assert cluster.node_pids() == {}


def _lineage(logs: Path) -> dict[int, int]:
    """Each committed step's generation, the latest attempt's (as ``_committed_steps``)."""
    committed: dict[int, int] = {}
    for path in logs.glob("rank*.txt"):
        for line in path.read_text().splitlines():
            kind, step, generation, *_ = line.split()
            if kind == "C":
                committed[int(step)] = max(committed.get(int(step), -1), int(generation))
    return committed


def _ddp_train(data_dir: str, ckpt: str, log: str, stop: int) -> Any:
    """DDP's layout in place with a checkpoint every 2 steps; returns after ``stop`` steps
    (``0``: the whole epoch). Logs each committed step's batch ids."""
    import torch

    import sparktrain
    from sparktrain.data import from_parquet

    def make_data(rank: int, world: int) -> object:
        return from_parquet(data_dir, batch_size=BATCH, shuffle=False, rank=rank, world_size=world)

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    run = sparktrain.elastic.in_place(
        model, optimizer, make_data, checkpoint_dir=ckpt, checkpoint_every=2
    )
    start = run.steps
    generation = 1000 if start else 0  # the second run's commits replace the first one's
    with open(Path(log, f"rank{run.me}.txt"), "a") as out:
        for batch in run.batches():
            x = batch["x"][:, None]
            ((model(x) - 2 * x) ** 2).mean().backward()
            step = run.steps + 1
            if run.step():
                ids = " ".join(str(int(i)) for i in batch["id"])
                out.write(f"P {step} {generation} {ids}\nC {step} {generation}\n")
            if stop and run.steps == stop:
                break
    weights = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    return {"me": run.me, "steps": run.steps, "start": start, "weights": weights}


def test_a_replicated_in_place_run_resumes_from_its_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two runs of 2 ranks on one folder: the first stops after 5 steps (its checkpoint of step
    4 published before it returns), the second resumes at step 4 with the data's position, the
    optimizer's state and the step count, and trains the rest of the epoch: every row once, the
    weights a one-process replay."""
    from sparktrain import launch

    data = _table(tmp_path)
    args = (data, str(tmp_path / "ckpt"), str(tmp_path / "logs"))
    first = launch(_ddp_train, (*args, 5), num_processes=2, min_processes=1, in_place=True,
                   progress=False)  # fmt: skip
    assert first.return_values[0]["steps"] == 5
    second = launch(_ddp_train, (*args, 0), num_processes=2, min_processes=1, in_place=True,
                    progress=False, return_all=True)  # fmt: skip
    assert "checkpoint step 4 loaded from" in capfd.readouterr().err
    ends = list(second.return_values.values())
    assert {e["start"] for e in ends} == {4}  # the step count went on from the checkpoint's
    _assert_like_one_process(tmp_path / "logs", ends)


def test_bad_checkpoint_options_are_named() -> None:
    import torch

    import sparktrain
    from sparktrain import ConfigError

    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"checkpoint_every=0\): pass the committed steps"):
        sparktrain.elastic.in_place(model, optimizer, list, checkpoint_dir="x", checkpoint_every=0)
    with pytest.raises(ConfigError, match=r"checkpoint_dir=5\): pass a folder"):
        sparktrain.elastic.in_place(model, optimizer, list, checkpoint_dir=5)  # type: ignore[arg-type]
