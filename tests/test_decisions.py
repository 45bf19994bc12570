"""The failure decisions, without a process: culprit, victims, restarts, the follow loop.

Reports are fabricated as nodes would send them; the real-process tests (test_local_run,
test_faults, test_spark, test_ray) check that nodes do send them so.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal
import time
from pathlib import Path
from typing import ClassVar

import cloudpickle
import pytest

from sparktrain import (
    ClusterError,
    ConfigError,
    HangError,
    SparkJobError,
    TrainingFailedError,
    TrainingTimeoutError,
)
from sparktrain.backends.base import Attempt, Backend, Nodes, Polled
from sparktrain.contract.outcome import NodeOutcome, RankExit
from sparktrain.contract.paths import error_path, result_path
from sparktrain.contract.report import NodeReport, node_report
from sparktrain.driver import capacity
from sparktrain.driver import follow as follow_module
from sparktrain.driver.attempts import run_attempts
from sparktrain.driver.capacity import watch_capacity
from sparktrain.driver.monitor import Monitor
from sparktrain.driver.results import GrowingBack, RunResult, finish
from sparktrain.ground.errors import CapacityError, RankFailure, StackSite
from sparktrain.launchplan.layout import LaunchPlan, make_plan
from sparktrain.launchplan.options import RunOptions
from sparktrain.launchplan.topology import Topology


def _failure(rank: int, when: float, message: str, exc: str | None = "ValueError") -> RankFailure:
    return RankFailure(rank, "host", when, exc, message, f"Traceback...\n{message}\n", 1)


def _report(node: int, ranks: tuple[int, ...], **fields: object) -> NodeReport:
    values = fields.pop("values", {})
    return NodeReport(
        node_rank=node, host=f"h{node}", ranks=ranks, failures=fields.pop("failures", {}),
        stopped=fields.pop("stopped", ()), values=values, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def _finish(reports: list[NodeReport], **kwargs: object) -> RunResult | GrowingBack:
    return finish(reports, world_size=4, timeout=9.0, duration=1.0, hang_timeout=5.0, **kwargs)  # type: ignore[arg-type]


# -- finish: from reports to one result or one error -------------------------------------------
def test_values_come_back_unpickled_and_nodes_in_order() -> None:
    reports = [
        _report(1, (2, 3), values={2: cloudpickle.dumps("two")}),
        _report(0, (0, 1), values={0: cloudpickle.dumps({"loss": 0.1})}),
    ]
    result = _finish(reports)
    assert result.value == {"loss": 0.1} and result.return_values[2] == "two"
    assert [n.node_rank for n in result.nodes] == [0, 1]


def test_the_culprit_is_the_first_cause_and_the_rest_are_victims() -> None:
    cause = _failure(3, when=20.0, message="bad batch")
    echo = _failure(0, when=10.0, message="Connection closed by peer", exc="RuntimeError")
    reports = [
        _report(0, (0, 1), failures={0: echo}, stopped=(1,)),
        _report(1, (2, 3), failures={3: cause}, stopped=(2,)),
    ]
    with pytest.raises(TrainingFailedError) as caught:
        _finish(reports)
    error = caught.value
    assert error.culprit is cause  # earlier, but a peer's connection error is a consequence
    assert error.victims == (0, 1, 2)
    assert set(error.failures) == {0, 3}
    assert str(error).startswith("rank 3 on host failed first: ValueError: bad batch")


def test_of_two_causes_the_earlier_wins_then_the_lower_rank() -> None:
    first, later, tie = _failure(2, 5.0, "a"), _failure(1, 6.0, "b"), _failure(0, 6.0, "c")
    reports = [
        _report(0, (0, 1), failures={1: later, 0: tie}),
        _report(1, (2, 3), failures={2: first}),
    ]
    with pytest.raises(TrainingFailedError) as caught:
        _finish(reports)
    assert caught.value.culprit is first
    with pytest.raises(TrainingFailedError) as caught:
        _finish([_report(0, (0, 1), failures={1: later, 0: tie})])
    assert caught.value.culprit is tie


def test_ranks_not_started_is_bad_input_every_node_agreeing() -> None:
    why = "task 1 on h1: ValueError: GPU addresses ['GPU-1'] are not plain integers"
    reports = [NodeReport.not_started(0, "h0", [why]), NodeReport.not_started(1, "h1", [why])]
    with pytest.raises(ConfigError, match=r"the ranks were not started: task 1 on h1") as caught:
        _finish(reports)
    assert str(caught.value).count("task 1") == 1


def test_a_lost_node_is_a_cluster_error_whatever_the_ranks_did() -> None:
    reports = [
        NodeReport.broken(1, "h1", "its Ray actor died: RayActorError: node lost"),
        _report(0, (0, 1), failures={0: _failure(0, 1.0, "Connection reset by peer")}),
    ]
    with pytest.raises(ClusterError, match=r"lost a node .* node 1 on h1: its Ray actor died"):
        _finish(reports)
    with pytest.raises(SparkJobError):  # the old name catches it too
        _finish(reports)


def test_a_stop_the_caller_asked_for_is_a_result() -> None:
    reports = [_report(0, (0, 1), stopped=(0, 1), values={0: cloudpickle.dumps(5)})]
    result = _finish(reports, stopped=True)
    assert result.stopped and result.value == 5


def test_a_hang_names_where_each_rank_waited_and_drops_the_echoes() -> None:
    site = StackSite(0, "all_reduce", "/x/train.py", 42, "train", "stack")
    echo = _failure(2, 1.0, "Connection closed by peer")
    reports = [
        _report(0, (0, 1), hung=True, hang_sites={0: site}, hang_silent=(1,), stopped=(0, 1)),
        _report(1, (2, 3), failures={2: echo}, stopped=(3,)),
    ]
    with pytest.raises(HangError) as caught:
        _finish(reports)
    assert "rank 0 in all_reduce at train.py:42 (in train)" in str(caught.value)
    assert "rank 1: no stack" in str(caught.value)


def test_a_timeout_names_the_ranks_still_running() -> None:
    reports = [_report(0, (0, 1), running_at_timeout=(1,), stopped=(1,)), _report(1, (2, 3))]
    with pytest.raises(TrainingTimeoutError, match=r"timeout=9s; stopped .*rank 1 \(finished"):
        _finish(reports)


def test_a_timeout_the_driver_saw_pass_names_the_ranks_it_stopped() -> None:
    # The driver's deadline for the whole call passed before any node's own clock: the ranks it
    # stopped were running, those that returned are finished, and a rank whose connection broke
    # when a peer was stopped was running too, not a failure of its own.
    reset = RankFailure(3, "h1", 1.1, "RuntimeError", "[gloo] Connection reset by peer")
    reports = [_report(0, (0, 1), stopped=(1,)), _report(1, (2, 3), stopped=(2,),
                                                          failures={3: reset})]  # fmt: skip
    running = r"running: rank 1, rank 2, rank 3 \(finished: rank 0\)"
    with pytest.raises(TrainingTimeoutError, match=running):
        _finish(reports, timed_out=True)
    assert isinstance(_finish(reports[:1]), RunResult)  # the same stop, no deadline: a result
    between = TrainingTimeoutError(9.0, (), ())  # it passed before the next attempt started
    assert "passed between two attempts" in str(between) and "running: ." not in str(between)


# -- node_report: from how the processes ended to a node's report --------------------------------
def _record(run_dir: Path, rank: int, when: float, message: str) -> None:
    record = {"time": when, "exc_type": "KeyError", "message": message, "traceback": "tb"}
    error_path(str(run_dir), rank).write_bytes(pickle.dumps(record))


def test_node_report_tells_failures_from_ranks_stopped_by_us(tmp_path: Path) -> None:
    stop = 100.0
    outcome = NodeOutcome(stop_time=stop)
    outcome.exits = {
        0: RankExit(0, 0, 99.0, stopped=False),
        1: RankExit(1, 1, 98.0, stopped=False),  # failed on its own, with a record
        2: RankExit(2, 1, 101.0, stopped=True),  # raised after our SIGTERM: stopped
        3: RankExit(3, -signal.SIGKILL, 97.0, stopped=False),  # killed, not by us: a cause
        5: RankExit(5, -signal.SIGTERM, 100.5, stopped=True),  # our SIGTERM: stopped
        4: RankExit(4, 0, 102.0, stopped=False, lingered=True),  # returned, then killed by us
    }
    _record(tmp_path, 1, 98.0, "'x'")
    _record(tmp_path, 2, 101.0, "KeyboardInterrupt")
    result_path(str(tmp_path), 4).write_bytes(cloudpickle.dumps(44))
    report = node_report(outcome, str(tmp_path), node_rank=0, host="h", tails={}, keep=(0, 4))
    assert set(report.failures) == {1, 3} and report.stopped == (2, 5)
    assert report.failures[1].exc_type == "KeyError" and report.failures[1].traceback == "tb"
    assert report.failures[3].message.startswith("killed by SIGKILL (often the out-of-memory")
    assert cloudpickle.loads(report.values[4]) == 44 and 0 not in report.values


# -- restarts ------------------------------------------------------------------------------------
class FakeBackend(Backend):
    """A backend whose capacity the test sets; layouts of one rank per node."""

    name: ClassVar[str] = "fake"

    def __init__(self, capacity: int) -> None:
        self.free = capacity

    def layout(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        topology = Topology(cpus=8, gpus=(), hostname="h")
        plan = make_plan(num_processes, topology=topology, use_gpu=False, name=name)
        return dataclasses.replace(plan, nodes=plan.world_size, procs_per_node=1)

    def start(self, attempt: Attempt) -> Nodes:
        raise AssertionError("the decisions never start nodes")

    def capacity(self, plan: LaunchPlan) -> int:
        return self.free


def _attempts(
    *outcomes: BaseException | GrowingBack | None, backend: FakeBackend | None = None, lose: int = 0
) -> tuple[list[tuple[int, int]], object]:
    """An attempt function that ends as ``outcomes`` say; a loss takes ``lose`` ranks away."""
    seen: list[tuple[int, int]] = []

    def attempt(plan: LaunchPlan, number: int) -> RunResult | GrowingBack:
        seen.append((number, plan.world_size))
        outcome = outcomes[number]
        if isinstance(outcome, GrowingBack):
            return outcome
        if outcome is not None:
            if backend is not None:
                backend.free -= lose
            raise outcome
        return RunResult({0: "ok"}, plan.world_size, 1.0)

    return seen, attempt


def _run(attempt: object, restarts: int = 0, size: int = 2, **elastic: object) -> RunResult:
    backend = elastic.pop("backend", None) or FakeBackend(size)
    assert isinstance(backend, FakeBackend)
    options = RunOptions(max_restarts=restarts, **elastic)  # type: ignore[arg-type]
    plan = backend.layout(size, use_gpu=False, name="num_processes")
    return run_attempts(backend, plan, options, attempt, Monitor(progress=False))  # type: ignore[arg-type]


def test_rank_failures_and_lost_nodes_are_restarted(capsys: pytest.CaptureFixture[str]) -> None:
    failed = TrainingFailedError(_failure(1, 1.0, "boom"), (0,), {})
    seen, attempt = _attempts(failed, ClusterError("node 1 lost"), None)
    result = _run(attempt, restarts=2)
    assert [n for n, _ in seen] == [0, 1, 2] and result.attempts == 3
    err = capsys.readouterr().err
    assert "restarting every rank (attempt 2 of 3)" in err and "node 1 lost" in err


def test_timeouts_are_not_restarted_and_the_last_error_counts_attempts() -> None:
    seen, attempt = _attempts(TrainingTimeoutError(5.0, (1,), (0,)), None)
    with pytest.raises(TrainingTimeoutError):
        _run(attempt, restarts=3)
    assert seen == [(0, 2)]
    failed = TrainingFailedError(_failure(1, 1.0, "boom"), (0,), {})
    seen, attempt = _attempts(failed, failed)
    with pytest.raises(TrainingFailedError) as caught:
        _run(attempt, restarts=1)
    assert caught.value.attempts == 2 and "(attempt 2 of 2)" in str(caught.value)


# -- elastic decisions: what is a loss, how far to shrink, when to grow ----------------------------
def _killed(rank: int) -> TrainingFailedError:
    """A rank that died by SIGKILL without a Python exception: a lost process."""
    dead = RankFailure(rank, "h", 1.0, None, "killed by SIGKILL", exit_code=-9)
    return TrainingFailedError(dead, (0,), {rank: dead})


def test_causes_are_told_apart() -> None:
    bug = TrainingFailedError(_failure(1, 1.0, "bad value"), (0,), {})
    assert bug.cause == "training code" and "cause: training code" in str(bug)
    assert _killed(1).cause == "infrastructure" and "cause: infrastructure" in str(_killed(1))
    peer = RankFailure(0, "h", 1.0, "RuntimeError", "[gloo] Connection closed by peer", exit_code=1)
    assert TrainingFailedError(peer, (), {0: peer}).cause == "infrastructure"
    assert ClusterError("node lost").cause == "infrastructure"


def test_a_loss_shrinks_an_elastic_run_to_what_is_left(capsys: pytest.CaptureFixture[str]) -> None:
    backend = FakeBackend(4)
    seen, attempt = _attempts(
        ClusterError("node 3 lost"), _killed(1), None, backend=backend, lose=1
    )
    result = _run(attempt, size=4, min_processes=2, backend=backend)
    assert seen == [(0, 4), (1, 3), (2, 2)]
    assert [(r.cause, r.old_world_size, r.new_world_size) for r in result.rescales] == [
        ("lost", 4, 3),
        ("lost", 3, 2),
    ]
    assert result.rescales[0].detail == "node 3 lost" and result.rescales[0].at > 0
    assert result.world_size == 2 and result.attempts == 3
    assert "sparktrain: elastic: lost node 3 lost; restarting on 3 ranks" in capsys.readouterr().err


def test_training_code_errors_are_not_rescaled_but_restarted() -> None:
    bug = TrainingFailedError(_failure(1, 1.0, "ValueError: bad"), (0,), {})
    backend = FakeBackend(2)
    seen, attempt = _attempts(bug, bug, backend=backend, lose=1)
    with pytest.raises(TrainingFailedError) as caught:
        _run(attempt, restarts=1, min_processes=1, backend=backend)
    assert seen == [(0, 2), (1, 2)]  # same size: max_restarts, not a rescale
    assert caught.value.cause == "training code"


def test_below_the_floor_is_a_capacity_error_at_once() -> None:
    backend = FakeBackend(3)
    seen, attempt = _attempts(ClusterError("executor 1 lost"), None, backend=backend, lose=2)
    with pytest.raises(CapacityError) as caught:
        _run(attempt, size=3, min_processes=2, backend=backend)
    text = str(caught.value)
    assert "1 rank(s) can run now" in text and "min_processes=2" in text
    assert "1 more rank(s) of capacity are missing" in text
    assert seen == [(0, 3)]


def _refused_at_start(rank: int = 1) -> TrainingFailedError:
    """A rank whose process group could not form: its peer announced a loopback address."""
    message = (
        "Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
        "Connection refused, remote=[127.0.0.1]:41221"
    )
    tb = f'  File "train.py", line 3, in train\n    dist.init_process_group("gloo")\n{message}\n'
    refused = RankFailure(rank, "10.0.0.3", 1.0, "RuntimeError", message, tb, 1)
    return TrainingFailedError(refused, (0,), {rank: refused})


def test_a_group_that_cannot_form_twice_at_one_size_is_the_set_up_not_a_loss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    refused = _refused_at_start()
    assert refused.cause == "infrastructure"  # a connection error, as a vanished peer is
    text = str(refused)
    assert "hint: the ranks could not connect to each other while the process group formed" in text
    assert "(it tried 127.0.0.1:41221). 127.0.0.1 is a loopback address" in text
    assert "GLOO_SOCKET_IFNAME" in text and "NCCL_SOCKET_IFNAME" in text
    seen, attempt = _attempts(refused, refused, None)  # elastic: the size does not change
    with pytest.raises(TrainingFailedError) as caught:
        _run(attempt, size=2, min_processes=1)
    assert seen == [(0, 2), (1, 2)] and caught.value.attempts == 2
    assert "the network's set-up, not a lost node" in capsys.readouterr().err
    seen, attempt = _attempts(refused, refused, None)  # max_restarts: the same
    with pytest.raises(TrainingFailedError):
        _run(attempt, restarts=5)
    assert len(seen) == 2
    peer_gone = TrainingFailedError(_failure(0, 1.0, "[gloo] Connection closed by peer"), (), {})
    seen, attempt = _attempts(peer_gone, peer_gone, None)  # after the start: a loss, twice
    assert _run(attempt, size=2, min_processes=1).attempts == 3


def test_rescales_are_bounded() -> None:
    backend = FakeBackend(2)
    seen, attempt = _attempts(*[ClusterError("lost")] * 3, backend=backend)
    with pytest.raises(ClusterError):
        _run(attempt, size=2, min_processes=1, max_rescales=2, backend=backend)
    assert len(seen) == 3


def test_growing_back_relays_out_at_what_fits() -> None:
    backend = FakeBackend(4)
    grow = GrowingBack(2, 1.0)
    seen, attempt = _attempts(ClusterError("lost"), grow, None, backend=backend, lose=2)

    def grown(plan: LaunchPlan, number: int) -> RunResult | GrowingBack:
        if number == 1:
            backend.free = 4  # capacity returned while the small run trained
        return attempt(plan, number)  # type: ignore[operator, no-any-return]

    result = _run(grown, size=4, min_processes=1, backend=backend)
    assert seen == [(0, 4), (1, 2), (2, 4)]
    assert [r.cause for r in result.rescales] == ["lost", "grew"]


def test_the_grow_watch_asks_once_when_more_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "GROW_CHECK_SECONDS", 0.0)
    backend = FakeBackend(2)
    small = backend.layout(2, use_gpu=False, name="n")
    asked: list[str] = []

    class Asked(FakeNodes):
        def request_grow(self) -> None:
            asked.append("grow")

    nodes = Asked(10)
    assert watch_capacity(backend, small, 2, RunOptions(min_processes=1)) is None  # full size
    assert watch_capacity(backend, small, 4, RunOptions(min_processes=1, grow_back=False)) is None
    tick = watch_capacity(backend, small, 4, RunOptions(min_processes=1))
    assert tick is not None
    tick(nodes)
    assert asked == []  # no more capacity than in use
    backend.free = 3
    tick(nodes)
    tick(nodes)
    assert asked == ["grow"]


GROW_BACK = "sparktrain.ground.errors.GrowBack"


def test_finish_turns_every_rank_stopping_to_grow_into_grow_back() -> None:
    grow = RankFailure(0, "h", 1.0, GROW_BACK, "checkpoint step 4 is saved")
    other = dataclasses.replace(grow, rank=1)
    assert _finish([_report(0, (0, 1), failures={0: grow, 1: other})]) == GrowingBack(4, 1.0)
    with pytest.raises(TrainingFailedError):  # a real failure beside it wins
        _finish([_report(0, (0, 1), failures={0: grow, 1: _failure(1, 0.5, "boom")})])


def test_growing_survives_peers_that_saw_the_others_leave() -> None:
    grow = RankFailure(0, "h", 1.0, GROW_BACK, "checkpoint step 4 is saved")
    reset = RankFailure(1, "h", 1.1, "RuntimeError", "[gloo] Connection reset by peer")
    assert isinstance(_finish([_report(0, (0, 1), failures={0: grow, 1: reset})]), GrowingBack)


def test_a_crash_is_the_training_codes_and_a_kill_from_outside_is_not() -> None:
    for sig, cause in ((11, "training code"), (6, "training code"), (15, "infrastructure")):
        dead = RankFailure(1, "h", 1.0, None, "killed", exit_code=-sig)
        assert TrainingFailedError(dead, (0,), {1: dead}).cause == cause


def test_elastic_bounds_are_checked() -> None:
    with pytest.raises(ConfigError, match="min_processes=0 must be a whole number >= 1"):
        RunOptions(min_processes=0)
    with pytest.raises(ConfigError, match="min_processes=3 is more than num_processes=2"):
        RunOptions(min_processes=3).check_ranks(2)
    with pytest.raises(ConfigError, match="grow_back='yes' must be True or False"):
        RunOptions(grow_back="yes")  # type: ignore[arg-type]


# -- the follow loop ----------------------------------------------------------------------------
class FakeNodes(Nodes):
    """Nodes that end after ``polls`` polls (or never), and record what they were told."""

    def __init__(self, polls: float, *, fail_at: int = -1, ignore_stop: bool = False) -> None:
        self.polls, self.fail_at, self.ignore_stop = polls, fail_at, ignore_stop
        self.count = 0
        self.calls: list[str] = []

    def poll(self, wait: float) -> Polled:
        self.count += 1
        if self.count >= self.polls:
            return Polled(reports=[_report(1, (2, 3)), _report(0, (0, 1))])
        return Polled(failed=self.count == self.fail_at)

    def cancel(self, *, force: bool) -> None:
        self.calls.append("kill" if force else "stop")
        if not self.ignore_stop:
            self.polls = self.count + 2

    def close(self) -> None:
        self.calls.append("close")


def test_follow_stops_every_node_at_the_first_failure_then_closes() -> None:
    nodes = FakeNodes(float("inf"), fail_at=3)
    reports = follow_module.follow(nodes, stop_grace=0.0, monitor=Monitor(progress=False))
    assert [r.node_rank for r in reports] == [0, 1]
    assert nodes.calls == ["stop", "close"]


def test_follow_stops_when_the_caller_asks() -> None:
    monitor = Monitor(progress=False)
    monitor.request_stop()
    nodes = FakeNodes(float("inf"))
    follow_module.follow(nodes, stop_grace=0.0, monitor=monitor)
    assert nodes.calls == ["stop", "close"]


def test_follow_kills_nodes_that_do_not_stop_and_gives_up_on_dead_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(follow_module, "CANCEL_AFTER", 0.05)
    monkeypatch.setattr(follow_module, "POLL_SECONDS", 0.01)
    nodes = FakeNodes(float("inf"), fail_at=1, ignore_stop=True)
    started = time.monotonic()
    with pytest.raises(ClusterError, match="were killed but did not end"):
        follow_module.follow(nodes, stop_grace=0.0, monitor=Monitor(progress=False))
    assert nodes.calls == ["stop", "kill", "close"]
    assert time.monotonic() - started < 5.0


def test_follow_stops_every_node_when_the_calls_deadline_passes() -> None:
    deadline = follow_module.Deadline.after(0.0)
    assert deadline is not None and deadline.left() == 0.0 and not deadline.passed
    nodes = FakeNodes(float("inf"))
    follow_module.follow(nodes, stop_grace=0.0, monitor=Monitor(progress=False), deadline=deadline)
    assert nodes.calls == ["stop", "close"] and deadline.passed
    assert follow_module.Deadline.after(None) is None


def test_ctrl_c_stops_the_nodes_then_raises() -> None:
    class Interrupted(FakeNodes):
        def poll(self, wait: float) -> Polled:
            if self.count == 0:
                self.count += 1
                raise KeyboardInterrupt
            return super().poll(wait)

    nodes = Interrupted(float("inf"))
    with pytest.raises(KeyboardInterrupt):
        follow_module.follow(nodes, stop_grace=0.0, monitor=Monitor(progress=False))
    assert nodes.calls == ["stop", "close"]  # they ended within the wait: no kill
