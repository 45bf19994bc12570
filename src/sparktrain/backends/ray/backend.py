"""The Ray backend: one actor per node, placed by a placement group, runs the node agent.

Which Ray: :func:`~sparktrain.backends.ray.connect.connect` (the one this process initialised,
one it joins, or a local one started for it and stopped when ``launch`` returns). The layout
(:mod:`sparktrain.backends.ray.layout`) puts the ranks on as few nodes as hold them, the same
number on each; each attempt's nodes (:mod:`sparktrain.backends.ray.nodes`) are one actor per
bundle of a placement group, running the same node code as a Spark task. The backend itself
keeps what outlives an attempt: what our placement groups hold (counted as capacity), and the
hosts of nodes that went silent (left out of layouts and placements until Ray sees them dead).

Cleanup: whatever happens (a failure, a timeout, Ctrl-C), every actor is killed and the
placement group removed when the attempt's nodes close; a killed actor's fork server sees its
socket close and kills the ranks it started.
"""

from __future__ import annotations

from typing import ClassVar

from sparktrain.backends.base import Attempt, Backend, Nodes, Wanted
from sparktrain.backends.ray.connect import connect
from sparktrain.backends.ray.held import Held
from sparktrain.backends.ray.layout import cluster_nodes, make_ray_plan
from sparktrain.backends.ray.nodes import RayNodes
from sparktrain.launchplan.layout import LaunchPlan


class RayBackend(Backend):
    """One actor per node of a Ray cluster, placed by a placement group."""

    name: ClassVar[str] = "ray"
    in_place: ClassVar[bool] = True

    def __init__(self, *, address: str | None = None) -> None:
        """Join the Ray this process uses, else ``ray.init(address=address)``."""
        self.ray, self.started = connect(address)
        #: What our attempts hold (counted as capacity) and the silent hosts left out.
        self.held = Held(self.ray)

    @classmethod
    def open(cls, wanted: Wanted) -> Backend:
        """Join the Ray this process uses, else ``ray.init(address=wanted.address)``."""
        return cls(address=wanted.address)

    def store_host(self) -> str:
        """This process's address as the Ray nodes reach it."""
        return str(self.ray.util.get_node_ip_address())

    def layout(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """The fewest nodes that hold the ranks, as many on each, from the nodes alive now."""
        nodes = cluster_nodes(self.ray, avoid=self.held.avoided())
        return make_ray_plan(num_processes, nodes, use_gpu=use_gpu, name=name)

    def capacity(self, plan: LaunchPlan) -> int:
        """The ranks the cluster can hold now: its free CPUs (GPUs), plus those our runs hold.

        One rank per CPU (per GPU on GPU runs), as the layout counts them. Read from the free
        resources, which drop a lost node's at once; ``ray.nodes()`` still lists such a node as
        alive until its health checks have failed.
        """
        kind = "GPU" if plan.device == "cuda" else "CPU"
        free = float(self.ray.available_resources().get(kind, 0))
        held = self.held.total(kind)
        silent = self.held.avoided().values()
        if silent:  # what Ray still counts free on a silent node cannot be used
            from ray._private.state import available_resources_per_node

            free_on = available_resources_per_node()
            free -= sum(float(free_on.get(node, {}).get(kind, 0)) for node in silent)
        return max(0, int(free + held))

    def start(self, attempt: Attempt) -> Nodes:
        """Place the actors, then start every node's ranks."""
        return RayNodes(self.ray, attempt, self.held)

    def close(self) -> None:
        """Stop the local Ray this backend started, if it did (a joined Ray is left alone)."""
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        self.started = False
