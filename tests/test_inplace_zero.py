"""Elastic in place for ZeRO-1/2 on a LocalCluster: the optimizer partitions re-divided.

The ranks run ``test_inplace_sharded``'s training function with ``zero=`` and log as there
(``P`` before a step, ``C`` after a committed one), so that the survivors' weights are compared
with a one-process replay of the committed steps (AdamW, each step's loss averaged over its
ranks) and every row is checked to be read once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from tests.test_inplace_sharded import _assert_like_one_process, _committed_steps, _model

pytest.importorskip("pyarrow")


def _launch(tmp_path: Path, cluster: Any, ranks: int, zero: int, on_report: Any, **kw: Any) -> Any:
    from tests.test_inplace_sharded import _hsdp_train, _table

    from sparktrain import launch

    _table(tmp_path)
    return launch(
        _hsdp_train,
        (str(tmp_path / "data"), str(tmp_path / "logs"), 1, kw.get("step_seconds", 0.1),
         kw.get("starts", 0), False, zero, "", str(kw.get("ckpt", ""))),
        num_processes=ranks,
        backend=cluster,
        min_processes=1,
        in_place=True,
        on_report=on_report,
        progress=False,
        return_all=True,
    )  # fmt: skip


def _ends(tmp_path: Path) -> dict[int, dict]:
    paths = (tmp_path / "logs").glob("end*.json")
    return {e["me"]: e for e in (json.loads(p.read_text()) for p in paths)}


@pytest.mark.parametrize(("zero", "how"), [(1, "kill"), (2, "kill"), (2, "preempt")])
def test_a_zero_run_loses_a_node_and_redivides_its_optimizer_partitions_in_place(
    tmp_path: Path, zero: int, how: str
) -> None:
    """4 nodes of 1 rank, AdamW's state in 4 partitions (each with a copy on the next node);
    node 2 is killed (or told to leave) at step 3: the 3 survivors keep the parameters, take
    partition 2 from its copy, and end equal to a one-process replay, every row once."""
    import sparktrain
    from sparktrain import LocalCluster

    cluster = LocalCluster(nodes=4)
    struck: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 3 and not struck:
            struck.append(time.time())
            if how == "kill":
                cluster.kill_node(2)
            else:
                assert sparktrain.preempt(2) == (2,)

    result = _launch(tmp_path, cluster, 4, zero, on_report)
    assert struck and result.attempts == 1
    lost = result.rescales[0]  # a noticed node's capacity comes back: a joiner may follow
    cause = "lost" if how == "kill" else "preempted"
    assert (lost.cause, lost.old_world_size, lost.new_world_size) == (cause, 4, 3)
    assert lost.in_place and lost.outcome == "redivided"
    assert "optimizer partitions divided anew" in lost.describe()
    assert [r.outcome for r in result.rescales[1:]] in ([], ["healed"])
    ends = _ends(tmp_path)
    finishers = [e for e in ends.values() if e["world"] == result.world_size]
    assert {0, 1, 3} <= {f["me"] for f in finishers} and 2 not in {f["me"] for f in finishers}
    _assert_like_one_process(tmp_path / "logs", finishers, padded=2 * 3)
    if how == "preempt":  # it left after a committed step: no step in flight was lost
        assert ends[2]["world"] == 4
        assert len(_committed_steps(tmp_path / "logs")) == ends[0]["steps"]
    assert not list(tmp_path.glob("**/*.ckpt*"))
    assert cluster.node_pids() == {}


def test_a_returning_node_takes_its_partitions_from_the_live_ranks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """ZeRO-1 on 3 nodes; node 1 is killed and a node returns: it joins, receives the
    parameters and its optimizer partitions from the live ranks (no checkpoint read), and all
    three end with the weights of a one-process replay. The loop's checkpoint (every 2 steps)
    is staged at every size the partitions were cut for (3, 2, 3 ranks), none read."""
    from sparktrain import LocalCluster

    cluster = LocalCluster(nodes=3)
    struck: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 3 and not struck:
            struck.append(time.time())
            cluster.kill_node(1)
            cluster.add_node()

    ckpt = tmp_path / "ckpt"
    result = _launch(tmp_path, cluster, 3, 1, on_report, starts=4, step_seconds=0.2, ckpt=ckpt)
    assert struck and result.attempts == 1 and result.world_size == 3
    err = capfd.readouterr().err
    # (the save in flight at the kill may fail: its peer is gone; no save fails to stage)
    assert "could not stage" not in err and "loaded from" not in err
    steps = ckpt.glob("step-*")
    saved = {json.loads((step / "COMPLETE").read_text())["world_size"] for step in steps}
    assert saved == {3}, saved  # the newest (kept: 2) at the end's size
    outcomes = sorted((r.cause, r.outcome) for r in result.rescales)
    assert outcomes == [("grew", "healed"), ("lost", "redivided")], outcomes
    ends = _ends(tmp_path)
    finishers = [e for e in ends.values() if e["world"] == 3]
    assert sorted(f["me"] for f in finishers) == [0, 2, 3]
    _assert_like_one_process(tmp_path / "logs", finishers, padded=2 * 2)
    assert not list(tmp_path.glob("**/*.ckpt*"))
    assert cluster.node_pids() == {}


def test_a_node_lost_just_after_a_join_is_kept_in_place(tmp_path: Path) -> None:
    """ZeRO-1 on 3 nodes: node 1 is killed and a node returns; as soon as rank 0 reports the
    joiner in (the step the join ended, before a step of the new partitions commits), node 2
    is killed too. The joiner counts its cuts as the group does, so the survivors agree on the
    partitions they hold: rank 0 and the joiner go on in place and end equal to a replay."""
    from sparktrain import LocalCluster

    cluster = LocalCluster(nodes=3)
    struck: list[str] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 3 and not struck:
            struck.append("first")
            cluster.kill_node(1)
            cluster.add_node()
        elif rank == 0 and struck == ["first"] and record["metrics"].get("world") == 3:
            struck.append("second")
            cluster.kill_node(2)

    result = _launch(tmp_path, cluster, 3, 1, on_report, starts=4, step_seconds=0.2)
    assert struck == ["first", "second"] and result.attempts == 1 and result.world_size == 2
    outcomes = [(r.cause, r.outcome) for r in result.rescales]
    assert outcomes == [("lost", "redivided"), ("grew", "healed"), ("lost", "redivided")]
    finishers = [e for e in _ends(tmp_path).values() if e["world"] == 2]
    assert sorted(f["me"] for f in finishers) == [0, 3]
    _assert_like_one_process(tmp_path / "logs", finishers, padded=3 * 2)
    assert cluster.node_pids() == {}


def test_a_partition_with_no_live_copy_resumes_from_the_loops_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """3 nodes of 1 rank lose nodes 1 and 2 at once: optimizer partition 1 (owner rank 1, its
    copy on rank 2) has no live copy, so the run goes back to its restart path (its second
    attempt, 1 rank) and says why. The driver checks the plan the ranks may still hold too: the
    second kill seen a moment after the first is still no in-place loss. The restart resumes
    from the loop's checkpoint (every 2 steps, each rank its own partition): its weights and
    optimizer state, the step count and the data's position, so that the rank ends equal to a
    one-process replay of the committed lineage, every row once."""
    from sparktrain import LocalCluster

    cluster = LocalCluster(nodes=3)
    struck: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 5 and not struck:
            struck.append(time.time())
            cluster.kill_node(1)
            cluster.kill_node(2)

    result = _launch(tmp_path, cluster, 3, 2, on_report, ckpt=str(tmp_path / "ckpt"))
    assert struck and result.attempts == 2 and result.world_size == 1
    restart = result.rescales[-1]
    assert (restart.in_place, restart.outcome) == (False, "restarted")
    assert restart.resumed_step in (2, 4), restart
    err = capfd.readouterr().err
    assert "lost their owner and their copy" in err and "restart path" in err
    assert f"checkpoint step {restart.resumed_step} loaded from" in err
    ends = _ends(tmp_path)
    assert ends[0]["world"] == 1
    _assert_like_one_process(tmp_path / "logs", [ends[0]], padded=2)
    assert cluster.node_pids() == {}


def test_each_partition_has_its_copy_on_another_node() -> None:
    """Place i owns partition i; its copy is the same place on the next node (the next rank
    when one node holds every rank); a partition is lost only with its owner and its copy."""
    from sparktrain.contract.inplace import copy_holder, partitions_lost
    from sparktrain.rank.zero_partitions import held

    assert [copy_holder(k, 4, 1) for k in range(4)] == [1, 2, 3, 0]
    assert [copy_holder(k, 4, 2) for k in range(4)] == [2, 3, 0, 1]  # 2 nodes of 2 ranks
    assert [copy_holder(k, 2, 2) for k in range(2)] == [1, 0]  # one node: the next rank
    assert held([10, 11, 12, 13], 11, 1) == [0, 1]  # its own, and the previous place's copy
    assert held([10, 11, 12, 13], 12, 2) == [0, 2]
    assert held([10], 10, 1) == [0] and held([10, 11], 12, 1) == []
    assert partitions_lost([0, 1, 2, 3], {1, 2}, 1) == [1]
    assert partitions_lost([0, 1, 2, 3], {2, 3}, 2) == []  # a whole node: copies elsewhere
    assert partitions_lost([0, 1, 2, 3], {1, 3}, 1) == []


def test_in_place_zero_refuses_what_it_cannot_keep_in_place() -> None:
    """ZeRO-3 is named with why (its parameter partitions have no copy) and what to use;
    another stage, two layouts at once and an optimizer it cannot make again are named."""
    import torch

    import sparktrain
    from sparktrain import ConfigError

    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"zero=3.*only in a checkpoint.*replicas="):
        sparktrain.elastic.in_place(model, adamw, lambda r, w: [], zero=3)
    for bad in (0, True, "1"):
        with pytest.raises(ConfigError, match=r"zero is the ZeRO stage, 1 .* or 2"):
            sparktrain.elastic.in_place(model, adamw, lambda r, w: [], zero=bad)
    with pytest.raises(ConfigError, match="pass one of mesh="):
        sparktrain.elastic.in_place(model, adamw, lambda r, w: [], zero=1, replicas=2)
    with pytest.raises(ConfigError, match=r"zero=\.\.\.\): optimizer=3 is neither"):
        sparktrain.elastic.in_place(model, 3, lambda r, w: [], zero=1)


def _buffers_train() -> list[float]:
    """A model whose buffer and frozen weight start different on each rank."""
    import os

    import torch

    import sparktrain

    model = torch.nn.Linear(2, 1)
    rank = float(os.environ["RANK"])
    model.register_buffer("seen", torch.full((2,), rank))
    frozen = torch.nn.Parameter(torch.full((3,), rank), requires_grad=False)
    model.register_parameter("frozen", frozen)
    run = sparktrain.elastic.in_place(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      lambda r, w: [], zero=1)  # fmt: skip
    return [*model.seen.tolist(), *model.frozen.tolist(), float(run.world_size)]


def test_buffers_and_frozen_parameters_start_from_rank_0() -> None:
    """As DDP does, every rank starts from rank 0's buffers and frozen parameters (they are not
    in the partitions: a rank's own would silently differ)."""
    from sparktrain import LocalCluster, launch

    result = launch(_buffers_train, num_processes=2, backend=LocalCluster(nodes=2),
                    min_processes=1, in_place=True, progress=False, return_all=True)  # fmt: skip
    assert result.return_values == {0: [0.0] * 5 + [2.0], 1: [0.0] * 5 + [2.0]}
