"""Where a run's nodes execute: the one interface every backend's wing implements.

A :class:`Backend` lays out ``N`` processes on what it offers (:meth:`Backend.layout`, which
may ask the cluster) and starts the nodes of one attempt (:meth:`Backend.start`). The started
:class:`Nodes` are then driven by the one follow loop of :mod:`sparktrain.driver.follow`, which
only polls them, cancels them and closes them. A backend object holds no attempt's state, so one
prepared launch can run its attempts (and a front door its runs) one after the other or at once.

What the front doors need to know about where the ranks run, they ask the backend (its class
attributes: :attr:`Backend.on_this_machine`, :attr:`Backend.multi_node`,
:attr:`Backend.barrier_context`; :meth:`Backend.tasks`, :meth:`Backend.every_slot`), never its
name. A backend is made from a :class:`Wanted` by :meth:`Backend.open`, which is how the
registry (:mod:`sparktrain.backends.registry`) makes one by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import NodeSpec, node_spec
from sparktrain.driver.monitor import Monitor
from sparktrain.driver.results import Rescale
from sparktrain.launchplan.entrypoint import Entrypoint
from sparktrain.launchplan.front import LAUNCH, FrontDoor
from sparktrain.launchplan.layout import LaunchPlan
from sparktrain.launchplan.options import RunOptions
from sparktrain.launchplan.topology import Topology


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One start of a run's whole group, as the backend needs it.

    Attributes:
        plan: The layout the launch was prepared with.
        options: The run's options.
        entry: What every rank runs.
        number: The attempt number (0 at first; one more per restart).
        monitor: Receives the ranks' reports; says when the caller asked to stop.
        extra_env: Variables of other contracts for every rank (MLflow's run).
        data_uri: Where Spark cached the DataFrame whose rows the ranks share, or ``None``.
        target_world_size: In an elastic run, the size it was launched at; ``None`` otherwise.
        store: In an in-place run, the store the driver hosts (``members/<g>`` of each
            generation), reached by the ranks at ``SPARKTRAIN_IN_PLACE_STORE``.
        run: The run's key, the same for all its attempts (what a backend keeps across them,
            such as its nodes' checkpoint memory, is kept under it until :meth:`Backend.end_run`).
    """

    plan: LaunchPlan
    options: RunOptions
    entry: Entrypoint
    number: int
    monitor: Monitor
    extra_env: dict[str, str] | None = None
    data_uri: str | None = None
    target_world_size: int | None = None
    store: Any = None  # in place: the store the driver hosts for the ranks' generations
    run: str = ""

    def spec(
        self, *, channel: tuple[str, int] | None = None, secret: bytes | None = None
    ) -> NodeSpec:
        """What every node of this attempt is given."""
        return node_spec(
            self.plan,
            self.options,
            self.entry,
            attempt=self.number,
            extra_env=self.extra_env,
            data_uri=self.data_uri,
            channel=channel,
            secret=secret,
            target_world_size=self.target_world_size,
        )


@dataclass(frozen=True)
class Polled:
    """What :meth:`Nodes.poll` saw.

    Attributes:
        failed: A rank failed since the last poll: every other node should stop.
        reports: Every node's report, once every node has ended; ``None`` before.
    """

    failed: bool = False
    reports: list[NodeReport] | None = None


class Nodes(ABC):
    """The started nodes of one attempt."""

    @abstractmethod
    def poll(self, wait: float) -> Polled:
        """Follow the nodes for up to ``wait`` seconds (their lines are shown meanwhile)."""

    @abstractmethod
    def cancel(self, *, force: bool) -> None:
        """Stop every node's ranks: ask them (``force=False``), or kill the nodes now."""

    @abstractmethod
    def close(self) -> None:
        """Release everything the attempt holds (called once, whatever happened)."""

    def in_place_rescales(self) -> tuple[Rescale, ...]:
        """The losses the survivors went on from in place during this attempt, in order."""
        return ()

    def lose_in_place(self) -> bool:
        """After a failure, let the survivors go on in place (``in_place``); ``False``: cannot.

        Nodes that can (a ``LocalCluster``'s, Ray's) name the survivors as the ranks' next
        generation in the run's store, when the failure was only nodes lost.
        """
        return False

    def in_place_world(self) -> int | None:
        """In place: the ranks in the group now, with those starting to join; ``None``: not."""
        return None

    def grow_in_place(self, ranks: int) -> int:
        """In place: start nodes for up to ``ranks`` more ranks, which join; the ranks started."""
        return 0

    def preempt(self, node: int | str) -> tuple[int, ...]:
        """Ask the ranks of ``node`` (index or host) to leave in place; ``()``: not here."""
        return ()

    def request_grow(self) -> None:  # noqa: B027 - optional: nodes that cannot grow ignore it
        """Ask the ranks to stop at their next checkpoint, so the run grows back (elastic)."""


