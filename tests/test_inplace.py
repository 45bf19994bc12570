"""Elastic in place (work in progress, issue 32): a rank killed mid-run costs the step in flight.

Three real processes form a gloo group over a store this test hosts (the driver's part, which is
not wired yet: it sees a rank die and names the survivors under ``members/1``). One rank SIGKILLs
itself before its third step; the two others go on without a checkpoint: every row is trained
exactly once, and both survivors end with the same weights.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS, BATCH = 96, 4
_RANK = "import sys; sys.path.insert(0, {here!r}); from test_inplace import _rank; _rank(*{args!r})"


def _rank(  # noqa: PLR0917 - called with one tuple of arguments from a subprocess
    me: int,
    port: int,
    data: str,
    out: str,
    die_at: int | None = None,
    step_seconds: float = 0.0,
    lag_at: int | None = None,
    joining: bool = False,
) -> None:
    """One rank: ``die_at`` SIGKILLs it before that batch; ``lag_at`` makes it see its peers
    fail just after it completed that step's reduction (so the others commit it and it does
    not, until the survivors heal it)."""
    import time

    import torch
    import torch.distributed as dist

    from sparktrain.data import from_parquet
    from sparktrain.rank import inplace

    torch.manual_seed(me)  # different on purpose: the group starts from rank 0's weights
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))

    def make_data(rank: int, world: int) -> object:
        return from_parquet(data, batch_size=BATCH, shuffle=False, rank=rank, world_size=world)

    run = inplace.InPlace(model, optimizer, make_data, store=store, me=me, timeout=20,
                          joining=joining)  # fmt: skip
    reduce = run._reduce

    def lagging() -> None:
        reduce()
        if run.steps + 1 == lag_at:
            # The peers must see the failure after they committed this step, not while their
            # part of its all-reduce is still ending (they would drop it too): wait for them.
            peers = [out.replace(f"rank{me}.json", f"rank{r}.json") for r in (0, 1, 2) if r != me]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(
                len(_lines_of(Path(p + ".ids"))) < lag_at for p in peers
            ):
                time.sleep(0.01)
            raise RuntimeError("a peer failed (made up by the test)")

    run._reduce = lagging  # type: ignore[method-assign]
    with open(out + ".ids", "a") as committed:
        for number, batch in enumerate(run.batches()):
            if number == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = (model(batch["x"][:, None]) ** 2).mean()
            loss.backward()
            if run.step():
                ids = " ".join(str(int(i)) for i in batch["id"])
                committed.write(f"{run.steps} {ids}\n")
                committed.flush()
            time.sleep(step_seconds)
    result = {"weights": [float(v) for v in model.state_dict()["weight"].reshape(-1)],
              "bias": [float(v) for v in model.state_dict()["bias"].reshape(-1)],
              "dropped": run.dropped, "steps": run.steps}  # fmt: skip
    Path(out).write_text(json.dumps(result))


def _table(tmp_path: Path) -> str:
    import numpy as np

    table = pa.table({"id": np.arange(ROWS), "x": np.linspace(0, 1, ROWS, dtype=np.float32)})
    (tmp_path / "data").mkdir()
    pq.write_table(table, tmp_path / "data" / "part-0.parquet", row_group_size=16)
    return str(tmp_path / "data")


def _store(members: list[int]) -> tuple[object, int]:
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set("members/0", json.dumps(members))
    return store, port


def _start(port: int, data: str, out: str, me: int, **how: object) -> subprocess.Popen:
    defaults = {"die_at": None, "step_seconds": 0.0, "lag_at": None, "joining": False}
    args = (me, port, data, out, *{**defaults, **how}.values())
    code = _RANK.format(here=str(Path(__file__).parent), args=args)
    return subprocess.Popen([sys.executable, "-c", code])


def _committed(outs: list[str]) -> dict[int, list[list[int]]]:
    """Each committed step's batches, one per rank that committed it."""
    steps: dict[int, list[list[int]]] = {}
    for out in outs:
        for line in _lines_of(Path(out + ".ids")):
            step, *ids = (int(word) for word in line.split())
            steps.setdefault(step, []).append(ids)
    return steps


