"""Elastic in place on Spark: an executor decommissioned with notice costs no step.

Spark tells a running task nothing when its executor is decommissioned; the driver watches the
run's executors (``TaskSchedulerImpl.isExecutorDecommissioned``) and asks the ranks of that
node to leave at the end of their step. The session fixture's local-cluster has
``spark.decommission.enabled``; the test decommissions node 1's executor from the driver, as
a cluster manager's notice (SIGPWR to a worker) does through the master.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

pytestmark = pytest.mark.spark
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("pyspark")

cloudpickle.register_pickle_by_value(sys.modules[__name__])

from test_inplace import _table  # noqa: E402 - after the skips

ROWS, BATCH = 96, 4


def _train(data_dir: str, log_dir: str, step_seconds: float) -> dict[str, Any]:
    """One epoch in place; each committed step's ids logged; the executor reported."""
    import os

    import torch

    import sparktrain
    from sparktrain.data import from_parquet

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def make_data(rank: int, world: int) -> object:
        return from_parquet(data_dir, batch_size=BATCH, shuffle=False, rank=rank, world_size=world)

    run = sparktrain.elastic.in_place(model, optimizer, make_data)
    executor = os.path.basename(os.getcwd())
    with open(Path(log_dir, f"rank{run.me}.txt"), "a") as out:
        for batch in run.batches():
            loss = (model(batch["x"][:, None]) ** 2).mean()
            loss.backward()
            if run.step():
                out.write(" ".join(str(int(i)) for i in batch["id"]) + "\n")
                out.flush()
            sparktrain.report(step=run.steps, executor=executor)
            time.sleep(step_seconds)
    return {"dropped": run.dropped, "world": run.world_size, "steps": run.steps,
            "weights": [float(v) for v in model.weight.detach().reshape(-1)]}  # fmt: skip


def test_a_decommissioned_executor_costs_no_step(spark: Any, tmp_path: Path) -> None:

    from sparktrain import launch

    _table(tmp_path)
    (tmp_path / "logs").mkdir()
    context = spark.sparkContext
    jvm = context._jvm
    noticed: list[str] = []

    def on_report(rank: int, record: dict) -> None:
        metrics = record.get("metrics") or {}
        if rank == 1 and record.get("step") == 2 and not noticed:
            noticed.append(str(metrics["executor"]))
            why = jvm.org.apache.spark.scheduler.ExecutorDecommissionInfo(
                "the test's notice", jvm.scala.Option.empty()
            )
            backend = context._jsc.sc().schedulerBackend()
            assert backend.decommissionExecutor(noticed[0], why, False, False)

    try:
        result = launch(
            _train,
            (str(tmp_path / "data"), str(tmp_path / "logs"), 0.4),
            num_processes=2,
            use_gpu=False,
            backend="spark",
            min_processes=1,
            in_place=True,
            on_report=on_report,
            progress=False,
            return_all=True,
        )
    finally:
        _wait_for_executors(context, 2)
    assert noticed and result.attempts == 1 and result.world_size == 1
    (left,) = result.rescales
    assert (left.cause, left.old_world_size, left.new_world_size) == ("preempted", 2, 1)
    assert left.in_place and "node 1" in left.detail
    values = result.return_values
    assert [values[r]["dropped"] for r in (0, 1)] == [0, 0]
    assert values[1]["world"] == 2 and values[0]["world"] == 1
    ids = sorted(
        int(i) for p in (tmp_path / "logs").glob("rank*.txt") for i in p.read_text().split()
    )
    assert ids == list(range(ROWS))  # every row once: node 1's share went to node 0


def _wait_for_executors(context: Any, count: int) -> None:
    """The decommissioned executor ends with its task; Spark starts another (other tests)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if context._jsc.sc().getExecutorMemoryStatus().size() >= count + 1:  # and the driver
            executors = context._jsc.sc().statusStore().executorList(True)
            if executors.size() >= count + 1:
                return
        time.sleep(0.5)
