"""The Ray backend: one actor per node, placed by a placement group, runs the node agent.

Which Ray: the one this process already initialised (``ray.is_initialized()``), else
``ray.init(address=ray_address)``; ``None`` means ``RAY_ADDRESS`` when set, else a local Ray
started for this process. That Ray stays up for the next launch (starting one takes seconds) and
Ray's own exit hook shuts it down when the interpreter exits; ``ray.shutdown()`` stops it sooner.

Layout: ranks go on as few nodes as hold them (intra-node traffic is cheaper), the same number on
each node: one CPU (or one GPU) per rank, and on CPU each rank's share of the node's CPUs. One
node is one bundle in a ``PACK`` group (the local case: one Ray node hosts every rank), several
nodes are bundles of a ``STRICT_SPREAD`` group, one per node. Each bundle holds one
:class:`~sparktrain.node.ray_actor.NodeActor`, which runs the same node code as a Spark task:
ranks forked from a fork server, live lines over the authenticated channel to this driver, stop
on the driver's word, and a :class:`NodeReport` that becomes the caller's result or one error.
Actor 0 binds the rendezvous port on its node before any rank starts.

Cleanup: whatever happens (a failure, a timeout, Ctrl-C), every actor is killed and the
placement group removed before ``run_ray`` returns; a killed actor's fork server sees its socket
close and kills the ranks it started.
"""

from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from sparktrain.driver.monitor import Monitor
from sparktrain.driver.remote import Printer, next_message, task_spec
from sparktrain.driver.results import RunResult, finish_plan
from sparktrain.errors import ConfigError
from sparktrain.node.channel import ChannelServer
from sparktrain.node.ray_actor import NodeActor
from sparktrain.node.report import NodeReport
from sparktrain.node.runner import TaskSpec
from sparktrain.plan.entrypoint import Entrypoint
from sparktrain.plan.layout import DEFAULT_EXIT_GRACE, ClusterFacts, LaunchPlan, make_cluster_plan

