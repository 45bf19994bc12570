"""Start a Ray cluster on the active SparkSession with settings that work, and end all of it.

``ray.util.spark.setup_ray_cluster`` does the starting: a Ray head node on the driver and one Ray
worker node per task of a background Spark job. Out of the box it trips on three things, each
settled here:

- It runs the ``ray`` command found on ``PATH``, which is missing when the interpreter's
  virtualenv is not activated: the interpreter's directory is put first on ``PATH``, for the
  head node and, through Ray's start hook, for every worker node.
- **Authentication.** Ray reads its token authentication settings per process, and Ray on
  Spark gives the head node the driver's environment but the worker nodes only its start hook's:
  left alone, the head, the driver and the worker nodes end up in different modes and cannot
  talk. Here the cluster runs with Ray's token authentication on, by default: a fresh per-cluster
  token (256 bits, Ray's own generator) in a file only this user can read (0600, in a 0700
  folder), named by ``RAY_AUTH_TOKEN_PATH`` for the head and this process, and handed to every
  worker node as ``RAY_AUTH_TOKEN`` through the start hook (never on a command line). A client
  without the token is refused. ``auth="disabled"`` (or ``RAY_AUTH_MODE=disabled`` set by the
  caller) turns it off for the whole cluster, with one warning. The token and its file are gone
  after :meth:`RayOnSpark.shutdown`.
- **Ray on Spark's job server.** Ray's autoscaler starts and ends worker nodes through a plain-HTTP
  server in the driver, which Ray binds to the driver's address and opens to anyone. Here
  (:mod:`sparktrain.ray.job_server`) it listens on ``127.0.0.1`` when Spark's master is
  ``local``, ``local[...]`` or ``local-cluster[...]`` (else on the driver's address, which
  executors on other machines must reach), and it refuses (401) every request without a second
  per-cluster token, which its three clients (the autoscaler, the Spark tasks that start worker
  nodes, this process) send; with ``auth="disabled"`` too. That token's file goes at shutdown.
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
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from sparktrain.backends.ray import procs
from sparktrain.ground.errors import ConfigError
from sparktrain.ray.tokens import write_token

if TYPE_CHECKING:
    from sparktrain.ray.job_server import JobServerGuard

log = logging.getLogger("sparktrain")

#: How long the cluster's processes get to exit after Ray's shutdown before they are killed.
EXIT_GRACE = 10.0
_HOOK_VARIABLE = "RAY_ON_SPARK_START_HOOK"


@dataclass(eq=False)
class RayOnSpark:
    """A Ray cluster running on a SparkSession; a context manager that shuts it down.

    Attributes:
        address: The head node's ``host:port`` (for ``ray.init(address=...)``).
        client_address: The ``ray://`` address for Ray Client connections.
        token_path: The file holding the cluster's token (mode 0600), or ``None`` when
            authentication is off. Another process of this user joins the cluster with
            ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` set to it.
    """

    address: str
    client_address: str
    _temp_dir: str | None = field(repr=False)  # the head node's, to find its processes
    _saved: dict[str, str | None] = field(repr=False)  # the variables to restore at shutdown
    token_path: str | None = None
    _job_server: JobServerGuard | None = field(default=None, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)

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
        if self._job_server is not None:
            self._job_server.close()
        left = procs.end(found | self.processes(), grace=EXIT_GRACE)
        _restore(self._saved)
        _forget_token(self.token_path)
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


_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _path_variable() -> dict[str, str]:
    """``PATH`` with the interpreter's directory first, when its ``ray`` would not be found."""
    here = os.path.dirname(sys.executable)
    ray_cli = os.path.join(here, "ray")
    if os.path.exists(ray_cli) and shutil.which("ray") != ray_cli:
        return {"PATH": here + os.pathsep + os.environ.get("PATH", "")}
    return {}


def _reload_auth() -> None:
    """Make this process's Ray read its authentication settings again (it caches them)."""
    with contextlib.suppress(ImportError):
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def _forget_token(path: str | None) -> None:
    """Make this process forget the cluster's token (its variables restored), then delete it."""
    _reload_auth()
    if path is not None:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _auth_mode(auth: object) -> str:
    if auth is None:
        caller = os.environ.get("RAY_AUTH_MODE", "").strip().lower()
        return "disabled" if caller == "disabled" else "token"
    if auth not in ("token", "disabled"):
        raise ConfigError(f"auth={auth!r} must be 'token' (the default) or 'disabled'.")
    return str(auth)


def _environment(mode: str) -> tuple[dict[str, str], dict[str, str], str | None]:
    """The variables for this process and the head node, and for the worker nodes; the token file.

    See the module docstring.
    """
    here = _path_variable()
    if mode == "disabled":
        log.warning(
            "sparktrain: Ray on Spark starts with authentication off: whoever reaches the "
            "driver's network can submit work to the cluster. Pass auth='token' (the default) "
            "to require the cluster's token."
        )
        off = {"RAY_AUTH_MODE": "disabled"}
        return {**off, **here}, {**off, **here}, None
    token, path = write_token()
    driver = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": path, **here}
    workers = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, **here}
    return driver, workers, path


def _set_environment(extra: dict[str, str], workers: dict[str, str]) -> dict[str, str | None]:
    """Set the cluster's variables; the values to restore.

    ``extra`` are for this process and the head node; ``workers`` for the worker nodes, through
    Ray's start hook.
    """
    from sparktrain.ray import hook

    names = [*extra, *_AUTH_VARIABLES, "RAY_ADDRESS", _HOOK_VARIABLE]
    saved = {name: os.environ.get(name) for name in dict.fromkeys(names)}
    hook.EXTRA_ENV.clear()
    hook.EXTRA_ENV.update(workers)
    for name in _AUTH_VARIABLES:  # a token of the caller's must not win over the cluster's
        os.environ.pop(name, None)
    os.environ.update(extra)
    _reload_auth()
    databricks = "DATABRICKS_RUNTIME_VERSION" in os.environ
    os.environ[_HOOK_VARIABLE] = f"sparktrain.ray.hook.{'DatabricksHook' if databricks else 'Hook'}"
    return saved


def _master() -> str:
    """The active SparkSession's master (``""`` when it has none to tell, as on Spark Connect)."""
    from sparktrain.backends.spark.session import active_session

    try:
        return str(active_session().sparkContext.master)
    except Exception:  # Ray on Spark itself fails on such a session, with its own message
        return ""


def setup_on_spark(
    *,
    max_worker_nodes: int | None = None,
    num_cpus_worker_node: int | None = None,
    num_gpus_worker_node: int | None = None,
    head_node_options: dict[str, Any] | None = None,
    auth: Literal["token", "disabled"] | None = None,
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
        auth: ``"token"``: Ray's token authentication with a fresh per-cluster token;
            ``"disabled"``: none. ``None``: token, unless the caller set
            ``RAY_AUTH_MODE=disabled``. Ray on Spark's job server requires its own token
            either way; with ``"disabled"``, Ray's own ports (the head node's GCS, the Ray
            Client server, the dashboard if asked for, the nodes' raylets) stay open to whoever
            reaches them, and through them anything this user may do, that token's file
            included.
        **options: Passed to ``ray.util.spark.setup_ray_cluster`` as they are.

    Returns:
        The running cluster; use it as a context manager, or call ``.shutdown()``.

    Raises:
        ConfigError: Ray or pyspark is missing, there is no active SparkSession, or this
            process is already connected to another Ray.
    """
    from sparktrain.backends.ray.connect import import_ray
    from sparktrain.backends.spark.session import active_session

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
    from sparktrain.ray.job_server import JobServerGuard, single_host

    extra, workers, token_path = _environment(_auth_mode(auth))
    saved = _set_environment(extra, workers)
    head = {"include_dashboard": False, **(head_node_options or {})}
    guard = None
    try:
        guard = JobServerGuard.install(loopback=single_host(_master()))
        address, client = setup_ray_cluster(
            max_worker_nodes=MAX_NUM_WORKER_NODES if max_worker_nodes is None else max_worker_nodes,
            num_cpus_worker_node=num_cpus_worker_node,
            num_gpus_worker_node=num_gpus_worker_node,
            head_node_options=head,
            **options,
        )
    except BaseException:
        if guard is not None:
            guard.close()
        _restore(saved)
        _forget_token(token_path)
        raise
    finally:
        if guard is not None:
            guard.end_setup()
        hook.EXTRA_ENV.clear()  # the token lives on only in the cluster's processes
        _restore({_HOOK_VARIABLE: saved.get(_HOOK_VARIABLE)})
    from ray.util.spark import cluster_init

    active = getattr(cluster_init, "_active_ray_cluster", None)
    temp_dir = getattr(active, "temp_dir", None)
    cluster = RayOnSpark(address, client, temp_dir, saved, token_path, guard)
    try:
        ray.init(address=address, log_to_driver=True)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
