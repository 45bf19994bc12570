"""Pure planning: user intent + topology -> a validated :class:`LaunchPlan`.

Every check of user input happens here, before any process starts, and each error names the bad
value and the fix. Nothing here starts a process, opens a socket or reads the environment: the
topology comes in as a value, so plans are cheap to build and test.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from sparktrain.errors import ConfigError
from sparktrain.plan.topology import Topology

Device = Literal["cpu", "cuda"]
#: Seconds a rank that has returned (or raised) gets to exit before it is killed.
DEFAULT_EXIT_GRACE = 10.0


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """How one run is laid out. Frozen; built by :func:`make_plan`.

    Attributes:
        world_size: Total number of ranks.
        nodes: Number of nodes (1 on the local backend).
        procs_per_node: Ranks started on each node.
        device: ``"cuda"`` or ``"cpu"``.
        dist_backend: The process-group backend that suits the device (``nccl`` or ``gloo``).
        gpus: GPU addresses this node's ranks own (empty on CPU).
        threads_per_rank: Intra-op threads per rank, so that ranks do not oversubscribe the CPUs.
        timeout: Seconds after which the run is stopped, or ``None``.
        log_ranks: Ranks whose output is shown, or ``None`` for all.
        return_all: Whether every rank's return value comes back (else rank 0's only).
        stop_grace: Seconds between SIGTERM and SIGKILL when ranks are stopped.
        max_restarts: How many times the whole group is started again after a failure.
        hang_timeout: Seconds without progress from any rank (output or ``report()``) after
            which the run is declared hung, or ``None``.
        exit_grace: Seconds a rank that has returned (or raised) gets to exit before it is
            killed; its outcome stands.
    """

    world_size: int
    nodes: int
    procs_per_node: int
    device: Device
    dist_backend: Literal["nccl", "gloo"]
    gpus: tuple[str, ...]
    threads_per_rank: int
    timeout: float | None = None
    log_ranks: frozenset[int] | None = None
    return_all: bool = False
    stop_grace: float = 3.0
    max_restarts: int = 0
    hang_timeout: float | None = None
    exit_grace: float = DEFAULT_EXIT_GRACE

    def shows(self, rank: int) -> bool:
        """Whether ``rank``'s output is shown to the caller."""
        return self.log_ranks is None or rank in self.log_ranks

    def describe(self) -> str:
        """One line for logs: ``2 ranks on 1 node, cpu (gloo)``."""
        where = f"{self.nodes} node" + ("s" if self.nodes != 1 else "")
        gpus = f" {','.join(self.gpus)}" if self.gpus else ""
        return f"{self.world_size} ranks on {where}, {self.device}{gpus} ({self.dist_backend})"


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{name}={value!r} ({type(value).__name__}) is not an int; pass a positive integer "
            f"such as {name}=2."
        )
    if value < 1:
        raise ConfigError(f"{name}={value} must be at least 1; pass a positive integer such as 2.")
    return value


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(
            f"timeout={timeout!r} must be a positive number of seconds, or None for no limit."
        )
    if math.isinf(timeout):
        return None
    return float(timeout)


def _check_restarts(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"max_restarts={value!r} must be a whole number >= 0 (0: fail at the first failure)."
        )
    return value


def _check_hang_timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"hang_timeout={value!r} must be a positive number of seconds, or None to not watch."
        )
    return None if math.isinf(value) else float(value)


