"""Pure planning: how many ranks, on which nodes and devices -> a validated :class:`LaunchPlan`.

Every check of user input happens here, before any process starts, and each error names the bad
value and the fix. Nothing here starts a process, opens a socket or reads the environment: the
topology comes in as a value, so plans are cheap to build and test.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from sparktrain.ground.errors import ClusterConfigError, ConfigError
from sparktrain.launchplan.front import GpuSharing
from sparktrain.launchplan.topology import Topology

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """How one run is laid out over nodes and devices (frozen).

    Built by :func:`make_plan` (this machine), :func:`make_cluster_plan` (Spark tasks) or the Ray
    backend's planner. The run's policy (timeouts, restarts, logs) is a separate value,
    :class:`~sparktrain.launchplan.options.RunOptions`.

    Attributes:
        world_size: Total number of ranks.
        nodes: Number of nodes (1 on the local backend).
        procs_per_node: Ranks started on each node.
        device: ``"cuda"`` or ``"cpu"``.
        dist_backend: The process-group backend that suits the device (``nccl`` or ``gloo``).
        gpus: GPU addresses this node's ranks own (empty on CPU, and on clusters, where each
            node learns its own).
        threads_per_rank: Intra-op threads per rank, so that ranks do not oversubscribe the CPUs.
        gpu_shares: On clusters whose tasks run one rank that owns several GPUs
            (``FrontDoor.gpus == "task"``): how many of its task's GPUs each node's rank uses;
            ``None`` when each rank owns one GPU.
    """

    world_size: int
    nodes: int
    procs_per_node: int
    device: Device
    dist_backend: Literal["nccl", "gloo"]
    gpus: tuple[str, ...]
    threads_per_rank: int
    gpu_shares: tuple[int, ...] | None = None

    def describe(self) -> str:
        """One line for logs: ``2 ranks on 1 node, cpu (gloo)``."""
        where = f"{self.nodes} node" + ("s" if self.nodes != 1 else "")
        gpus = f" {','.join(self.gpus)}" if self.gpus else ""
        return f"{self.world_size} ranks on {where}, {self.device}{gpus} ({self.dist_backend})"


def check_count(name: str, value: object) -> int:
    """``value`` as a count of at least 1, or the error naming ``name`` and the fix."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{name}={value!r} ({type(value).__name__}) is not an int; pass a positive integer "
            f"such as {name}=2."
        )
    if value < 1:
        raise ConfigError(f"{name}={value} must be at least 1; pass a positive integer such as 2.")
    return value


def check_use_gpu(use_gpu: object) -> None:
    """Refuse a ``use_gpu`` that is not ``True``, ``False`` or ``None``."""
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise ConfigError(f"use_gpu={use_gpu!r} must be True, False, or None (GPUs if any).")


def _resolve_device(use_gpu: object, world_size: int, topology: Topology, name: str) -> Device:
    check_use_gpu(use_gpu)
    gpus = len(topology.gpus)
    if use_gpu is False or (use_gpu is None and gpus == 0):
        return "cpu"
    if gpus == 0:
        raise ClusterConfigError(
            "use_gpu=True but no GPU is visible on the driver (this process: "
            "torch.cuda.device_count() == 0, CUDA_VISIBLE_DEVICES is empty, or the SparkSession "
            "gives the driver no GPU); pass use_gpu=False to train on CPU with gloo, or run "
            "where a GPU is available."
        )
    if world_size > gpus:
        raise ClusterConfigError(
            f"{name}={world_size} but only {gpus} GPU(s) are visible here "
            f"({', '.join(topology.gpus)}); one rank needs one GPU. Pass {name}<={gpus}, "
            "or use_gpu=False to run the ranks on CPU."
        )
    return "cuda"


def _assemble(
    world_size: int,
    *,
    nodes: int,
    per_node: int,
    device: Device,
    gpus: tuple[str, ...],
    threads: int,
) -> LaunchPlan:
    return LaunchPlan(
        world_size=world_size,
        nodes=nodes,
        procs_per_node=per_node,
        device=device,
        dist_backend="nccl" if device == "cuda" else "gloo",
        gpus=gpus,
        threads_per_rank=threads,
    )


@dataclass(frozen=True, kw_only=True)
class ClusterFacts:
    """What a cluster offers, read before submitting (see :mod:`sparktrain.backends.spark.backend`).

    Attributes:
        task_gpus: ``spark.task.resource.gpu.amount`` (0 when unset).
        task_cpus: ``spark.task.cpus``.
        slots: Tasks the cluster can run at once, or ``None`` when it cannot be asked
            (Spark Connect).
    """

    task_gpus: int
    task_cpus: int
    slots: int | None


