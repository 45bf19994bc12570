"""Elastic in place on a real two-node Ray cluster (``ray.cluster_utils.Cluster``).

The worker node is removed mid-epoch: the rank on the head goes on in place (no restart, no
checkpoint). A node is added back: the driver places a node there whose rank asks in and takes
the live state from its peer by broadcast. The joiner's final state is bit-identical to the
survivor's, and every row is trained once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import test_inplace
from test_elastic_ray import two_node_cluster
from test_inplace import ROWS, _in_place_train, _table, logged_rows

cloudpickle.register_pickle_by_value(test_inplace)
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture
def two_node_ray() -> Iterator[Any]:
    """A head node and a worker node, one CPU each; Ray sees a node gone within about 2 s
    (its health checks every 500 ms, dead after 3 missed; the default takes about 10 s)."""
    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    with two_node_cluster(fast) as cluster:
        yield cluster


def test_a_ray_node_removed_then_added_back_heals_from_a_live_peer(
    two_node_ray: Any, tmp_path: Path
) -> None:

    from sparktrain import launch

    cluster = two_node_ray
    worker = cluster.list_all_nodes()[-1]
    _table(tmp_path)
    (tmp_path / "logs").mkdir()
    events: list[str] = []

    def on_report(rank: int, record: dict[str, Any]) -> None:
        step = record.get("step")  # from either rank: which one the worker runs is Ray's choice
        if step == 3 and not events:
            events.append("removed")
            cluster.remove_node(worker, allow_graceful=False)
        elif step == 4 and events == ["removed"]:
            events.append("added")
            cluster.add_node(num_cpus=1)

    result = launch(  # the survivor alone waits for the joiner's process to start (3 starts)
        _in_place_train,
        (str(tmp_path / "data"), str(tmp_path / "logs"), 1.0, 3),
        num_processes=2,
        backend="ray",
        min_processes=1,
        in_place=True,
        on_report=on_report,
        progress=False,
    )
    assert events == ["removed", "added"] and result.attempts == 1
    causes = [(r.cause, r.old_world_size, r.new_world_size, r.in_place) for r in result.rescales]
    assert causes == [("lost", 2, 1, True), ("grew", 1, 2, True)]
    ends = {int(p.stem[3:]): json.loads(p.read_text()) for p in (tmp_path / "logs").glob("end*")}
    survivor = min(ends)
    assert sorted(ends) == [survivor, 2]  # one rank went with the worker node; rank 2 joined
    kept, joined = ends[survivor], ends[2]
    assert kept["weights"] == joined["weights"] and kept["bias"] == joined["bias"]
    assert kept["steps"] == joined["steps"] and joined["world"] == 2
    assert (tmp_path / "logs" / "rank2.txt").read_text(), "the joiner trained at size 2"
    assert logged_rows(tmp_path / "logs") == list(range(ROWS))
    assert not list(tmp_path.glob("**/*.ckpt*"))


def test_an_hsdp_run_on_ray_loses_a_replica_group_and_goes_on_in_place(tmp_path: Path) -> None:
    """Two Ray nodes of 2 CPUs, a rank each: 4 ranks, 2 replica groups of 2 shards, one group a
    node. The worker node is removed: its group goes, the other keeps its shards and goes on
    (no restart, no checkpoint), weights equal to a one-process replay, every row once."""
    import test_inplace_sharded
    from sparktrain import launch

    cloudpickle.register_pickle_by_value(test_inplace_sharded)
    test_inplace_sharded._table(tmp_path)
    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    with two_node_cluster(fast, cpus=2) as cluster:
        worker = cluster.list_all_nodes()[-1]
        removed: list[int] = []

        def on_report(rank: int, record: dict[str, Any]) -> None:
            if record.get("step") == 3 and not removed:
                removed.append(rank)
                cluster.remove_node(worker, allow_graceful=False)

        result = launch(
            test_inplace_sharded._hsdp_train,
            (str(tmp_path / "data"), str(tmp_path / "logs"), 2, 0.2, 0),
            num_processes=4,
            backend="ray",
            min_processes=1,
            in_place=True,
            on_report=on_report,
            progress=False,
        )
    assert removed and result.attempts == 1 and result.world_size == 2
    causes = [(r.cause, r.old_world_size, r.new_world_size, r.in_place) for r in result.rescales]
    assert causes == [("lost", 4, 2, True)]
    ends = [json.loads(p.read_text()) for p in (tmp_path / "logs").glob("end*.json")]
    finishers = [end for end in ends if end["world"] == 2]
    assert len(finishers) == 2
    test_inplace_sharded._assert_like_one_process(tmp_path / "logs", finishers)
