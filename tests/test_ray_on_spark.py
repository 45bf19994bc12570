"""Ray on Spark: a Ray cluster on the Spark fixture's executors, a 2-rank run on it, then nothing
left running."""

from __future__ import annotations

import os
import sys

import cloudpickle
import pytest

from conftest import alive
from sparktrain import launch

pytestmark = pytest.mark.spark

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers lack tests/


def _rank_world_pid() -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item()), os.getpid()


def test_two_ranks_on_ray_on_spark_then_nothing_left(spark: object) -> None:
    pytest.importorskip("ray.util.spark")
    import ray

    from sparktrain.ray import setup_on_spark

    # The fixture's executors have fake GPUs; this CPU cluster asks Ray for none.
    with setup_on_spark(max_worker_nodes=2, num_cpus_worker_node=1, num_gpus_worker_node=0) as c:
        assert ray.is_initialized()
        result = launch(_rank_world_pid, num_processes=2, use_gpu=False, backend="ray")
        running = {pid for pid, _ in c.processes()}
    assert result.value[:2] == (0, 2)
    assert [node.ranks for node in result.nodes] == [(0,), (1,)]  # two Ray worker nodes
    assert len(running) > 5  # head, two worker nodes, their raylets and agents
    assert not ray.is_initialized()
    assert [pid for pid in running | {result.value[2]} if alive(pid)] == []
    assert "RAY_ADDRESS" not in os.environ
