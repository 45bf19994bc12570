"""How a node's ranks ended, as its agent saw them, and what may tell a node to stop.

Plain values, so that a node's report can be read from them without loading the agent (or the
fork server client) into the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from sparktrain.ground.errors import StackSite


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended.

    Attributes:
        rank: Global rank.
        exit_code: 0 on success; negative for a signal.
        time: Wall-clock time the fork server saw it exit.
        stopped: Whether the agent had signalled it to stop before it exited.
        lingered: Whether it had recorded its outcome but did not exit within the exit grace
            period, and was killed; ``exit_code`` is then the outcome it recorded.
    """

    rank: int
    exit_code: int
    time: float
    stopped: bool
    lingered: bool = False


class Control(Protocol):
    """A channel from whoever coordinates several nodes: it can tell this node to stop."""

    def fileno(self) -> int:
        """Descriptor to wait on."""
        ...

    def receive(self) -> Literal["stop", "busy"] | None:
        """Read what arrived: ``"stop"``, ``"busy"`` or ``None``.

        ``"stop"`` also for a closed channel; ``"busy"`` when a rank of another node builds an
        op, which is progress for this node's ranks too, since they wait for it.
        """
        ...

    def deadline(self) -> float | None:
        """When this node is cut off if nothing more arrives (``time.monotonic()``), or never."""
        ...


@dataclass
class NodeOutcome:
    """What happened to a node's ranks."""

    exits: dict[int, RankExit] = field(default_factory=dict)
    timed_out: bool = False
    running_at_timeout: tuple[int, ...] = ()
    stop_time: float | None = None
    hung: bool = False
    hang_sites: dict[int, StackSite] = field(default_factory=dict)
    hang_silent: tuple[int, ...] = ()
