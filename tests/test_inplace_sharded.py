"""Elastic in place for sharded models (HSDP): replica groups of FSDP2 shards on a LocalCluster.

Each rank logs, before each step, the step number, the generation it runs in and its batch's
ids (``P``), and after a committed step the same step and generation (``C``). A step commits
in one generation on every rank of it or on none, and a rank attempts a step once per
generation, so the batches that made committed step ``s`` are exactly the ``P s g`` lines of the
``g`` it committed in: the test replays those in one process (each step's loss averaged over its
ranks, AdamW) and compares the weights, and checks that every row was trained exactly once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS, BATCH = 192, 4


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _hsdp_train(  # noqa: PLR0917 - one tuple of arguments from launch
    data_dir: str, log_dir: str, replicas: int, step_seconds: float, starts: int,
    build: bool = False, zero: int = 0, hold: str = "", ckpt: str = "",
) -> Any:  # fmt: skip
    """One rank: FSDP2 inside its replica group, in place across groups; logs as described.
    ``build``: ``in_place(..., replicas=)`` shards the plain model and makes the optimizer.
    ``zero``: the whole model, its optimizer state partitioned instead (ZeRO in place).
    ``hold``: ranks 0 and 1 wait for that file to exist before they form their group.
    ``ckpt``: the in-place checkpoint's folder (every 2 steps). A generation is logged as
    ``1000 * attempt + generation`` (a restart's generations count from 0 again)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import sparktrain
    from sparktrain.data import from_parquet

    def make_data(rank: int, world: int) -> object:
        return from_parquet(data_dir, batch_size=BATCH, shuffle=False, rank=rank, world_size=world)

    Path(log_dir, f"started-{os.getpid()}-{time.time_ns()}").touch()
    held = time.monotonic() + 60
    while hold and os.environ["RANK"] in "01" and not os.path.exists(hold):
        if time.monotonic() > held:
            break
        time.sleep(0.02)
    model = _model()
    kept = {"checkpoint_dir": ckpt, "checkpoint_every": 2} if ckpt else {}
    if zero:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        run = sparktrain.elastic.in_place(model, optimizer, make_data, zero=zero, **kept)
    elif build:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        run = sparktrain.elastic.in_place(model, optimizer, make_data, replicas=replicas)
    else:
        mesh = sparktrain.elastic.mesh(replicas=replicas)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        run = sparktrain.elastic.in_place(model, optimizer, make_data, mesh=mesh, **kept)
    attempt = 1000 * sparktrain.restart_count()
    with open(Path(log_dir, f"rank{run.me}.txt"), "a") as out:
        for batch in run.batches():
            x = batch["x"][:, None]
            loss = ((model(x) - 2 * x) ** 2).mean()
            loss.backward()
            step, generation = run.steps + 1, attempt + run.generation
            ids = " ".join(str(int(i)) for i in batch["id"])
            out.write(f"P {step} {generation} {ids}\n")
            out.flush()
            if run.step():
                out.write(f"C {step} {generation} {run.world_size}\n")
                out.flush()
            sparktrain.report(step=run.steps, world=run.world_size)
            time.sleep(step_seconds)
            deadline = time.monotonic() + 120
            while (  # after a loss, wait for the returning ranks to start (a loaded machine)
                run.world_size < sparktrain.elastic.target_world_size()
                and time.monotonic() < deadline
                and len(list(Path(log_dir).glob("started-*"))) < starts
            ):
                time.sleep(0.05)
    weights = {
        n: (p if zero else p.full_tensor()).detach().reshape(-1).tolist()
        for n, p in model.named_parameters()
    }
    end = {"me": run.me, "steps": run.steps, "world": run.world_size, "weights": weights}
    Path(log_dir, f"end{run.me}.json").write_text(json.dumps(end))  # a joiner's too
    return end


def _table(tmp_path: Path) -> str:
    import numpy as np

    table = pa.table({"id": np.arange(ROWS), "x": np.linspace(0, 1, ROWS, dtype=np.float32)})
    (tmp_path / "data").mkdir()
    pq.write_table(table, tmp_path / "data" / "part-0.parquet", row_group_size=16)
    (tmp_path / "logs").mkdir()
    return str(tmp_path / "data")


def _launch(
    tmp_path: Path, cluster: Any, ranks: int, replicas: int, on_report: Any, **kw: Any
) -> Any:
    from sparktrain import launch

    return launch(
        _hsdp_train,
        (str(tmp_path / "data"), str(tmp_path / "logs"), replicas, kw.get("step_seconds", 0.1),
         kw.get("starts", 0), kw.get("build", False), 0, kw.get("hold", ""), kw.get("ckpt", "")),
        num_processes=ranks,
        backend=cluster,
        min_processes=1,
        in_place=True,
        on_report=on_report,
        progress=False,
        return_all=True,
    )  # fmt: skip


def _committed_steps(logs: Path) -> dict[int, list[list[int]]]:
    """Each committed step's batches (the ``P`` lines of the generation it committed in)."""
    pending: dict[tuple[int, int], list[list[int]]] = {}
    committed: dict[int, int] = {}
    for path in logs.glob("rank*.txt"):
        for line in path.read_text().splitlines():
            kind, step, generation, *rest = line.split()
            key = (int(step), int(generation))
            if kind == "P":
                pending.setdefault(key, []).append([int(i) for i in rest])
                continue
            before = committed.setdefault(*key)  # one generation an attempt; a later attempt's
            assert before == key[1] or before // 1000 != key[1] // 1000, line  # commit (after a
            committed[key[0]] = max(before, key[1])  # restart) replaces an earlier attempt's
    return {step: pending[(step, generation)] for step, generation in committed.items()}


def _assert_like_one_process(logs: Path, finishers: list[dict], padded: int = 0) -> None:
    """Every row trained once; every finisher's weights equal to a one-process replay.

    ``padded``: how many rows a world size that does not divide the rest may repeat (the
    reader's padding, ``uneven="pad"``: at most ``world - 1`` a re-division).
    """
    import torch

    steps = _committed_steps(logs)
    assert sorted(steps) == list(range(1, len(steps) + 1))
    rows = sorted(i for batches in steps.values() for batch in batches for i in batch)
    assert sorted(set(rows)) == list(range(ROWS))
    assert len(rows) - ROWS <= padded, f"{len(rows) - ROWS} rows trained twice"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    xs = torch.linspace(0, 1, ROWS)
    for step in sorted(steps):
        batches = steps[step]
        for ids in batches:
            x = xs[ids][:, None]
            (((model(x) - 2 * x) ** 2).mean() / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    replay = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    for result in finishers:
        assert result["steps"] == len(steps)
        for name, values in replay.items():
            assert result["weights"][name] == pytest.approx(values, abs=1e-5), (result["me"], name)


@pytest.mark.parametrize("how", ["kill", "preempt"])
def test_an_hsdp_2x2_run_loses_a_replica_group_and_goes_on_in_place(
    tmp_path: Path, how: str
) -> None:
    """2 nodes of 2 ranks, each node a replica group of 2 shards; node 1 is killed (or told to
    leave, ``sparktrain.preempt``) at step 3: its group goes, the other keeps its shards and goes
    on alone, no restart, no checkpoint; a notice loses no step."""
    import sparktrain
    from sparktrain import LocalCluster

    _table(tmp_path)
    cluster = LocalCluster(nodes=2, procs_per_node=2)
    killed: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 3 and not killed:
            killed.append(time.time())
            if how == "kill":
                cluster.kill_node(1)
            else:
                assert sparktrain.preempt(1) == (2, 3)

    result = _launch(tmp_path, cluster, 4, 2, on_report)
    assert killed and result.attempts == 1 and result.world_size == 2
    (lost,) = result.rescales
    cause = "lost" if how == "kill" else "preempted"
    assert (lost.cause, lost.old_world_size, lost.new_world_size, lost.in_place) == (
        cause, 4, 2, True,
    )  # fmt: skip
    assert lost.outcome == "dropped group" and "the whole groups kept their shards" in (
        lost.describe()
    )
    ends = {
        e["me"]: e for e in map(json.loads, map(Path.read_text, (tmp_path / "logs").glob("end*")))
    }
    finishers = [ends[0], ends[1]]
    assert [f["world"] for f in finishers] == [2, 2]
    _assert_like_one_process(tmp_path / "logs", finishers)
    if how == "preempt":  # it left after a committed step: no step in flight was lost
        assert {0, 1, 2, 3} <= set(ends) and ends[2]["world"] == 4
        assert len(_committed_steps(tmp_path / "logs")) == ends[0]["steps"]
    assert not list(tmp_path.glob("**/*.ckpt*"))
    assert cluster.node_pids() == {}


def test_a_returning_node_heals_its_replica_group_from_a_live_replica(tmp_path: Path) -> None:
    """4 nodes of 1 rank, 2 replica groups of 2; node 3 is killed: group [2, 3] is dropped and
    rank 2 waits; a node returns, joins rank 2 as a new group, and heals from group [0, 1]: all
    four end with the same weights as a one-process replay, every row once."""
    from sparktrain import LocalCluster

    _table(tmp_path)
    cluster = LocalCluster(nodes=4)
    killed: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 3 and not killed:
            killed.append(time.time())
            cluster.kill_node(3)
            cluster.add_node()

    # 4 first starts, rank 2's second, the returning node's: the survivors wait for all 6
    result = _launch(tmp_path, cluster, 4, 2, on_report, starts=6, step_seconds=0.2)
    assert killed and result.attempts == 1 and result.world_size == 4
    causes = sorted((r.cause, r.old_world_size, r.new_world_size) for r in result.rescales)
    assert causes[-1] == ("lost", 4, 2), causes
    assert [c[0] for c in causes[:-1]] == ["grew", "grew"], causes
    assert sorted(r.outcome for r in result.rescales) == ["dropped group", "healed", "healed"]
    ends = [json.loads(p.read_text()) for p in (tmp_path / "logs").glob("end*.json")]
    finishers = [v for v in ends if v["world"] == 4]
    assert sorted(f["me"] for f in finishers) == [0, 1, 2, 4]
    _assert_like_one_process(tmp_path / "logs", finishers)
    assert cluster.node_pids() == {}


def test_a_shard_with_no_live_replica_goes_back_to_the_restart_path(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """One replica group of 2 shards over 2 nodes: a lost node leaves half of every parameter
    with no copy, so the run restarts (its second attempt, 1 rank) and says why."""
    from sparktrain import LocalCluster

    _table(tmp_path)
    cluster = LocalCluster(nodes=2)
    killed: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 3 and not killed:
            killed.append(time.time())
            cluster.kill_node(1)

    result = _launch(tmp_path, cluster, 2, 1, on_report)
    assert killed and result.attempts == 2 and result.world_size == 1
    assert [(r.in_place, r.outcome) for r in result.rescales] == [(False, "restarted")]
    err = capfd.readouterr().err
    assert "no replica group of 2 ranks is whole" in err and "restart path" in err
    assert cluster.node_pids() == {}


def test_keep_whole_drops_a_replica_group_that_lost_a_rank() -> None:
    from sparktrain.contract.inplace import keep_whole

    assert keep_whole([0, 1, 2, 3], {3}, 2) == ([0, 1], [2])
    assert keep_whole([0, 1, 2, 3], {1, 2}, 2) == ([], [0, 3])
    assert keep_whole([0, 1, 2], {1}, 1) == ([0, 2], [])
    assert keep_whole([4, 2, 0, 1], {0}, 2) == ([4, 2], [1])
    assert keep_whole([0, 1, 2], {5}, 2) == ([0, 1], [2])  # a short rest (started short) waits


def test_an_attempt_that_started_short_keeps_its_whole_groups() -> None:
    from sparktrain.contract.inplace import whole_groups
    from sparktrain.rank.replicas import group_size

    assert group_size(2, 4, 4) == 2 and group_size(2, 3, 4) == 2  # 3 up: a group and a rest
    assert group_size(2, 1, 4) == 1  # fewer than a group: one group of all
    assert group_size(1, 1, 2) == 1  # one replica: the attempt's ranks, whatever they are

    assert whole_groups([0, 1, 2], 2) == [0, 1]
    assert whole_groups([0, 1, 2, 3], 2) == [0, 1, 2, 3]
    assert whole_groups([3], 2) == []


def test_a_replica_count_that_does_not_divide_the_ranks_is_named() -> None:
    from sparktrain import ConfigError
    from sparktrain.rank.replicas import _check_replicas

    assert _check_replicas(2, 4) == 2
    with pytest.raises(ConfigError, match="6 ranks do not divide into 4 replica groups"):
        _check_replicas(4, 6)
    with pytest.raises(ConfigError, match="replicas must be a whole number"):
        _check_replicas(0, 4)


def test_in_place_refuses_a_mesh_it_did_not_make() -> None:
    import sparktrain
    from sparktrain import ConfigError

    with pytest.raises(ConfigError, match=r"takes the mesh that sparktrain.elastic.mesh"):
        sparktrain.elastic.in_place(object(), object(), lambda r, w: [], mesh=object())


def test_each_outcome_says_what_was_kept_and_what_was_reloaded() -> None:
    """The one line of each outcome: kept in place, a dropped group, healed, restarted."""
    from sparktrain import Rescale

    def line(cause: Any, outcome: Any, in_place: bool = True) -> str:
        return Rescale(cause, "node 3", 4, 2, 0.0, in_place=in_place, outcome=outcome).describe()

    assert "no restart, no checkpoint read, the step in flight lost" in line("lost", "kept")
    dropped = line("lost", "dropped group")
    assert "the whole groups kept their shards, no checkpoint read" in dropped
    assert "healed from a live replica" in line("grew", "healed")
    assert "left" not in line("grew", "healed")  # a grow is not a loss
    assert "no step lost" in line("preempted", "kept")
    assert "with no checkpoint loaded" in line("lost", "restarted", in_place=False)


_FORMING = """
import json, sys
import torch.distributed as dist
from sparktrain.contract.inplace import members
from sparktrain.rank import replicas
try:
    replicas.mesh(replicas=2, timeout=2)
except RuntimeError as error:
    layout = replicas._ACTIVE
    if not layout.joining:  # the driver names the next generation, without this group
        layout.store.set(members(1), json.dumps([2, 3]))
    print(json.dumps({"rejoin": replicas.rejoin_after(error), "left": dist.is_initialized(),
                      "group": layout.group, "active": replicas._ACTIVE is not None}))
"""


@pytest.mark.parametrize("joining", [True, False])
def test_a_member_lost_while_its_replica_group_forms_sends_the_rank_to_join_again(
    joining: bool,
) -> None:
    """The group's other member never arrives in ``mesh()``'s ``init_process_group`` (a node
    lost meanwhile): the rank's error is a dropped group, not a training error, so the training
    function runs again as a joiner (found by the goodput schedule: the run failed). A joiner
    whose partner's ticket came first; a first-generation rank whose group the driver drops."""
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from sparktrain.contract.inplace import REPLICA_SIZE, TICKETS, members

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    secret = "a-job-secret"
    store = dist.PrefixStore(secret, server)  # type: ignore[attr-defined]
    store.set(members(0), json.dumps([0, 1, 2, 3]))
    if joining:
        store.set(REPLICA_SIZE, "2")
        store.add(TICKETS, 1)
        store.set("ticket/0", "4")  # a returning node's rank took the first ticket, then died
    env = {**os.environ, "RANK": "2" if joining else "0", "WORLD_SIZE": "4",
           "SPARKTRAIN_TARGET_WORLD_SIZE": "4",
           "SPARKTRAIN_IN_PLACE_STORE": f"{secret}@127.0.0.1:{server.port}",
           "SPARKTRAIN_IN_PLACE_JOIN": "1" if joining else "0"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _FORMING], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"rejoin": True, "left": False, "active": False,
                     "group": [4, 2] if joining else [0, 1]}  # fmt: skip
    assert "joins again as a new group" in done.stderr


def test_a_recovery_that_fails_is_tried_again_but_a_broken_group_is_not() -> None:
    """A loss while the survivors form their next generation (or heal a joiner) fails that
    recovery: it is tried again, as in DDP's layout (the sharded run failed instead). A recovery
    that finds this rank's own group broken ends at once: the rank joins again as a new group."""
    from sparktrain.rank.inplace_sharded import ShardedInPlace
    from sparktrain.rank.replicas import Dropped

    class Tried(ShardedInPlace):
        def __init__(self, errors: list[RuntimeError]) -> None:  # no run: the retry alone
            self.errors, self.tries = errors, 0

        def _recover(self) -> bool:
            self.tries += 1
            if self.errors:
                raise self.errors.pop(0)
            return True

    lost = Tried([RuntimeError("a member died while the group formed")] * 2)
    assert lost._recovered() is True and lost.tries == 3
    broken = Tried([Dropped("a peer of rank 2's replica group was lost")])
    with pytest.raises(Dropped):
        broken._recovered()
    assert broken.tries == 1


def test_in_place_shards_a_plain_model_itself_from_replicas(tmp_path: Path) -> None:
    """``in_place(model, optimizer, make_data, replicas=2)`` on a plain model and an AdamW made
    over it: the call makes the mesh, shards the model and makes the AdamW again over the shards;
    a 2x2 run with no loss trains every row once, to a one-process replay's weights."""
    from sparktrain import LocalCluster

    _table(tmp_path)
    cluster = LocalCluster(nodes=2, procs_per_node=2)
    result = _launch(tmp_path, cluster, 4, 2, None, step_seconds=0.0, build=True)
    assert result.attempts == 1 and result.world_size == 4 and not result.rescales
    _assert_like_one_process(tmp_path / "logs", list(result.return_values.values()))


def test_in_place_replicas_refuses_what_it_cannot_shard_or_make_again() -> None:
    import torch

    import sparktrain
    from sparktrain import ConfigError

    model = _model()
    with pytest.raises(ConfigError, match=r"pass one of mesh= .* replicas= .* zero="):
        sparktrain.elastic.in_place(model, None, lambda r, w: [], mesh=object(), replicas=2)
    two = torch.optim.SGD([{"params": [model[0].weight]}, {"params": [model[2].weight]}], lr=1)
    with pytest.raises(ConfigError, match=r"2 parameter groups.*lambda params"):
        sparktrain.elastic.in_place(model, two, lambda r, w: [], replicas=2)
    with pytest.raises(ConfigError, match="optimizer=3 is neither"):
        sparktrain.elastic.in_place(model, 3, lambda r, w: [], replicas=2)


@pytest.mark.parametrize("when", ["launch", "forming"])
def test_a_node_lost_while_the_ranks_start_is_no_training_error(
    tmp_path: Path, when: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """HSDP 2x2 on 4 nodes of 1 rank. ``launch``: node 1 is killed at once (the run starts short,
    or no rank has reached its in-place loop: the restart path, said so). ``forming``: ranks 0
    and 1 hold before their group forms while group [2, 3] forms and declares the run sharded;
    node 1 is killed, the driver drops group [0, 1], and only then does rank 0 go on to form
    it: it must leave at once and join again (it used to wait 30 s in init_process_group for
    rank 1 and fail the run). Either way the run ends, no rank fails."""
    import threading

    from sparktrain import LocalCluster

    _table(tmp_path)
    cluster = LocalCluster(nodes=4)
    logs, go = tmp_path / "logs", tmp_path / "go"

    def strike() -> None:
        deadline = time.monotonic() + 120
        while when == "forming" and len(list(logs.glob("started-*"))) < 4:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        time.sleep(2.0 if when == "forming" else 0.0)  # group [2, 3] says what the run keeps
        cluster.kill_node(1)
        time.sleep(5.0)  # the driver names the next generation without group [0, 1]
        go.touch()

    striker = threading.Thread(target=strike, daemon=True)
    striker.start()
    result = _launch(tmp_path, cluster, 4, 2, None, step_seconds=0.02, hold=str(go))
    striker.join(timeout=10)
    err = capfd.readouterr().err
    if not result.rescales:  # killed before the nodes were placed: the run started short
        assert when == "launch" and "starting on 3 ranks" in err, err[-2000:]
    else:
        first = result.rescales[0]
        assert first.cause == "lost" and first.outcome in ("restarted", "dropped group"), first
        if first.outcome == "restarted" and "fewer than" not in err:
            assert "no rank has started its in-place loop yet" in err, err[-2000:]
    if when == "forming":
        assert result.attempts == 1 and first.outcome == "dropped group", err[-2000:]
        assert "rank 0: its replica group [0, 1] was dropped" in err
    assert cluster.node_pids() == {}
