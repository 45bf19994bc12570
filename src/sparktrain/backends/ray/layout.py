"""A Ray run's layout and placement, pure: the fewest nodes that hold the ranks, as many on each.

One rank per CPU (one per GPU on GPU runs), and on CPU each rank's share of the node's CPUs. One
node is one bundle in a ``PACK`` group (the local case: one Ray node hosts every rank), several
nodes are bundles of a ``STRICT_SPREAD`` group, one per node.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.layout import ClusterFacts, LaunchPlan, make_cluster_plan


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