def _check_exit_grace(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(
            f"exit_grace={value!r} must be a positive number of seconds: how long a rank that "
            f"has returned may take to exit before it is killed (default {DEFAULT_EXIT_GRACE:g})."
        )
    return float(value)


def _check_log_ranks(log_ranks: Collection[int] | None, world_size: int) -> frozenset[int] | None:
    if log_ranks is None:
        return None
    if isinstance(log_ranks, (str, bytes)) or not isinstance(log_ranks, Collection):
        raise ConfigError(
            f"log_ranks={log_ranks!r} must be a collection of ranks such as [0] or None for all."
        )
    bad: list[object] = [
        r
        for r in log_ranks
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size
    ]
    if bad:
        raise ConfigError(
            f"log_ranks={sorted(log_ranks, key=repr)!r} names {bad!r}, not ranks of this run "
            f"(0 to {world_size - 1}); pass ranks in that range, or None to show all."
        )
    return frozenset(log_ranks)


def _resolve_device(use_gpu: object, world_size: int, topology: Topology) -> Device:
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise ConfigError(
            f"use_gpu={use_gpu!r} must be True, False, or None (GPUs when CUDA is available)."
        )
    gpus = len(topology.gpus)
    if use_gpu is False or (use_gpu is None and gpus == 0):
        return "cpu"
    if gpus == 0:
        raise ConfigError(
            "use_gpu=True but no GPU is visible to this process (torch.cuda.device_count() == 0 "
            "or CUDA_VISIBLE_DEVICES is empty); pass use_gpu=False to train on CPU with gloo, "
            "or run where a GPU is available."
        )
    if world_size > gpus:
        raise ConfigError(
            f"num_processes={world_size} but only {gpus} GPU(s) are visible here "
            f"({', '.join(topology.gpus)}); one rank needs one GPU. Pass num_processes<={gpus}, "
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
    timeout: object,
    log_ranks: Collection[int] | None,
    return_all: bool,
    max_restarts: object,
    hang_timeout: object,
    exit_grace: object = DEFAULT_EXIT_GRACE,
) -> LaunchPlan:
    """The plan, with the checks every layout shares (timeout, log filter, failure policy)."""
    return LaunchPlan(
        world_size=world_size,
        nodes=nodes,
        procs_per_node=per_node,
        device=device,
        dist_backend="nccl" if device == "cuda" else "gloo",
        gpus=gpus,
        threads_per_rank=threads,
        timeout=_check_timeout(timeout),
        log_ranks=_check_log_ranks(log_ranks, world_size),
        return_all=bool(return_all),
        max_restarts=_check_restarts(max_restarts),
        hang_timeout=_check_hang_timeout(hang_timeout),
        exit_grace=_check_exit_grace(exit_grace),
    )


@dataclass(frozen=True, kw_only=True)
class ClusterFacts:
    """What a cluster offers, read before submitting (see :mod:`sparktrain.driver.spark`).

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
    timeout: object = None,
    log_ranks: Collection[int] | None = None,
    return_all: bool = False,
    max_restarts: object = 0,
    hang_timeout: object = None,
    exit_grace: object = DEFAULT_EXIT_GRACE,
) -> LaunchPlan:
    """Lay out a run over cluster tasks: one rank per task on CPU, one per GPU of a task on GPU.

    Raises:
        ConfigError: Bad values, GPUs asked for but not configured, ``num_processes`` not a
            multiple of the GPUs per task, or more tasks than the cluster can run at once.
    """
    world_size = _check_count("num_processes", num_processes)
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise ConfigError(f"use_gpu={use_gpu!r} must be True, False, or None.")
    device: Device = "cuda" if use_gpu or (use_gpu is None and facts.task_gpus > 0) else "cpu"
    per_task = 1
    if device == "cuda":
        if facts.task_gpus < 1:
            raise ConfigError(
                "use_gpu=True but spark.task.resource.gpu.amount is unset, so Spark gives tasks "
                "no GPU; create the session with spark.task.resource.gpu.amount=1 (and "
                "spark.executor.resource.gpu.amount), or pass use_gpu=False."
            )
        per_task = facts.task_gpus
        if world_size % per_task:
            raise ConfigError(
                f"num_processes={world_size} is not a multiple of spark.task.resource.gpu.amount"
                f"={per_task}: each task runs one rank per GPU it gets. Pass a multiple of "
                f"{per_task}."
            )
    tasks = world_size // per_task
    if facts.slots is not None and tasks > facts.slots:
        gpu_note = f" ({per_task} GPU(s) each)" if device == "cuda" else ""
        raise ConfigError(
            f"num_processes={world_size} needs {tasks} barrier tasks{gpu_note} running at once, "
            f"but the cluster has {facts.slots} task slot(s) now; a barrier stage would wait or "
            "fail. Lower num_processes, or add executors/cores (or GPUs)."
        )
    return _assemble(
        world_size,
        nodes=tasks,
        per_node=per_task,
        device=device,
        gpus=(),
        threads=max(1, facts.task_cpus // per_task),
        timeout=timeout,
        log_ranks=log_ranks,
        return_all=return_all,
        max_restarts=max_restarts,
        hang_timeout=hang_timeout,
        exit_grace=exit_grace,
    )


def make_plan(
    num_processes: object,
    *,
    topology: Topology,
    use_gpu: object = None,
    timeout: object = None,
    log_ranks: Collection[int] | None = None,
    return_all: bool = False,
    max_restarts: object = 0,
    hang_timeout: object = None,
    exit_grace: object = DEFAULT_EXIT_GRACE,
) -> LaunchPlan:
    """Validate the caller's intent against ``topology`` and lay out a single-node run.

    Args:
        num_processes: Number of ranks; a positive int.
        topology: The node's resources (see :func:`sparktrain.plan.topology.detect_local`).
        use_gpu: ``True`` (GPUs, error without), ``False`` (CPU), ``None`` (GPUs if any).
        timeout: Seconds before the run is stopped, or ``None``.
        log_ranks: Ranks whose output to show, or ``None`` for all.
        return_all: Bring back every rank's return value, not only rank 0's.
        max_restarts: Restarts of the whole group allowed after a failure.
        hang_timeout: Seconds without progress before the run is declared hung.
        exit_grace: Seconds a rank that has returned gets to exit before it is killed.

    Raises:
        ConfigError: A value is out of range; the message says which and what to pass instead.
    """
    world_size = _check_count("num_processes", num_processes)
    device = _resolve_device(use_gpu, world_size, topology)
    return _assemble(
        world_size,
        nodes=1,
        per_node=world_size,
        device=device,
        gpus=topology.gpus[:world_size] if device == "cuda" else (),
        threads=max(1, topology.cpus // world_size),
        timeout=timeout,
        log_ranks=log_ranks,
        return_all=return_all,
        max_restarts=max_restarts,
        hang_timeout=hang_timeout,
        exit_grace=exit_grace,
    )
