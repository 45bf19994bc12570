"""The failure decisions, without a process: culprit, victims, restarts, the follow loop.

Reports are fabricated as nodes would send them; the real-process tests (test_local_run,
test_faults, test_spark, test_ray) check that nodes do send them so.
"""

from __future__ import annotations

import pickle
import signal
import time
from pathlib import Path

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
from sparktrain.driver import follow as follow_module
from sparktrain.driver.backend import Nodes, Polled
from sparktrain.driver.launch import _with_restarts
from sparktrain.driver.monitor import Monitor
from sparktrain.driver.results import RunResult, finish
from sparktrain.errors import RankFailure, StackSite
from sparktrain.node.outcome import NodeOutcome, RankExit
from sparktrain.node.report import NodeReport, node_report
from sparktrain.rank.paths import error_path, result_path


def _failure(rank: int, when: float, message: str, exc: str | None = "ValueError") -> RankFailure:
    return RankFailure(rank, "host", when, exc, message, f"Traceback...\n{message}\n", 1)


def _report(node: int, ranks: tuple[int, ...], **fields: object) -> NodeReport:
    values = fields.pop("values", {})
    return NodeReport(
        node_rank=node, host=f"h{node}", ranks=ranks, failures=fields.pop("failures", {}),
        stopped=fields.pop("stopped", ()), values=values, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def _finish(reports: list[NodeReport], **kwargs: object) -> RunResult:
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
def _attempts(*outcomes: BaseException | None) -> tuple[list[int], object]:
    seen: list[int] = []

    def attempt(number: int) -> RunResult:
        seen.append(number)
        outcome = outcomes[number]
        if outcome is not None:
            raise outcome
        return RunResult({0: "ok"}, 2, 1.0)

    return seen, attempt


def test_rank_failures_and_lost_nodes_are_restarted(capsys: pytest.CaptureFixture[str]) -> None:
    failed = TrainingFailedError(_failure(1, 1.0, "boom"), (0,), {})
    seen, attempt = _attempts(failed, ClusterError("node 1 lost"), None)
    result = _with_restarts(2, attempt)  # type: ignore[arg-type]
    assert seen == [0, 1, 2] and result.attempts == 3
    err = capsys.readouterr().err
    assert "restarting every rank (attempt 2 of 3)" in err and "node 1 lost" in err


def test_timeouts_are_not_restarted_and_the_last_error_counts_attempts() -> None:
    seen, attempt = _attempts(TrainingTimeoutError(5.0, (1,), (0,)), None)
    with pytest.raises(TrainingTimeoutError):
        _with_restarts(3, attempt)  # type: ignore[arg-type]
    assert seen == [0]
    failed = TrainingFailedError(_failure(1, 1.0, "boom"), (0,), {})
    seen, attempt = _attempts(failed, failed)
    with pytest.raises(TrainingFailedError) as caught:
        _with_restarts(1, attempt)  # type: ignore[arg-type]
    assert caught.value.attempts == 2 and "(attempt 2 of 2)" in str(caught.value)


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
