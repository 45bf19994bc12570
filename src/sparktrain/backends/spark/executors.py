"""The driver's word to Spark about executors it knows are gone before Spark does.

Spark notices an executor it cannot reach only after ``spark.network.timeout`` (120 s by
default; 87 s in one partition tried here), and until then counts its slots. A node whose
channel went silent for the run's ``heartbeat_timeout`` is cut off: :func:`forget_hosts` asks
Spark to remove the executors on its host at once (``SparkContext.killExecutor``), so that the
capacity an elastic run reads next, and the barrier stage it submits, leave them out. The
application's executor target is requested back (``requestExecutors``), so that a worker that
returns, or a new one, gets an executor again and the run can grow back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Any


def executors_on(session: Any, hosts: Collection[str]) -> list[str]:
    """The ids of the live executors whose address is on one of ``hosts``."""
    summaries = session.sparkContext._jsc.sc().statusStore().executorList(True)
    found = []
    for index in range(summaries.size()):
        summary = summaries.apply(index)
        executor, host = str(summary.id()), str(summary.hostPort()).rsplit(":", 1)[0]
        if executor != "driver" and host in hosts:
            found.append(executor)
    return found


def forget_hosts(session: Any, hosts: Collection[str]) -> list[str]:
    """Remove the executors on ``hosts`` from Spark's scheduling now; the ids removed.

    Does nothing over Spark Connect (the client cannot reach the scheduler) or when Spark
    refuses (dynamic allocation on: it manages executors itself).
    """
    from sparktrain.backends.spark.session import is_connect

    if not hosts or is_connect(session):
        return []
    removed: list[str] = []
    with contextlib.suppress(Exception):  # py4j errors: Spark then finds out by itself
        sc = session.sparkContext._jsc.sc()
        for executor in executors_on(session, hosts):
            if sc.killExecutor(executor):
                removed.append(executor)
        if removed:
            sc.requestExecutors(len(removed))
    return removed


def decommissioned(session: Any, executors: Collection[str]) -> list[str]:
    """The ``executors`` Spark is decommissioning (``spark.decommission.enabled``; classic).

    Spark tells a running task nothing when its executor is decommissioned (the task runs on,
    and the executor exits once its tasks end); the driver's scheduler knows within about a
    second (``TaskSchedulerImpl.isExecutorDecommissioned``, Spark 3.1 and later).
    """
    scheduler = session.sparkContext._jsc.sc().taskScheduler()
    return [e for e in executors if bool(scheduler.isExecutorDecommissioned(e))]