def make_cluster_plan(
    num_processes: object,
    *,
    facts: ClusterFacts,
    use_gpu: object = None,
    name: str = "num_processes",
    gpus: GpuSharing = "rank",
) -> LaunchPlan:
    """Lay out a run over cluster tasks: one rank per task on CPU, one per GPU of a task on GPU.

    With ``gpus="task"`` (spark-tensorflow-distributor's workers) each task runs one rank that
    owns a share of the task's GPUs instead: ``num_processes`` GPUs over
    ``ceil(num_processes / spark.task.resource.gpu.amount)`` tasks, shared out as evenly as they
    go (6 GPUs at 4 a task: 2 tasks of 3).

    Args:
        num_processes: Number of ranks (with ``gpus="task"`` on GPUs: number of GPUs).
        facts: What the cluster offers.
        use_gpu: ``True`` (GPUs, error without), ``False`` (CPU), ``None`` (GPUs if tasks get
            some).
        name: What the caller's front door calls the number of ranks, for messages.
        gpus: How ranks own their task's GPUs (see :mod:`sparktrain.launchplan.front`).

    Raises:
        ConfigError: Bad values; :class:`ClusterConfigError` for GPUs asked for but not
            configured, a count that is not a multiple of the GPUs per task, or more tasks than
            the cluster can run at once.
    """
    world_size = check_count(name, num_processes)
    check_use_gpu(use_gpu)
    device: Device = "cuda" if use_gpu or (use_gpu is None and facts.task_gpus > 0) else "cpu"
    per_task, shares = 1, None
    if device == "cuda":
        if facts.task_gpus < 1:
            raise ClusterConfigError(
                "use_gpu=True but spark.task.resource.gpu.amount is unset, so Spark gives tasks "
                "no GPU; create the session with spark.task.resource.gpu.amount=1 (and "
                "spark.executor.resource.gpu.amount), or pass use_gpu=False."
            )
        if gpus == "task":
            tasks = -(-world_size // facts.task_gpus)
            shares = tuple(world_size // tasks + (i < world_size % tasks) for i in range(tasks))
        else:
            per_task = facts.task_gpus
            if world_size % per_task:
                raise ClusterConfigError(
                    f"{name}={world_size} is not a multiple of spark.task.resource.gpu.amount"
                    f"={per_task}: each task runs one rank per GPU it gets. Pass a multiple of "
                    f"{per_task}."
                )
    tasks = len(shares) if shares else world_size // per_task
    plan = _assemble(
        tasks * per_task,
        nodes=tasks,
        per_node=per_task,
        device=device,
        gpus=(),
        threads=max(1, facts.task_cpus // per_task),
    )
    plan = dataclasses.replace(plan, gpu_shares=shares)
    check_slots(plan, facts, facts.slots, name=name)
    return plan


def asked_count(plan: LaunchPlan) -> int:
    """The number the caller asked for: ranks, or GPUs where a task's rank owns several."""
    return sum(plan.gpu_shares) if plan.gpu_shares else plan.world_size


def check_slots(
    plan: LaunchPlan, facts: ClusterFacts, slots: int | None, *, name: str, note: str = ""
) -> None:
    """Refuse ``plan`` when its barrier tasks outnumber ``slots`` (``None``: not known).

    Args:
        plan: The run's layout (one barrier task per node).
        facts: The cluster's task settings (for the GPUs each task gets).
        slots: The task slots free now.
        name: What the caller's front door calls the number of ranks.
        note: Said after the slots (how long the run waited for them, how far the cluster grows).

    Raises:
        ClusterConfigError: Names the ranks asked for, the tasks, the slots and the fix.
    """
    if slots is None or plan.nodes <= slots:
        return
    gpu_note = f" ({facts.task_gpus} GPU(s) each)" if plan.device == "cuda" else ""
    raise ClusterConfigError(
        f"{name}={asked_count(plan)} needs {plan.nodes} barrier tasks{gpu_note} running at once, "
        f"but the cluster has {slots} task slot(s) now{note}; a barrier stage would wait or "
        f"fail. Lower {name}, or add executors/cores (or GPUs)."
    )


def make_plan(
    num_processes: object,
    *,
    topology: Topology,
    use_gpu: object = None,
    name: str = "num_processes",
) -> LaunchPlan:
    """Validate the caller's intent against ``topology`` and lay out a single-node run.

    Args:
        num_processes: Number of ranks; a positive int.
        topology: The node's resources (see :func:`sparktrain.launchplan.topology.detect_local`).
        use_gpu: ``True`` (GPUs, error without), ``False`` (CPU), ``None`` (GPUs if any).
        name: What the caller's front door calls the number of ranks, for messages.

    Raises:
        ConfigError: A value is out of range; the message says which and what to pass instead.
    """
    world_size = check_count(name, num_processes)
    device = _resolve_device(use_gpu, world_size, topology, name)
    return _assemble(
        world_size,
        nodes=1,
        per_node=world_size,
        device=device,
        gpus=topology.gpus[:world_size] if device == "cuda" else (),
        threads=max(1, topology.cpus // world_size),
    )