def _replayed(steps: dict[int, list[list[int]]]) -> tuple[list[float], list[float]]:
    """The weights of one process that trains the committed steps, each averaged over its ranks."""
    import numpy as np
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = torch.tensor(np.linspace(0, 1, ROWS, dtype=np.float32))
    for step in sorted(steps):
        batches = steps[step]
        loss = sum((model(xs[ids][:, None]) ** 2).mean() for ids in batches) / len(batches)
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
    return model.weight.reshape(-1).tolist(), model.bias.reshape(-1).tolist()


def _finish(ranks: list[subprocess.Popen]) -> list[int | None]:
    try:
        return [process.wait(60) for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()


def _lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _assert_like_one_process(outs: list[str], finished: list[int]) -> dict[int, list[list[int]]]:
    """Every row once; the finishers' weights equal to each other and to the replay."""
    import pytest as _pytest

    steps = _committed(outs)
    ids = sorted(i for batches in steps.values() for batch in batches for i in batch)
    assert ids == list(range(ROWS))
    results = [json.loads(Path(outs[r]).read_text()) for r in finished]
    assert all(r["weights"] == results[0]["weights"] for r in results)  # bit-identical
    assert all(r["bias"] == results[0]["bias"] for r in results)
    weights, bias = _replayed(steps)
    assert results[0]["weights"] == _pytest.approx(weights, abs=1e-6)
    assert results[0]["bias"] == _pytest.approx(bias, abs=1e-6)
    return steps


def test_a_killed_rank_costs_the_step_in_flight_and_no_checkpoint(tmp_path: Path) -> None:
    data = _table(tmp_path)
    store, port = _store([0, 1, 2])
    outs = [str(tmp_path / f"rank{r}.json") for r in range(3)]
    ranks = [_start(port, data, outs[r], r, die_at=2 if r == 2 else None) for r in range(3)]
    try:
        assert ranks[2].wait(60) == -signal.SIGKILL
        store.set("members/1", json.dumps([0, 1]))  # type: ignore[attr-defined] # the driver's
    finally:
        codes = _finish(ranks)
    assert codes[:2] == [0, 0]
    assert not Path(outs[2]).exists()
    steps = _assert_like_one_process(outs, [0, 1])
    # Rank 2's two committed steps were reduced into everyone's weights: its rows count once.
    assert len(_lines_of(Path(outs[2] + ".ids"))) == 2
    assert [len(steps[s]) for s in sorted(steps)][:3] == [3, 3, 2]  # step 3 dropped, redone by 2
    assert [json.loads(Path(o).read_text())["dropped"] for o in outs[:2]] == [1, 1]
    assert not list(tmp_path.glob("**/*.ckpt*"))  # nothing was written to disk to resume


def test_a_rank_lost_before_the_group_formed_is_left_behind_at_once(tmp_path: Path) -> None:
    """Rank 2 never comes (a node lost during start-up): ranks 0 and 1 gather for generation 0,
    the driver names generation 1 without rank 2, and they form it at once instead of waiting
    in init_process_group for rank 2 until its timeout; every row is trained once."""
    import time

    data = _table(tmp_path)
    store, port = _store([0, 1, 2])
    outs = [str(tmp_path / f"rank{r}.json") for r in range(3)]
    ranks = [_start(port, data, outs[r], r) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        gathered = ["here/0/0", "here/0/1"]
        while not store.check(gathered) and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.05)
        store.set("members/1", json.dumps([0, 1]))  # type: ignore[attr-defined] # the driver's
    finally:
        codes = _finish(ranks)
    assert codes == [0, 0]  # before, both failed: init_process_group waited for rank 2
    _assert_like_one_process(outs[:2], [0, 1])


def test_a_rank_behind_by_the_step_in_flight_is_healed_by_a_peer(tmp_path: Path) -> None:
    """Rank 1 sees a failure just after its step 3's reduction: 0 and 2 committed step 3, it did
    not. The group forms again with all three; rank 0 sends its state, and the three end equal."""
    data = _table(tmp_path)
    store, port = _store([0, 1, 2])
    outs = [str(tmp_path / f"rank{r}.json") for r in range(3)]
    ranks = [_start(port, data, outs[r], r, lag_at=3 if r == 1 else None) for r in range(3)]
    try:
        store.wait(["abort/0"], timedelta(seconds=60))  # type: ignore[attr-defined]
        store.set("members/1", json.dumps([0, 1, 2]))  # type: ignore[attr-defined]
    finally:
        codes = _finish(ranks)
    assert codes == [0, 0, 0]
    _assert_like_one_process(outs, [0, 1, 2])
    dropped = [json.loads(Path(o).read_text())["dropped"] for o in outs]
    assert dropped == [1, 0, 1]  # 0 and 2 lost their step 4 in flight; rank 1 lost nothing


def test_a_notice_costs_no_step_and_hands_the_share_over(tmp_path: Path) -> None:
    """SIGTERM to a rank (a preemption notice): it leaves after its step commits; 0 dropped."""
    data = _table(tmp_path)
    _store_keep, port = _store([0, 1, 2])
    outs = [str(tmp_path / f"rank{r}.json") for r in range(3)]
    ranks = [_start(port, data, outs[r], r, step_seconds=0.05) for r in range(3)]
    try:
        _wait_lines(Path(outs[2] + ".ids"), 2)
        ranks[2].send_signal(signal.SIGTERM)
    finally:
        codes = _finish(ranks)
    assert codes == [0, 0, 0]
    _assert_like_one_process(outs, [0, 1])
    assert [json.loads(Path(o).read_text())["dropped"] for o in outs] == [0, 0, 0]


def test_a_rank_joins_from_a_live_peer_and_another_leaves_on_request(tmp_path: Path) -> None:
    """Rank 2 joins a group of two once it has started, and takes the live state from its
    peers (a broadcast, no disk); then the driver asks rank 1 to go (0 dropped). Sizes 2, 3,
    2: every leg that ends the epoch divides its rows evenly, so no rank pads."""
    from sparktrain.contract.inplace import post

    data = _table(tmp_path)
    store, port = _store([0, 1])
    outs = [str(tmp_path / f"rank{r}.json") for r in range(3)]
    ranks = [_start(port, data, outs[r], r, step_seconds=0.2) for r in range(2)]
    ranks.append(_start(port, data, outs[2], 2, step_seconds=0.2, joining=True))
    try:
        _wait_lines(Path(outs[2] + ".ids"), 1)  # it asked in once ready, and is in
        post(store, {"leave": [1]})
    finally:
        codes = _finish(ranks)
    assert codes == [0, 0, 0]
    steps = _assert_like_one_process(outs, [0, 2])
    assert [len(batches) for batches in steps.values()].count(3) >= 1  # 2 + the joiner
    assert _lines_of(Path(outs[1] + ".ids"))  # rank 1 trained, then left
    assert [json.loads(Path(o).read_text())["dropped"] for o in outs] == [0, 0, 0]
    assert not list(tmp_path.glob("**/*.ckpt*"))


def _wait_lines(path: Path, count: int) -> None:
    import time

    deadline = time.monotonic() + 240  # a joiner's start on a loaded machine (load 10 on 2 cores)
    while time.monotonic() < deadline and len(_lines_of(path)) < count:
        time.sleep(0.01)
    assert len(_lines_of(path)) >= count, f"{path} has fewer than {count} committed steps"


def _log_lines(logs: Path) -> list[list[str]]:
    return [line.split() for p in logs.glob("rank*.txt") for line in p.read_text().splitlines()]


def logged_rows(logs: Path, lines: list[list[str]] | None = None) -> list[int]:
    """The ids the ranks of ``_in_place_train`` logged as committed, sorted."""
    return sorted(int(i) for line in lines or _log_lines(logs) for i in line[4:])


def _rows_counting_the_killed_ranks_last_step(logs: Path, killed: int) -> list[int]:
    """``logged_rows``, plus the killed rank's last batch where it was killed after that step
    committed everywhere but before its log line (seen under load): another rank logged the
    same step (its generation and count) as committed, so those rows were trained once."""
    lines = _log_lines(logs)
    rows = logged_rows(logs, lines)
    generation, steps, *ids = (logs / f"rank{killed}.pending").read_text().split()
    committed = any(line[2:4] == [generation, steps] for line in lines)
    return sorted(rows + [int(i) for i in ids]) if committed and int(ids[0]) not in rows else rows


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _in_place_train(data_dir: str, log_dir: str, step_seconds: float, starts: int = 0) -> dict:
    """One epoch in place: no checkpoint anywhere; each committed step's ids logged.

    With ``starts``, a rank left alone does not step on until ``starts`` processes have started
    this function (so that a joiner still starting up finds the epoch not yet over).
    """
    import time

    import torch

    import sparktrain
    from sparktrain.data import from_parquet

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def make_data(rank: int, world: int) -> object:
        return from_parquet(data_dir, batch_size=BATCH, shuffle=False, rank=rank, world_size=world)

    Path(log_dir, f"started-{os.getpid()}").touch()
    run = sparktrain.elastic.in_place(model, optimizer, make_data)
    me = run.me
    with open(Path(log_dir, f"rank{me}.txt"), "a") as out:
        for batch in run.batches():
            loss = (model(batch["x"][:, None]) ** 2).mean()
            loss.backward()
            # the generation and the steps before this one name the step on every rank
            ids = f"{run.generation} {run.steps} " + " ".join(str(int(i)) for i in batch["id"])
            Path(log_dir, f"rank{me}.next").write_text(ids)  # a kill may fall before its log
            os.replace(Path(log_dir, f"rank{me}.next"), Path(log_dir, f"rank{me}.pending"))
            if run.step():
                out.write(f"{time.time():.6f} {run.world_size} ")
                out.write(ids + "\n")
                out.flush()
            sparktrain.report(step=run.steps, world=run.world_size, pid=os.getpid())
            time.sleep(step_seconds)
            deadline = time.monotonic() + 60
            while (
                run.world_size == 1
                and time.monotonic() < deadline
                and (len(list(Path(log_dir).glob("started-*"))) < starts)
            ):
                time.sleep(0.05)
    state = {"steps": run.steps, "dropped": run.dropped, "world": run.world_size,
             "weights": [float(v) for v in model.weight.detach().reshape(-1)],
             "bias": [float(v) for v in model.bias.detach().reshape(-1)]}  # fmt: skip
    Path(log_dir, f"end{me}.json").write_text(json.dumps(state))  # a joiner's too
    return state


def _launch_in_place(  # noqa: PLR0917 - the tests' one way to launch
    tmp_path: Path,
    ranks: int,
    step_seconds: float,
    on_report: object,
    backend: object = "local",
    starts: int = 0,
) -> Any:
    """``_in_place_train`` on ``tmp_path``'s data, elastic down to 1 rank, in place."""
    from sparktrain import launch

    return launch(
        _in_place_train,
        (str(tmp_path / "data"), str(tmp_path / "logs"), step_seconds, starts),
        num_processes=ranks,
        backend=backend,  # type: ignore[arg-type]
        min_processes=1,
        in_place=True,
        on_report=on_report,  # type: ignore[arg-type]
        progress=False,
        return_all=True,
    )


def test_a_lost_node_of_a_local_cluster_costs_no_restart(tmp_path: Path) -> None:
    import time

    from sparktrain import LocalCluster

    _table(tmp_path)
    (tmp_path / "logs").mkdir()
    cluster = LocalCluster(nodes=3)
    killed: list[int] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 4 and not killed:
            killed.append(time.time())
            cluster.kill_node(2)

    result = _launch_in_place(tmp_path, 3, 0.05, on_report, backend=cluster)
    assert killed and result.attempts == 1
    (lost,) = result.rescales
    assert (lost.cause, lost.old_world_size, lost.new_world_size) == ("lost", 3, 2)
    assert "node 2" in lost.detail and result.world_size == 2 and lost.outcome == "kept"
    values = [result.return_values[r] for r in (0, 1)]
    assert values[0]["world"] == 2 and values[0]["weights"] == values[1]["weights"]
    assert _rows_counting_the_killed_ranks_last_step(tmp_path / "logs", 2) == list(range(ROWS))
    lines = [line.split() for p in (tmp_path / "logs").glob("rank*.txt") for line in _lines_of(p)]
    after = [float(line[0]) for line in lines if line[1] == "2"]
    print(f"in place: kill -> next committed step {min(after) - killed[0]:.3f} s")
    assert cluster.node_pids() == {}


def test_node_0_may_go_too_since_the_driver_holds_the_store(tmp_path: Path) -> None:

    from sparktrain import LocalCluster

    _table(tmp_path)
    (tmp_path / "logs").mkdir()
    cluster = LocalCluster(nodes=3)
    killed: list[int] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 1 and record.get("step") == 4 and not killed:
            killed.append(0)
            cluster.kill_node(0)

    result = _launch_in_place(tmp_path, 3, 0.05, on_report, backend=cluster)
    assert killed and result.attempts == 1 and result.world_size == 2
    values = [result.return_values[r] for r in (1, 2)]
    assert values[0]["world"] == 2 and values[0]["weights"] == values[1]["weights"]
    assert _rows_counting_the_killed_ranks_last_step(tmp_path / "logs", 0) == list(range(ROWS))
    assert cluster.node_pids() == {}


@pytest.mark.parametrize("how", ["preempt", "sigterm"])
def test_a_notice_to_a_node_of_a_local_cluster_costs_no_step(tmp_path: Path, how: str) -> None:
    """``sparktrain.preempt(2)`` from the driver, or SIGTERM to node 2's process (the cloud's
    notice): its rank leaves after its step commits, the others take its share, 0 steps lost."""
    import time

    import sparktrain
    from sparktrain import LocalCluster

    _table(tmp_path)
    (tmp_path / "logs").mkdir()
    cluster = LocalCluster(nodes=3)
    noticed: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 3 and not noticed:
            noticed.append(time.time())
            if how == "preempt":
                assert sparktrain.preempt("node2") == (2,)
            else:
                os.kill(cluster.node_pids()[2], signal.SIGTERM)

    result = _launch_in_place(tmp_path, 3, 0.05, on_report, backend=cluster)
    assert noticed and result.attempts == 1 and result.world_size == 2
    (left,) = result.rescales
    assert (left.cause, left.old_world_size, left.new_world_size) == ("preempted", 3, 2)
    assert left.in_place and "node 2" in left.detail
    values = result.return_values
    assert values[0]["weights"] == values[1]["weights"]
    assert [values[r]["dropped"] for r in (0, 1, 2)] == [0, 0, 0]
    assert values[2]["world"] == 3 and values[0]["world"] == 2
    assert logged_rows(tmp_path / "logs") == list(range(ROWS))
    assert cluster.node_pids() == {}


def test_in_place_refuses_what_it_cannot_do() -> None:
    import sparktrain
    from sparktrain import ConfigError, launch

    with pytest.raises(ConfigError, match="min_processes"):
        launch(print, num_processes=2, in_place=True)
    with pytest.raises(ConfigError, match="no in-place run is in progress"):
        sparktrain.preempt(1)


def test_a_node_that_returns_joins_and_heals_from_a_live_peer(tmp_path: Path) -> None:
    """Node 1 is killed (the survivor goes on in place); the cluster gets a node back; a node
    starts there, asks in, and takes the live state by broadcast: no checkpoint anywhere, the
    joiner ends bit-identical to the survivor, every row once."""
    import time

    from sparktrain import LocalCluster

    _table(tmp_path)
    (tmp_path / "logs").mkdir()
    cluster = LocalCluster(nodes=2)
    killed: list[float] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 3 and not killed:
            killed.append(time.time())
            cluster.kill_node(1)
            cluster.add_node()  # the capacity returns at once: the driver sees it within 2 s

    # The survivor alone waits for the joiner's process to start (3 starts), however loaded.
    result = _launch_in_place(tmp_path, 2, 0.5, on_report, backend=cluster, starts=3)
    assert killed and result.attempts == 1 and result.world_size == 2
    causes = [(r.cause, r.old_world_size, r.new_world_size, r.in_place) for r in result.rescales]
    assert causes == [("lost", 2, 1, True), ("grew", 1, 2, True)]
    ends = {int(p.stem[3:]): json.loads(p.read_text()) for p in (tmp_path / "logs").glob("end*")}
    assert sorted(ends) == [0, 2]  # rank 1 was killed; rank 2 joined
    assert ends[0]["weights"] == ends[2]["weights"] and ends[0]["bias"] == ends[2]["bias"]
    assert ends[0]["world"] == ends[2]["world"] == 2 and ends[2]["steps"] == ends[0]["steps"]
    assert _rows_counting_the_killed_ranks_last_step(tmp_path / "logs", 1) == list(range(ROWS))
    assert any(line[1] == "2" for line in _lines_of_rank(tmp_path, 2))  # it trained at size 2
    assert not list(tmp_path.glob("**/*.ckpt*"))
    assert cluster.node_pids() == {}


def _lines_of_rank(tmp_path: Path, rank: int) -> list[list[str]]:
    path = tmp_path / "logs" / f"rank{rank}.txt"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_in_place_refuses_a_model_it_cannot_reduce() -> None:
    import torch

    from sparktrain import ConfigError
    from sparktrain.rank.inplace import InPlace

    model = torch.nn.Linear(2, 2).to("meta")
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"on the CPU over gloo today.*\['meta'\]"):
        InPlace(model, optimizer, lambda r, w: None, store=None, me=0)