#: How long the placement group may wait for its resources before the launch gives up.
PLACEMENT_SECONDS = 60.0
#: After the first failure or Ctrl-C, how long the nodes get to stop their ranks before their
#: actors are killed.
CANCEL_AFTER = 15.0
INSTALL_HINT = "backend='ray' needs Ray: pip install 'sparktrain[ray]'"


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` with the install hint."""
    try:
        import ray
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return ray


def connect(address: str | None = None) -> Any:
    """The Ray this process uses: the initialised one, else ``ray.init(address=address)``."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=True)
    return ray


@dataclass(frozen=True)
class RayNode:
    """What one alive Ray node offers (its totals, as Ray counts them)."""

    host: str
    cpus: int
    gpus: int


def cluster_nodes(ray: Any) -> list[RayNode]:
    """The alive nodes of the connected cluster."""
    return [
        RayNode(
            str(n["NodeManagerAddress"]),
            int(n["Resources"].get("CPU", 0)),
            int(n["Resources"].get("GPU", 0)),
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]


def make_ray_plan(
    num_processes: object,
    nodes: Sequence[RayNode],
    *,
    use_gpu: object = None,
    timeout: object = None,
    log_ranks: Collection[int] | None = None,
    return_all: bool = False,
    max_restarts: object = 0,
    hang_timeout: object = None,
    exit_grace: object = DEFAULT_EXIT_GRACE,
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
    base = make_cluster_plan(
        num_processes,
        facts=ClusterFacts(task_gpus=1 if gpu else 0, task_cpus=1, slots=None),
        use_gpu=use_gpu,
        timeout=timeout,
        log_ranks=log_ranks,
        return_all=return_all,
        max_restarts=max_restarts,
        hang_timeout=hang_timeout,
        exit_grace=exit_grace,
    )
    world = base.world_size
    for count in range(1, len(units) + 1):
        per = world // count
        if world % count == 0 and units[count - 1] >= per:
            cpus = sorted((n.cpus for n in nodes), reverse=True)[count - 1]
            threads = 1 if gpu else max(1, cpus // per)
            return replace(base, nodes=count, procs_per_node=per, threads_per_rank=threads)
    kind = "GPU" if gpu else "CPU"
    raise ConfigError(
        f"num_processes={world} does not fit the Ray cluster: its nodes have {units} {kind}(s) "
        f"and each rank needs one {kind}, the same number of ranks on each node. Lower "
        "num_processes, add nodes" + (", or pass use_gpu=False." if gpu else ".")
    )


def placement(plan: LaunchPlan) -> tuple[list[dict[str, float]], Literal["PACK", "STRICT_SPREAD"]]:
    """The placement group's bundles (one per node) and its strategy."""
    per = plan.procs_per_node
    bundle: dict[str, float] = {"CPU": float(per * plan.threads_per_rank)}
    if plan.device == "cuda":
        bundle = {"CPU": float(per), "GPU": float(per)}
    return [dict(bundle) for _ in range(plan.nodes)], "PACK" if plan.nodes == 1 else "STRICT_SPREAD"


def plan_run(num_processes: object, *, address: str | None, **options: Any) -> LaunchPlan:
    """Connect to Ray (see :func:`connect`) and lay out the run on its nodes."""
    ray = connect(address)
    return make_ray_plan(num_processes, cluster_nodes(ray), **options)


class _Nodes:
    """The actors of one attempt, their placement group and the reports they returned."""

    def __init__(self, ray: Any, plan: LaunchPlan) -> None:
        from ray.util.placement_group import placement_group

        self.ray = ray
        self.plan = plan
        bundles, strategy = placement(plan)
        self.group = placement_group(bundles, strategy=strategy, name=f"sparktrain-{uuid.uuid4()}")
        self.actors: list[Any] = []
        self.pending: dict[Any, int] = {}
        self.reports: dict[int, NodeReport] = {}
        self.pids: list[int] = []
        self.killed: set[int] = set()

    def start(self) -> list[tuple[str, int | None, tuple[str, ...], int]]:
        """Wait for the placement, create one actor per bundle; each says where it runs."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ready, _ = self.ray.wait([self.group.ready()], timeout=PLACEMENT_SECONDS)
        if not ready:
            bundles, strategy = placement(self.plan)
            raise ConfigError(
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
        self.pids = [place[3] for place in places]
        return list(places)

    def run(self, spec: TaskSpec, places: Sequence[tuple[str, int | None, Any, int]]) -> None:
        """Start every node's ranks."""
        import os

        master = (places[0][0], places[0][1] or 0)
        for node, (actor, (host, _, gpus, _)) in enumerate(zip(self.actors, places, strict=True)):
            ref = actor.run.remote(
                spec,
                node=node,
                host=host,
                master=master,
                gpus=gpus,
                caller_threads=os.environ.get("OMP_NUM_THREADS"),
            )
            self.pending[ref] = node

    def poll(self, wait: float) -> list[NodeReport]:
        """Collect the reports of nodes that finished within ``wait`` seconds."""
        if not self.pending:
            return []
        done, _ = self.ray.wait(list(self.pending), num_returns=len(self.pending), timeout=wait)
        new = []
        for ref in done:
            node = self.pending.pop(ref)
            try:
                report = self.ray.get(ref)
            except Exception as exc:  # the actor died: node lost, or killed by its host
                report = self._lost(node, f"its Ray actor died: {type(exc).__name__}: {exc}")
            self.reports[node] = report
            new.append(report)
        return new

    def _lost(self, node: int, why: str, *, stopped: bool = False) -> NodeReport:
        per = self.plan.procs_per_node
        ranks = tuple(range(node * per, (node + 1) * per))
        host = "?"
        return NodeReport(
            node_rank=node, host=host, ranks=ranks, failures={}, values={},
            stopped=ranks if stopped else (),
            agent_error=None if stopped else f"node {node}: {why}"[:2000],
        )  # fmt: skip

    def kill_pending(self) -> None:
        """Kill the actors still running; their ranks count as stopped."""
        for ref, node in list(self.pending.items()):
            with contextlib.suppress(Exception):
                self.ray.kill(self.actors[node], no_restart=True)
            self.reports[node] = self._lost(node, "killed", stopped=True)
            self.killed.add(node)
            del self.pending[ref]

    def close(self) -> None:
        """Kill every actor and remove the placement group."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.group)


def run_ray(
    plan: LaunchPlan,
    entry: Entrypoint,
    *,
    attempt: int = 0,
    extra_env: dict[str, str] | None = None,
    monitor: Monitor | None = None,
) -> RunResult:
    """Run ``entry`` on ``plan.nodes`` actors of the connected Ray cluster."""
    ray = import_ray()
    monitor = monitor or Monitor(progress=False)
    started = time.monotonic()
    channel = ChannelServer(ray.util.get_node_ip_address(), secrets.token_bytes(32))
    nodes = _Nodes(ray, plan)
    try:
        spec = task_spec(plan, entry, channel, attempt=attempt, extra_env=extra_env)
        nodes.run(spec, nodes.start())
        reports = _follow(nodes, channel, plan, monitor)
    finally:
        nodes.close()
        channel.close()
    return finish_plan(reports, plan, started=started, stopped=monitor.stop_requested())


def _follow(
    nodes: _Nodes, channel: ChannelServer, plan: LaunchPlan, monitor: Monitor
) -> list[NodeReport]:
    printer = Printer(plan.log_ranks, monitor)
    cancel_at: float | None = None

    def stop() -> None:
        nonlocal cancel_at
        if cancel_at is None:
            channel.broadcast({"op": "stop"})
            cancel_at = time.monotonic() + CANCEL_AFTER + plan.stop_grace

    try:
        while nodes.pending:
            message = next_message(channel, 0.1)
            while message is not None:
                if printer.handle(message):
                    stop()  # the first failure stops every node
                message = next_message(channel, 0)
            if any(r.agent_error for r in nodes.poll(0)) or monitor.stop_requested():
                stop()
            if cancel_at is not None and time.monotonic() > cancel_at:
                nodes.kill_pending()  # a node did not stop its ranks in time
    except KeyboardInterrupt:
        stop()
        deadline = time.monotonic() + plan.stop_grace + 5.0
        while nodes.pending and time.monotonic() < deadline:
            nodes.poll(0.2)
        raise
    printer.drain(
        channel,
        sum(1 for n, r in nodes.reports.items() if r.agent_error is None and n not in nodes.killed),
    )
    return [nodes.reports[n] for n in sorted(nodes.reports)]
