"""What every node of one attempt is given: :class:`NodeSpec`, built once by the driver.

The spec travels to each node as one pickled value (a Spark task's closure, a Ray actor call, or
an argument in the caller's own process) and holds everything a node needs to start its ranks:
the layout it belongs to, the payload, the run's options (less the caller's callback), and for
remote nodes the driver's channel. Each node adds only what it learns where it runs: its index,
its host, its GPUs and the rendezvous address.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sparktrain.launchplan.entrypoint import Entrypoint, FunctionEntry, ScriptEntry
from sparktrain.launchplan.layout import LaunchPlan
from sparktrain.launchplan.options import RunOptions


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """One attempt of a run, as every node sees it.

    Attributes:
        run_id: Identifier of the attempt (``TORCHELASTIC_RUN_ID``).
        world_size: Ranks in the run.
        procs_per_node: Ranks on each node.
        use_gpu: Whether ranks own GPUs (those the node was given).
        threads: Intra-op threads per rank.
        payload: The pickled function and arguments, or ``None`` for a script.
        script: The script, or ``None`` for a function.
        keep: Ranks whose return values come back.
        data_uri: Where Spark cached the run's DataFrame (``train_on_dataframe``), or ``None``.
        attempt: The attempt number (0 at first).
        options: The run's options, without the caller's ``on_report``.
        extra_env: Variables of other contracts for every rank (MLflow's run).
        channel: The driver's channel address (``None`` for a node in the caller's process).
        secret: The attempt's secret for the channel.
        gpu_shares: GPUs of each node's one rank, when a rank owns several (see
            ``LaunchPlan.gpu_shares``); ``None``: one GPU per rank.
        target_world_size: In an elastic run, the size it was launched at (this attempt may
            run fewer ranks); ``None`` when the run is not elastic.
    """

    run_id: str
    world_size: int
    procs_per_node: int
    use_gpu: bool
    threads: int
    payload: bytes | None
    script: ScriptEntry | None
    keep: frozenset[int]
    data_uri: str | None
    attempt: int
    options: RunOptions
    extra_env: dict[str, str] | None = None
    channel: tuple[str, int] | None = None
    secret: bytes | None = None
    gpu_shares: tuple[int, ...] | None = None
    target_world_size: int | None = None

    @property
    def nodes(self) -> int:
        """How many nodes the run has."""
        return self.world_size // self.procs_per_node

    def ranks_of(self, node: int) -> range:
        """The global ranks that ``node`` runs."""
        return range(node * self.procs_per_node, (node + 1) * self.procs_per_node)


@dataclass(frozen=True)
class Place:
    """What a node learns where it runs, and adds to the spec.

    Attributes:
        node: This node's index.
        host: This node's address (for log prefixes and the report).
        master: Host and port of the rendezvous store (node 0's bound socket).
        gpus: GPU addresses this node's ranks own (one each, or the node's one rank all of
            them), empty on CPU.
        address: The address by which the other nodes reach this one; its interface is the one
            gloo and NCCL bind to (:mod:`sparktrain.node.interfaces`). Empty: the rendezvous
            host's, as when every node runs on this machine.
        joining: This node joins a running in-place group (its ranks ask in and heal from a
            live peer) instead of starting with the others.
        memory: A folder in this node's host memory that outlives the run's attempts, where
            its ranks keep the newest checkpoint's parts (recovery from memory); empty where
            the node has none (its processes end with the attempt).
    """

    node: int
    host: str
    master: tuple[str, int]
    gpus: tuple[str, ...] = ()
    address: str = ""
    joining: bool = False
    memory: str = ""


def node_spec(
    plan: LaunchPlan,
    options: RunOptions,
    entry: Entrypoint,
    *,
    attempt: int,
    extra_env: dict[str, str] | None = None,
    data_uri: str | None = None,
    channel: tuple[str, int] | None = None,
    secret: bytes | None = None,
    target_world_size: int | None = None,
) -> NodeSpec:
    """The spec of one attempt of ``plan`` running ``entry`` under ``options``."""
    function = isinstance(entry, FunctionEntry)
    keep = frozenset(range(plan.world_size)) if options.output.return_all else frozenset({0})
    return NodeSpec(
        run_id=uuid.uuid4().hex[:12],
        world_size=plan.world_size,
        procs_per_node=plan.procs_per_node,
        use_gpu=plan.device == "cuda",
        threads=plan.threads_per_rank,
        payload=entry.payload if isinstance(entry, FunctionEntry) else None,
        script=entry if isinstance(entry, ScriptEntry) else None,
        keep=keep if function else frozenset(),
        data_uri=data_uri,
        attempt=attempt,
        options=options.for_nodes(),
        extra_env=extra_env,
        channel=channel,
        secret=secret,
        gpu_shares=plan.gpu_shares,
        target_world_size=target_world_size,
    )
