"""The Ray backend: one actor per node, placed by a placement group, runs the node agent.

Which Ray: the one this process already initialised (``ray.is_initialized()``), else
``ray.init(address=ray_address)``; ``None`` means ``RAY_ADDRESS`` when set, else a local Ray
started for this process. A Ray that sparktrain started is stopped when ``launch`` returns, and
a keeper process (:mod:`sparktrain.ray.keeper`) ends it if the caller is killed first. A warm Ray
across launches is asked for explicitly: :func:`sparktrain.ray.start_local` starts one that
stays up until the caller exits (with the same keeper); a Ray the user started is never stopped.

Layout: ranks go on as few nodes as hold them (intra-node traffic is cheaper), the same number on
each node: one CPU (or one GPU) per rank, and on CPU each rank's share of the node's CPUs. One
node is one bundle in a ``PACK`` group (the local case: one Ray node hosts every rank), several
nodes are bundles of a ``STRICT_SPREAD`` group, one per node. Each bundle holds one
:class:`~sparktrain.node.ray_actor.NodeActor`, which runs the same node code as a Spark task:
ranks forked from a fork server, live lines over the authenticated channel to this driver, stop
on the driver's word, and a :class:`NodeReport` that becomes the caller's result or one error.
Actor 0 binds the rendezvous port on its node before any rank starts.

Cleanup: whatever happens (a failure, a timeout, Ctrl-C), every actor is killed and the
placement group removed when the attempt's nodes close; a killed actor's fork server sees its
socket close and kills the ranks it started.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import Place
from sparktrain.driver.backend import Attempt, Backend, Nodes, Polled
from sparktrain.driver.remote import RemoteNodes
from sparktrain.errors import ClusterConfigError, ConfigError
from sparktrain.launchplan.layout import ClusterFacts, LaunchPlan, make_cluster_plan
from sparktrain.node.ray_actor import NodeActor
from sparktrain.ray import keeper

#: How long the placement group may wait for its resources before the launch gives up.
PLACEMENT_SECONDS = 60.0
#: In place: how long a joining node's actor may take to start before the next look retries.
JOIN_SECONDS = 30.0
#: How long a node that went silent is left out of layouts and placements (Ray itself declares
#: an unreachable node dead after its health checks fail, which takes tens of seconds).
AVOID_SECONDS = 120.0
INSTALL_HINT = "backend='ray' needs Ray: pip install 'sparktrain[ray]'"


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` with the install hint."""
    try:
        import ray
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return ray


def connect(address: str | None = None) -> tuple[Any, bool]:
    """The Ray this process uses: the initialised one, else ``ray.init(address=address)``.

    Returns:
        The ``ray`` module, and whether this call started a local Ray (kept by a keeper).
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    # With no address, Ray joins the cluster it finds named in /tmp/ray/ray_current_cluster (the
    # last one started on the machine, dead or not); the documented choice is RAY_ADDRESS, else
    # a Ray of this process's own.
    if address is None and not os.environ.get("RAY_ADDRESS"):
        address = "local"
    ray.init(address=address, log_to_driver=True)
    session = keeper.session_dir(ray)
    if session is not None:
        keeper.watch(session)
    return ray, session is not None


@dataclass(frozen=True)
class RayNode:
    """What one alive Ray node offers (its totals, as Ray counts them)."""

    host: str
    cpus: int
    gpus: int


def cluster_nodes(ray: Any, avoid: Collection[str] = ()) -> list[RayNode]:
    """The alive nodes of the connected cluster, but those on the hosts ``avoid``."""
    return [
        RayNode(
            str(n["NodeManagerAddress"]),
            int(n["Resources"].get("CPU", 0)),
            int(n["Resources"].get("GPU", 0)),
        )
        for n in ray.nodes()
        if n.get("Alive") and str(n["NodeManagerAddress"]) not in avoid
    ]


def make_ray_plan(
    num_processes: object,
    nodes: Sequence[RayNode],
    *,
    use_gpu: object = None,
    name: str = "num_processes",
) -> LaunchPlan:
    """Lay out a run on ``nodes``: the fewest nodes that hold the ranks, as many on each.

    Raises:
        ConfigError: Bad values, GPUs asked for on a cluster without any, or more ranks than
            the nodes hold; the message lists what the nodes offer.
    """
    gpu = use_gpu is True or (use_gpu is None and any(n.gpus for n in nodes))
    if use_gpu is True and not any(n.gpus for n in nodes):
        raise ConfigError(
            "use_gpu=True but no node of the Ray cluster has a GPU (ray.nodes() lists none); "
            "add GPU nodes, or pass use_gpu=False to train on CPU with gloo."
        )
    units = sorted((n.gpus if gpu else n.cpus for n in nodes), reverse=True)
    facts = ClusterFacts(task_gpus=1 if gpu else 0, task_cpus=1, slots=None)
    base = make_cluster_plan(num_processes, facts=facts, use_gpu=use_gpu, name=name)
    world = base.world_size
    for count in range(1, len(units) + 1):
        per = world // count
        if world % count == 0 and units[count - 1] >= per:
            cpus = sorted((n.cpus for n in nodes), reverse=True)[count - 1]
            threads = 1 if gpu else max(1, cpus // per)
            return replace(base, nodes=count, procs_per_node=per, threads_per_rank=threads)
    kind = "GPU" if gpu else "CPU"
    raise ConfigError(
        f"{name}={world} does not fit the Ray cluster: its nodes have {units} {kind}(s) "
        f"and each rank needs one {kind}, the same number of ranks on each node. Lower "
        f"{name}, add nodes" + (", or pass use_gpu=False." if gpu else ".")
    )


def placement(plan: LaunchPlan) -> tuple[list[dict[str, float]], Literal["PACK", "STRICT_SPREAD"]]:
    """The placement group's bundles (one per node) and its strategy."""
    per = plan.procs_per_node
    bundle: dict[str, float] = {"CPU": float(per * plan.threads_per_rank)}
    if plan.device == "cuda":
        bundle = {"CPU": float(per), "GPU": float(per)}
    return [dict(bundle) for _ in range(plan.nodes)], "PACK" if plan.nodes == 1 else "STRICT_SPREAD"


