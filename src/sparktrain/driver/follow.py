"""The driver's one follow loop: every backend's nodes, from their start to their reports.

The loop polls the started :class:`~sparktrain.backends.base.Nodes` (their lines are shown as
they come). At the first failure a node reports, or when the caller's ``on_report`` asks, it
tells every node to stop its ranks. If the nodes have not ended :data:`CANCEL_AFTER` seconds
after the stop grace period, it kills them; if even that does not end them within as long, the
attempt fails with :class:`~sparktrain.ClusterError`. When the call's ``timeout`` passes (a
:class:`Deadline`, held by the driver for the whole call: every attempt, every node that joined
late), it stops them the same way and the deadline says it passed. On Ctrl-C it stops them
the same way, waits a short while for them to end, kills what is left and re-raises. Whatever
happens, the nodes are closed. How a backend stops or kills a node (a message on the channel,
cancelling a Spark job, killing a Ray actor, signalling local ranks) is the backend's business.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from sparktrain.backends.base import Nodes
from sparktrain.contract.report import NodeReport
from sparktrain.driver.monitor import Monitor
from sparktrain.ground.errors import ClusterError

#: After asking the nodes to stop, how long they get (beyond the stop grace) before being killed.
CANCEL_AFTER = 15.0
#: How often the loop looks at the nodes when none of them says anything.
POLL_SECONDS = 0.2
#: After Ctrl-C, how long (beyond the stop grace) the nodes get to stop before being killed.
INTERRUPT_WAIT = 5.0


@dataclass
class Deadline:
    """A launch call's ``timeout`` on the driver's clock, for all of the call's attempts.

    Each node's agent also stops its ranks ``timeout`` seconds after its own start, but a node
    that joined late, or an attempt started after a restart, counts from later: the driver holds
    the one deadline of the whole call.

    Attributes:
        timeout: The call's ``timeout=`` in seconds.
        at: When it passes (``time.monotonic()``).
        passed: Whether the driver stopped the run's nodes for it.
    """

    timeout: float
    at: float
    passed: bool = False

    @classmethod
    def after(cls, timeout: float | None) -> Deadline | None:
        """The deadline ``timeout`` seconds from now (``None``: no timeout)."""
        return None if timeout is None else cls(timeout, time.monotonic() + timeout)

    def left(self) -> float:
        """Seconds until it passes (``0`` once it has)."""
        return max(0.0, self.at - time.monotonic())


def follow(
    nodes: Nodes,
    *,
    stop_grace: float,
    monitor: Monitor,
    tick: Callable[[Nodes], None] | None = None,
    in_place: bool = False,
    deadline: Deadline | None = None,
) -> list[NodeReport]:
    """Follow ``nodes`` until every one has reported; close them in any case.

    Args:
        nodes: The started nodes of one attempt.
        stop_grace: Seconds the nodes take between SIGTERM and SIGKILL of their ranks.
        monitor: Says when the caller (``on_report``) asked for the run to stop.
        tick: Called with the nodes at every turn of the loop while they run (an elastic run
            watching for capacity to grow back).
        in_place: At a failure, first let the survivors go on in place
            (:meth:`Nodes.lose_in_place`); stop every node only when that cannot be done.
        deadline: The call's ``timeout``: once it passes, every node is stopped and
            ``deadline.passed`` is set.

    Returns:
        Every node's report, in node order.

    Raises:
        KeyboardInterrupt: After the nodes were stopped (or killed).
    """
    cancel_at: float | None = None
    killed = False
    try:
        while True:
            polled = nodes.poll(POLL_SECONDS)
            if polled.reports is not None:
                return sorted(polled.reports, key=lambda report: report.node_rank)
            if tick is not None and cancel_at is None:
                tick(nodes)
            if in_place and polled.failed and cancel_at is None and nodes.lose_in_place():
                continue
            due = deadline is not None and not deadline.left()
            if cancel_at is None and (polled.failed or monitor.stop_requested() or due):
                if deadline is not None and due and not polled.failed:
                    deadline.passed = True
                nodes.cancel(force=False)
                cancel_at = time.monotonic() + CANCEL_AFTER + stop_grace
            elif cancel_at is not None and time.monotonic() > cancel_at:
                if killed:
                    raise ClusterError(
                        "the run's nodes were killed but did not end within "
                        f"{CANCEL_AFTER:g}s; the cluster (or this machine) is not responding."
                    )
                nodes.cancel(force=True)  # a node did not stop its ranks in time
                killed = True
                cancel_at = time.monotonic() + CANCEL_AFTER
    except KeyboardInterrupt:
        _interrupted(nodes, stop_grace)
        raise
    finally:
        nodes.close()


def _interrupted(nodes: Nodes, stop_grace: float) -> None:
    """After Ctrl-C: stop the nodes, wait a little for them, kill what is left."""
    with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C still ends the nodes
        nodes.cancel(force=False)
        deadline = time.monotonic() + stop_grace + INTERRUPT_WAIT
        while time.monotonic() < deadline:
            if nodes.poll(POLL_SECONDS).reports is not None:
                return
    nodes.cancel(force=True)
