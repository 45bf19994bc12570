"""The nodes of one Ray attempt: a placement group, one actor per bundle, the reports they return.

Each actor (:class:`~sparktrain.backends.ray.node.actor.NodeActor`) runs the same node code as a
Spark task; its lines come over the attempt's authenticated channel. In place, a node that
returns is placed on a lost node's bundle (or a group of its own) and joins the running ranks.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from typing import Any

from sparktrain.backends.base import Attempt, Polled
from sparktrain.backends.ray.held import Held
from sparktrain.backends.ray.layout import placement
from sparktrain.backends.ray.node.actor import NodeActor
from sparktrain.backends.remote import RemoteNodes
from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import Place
from sparktrain.ground.errors import ClusterConfigError

#: How long the placement group may wait for its resources before the launch gives up.
PLACEMENT_SECONDS = 60.0
#: In place: how long a joining node's actor may take to start before the next look retries.
JOIN_SECONDS = 30.0


class RayNodes(RemoteNodes):
    """The actors of one attempt, their placement group and the reports they returned."""

    def __init__(self, ray: Any, attempt: Attempt, held: Held | None = None) -> None:
        """Open the channel, place one actor per node and start each node's ranks."""
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        super().__init__(attempt, ray.util.get_node_ip_address())
        self.ray = ray
        self.held = held
        self.plan = attempt.plan
        self.actors: list[Any] = []
        self.pending: dict[Any, int] = {}
        self.killed: set[int] = set()
        self.hosts: list[str] = []
        self.master: tuple[str, int] = ("", 0)
        self.joining_groups: list[Any] = []  # in place: the groups of nodes started to join
        self.placing: Any = None  # in place: a joining node's group, not placed yet
        self.rebundled: set[int] = set()  # in place: lost nodes whose bundle a joiner took
        self.bundle_nodes: dict[int, str] = {}  # the Ray node of each bundle at the start
        bundles, strategy = placement(self.plan)
        avoided = held.avoided() if held is not None else {}
        selector = (
            [{NODE_ID_LABEL_KEY: f"!in({','.join(sorted(avoided.values()))})"}] * len(bundles)
            if avoided
            else None
        )
        self.group = placement_group(
            bundles, strategy=strategy, name=f"sparktrain-{uuid.uuid4()}",
            bundle_label_selector=selector,
        )  # fmt: skip
        try:
            self._run(self._place())
        except BaseException:
            self.close()
            raise

    def _place(self) -> list[tuple[str, int | None, tuple[str, ...], int]]:
        """Wait for the placement, create one actor per bundle; each says where it runs."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ready, _ = self.ray.wait([self.group.ready()], timeout=PLACEMENT_SECONDS)
        if ready and self.held is not None:
            bundles, _ = placement(self.plan)
            held = {k: sum(b.get(k, 0.0) for b in bundles) for k in ("CPU", "GPU")}
            self.held.hold(id(self), held)
        if not ready:
            bundles, strategy = placement(self.plan)
            raise ClusterConfigError(
                f"the Ray cluster could not place {len(bundles)} bundle(s) of {bundles[0]} "
                f"({strategy}) within {PLACEMENT_SECONDS:.0f} s; its free resources are "
                f"{self.ray.available_resources()}. Free resources, or lower num_processes."
            )
        remote = self.ray.remote(NodeActor)
        gpus = self.plan.procs_per_node if self.plan.device == "cuda" else 0
        for index in range(self.plan.nodes):
            where = PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=index
            )
            self.actors.append(
                remote.options(
                    num_cpus=0, num_gpus=gpus, max_restarts=0, scheduling_strategy=where
                ).remote()
            )
        places = self.ray.get([a.where.remote(i == 0) for i, a in enumerate(self.actors)])
        from ray.util.placement_group import placement_group_table

        where = placement_group_table(self.group).get("bundles_to_node_id", {})
        self.bundle_nodes = {int(k): str(v) for k, v in where.items()}
        return list(places)

    def _run(self, places: Sequence[tuple[str, int | None, Any, int]]) -> None:
        """Start every node's ranks."""
        master = self.master = (places[0][0], places[0][1] or 0)
        self.hosts = [place[0] for place in places]
        for node, (actor, (host, _, gpus, _)) in enumerate(zip(self.actors, places, strict=True)):
            place = Place(node, host, master, tuple(gpus), address=host)
            ref = actor.run.remote(self.spec, place, os.environ.get("OMP_NUM_THREADS"))
            self.pending[ref] = node

    def poll(self, wait: float) -> Polled:
        """Show what the nodes sent; collect the reports of nodes that finished.

        A node lost by silence is reported lost at once (its actor cannot answer), killed as far
        as Ray can, and left out of the next layouts for a while (:meth:`RayBackend.avoid`).
        """
        failed = self.pump(wait)
        for host, why in self.printer.silent_hosts.items():
            if self.held is not None:
                self.held.avoid([host])
            for ref, node in list(self.pending.items()):
                if self.hosts[node] == host:
                    del self.pending[ref]
                    self.reports[node] = NodeReport.broken(node, host, why)
                    with contextlib.suppress(Exception):
                        self.ray.kill(self.actors[node], no_restart=True)
        self.printer.silent_hosts.clear()
        failed = self._collect() or failed
        if self.pending:
            return Polled(failed=failed)
        alive = [n for n, r in self.reports.items() if r.agent_error is None]
        self.drain(sum(1 for n in alive if n not in self.killed and n not in self.left))
        return Polled(failed=failed, reports=[self.reports[n] for n in sorted(self.reports)])

    def _collect(self) -> bool:
        """Collect the reports of the actors that returned or died; whether a node was lost."""
        lost = False
        if self.pending:
            done, _ = self.ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
            for ref in done:
                node = self.pending.pop(ref)
                if node in self.left:  # lost in place: its report is written
                    continue
                try:
                    report = self.ray.get(ref)
                except Exception as exc:  # the actor died: node lost, or killed by its host
                    why = f"its Ray actor died: {type(exc).__name__}: {exc}"
                    report = NodeReport.broken(node, self.hosts[node], why)
                self.reports[node] = report
                lost = lost or report.agent_error is not None
        return lost

    def collect(self) -> None:
        """Collect the reports of the actors that returned or died."""
        self._collect()

    def grow_in_place(self, ranks: int) -> int:
        """Start a node whose ranks join, where Ray has placed room for it; the ranks started.

        A lost node's bundle of the run's placement group is placed again by Ray once a node
        has room (the group is ``CREATED`` again): the joiner goes there. Without such a bundle
        (the run started short), a group of one bundle is asked for and used once placed. Never
        waits: the follow loop looks again at its next tick.
        """
        from ray.util.placement_group import placement_group, placement_group_table

        if self.generations is None or ranks < self.plan.procs_per_node:
            return 0
        free = [n for n in sorted(self.left) if n < self.plan.nodes and n not in self.rebundled]
        if free:
            table = placement_group_table(self.group)
            now = table.get("bundles_to_node_id", {}).get(free[0])
            alive = {str(n["NodeID"]) for n in self.ray.nodes() if n.get("Alive")}
            if table.get("state") != "CREATED" or now == self.bundle_nodes.get(free[0]):
                return 0  # Ray has not placed the lost node's bundle again yet
            if now not in alive:
                return 0
            started = self._join(self.group, free[0])
            if started:
                self.rebundled.add(free[0])
            return started
        if self.placing is None:
            bundles, _ = placement(self.plan)
            self.placing = placement_group(bundles[:1], name=f"sparktrain-{uuid.uuid4()}")
            self.joining_groups.append(self.placing)
        ready, _ = self.ray.wait([self.placing.ready()], timeout=0)
        if not ready:
            return 0
        group, self.placing = self.placing, None
        return self._join(group, 0)

    def _join(self, group: Any, bundle: int) -> int:
        """Start a joining node's actor on ``group``'s ``bundle``; its ranks."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self.generations is not None
        gpus = self.plan.procs_per_node if self.plan.device == "cuda" else 0
        where = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle
        )
        actor = (
            self.ray.remote(NodeActor)
            .options(num_cpus=0, num_gpus=gpus, max_restarts=0, scheduling_strategy=where)
            .remote()
        )
        try:
            host, _, assigned, _ = self.ray.get(actor.where.remote(False), timeout=JOIN_SECONDS)
        except Exception:  # its node went too, or it did not start: the next look tries again
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
            return 0
        node = len(self.actors)
        self.actors.append(actor)
        self.hosts.append(host)
        place = Place(node, host, self.master, tuple(assigned), address=host, joining=True)
        self.pending[actor.run.remote(self.spec, place, os.environ.get("OMP_NUM_THREADS"))] = node
        joining = tuple(self.spec.ranks_of(node))
        self.generations.join(joining, f"node {node} on {host}, rank(s) {list(joining)}")
        return len(joining)

    def cancel(self, *, force: bool) -> None:
        """Tell every node to stop its ranks; or kill the actors still running."""
        if not force:
            self.stop_nodes()
            return
        per = self.plan.procs_per_node
        for ref, node in list(self.pending.items()):
            with contextlib.suppress(Exception):
                self.ray.kill(self.actors[node], no_restart=True)
            ranks = range(node * per, (node + 1) * per)
            self.reports[node] = NodeReport.killed(node, self.hosts[node], ranks)
            self.killed.add(node)
            del self.pending[ref]

    def close(self) -> None:
        """Kill every actor, remove the placement group, close the channel."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        for group in (self.group, *self.joining_groups):
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        if self.held is not None:
            self.held.release(id(self))
        super().close()