class RayBackend(Backend):
    """One actor per node of a Ray cluster, placed by a placement group."""

    name: ClassVar[str] = "ray"
    in_place: ClassVar[bool] = True

    def __init__(self, *, address: str | None = None) -> None:
        """Join the Ray this process uses, else ``ray.init(address=address)``."""
        self.ray, self.started = connect(address)
        self._lock = threading.Lock()
        #: The resources each running attempt's placement group holds (for :meth:`capacity`).
        self._held: dict[int, dict[str, float]] = {}
        #: Hosts of nodes that went silent, and when: left out until Ray sees them dead.
        self._silent: dict[str, float] = {}

    def avoid(self, hosts: Collection[str]) -> None:
        """Leave the nodes on ``hosts`` out for a while: they went silent (cut off, frozen).

        Ray still counts such a node alive, with its resources free, until its health checks
        have failed; a new placement there would wait for a node that cannot answer.
        """
        with self._lock:
            self._silent.update(dict.fromkeys(hosts, time.monotonic()))

    def avoided(self) -> dict[str, str]:
        """The silent hosts still left out, with their Ray node ids (alive in Ray's view)."""
        with self._lock:
            now = time.monotonic()
            self._silent = {h: t for h, t in self._silent.items() if now - t < AVOID_SECONDS}
            silent = set(self._silent)
        return {
            str(n["NodeManagerAddress"]): str(n["NodeID"])
            for n in self.ray.nodes()
            if n.get("Alive") and str(n["NodeManagerAddress"]) in silent
        }

    def store_host(self) -> str:
        """This process's address as the Ray nodes reach it."""
        return str(self.ray.util.get_node_ip_address())

    def layout(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """The fewest nodes that hold the ranks, as many on each, from the nodes alive now."""
        nodes = cluster_nodes(self.ray, avoid=self.avoided())
        return make_ray_plan(num_processes, nodes, use_gpu=use_gpu, name=name)

    def capacity(self, plan: LaunchPlan) -> int:
        """The ranks the cluster can hold now: its free CPUs (GPUs), plus those our runs hold.

        One rank per CPU (per GPU on GPU runs), as the layout counts them. Read from the free
        resources, which drop a lost node's at once; ``ray.nodes()`` still lists such a node as
        alive until its health checks have failed.
        """
        kind = "GPU" if plan.device == "cuda" else "CPU"
        free = float(self.ray.available_resources().get(kind, 0))
        with self._lock:
            held = sum(bundle.get(kind, 0.0) for bundle in self._held.values())
        silent = self.avoided().values()
        if silent:  # what Ray still counts free on a silent node cannot be used
            from ray._private.state import available_resources_per_node

            free_on = available_resources_per_node()
            free -= sum(float(free_on.get(node, {}).get(kind, 0)) for node in silent)
        return max(0, int(free + held))

    def start(self, attempt: Attempt) -> Nodes:
        """Place the actors, then start every node's ranks."""
        return RayNodes(self.ray, attempt, self)

    def close(self) -> None:
        """Stop the local Ray this backend started, if it did (a joined Ray is left alone)."""
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        self.started = False


class RayNodes(RemoteNodes):
    """The actors of one attempt, their placement group and the reports they returned."""

    def __init__(self, ray: Any, attempt: Attempt, backend: RayBackend | None = None) -> None:
        """Open the channel, place one actor per node and start each node's ranks."""
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        super().__init__(attempt, ray.util.get_node_ip_address())
        self.ray = ray
        self.backend = backend
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
        avoided = backend.avoided() if backend is not None else {}
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
        if ready and self.backend is not None:
            bundles, _ = placement(self.plan)
            held = {k: sum(b.get(k, 0.0) for b in bundles) for k in ("CPU", "GPU")}
            with self.backend._lock:
                self.backend._held[id(self)] = held
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
            if self.backend is not None:
                self.backend.avoid([host])
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
        if self.backend is not None:
            with self.backend._lock:
                self.backend._held.pop(id(self), None)
        super().close()
