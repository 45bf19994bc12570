"""Elastic runs on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``).

A head and one worker node, one CPU each: the run's two ranks are spread one per node. Mid-epoch
the worker node is removed (its raylet and workers killed); the run goes on with one rank from
the latest checkpoint in a smaller placement group, and when a node joins again the next
checkpoint brings it back to two. Every row of the epoch is trained on exactly once.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import test_elastic
from sparktrain import launch
from test_elastic import committed_ids, elastic_train, write_rows

cloudpickle.register_pickle_by_value(test_elastic)


@contextlib.contextmanager
def two_node_cluster(system_config: dict[str, Any] | None = None, cpus: int = 1) -> Iterator[Any]:
    """A head node and a worker node, ``cpus`` CPUs each, with this process connected."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_AUTH_MODE")
    saved_print = builtins.print  # ray.init replaces it in the driver and leaves it replaced
    os.environ["RAY_AUTH_MODE"] = "disabled"
    if ray.is_initialized():
        ray.shutdown()
    head: dict[str, Any] = {"num_cpus": cpus, "include_dashboard": False}
    if system_config:
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        cluster.add_node(num_cpus=cpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        builtins.print = saved_print
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture
def two_node_ray() -> Iterator[Any]:
    """A head node and a worker node, one CPU each, with this process connected."""
    with two_node_cluster() as cluster:
        yield cluster


def test_a_lost_ray_node_shrinks_the_run_and_a_joining_one_grows_it(
    two_node_ray: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cluster = two_node_ray
    worker = cluster.list_all_nodes()[-1]
    data_dir = write_rows(tmp_path / "data")
    logs = tmp_path / "logs"
    logs.mkdir()
    events: list[str] = []

    def on_report(rank: int, record: dict[str, Any]) -> None:
        step, world = record.get("step"), (record.get("metrics") or {}).get("world")
        if rank == 0 and world == 2 and step == 8 and "removed" not in events:
            events.append("removed")
            cluster.remove_node(worker, allow_graceful=False)
        elif rank == 0 and world == 1 and step == 20 and "added" not in events:
            events.append("added")
            cluster.add_node(num_cpus=1)

    result = launch(
        elastic_train,
        (data_dir, str(tmp_path / "ckpt"), str(logs), 0.15, 25),  # growth comes by step 25
        num_processes=2,
        backend="ray",
        min_processes=1,
        on_report=on_report,
        progress=False,
    )
    assert events == ["removed", "added"]
    assert [(r.cause, r.old_world_size, r.new_world_size) for r in result.rescales] == [
        ("lost", 2, 1),
        ("grew", 1, 2),
    ]
    lost, grew = result.rescales
    assert "its Ray actor died" in lost.detail
    assert lost.resumed_step is not None and lost.resumed_step % 5 == 0
    assert grew.resumed_step is not None and grew.resumed_step > 20
    assert result.value["world"] == 2 and result.value["rescaled"] == [(1, 2)]
    assert sorted(committed_ids(logs)) == list(range(240))  # every row exactly once
    assert "sparktrain: elastic: lost node" in capfd.readouterr().err


def test_an_elastic_run_starts_on_the_ray_node_that_is_there_and_grows(
    two_node_ray: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cluster = two_node_ray
    import ray

    cluster.remove_node(cluster.list_all_nodes()[-1], allow_graceful=False)  # before the run
    deadline = time.monotonic() + 60  # until Ray no longer counts the removed node's CPU free
    while ray.available_resources().get("CPU", 0) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    data_dir = write_rows(tmp_path / "data")
    logs = tmp_path / "logs"
    logs.mkdir()
    added: list[str] = []

    def on_report(rank: int, record: dict[str, Any]) -> None:
        world = (record.get("metrics") or {}).get("world")
        if rank == 0 and world == 1 and record.get("step") == 3 and not added:
            added.append("added")
            cluster.add_node(num_cpus=1)

    result = launch(
        elastic_train, (data_dir, str(tmp_path / "ckpt"), str(logs), 0.15, 5), num_processes=2,
        backend="ray", min_processes=1, on_report=on_report, progress=False,
    )  # fmt: skip
    assert added == ["added"]
    assert [(r.cause, r.old_world_size, r.new_world_size) for r in result.rescales] == [
        ("grew", 1, 2)
    ]
    assert (logs / "attempt0-start.txt").read_text() == "0 1"
    assert result.value["world"] == 2 and result.value["rescaled"] == [(1, 2)]
    assert sorted(committed_ids(logs)) == list(range(240))  # every row exactly once
    err = capfd.readouterr().err
    assert "sparktrain: elastic: 2 rank(s) do not fit now (" in err
    assert "starting on 1 ranks on 1 node" in err
