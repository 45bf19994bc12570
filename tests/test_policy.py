"""The attempt loop's decisions as values: every ending, every counter, no process.

``decide`` is pure (``sparktrain.launchplan.policy``); ``tests/test_decisions.py`` checks that
``run_attempts`` carries its decisions out, and the elastic tests that real runs end so.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from sparktrain import ClusterError, ConfigError, TrainingFailedError, TrainingTimeoutError
from sparktrain.ground.errors import CapacityError, ClusterConfigError, HangError, RankFailure
from sparktrain.launchplan.options import RunOptions
from sparktrain.launchplan.policy import Decision, Ended, Room, Tally, decide, ended_by

PLAIN = RunOptions()
RESTARTS = RunOptions(max_restarts=2)
ELASTIC = RunOptions(min_processes=1, max_rescales=2)
BOTH = RunOptions(min_processes=1, max_rescales=1, max_restarts=1)
CODE, INFRA = "training code", "infrastructure"
#: What fits after a loss in these tests: 3 ranks of capacity, all of which lay out.
ROOM = Room(capacity=3, fits=3)


def _room() -> Room:
    return ROOM


def _unasked() -> Room:
    raise AssertionError("the room was read for a decision that is no resize")


def _failed(cause: str, size: int = 4, forming: bool = False) -> Ended:
    return Ended("failed", size, cause, forming)


def test_a_result_returns_and_a_grow_back_stop_grows_whatever_was_used() -> None:
    for options, tally in itertools.product(
        (PLAIN, RESTARTS, ELASTIC, BOTH), (Tally(), Tally(restarts=9, rescales=9))
    ):
        assert decide(Ended("finished", 4), tally, options, _unasked) == Decision("return", tally)
        assert decide(Ended("grow back", 2), tally, options, _room) == Decision(
            "grow", tally, size=3, room=ROOM
        )


def test_a_timeout_is_final_even_with_restarts_and_rescales_left() -> None:
    for options in (PLAIN, RESTARTS, ELASTIC, BOTH):
        decision = decide(Ended("timed out", 4), Tally(), options, _unasked)
        assert decision == Decision("raise", Tally(), "final")


def test_capacity_gone_before_an_attempt_started_shrinks_again() -> None:
    """Nodes lost between an attempt's sizing and its start: an elastic run shrinks, the first
    attempt too (a node killed during the launch); a run that is not elastic raises."""
    went = Ended("capacity went", 3)
    assert decide(went, Tally(rescales=1), ELASTIC, _room).action == "shrink"
    assert decide(went, Tally(rescales=0), ELASTIC, _room).action == "shrink"
    assert decide(went, Tally(rescales=2), ELASTIC, _unasked).reason == "final"  # max_rescales used
    assert decide(went, Tally(rescales=1), RESTARTS, _unasked).reason == "final"  # not elastic


def test_training_code_restarts_at_the_same_size_until_max_restarts() -> None:
    tally = Tally()
    actions = []
    for _ in range(3):
        decision = decide(_failed(CODE), tally, RESTARTS, _unasked)
        actions.append(decision.action)
        tally = decision.tally
    assert actions == ["restart", "restart", "raise"]
    assert tally.restarts == 2 and decision.reason == "restarts used"
    # Elastic or not, a bug is never a rescale.
    assert decide(_failed(CODE), Tally(), ELASTIC, _unasked) == Decision(
        "raise", Tally(), "restarts used"
    )
    assert decide(_failed(CODE), Tally(), BOTH, _unasked).action == "restart"


def test_infrastructure_shrinks_an_elastic_run_then_uses_restarts() -> None:
    assert decide(_failed(INFRA), Tally(), ELASTIC, _room) == Decision(
        "shrink", Tally(), size=3, room=ROOM
    )
    assert decide(_failed(INFRA), Tally(rescales=2), ELASTIC, _unasked).reason == "rescales used"
    # max_rescales used: max_restarts still applies, at the current size.
    decision = decide(_failed(INFRA), Tally(rescales=1), BOTH, _unasked)
    assert decision == Decision("restart", Tally(restarts=1, rescales=1))
    assert decide(_failed(INFRA), decision.tally, BOTH, _unasked).reason == "rescales used"
    # Not elastic: a lost node is restarted like any failure.
    assert decide(_failed(INFRA), Tally(), RESTARTS, _unasked).action == "restart"
    assert decide(_failed(INFRA), Tally(), PLAIN, _unasked) == Decision(
        "raise", Tally(), "restarts used"
    )


def test_a_group_that_fails_to_form_twice_at_one_size_is_the_set_up() -> None:
    forming = _failed(INFRA, size=4, forming=True)
    for options in (ELASTIC, RESTARTS):
        first = decide(forming, Tally(), options, _room)
        assert first.action in ("shrink", "restart") and first.tally.forming == {4}
        second = decide(forming, first.tally, options, _room)
        assert second.action == "raise" and second.reason == "set-up"
    # At another size it is a first time again; without forming, a loss as any other.
    again = Tally(forming=frozenset({4}))
    assert decide(_failed(INFRA, 2, True), again, ELASTIC, _room).action == "shrink"
    assert decide(_failed(INFRA), again, ELASTIC, _room).action == "shrink"


def test_a_resize_carries_the_size_the_room_fits_or_raises_below_the_floor() -> None:
    """The size a resize goes to is the decision's, as Ray Train's ResizeDecision carries
    num_workers: the largest size the room lays out; with none down to the floor, the run ends
    at once, with the room that said so."""
    lost = _failed(INFRA)
    small = Room(capacity=2, fits=2)
    assert decide(lost, Tally(), ELASTIC, lambda: small).size == 2
    laid = Room(capacity=3, fits=2)  # 3 ranks of capacity, but 2 is what lays out
    assert decide(lost, Tally(), ELASTIC, lambda: laid) == Decision(
        "shrink", Tally(), size=2, room=laid
    )
    empty = Room(capacity=0, fits=None)
    assert decide(lost, Tally(), ELASTIC, lambda: empty) == Decision(
        "raise", Tally(), "below floor", room=empty
    )
    assert decide(Ended("grow back", 2), Tally(), ELASTIC, lambda: empty).reason == "below floor"
    went = Ended("capacity went", 3)
    assert decide(went, Tally(rescales=1), ELASTIC, lambda: small).size == 2


def test_a_decision_never_lowers_a_counter() -> None:
    endings = [Ended("finished", 4), Ended("grow back", 4), Ended("timed out", 4)]
    endings += [Ended("capacity went", 4)]
    endings += [_failed(c, s, f) for c in (CODE, INFRA) for s in (2, 4) for f in (False, True)]
    tallies = [Tally(r, s, frozenset(f)) for r in (0, 1, 3) for s in (0, 1, 3) for f in ((), (4,))]
    for ended, tally, options in itertools.product(
        endings, tallies, (PLAIN, RESTARTS, ELASTIC, BOTH)
    ):
        after = decide(ended, tally, options, _room).tally
        assert after.restarts in (tally.restarts, tally.restarts + 1)
        assert after.rescales == tally.rescales and after.forming >= tally.forming


def _culprit(message: str, exc: str | None = "RuntimeError", code: int = 1) -> RankFailure:
    return RankFailure(1, "h", 1.0, exc, message, f"Traceback\n{message}\n", code)


def test_errors_become_endings() -> None:
    bug = TrainingFailedError(_culprit("ValueError: bad", "ValueError"), (0,), {})
    assert ended_by(bug, 4) == Ended("failed", 4, CODE)
    killed = _culprit("killed by SIGKILL", None, -9)
    assert ended_by(TrainingFailedError(killed, (0,), {1: killed}), 3) == Ended("failed", 3, INFRA)
    assert ended_by(ClusterError("node 1 lost"), 2) == Ended("failed", 2, INFRA)
    assert ended_by(CapacityError("short"), 2) == Ended("failed", 2, INFRA)
    refused = _culprit(
        "Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
        "Connection refused, remote=[127.0.0.1]:41221"
    )
    refused = dataclasses.replace(
        refused, traceback=f'    dist.init_process_group("gloo")\n{refused.message}\n'
    )
    assert ended_by(TrainingFailedError(refused, (0,), {1: refused}), 2).forming
    assert ended_by(TrainingTimeoutError(5.0, (1,), (0,)), 2) == Ended("timed out", 2)
    assert ended_by(ClusterConfigError("gone"), 2) == Ended("capacity went", 2)
    hang = HangError(5.0, {}, (1,))
    assert ended_by(hang, 2).kind == "failed"
    with pytest.raises(ConfigError, match="bad input"):  # not an ending: raised as it is
        ended_by(ConfigError("bad input"), 2)
