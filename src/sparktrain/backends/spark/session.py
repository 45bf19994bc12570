"""The Spark session a run uses, on the driver: which one, what kind, and what its cluster offers.

Classic and Spark Connect sessions alike: :func:`active_session` finds the caller's (from any
thread), :func:`cluster_facts` reads the task resources and counts the free task slots (waiting
a moment for executors still registering, :mod:`sparktrain.backends.spark.slots`), and
:func:`channel_host` is the address at which executors reach this process.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from sparktrain.backends.spark.slots import SLOT_WAIT_SECONDS, slot_count, wait_for_slots
from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.layout import ClusterFacts


def active_session() -> Any:
    """The active SparkSession (classic or Connect), or a :class:`ConfigError` saying what to do.

    The active session is per thread in pyspark; from another thread (``sparktrain.tune``'s
    trials, a user's thread pool) the process's default session is used, as
    ``SparkSession.active()`` does.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigError(
            "local_mode=False runs the ranks on Spark, which needs pyspark: "
            "pip install 'sparktrain[spark]'"
        ) from None
    session = SparkSession.getActiveSession() or _default_session(SparkSession)
    if session is None:
        raise ConfigError(
            "local_mode=False needs an active SparkSession; create one first "
            "(SparkSession.builder...getOrCreate()), or pass local_mode=True to run on this "
            "machine."
        )
    return session


def _default_session(classic: Any) -> Any:
    session = None
    with contextlib.suppress(Exception):  # no session at all: pyspark raises
        session = classic.active()
    if session is None:
        with contextlib.suppress(Exception):  # a Spark Connect session made in another thread
            from pyspark.sql.connect.session import SparkSession as ConnectSession

            session = ConnectSession._get_default_session()
    return session


def is_connect(session: Any) -> bool:
    """Whether ``session`` is a Spark Connect session."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def _slots(session: Any, want: int) -> int:
    """The slots, after waiting up to :data:`SLOT_WAIT_SECONDS` for executors to register."""
    return wait_for_slots(lambda: slot_count(session), want, bound=SLOT_WAIT_SECONDS)


def cluster_facts(
    session: Any, num_processes: object = 1, *, count_slots: bool = True
) -> ClusterFacts:
    """GPU and CPU settings of tasks and the number of concurrent task slots.

    When the cluster has fewer slots than ``num_processes`` needs, waits up to
    :data:`SLOT_WAIT_SECONDS` for executors that are still registering. With
    ``count_slots=False`` the slots are not counted (``None``), as over Spark Connect.
    """
    raw = session.conf.get("spark.task.resource.gpu.amount", "0") or "0"
    try:
        task_gpus = float(raw)
    except ValueError:
        raise ConfigError(f"spark.task.resource.gpu.amount={raw!r} is not a number") from None
    if task_gpus != int(task_gpus):
        raise ConfigError(
            f"spark.task.resource.gpu.amount={raw} shares a GPU between tasks; a rank needs a "
            "whole GPU. Set it to a whole number such as 1."
        )
    slots = None
    if count_slots and not is_connect(session):
        want = num_processes if isinstance(num_processes, int) else 1
        slots = _slots(session, -(-want // max(1, int(task_gpus))))
    task_cpus = int(session.conf.get("spark.task.cpus", "1") or "1")
    return ClusterFacts(task_gpus=int(task_gpus), task_cpus=task_cpus, slots=slots)


def channel_host(session: Any) -> str:
    """The address at which executors reach this process.

    The driver's host, or, for Spark Connect, this client's address on the route to the server.
    """
    if not is_connect(session):
        return str(session.conf.get("spark.driver.host", "127.0.0.1"))
    server = str(getattr(session.client, "host", "") or "127.0.0.1")
    if server in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((server, 9))
        return str(probe.getsockname()[0])
