"""Start a Ray cluster on the active SparkSession with settings that work, and end all of it.

``ray.util.spark.setup_ray_cluster`` does the starting: a Ray head node on the driver and one Ray
worker node per task of a background Spark job. Out of the box it trips on three things, each
settled here:

- It runs the ``ray`` command found on ``PATH``, which is missing when the interpreter's
  virtualenv is not activated: the interpreter's directory is put first on ``PATH``, for the
  head node and, through Ray's start hook, for every worker node.
- Ray 2.5x turns token authentication on for new clusters, and worker nodes on other machines
  have no token file: ``RAY_AUTH_MODE=disabled`` is set for the head, the workers and this
  process, unless the caller set ``RAY_AUTH_MODE`` themselves. The cluster is then open to
  whoever reaches the driver's network, as Ray clusters were before token authentication.
- Its shutdown leaves helper processes (the nodes' dashboard and runtime-env agents, reparented
  to init, some of which ignore SIGTERM): :meth:`RayOnSpark.shutdown` lists every process of the
  cluster on this machine (by its temporary directory and address, and their descendants)
  before shutting down, waits for them, and kills by PID whatever is left.

The head node's dashboard is off unless asked for (it starts a dozen processes and is slow to
start). This process is connected to the new cluster, so ``launch(..., backend="ray")`` runs on
it; :meth:`RayOnSpark.shutdown` disconnects first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from typing import Any

from sparktrain.errors import ConfigError
from sparktrain.ray import procs

#: How long the cluster's processes get to exit after Ray's shutdown before they are killed.
EXIT_GRACE = 10.0
_HOOK_VARIABLE = "RAY_ON_SPARK_START_HOOK"


class RayOnSpark:
    """A Ray cluster running on a SparkSession; a context manager that shuts it down.

    Attributes:
        address: The head node's ``host:port`` (for ``ray.init(address=...)``).
        client_address: The ``ray://`` address for Ray Client connections.
    """

    def __init__(
        self, address: str, client_address: str, temp_dir: str | None, saved: dict[str, str | None]
    ) -> None:
        self.address = address
        self.client_address = client_address
        self._temp_dir = temp_dir
        self._saved = saved
        self._closed = False

    def processes(self) -> set[procs.Proc]:
        """This machine's processes of the cluster (head, local worker nodes, their helpers)."""
        port = self.address.rsplit(":", 1)[-1]
        return procs.matching([self._temp_dir or "", f"--port={port} ", f":{port} "])

    def shutdown(self) -> None:
        """Disconnect, shut the cluster down, and kill what is left of it on this machine.

        Raises:
            RuntimeError: A process of the cluster could not be killed (its PID is named).
        """
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.util.spark import shutdown_ray_cluster

        found = self.processes()
        if ray.is_initialized():
            ray.shutdown()
        with contextlib.suppress(RuntimeError):  # already shut down
            shutdown_ray_cluster()
        left = procs.end(found | self.processes(), grace=EXIT_GRACE)
        _restore(self._saved)
        if left:
            raise RuntimeError(
                f"processes of the Ray cluster could not be killed: {sorted(p for p, _ in left)}"
            )

    def __enter__(self) -> RayOnSpark:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _environment() -> dict[str, str]:
    """What the head node, the worker nodes and this process need (see the module docstring)."""
    extra: dict[str, str] = {}
    if "RAY_AUTH_MODE" not in os.environ:
        extra["RAY_AUTH_MODE"] = "disabled"
    here = os.path.dirname(sys.executable)
    ray_cli = os.path.join(here, "ray")
    if os.path.exists(ray_cli) and shutil.which("ray") != ray_cli:
        extra["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    return extra


def setup_on_spark(
    *,
    max_worker_nodes: int | None = None,
    num_cpus_worker_node: int | None = None,
    num_gpus_worker_node: int | None = None,
    head_node_options: dict[str, Any] | None = None,
    **options: Any,
) -> RayOnSpark:
    """Start a Ray cluster on the active SparkSession and connect this process to it.

    Args:
        max_worker_nodes: Ray worker nodes to start (``None``: as many as Spark has task slots).
            All of them are started now, not on demand.
        num_cpus_worker_node: CPUs of each worker node (``None``: Ray's choice, from Spark's
            task settings). Give ``num_gpus_worker_node`` with it (Ray requires both or none).
        num_gpus_worker_node: GPUs of each worker node (``0`` for a CPU cluster).
        head_node_options: Extra ``ray start`` options of the head node; the dashboard is off
            unless this has ``include_dashboard=True``.
        **options: Passed to ``ray.util.spark.setup_ray_cluster`` as they are.

    Returns:
        The running cluster; use it as a context manager, or call ``.shutdown()``.

    Raises:
        ConfigError: Ray or pyspark is missing, there is no active SparkSession, or this
            process is already connected to another Ray.
    """
    from sparktrain.driver.ray import import_ray
    from sparktrain.driver.spark import active_session

    ray = import_ray()
    try:
        from ray.util.spark import MAX_NUM_WORKER_NODES, setup_ray_cluster
    except ImportError as exc:  # pragma: no cover - ray without its Spark support
        raise ConfigError(f"Ray on Spark needs ray[default]: {exc}") from None
    active_session()  # a clear error when there is none
    if ray.is_initialized():
        raise ConfigError(
            "this process is already connected to a Ray cluster; call ray.shutdown() before "
            "setup_on_spark(), or launch on that cluster instead."
        )
    from sparktrain.ray import hook

    extra = _environment()
    saved = {name: os.environ.get(name) for name in [*extra, "RAY_ADDRESS", _HOOK_VARIABLE]}
    hook.EXTRA_ENV.clear()
    hook.EXTRA_ENV.update(extra)
    os.environ.update(extra)
    databricks = "DATABRICKS_RUNTIME_VERSION" in os.environ
    os.environ[_HOOK_VARIABLE] = f"sparktrain.ray.hook.{'DatabricksHook' if databricks else 'Hook'}"
    head = {"include_dashboard": False, **(head_node_options or {})}
    try:
        address, client = setup_ray_cluster(
            max_worker_nodes=MAX_NUM_WORKER_NODES if max_worker_nodes is None else max_worker_nodes,
            num_cpus_worker_node=num_cpus_worker_node,
            num_gpus_worker_node=num_gpus_worker_node,
            head_node_options=head,
            **options,
        )
    except BaseException:
        _restore(saved)
        raise
    finally:
        hook_saved = saved.get(_HOOK_VARIABLE)
        if hook_saved is None:
            os.environ.pop(_HOOK_VARIABLE, None)
        else:
            os.environ[_HOOK_VARIABLE] = hook_saved
    from ray.util.spark import cluster_init

    active = getattr(cluster_init, "_active_ray_cluster", None)
    cluster = RayOnSpark(address, client, getattr(active, "temp_dir", None), saved)
    try:
        ray.init(address=address, log_to_driver=True)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