@dataclass(frozen=True, kw_only=True)
class Wanted:
    """What a front door asks of the backend it names: the values some backends take.

    Attributes:
        topology: This machine's resources (tests pass their own; detected when ``None``).
        address: The cluster to join, for backends that join one (Ray's ``ray_address``).
        front: The front door launching (its TLS-override conf, how ranks own GPUs).
    """

    topology: Topology | None = None
    address: str | None = None
    front: FrontDoor = LAUNCH


class Backend(ABC):
    """Where the nodes of a run execute."""

    name: ClassVar[str]
    #: Whether an elastic run may keep its survivors in place here (``in_place=True``).
    in_place: ClassVar[bool] = False
    #: Whether every rank runs on this machine (a local path is then every rank's, and a
    #: package the ranks import must be installed here).
    on_this_machine: ClassVar[bool] = False
    #: Whether the ranks may span several nodes (machines, executors, node processes).
    multi_node: ClassVar[bool] = True
    #: Whether each node is a Spark barrier task (``BarrierTaskContext`` is the ranks' to ask).
    barrier_context: ClassVar[bool] = False

    @classmethod
    def open(cls, wanted: Wanted) -> Backend:
        """The backend for ``wanted`` (the registry makes named backends so).

        The default takes nothing from ``wanted``.

        Raises:
            ConfigError: What the backend needs is missing (its package, a session, a cluster).
        """
        return cls()

    def tasks(self, plan: LaunchPlan) -> int:
        """How many tasks of the cluster manager ``plan`` takes (pyspark's ``num_tasks``).

        One per node by default; the local backend runs its ranks as processes of its own.
        """
        return plan.nodes

    def every_slot(self, use_gpu: object) -> int | None:
        """The ranks that every slot of the cluster would run (``HorovodRunner(np=0)``).

        ``None``: this backend cannot count them (the front door then asks for a number).
        """
        return None

    @classmethod
    def counts_slots(cls) -> bool:
        """Whether :meth:`every_slot` counts slots here (asked of the class, before one is made)."""
        return cls.every_slot is not Backend.every_slot

    def store_host(self) -> str:
        """Where an in-place run's store listens: an address every node reaches this process at."""
        return "127.0.0.1"

    @abstractmethod
    def layout(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """Lay out ``num_processes`` ranks on what this backend offers now.

        Args:
            num_processes: The number of ranks asked for.
            use_gpu: ``True``, ``False`` or ``None`` (GPUs where there are some).
            name: What the caller's front door calls the number, for messages.

        Raises:
            ConfigError: The ranks do not fit, or a value is bad; nothing was started.
        """

    def layout_ahead(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """Lay out the ranks for runs started later, without asking what is free now.

        :meth:`check_room` then checks before each run. The default is :meth:`layout`, whose
        plan was checked against what is there.
        """
        return self.layout(num_processes, use_gpu=use_gpu, name=name)

    def check_room(self, plan: LaunchPlan, *, name: str) -> None:  # noqa: B027 - optional
        """Before a run of a plan made by :meth:`layout_ahead`: refuse it if it does not fit now.

        Raises:
            ConfigError: The ranks do not fit; nothing was started. The default checks
                nothing: :meth:`layout_ahead` checked.
        """

    @abstractmethod
    def start(self, attempt: Attempt) -> Nodes:
        """Start every node of ``attempt``; what is started is released if this raises."""

    def capacity(self, plan: LaunchPlan) -> int:
        """How many ranks laid out like ``plan`` could run now, without waiting for any.

        An elastic run asks this after a loss (to shrink) and while it runs short (to grow
        back). The default is a backend whose capacity is never lost: ``plan``'s size.
        """
        return plan.world_size

    def end_run(self, run: str) -> None:  # noqa: B027 - optional: most keep nothing
        """Release what the backend kept across the attempts of the run ``run``.

        That is its nodes' checkpoint memory (kept under :attr:`Attempt.run`).
        ``launch`` calls it once at the end of every run, whoever made the backend; runs of
        one backend may overlap (the trials of a search), each with its own key.
        """

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing of their own
        """Release what the backend itself started (a local Ray); ``launch`` calls it at its end."""