def test_sigterm_to_a_rank_of_local_processes_is_a_notice(tmp_path: Path) -> None:
    """On the local backend (no nodes): SIGTERM to rank 2's process; it leaves after its step,
    the run ends well with every row once and no step lost."""

    _table(tmp_path)
    (tmp_path / "logs").mkdir()
    sent: list[int] = []

    def on_report(rank: int, record: dict) -> None:
        if rank == 2 and record.get("step") == 3 and not sent:
            sent.append(int(record["metrics"]["pid"]))
            os.kill(sent[0], signal.SIGTERM)

    result = _launch_in_place(tmp_path, 3, 0.05, on_report)
    assert sent and result.attempts == 1
    values = result.return_values
    assert [values[r]["dropped"] for r in (0, 1, 2)] == [0, 0, 0]
    assert values[2]["world"] == 3 and values[0]["world"] == values[1]["world"] == 2
    assert values[0]["weights"] == values[1]["weights"]
    assert logged_rows(tmp_path / "logs") == list(range(ROWS))


def _listening_on(port: int) -> set[str]:
    """The local addresses (hex, as ``/proc/net/tcp`` writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in lines.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def test_the_drivers_store_is_closed_to_strangers() -> None:
    """Loopback only for a run on this machine, and every key under a secret prefix."""
    import torch.distributed as dist

    from sparktrain.contract.env import IN_PLACE_STORE, in_place_store
    from sparktrain.contract.inplace import host_store, latest, members

    store, address = host_store(2)
    os.environ[IN_PLACE_STORE] = address
    try:
        host, port, secret = in_place_store()  # type: ignore[misc]
    finally:
        del os.environ[IN_PLACE_STORE]
    assert (host, len(secret)) == ("127.0.0.1", 32)
    assert _listening_on(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
    timeout = timedelta(seconds=10)
    stranger = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    assert not stranger.check([members(0)])
    stranger.set(members(1), "[0]")  # a forged generation goes nowhere
    assert latest(store, 0) == 0
    friend = dist.PrefixStore(secret, dist.TCPStore(host, port, is_master=False, timeout=timeout))
    assert json.loads(friend.get(members(0))) == [0, 1]
