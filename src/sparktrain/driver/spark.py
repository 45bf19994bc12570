"""The Spark backend: one barrier stage whose tasks are the run's nodes.

The driver checks the cluster before submitting (GPU settings, concurrent task slots), opens an
authenticated channel for live logs and stop requests, and runs
``spark.range(tasks).mapInArrow(run_node, barrier=True)`` (or the user's DataFrame, split into
as many partitions) in a helper thread, tagged so that it can be cancelled. The follow loop
polls it: every rank's lines are printed as they arrive (``[rank 1 host] ...``), every node is
told to stop at the first failure, and the nodes' reports become a result or one error, never a
Py4J wall of text. The same code serves classic and Spark Connect sessions.
"""

from __future__ import annotations

import contextlib
import re
import socket
import sys
import threading
import time
from typing import Any, ClassVar

import cloudpickle

from sparktrain.contract.report import NodeReport
from sparktrain.contract.spec import NodeSpec
from sparktrain.driver.backend import Attempt, Backend, Nodes, Polled
from sparktrain.driver.monitor import say
from sparktrain.driver.remote import RemoteNodes
from sparktrain.driver.spark_conf import check_encryption
from sparktrain.driver.spark_executors import decommissioned, forget_hosts
from sparktrain.driver.spark_slots import (
    SLOT_WAIT_SECONDS,
    ensure_slots,
    slot_count,
    wait_for_slots,
)
from sparktrain.errors import ClusterError, ConfigError
from sparktrain.launchplan.front import LAUNCH, FrontDoor
from sparktrain.launchplan.layout import ClusterFacts, LaunchPlan, make_cluster_plan
from sparktrain.node.spark_task import run_node

SCHEMA = "node long, report binary"
#: In place: how often the driver asks Spark which of the run's executors it decommissions.
DECOMMISSION_LOOK_SECONDS = 1.0


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


def _channel_host(session: Any) -> str:
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


_PYTHON_ERROR = re.compile(
    r"(?s)Traceback \(most recent call last\):\n.*?\n(\w[\w.]*(?:Error|Exception)\b[^\n]*)"
)
_JOB_ERRORS = (
    r"(ExecutorLostFailure[^\n]*)",
    r"(BarrierJobSlotsNumberCheckFailed[^\n]*)",
    r"Job aborted due to stage failure: ([^\n]*)",
    r"(SparkException: [^\n]*)",
)


def summarise_job_error(exc: BaseException) -> str:
    """The one line of a Spark job failure worth showing (not the Java stack)."""
    text = str(exc)
    python = _PYTHON_ERROR.search(text)
    if python:
        return f"a task raised {python.group(1)}:\n{python.group(0)}"[:4000] + _missing_hint(text)
    for pattern in _JOB_ERRORS:
        found = re.search(pattern, text)
        if found:
            return found.group(1)[:500]
    return text.splitlines()[0][:500] if text else type(exc).__name__


def _missing_hint(text: str) -> str:
    """What to do when the executors' Python lacks sparktrain or torch."""
    missing = re.search(r"No module named '(sparktrain|torch|cloudpickle)'", text)
    if not missing:
        return ""
    return (
        f"\nThe executors' Python has no {missing.group(1)}: install sparktrain and torch where "
        "the executors run (the cluster's libraries), or, with a local master, point Spark at "
        f"this interpreter before the SparkSession is built: os.environ['PYSPARK_PYTHON'] = "
        f"{sys.executable!r} (the conf spark.pyspark.python is not enough there)"
    )


class _Job:
    """The barrier job, run in a helper thread so the caller's thread can print and cancel."""

    def __init__(self, session: Any, frame: Any, spec: NodeSpec) -> None:
        self.session = session
        self.frame = frame
        self.spec = spec
        self.tag = f"sparktrain-{spec.run_id}"
        self.rows: list[Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="sparktrain-spark-job", daemon=True)

    def _run(self) -> None:
        fn = _bind(run_node, self.spec)
        try:
            self.session.addTag(self.tag)
            try:
                self.rows = self.frame.mapInArrow(fn, SCHEMA, barrier=True).collect()
            finally:
                self.session.removeTag(self.tag)
        except BaseException as exc:
            self.error = exc

    def cancel(self) -> None:
        with contextlib.suppress(Exception):
            self.session.interruptTag(self.tag)


def _bind(fn: Any, spec: NodeSpec) -> Any:
    def task(batches: Any) -> Any:
        return fn(spec, batches)

    return task


class SparkBackend(Backend):
    """One barrier task per node on the active SparkSession's executors."""

    name: ClassVar[str] = "spark"
    in_place: ClassVar[bool] = True  # notices (decommissioning); a sudden loss restarts

    def __init__(self, session: Any = None, *, front: FrontDoor = LAUNCH) -> None:
        """Use ``session``, or the active SparkSession (a :class:`ConfigError` without one).

        ``front``: the front door launching (its TLS-override conf, how ranks own GPUs).
        """
        self.session = session if session is not None else active_session()
        self.front = front

    def store_host(self) -> str:
        """The address at which executors reach this process."""
        return _channel_host(self.session)

    def layout(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """One rank per task on CPU, one per GPU of a task on GPU; checks the free slots."""
        facts = cluster_facts(self.session, num_processes)
        return make_cluster_plan(
            num_processes, facts=facts, use_gpu=use_gpu, name=name, gpus=self.front.gpus
        )

    def capacity(self, plan: LaunchPlan) -> int:
        """The ranks the executors registered now can run at once (Spark Connect: ``plan``'s).

        The slots of the default resource profile (cores, or GPUs, over the task's share),
        counted without waiting: an elastic run never waits for lost executors.
        """
        if is_connect(self.session):  # the server's scheduler cannot be asked
            return plan.world_size
        return slot_count(self.session) * plan.procs_per_node

    def layout_ahead(self, num_processes: object, *, use_gpu: object, name: str) -> LaunchPlan:
        """:meth:`layout` from the session's settings alone: :meth:`check_room` counts the slots."""
        facts = cluster_facts(self.session, num_processes, count_slots=False)
        return make_cluster_plan(
            num_processes, facts=facts, use_gpu=use_gpu, name=name, gpus=self.front.gpus
        )

    def check_room(self, plan: LaunchPlan, *, name: str) -> None:
        """Refuse ``plan`` when its tasks outnumber the free slots, after waiting where it helps.

        On a cluster that can grow (dynamic allocation, Databricks autoscaling) the wait is up to
        :data:`~sparktrain.driver.spark_slots.GROW_WAIT_SECONDS`, with one line saying so; see
        :mod:`sparktrain.driver.spark_slots`. Spark Connect cannot be asked: nothing is checked.
        """
        if not is_connect(self.session):
            facts = cluster_facts(self.session, count_slots=False)
            ensure_slots(self.session, plan, facts, name=name)

    def start(self, attempt: Attempt) -> Nodes:
        """Refuse a TLS cluster without the override, then submit the barrier job."""
        check_encryption(self.session, self.front)
        return SparkNodes(self.session, attempt)


class SparkNodes(RemoteNodes):
    """The barrier job of one attempt."""

    def __init__(self, session: Any, attempt: Attempt) -> None:
        """Open the channel and submit the job (it runs in a helper thread)."""
        super().__init__(attempt, _channel_host(session))
        self.session = session
        self.monitor = attempt.monitor
        self._next_look = 0.0
        try:
            plan = attempt.plan
            frame = session.range(0, plan.nodes, 1, plan.nodes)
            self.job = _Job(session, frame, self.spec)
            self.cancelled = False
            self.job.thread.start()
        except BaseException:
            self.channel.close()
            raise

    def poll(self, wait: float) -> Polled:
        """Show what the nodes sent; once the job has ended, its nodes' reports (or its error).

        A node lost (its executor gone) cancels the job at once: Spark would otherwise resubmit
        the barrier stage and wait for slots that may never return. A node lost by silence (cut
        off) also has its host's executors removed, which Spark would do only minutes later.
        """
        if self.job.thread.is_alive():
            failed = self.pump(wait)
            self._watch_decommissioning()
            if self.printer.lost and not self.cancelled:
                self.cancelled = True
                self.stop_nodes()
                self.job.cancel()
                forget_hosts(self.session, list(self.printer.silent_hosts))
            if self.printer.silent_hosts:
                # A cut-off executor cannot end its task: Spark would hold the cancelled job
                # until it times the executor out (minutes). The attempt is over now; the job
                # thread ends by itself, and the survivors' tasks as soon as their ranks stop.
                raise ClusterError(
                    f"{', '.join(self.printer.lost)}. Its executor was removed, and the other "
                    "nodes' ranks were stopped."
                )
            if self.job.thread.is_alive():
                return Polled(failed=failed)
        if self.job.error is not None:
            seen = self.printer.first_failure
            first = (
                f" (rank {seen['rank']} had exited with code {seen['code']} first)" if seen else ""
            )
            if self.printer.lost:
                raise ClusterError(
                    f"{', '.join(self.printer.lost)} (its executor went away; Spark: "
                    f"{summarise_job_error(self.job.error)}). Its ranks were stopped."
                ) from self.job.error
            raise ClusterError(
                f"the Spark barrier job failed: {summarise_job_error(self.job.error)}{first}. "
                "Its ranks were stopped; the executors' logs have the details."
            ) from self.job.error
        assert self.job.rows is not None
        reports: list[NodeReport] = [cloudpickle.loads(row.report) for row in self.job.rows]
        self.drain(sum(1 for report in reports if not report.setup_errors))
        return Polled(reports=reports)

    #: A lost executor fails the barrier stage: Spark ends every task, so no survivor is left.
    shrinks_in_place: ClassVar[bool] = False

    def _watch_decommissioning(self) -> None:
        """In place: the ranks of a node whose executor is being decommissioned leave now."""
        now = time.monotonic()
        if self.generations is None or is_connect(self.session) or now < self._next_look:
            return
        self._next_look = now + DECOMMISSION_LOOK_SECONDS
        watched = {e: n for n, e in self.printer.executors.items() if n not in self.printer.noticed}
        for executor in decommissioned(self.session, watched):
            node = watched[executor]
            ranks = self.preempt(node)
            say(
                f"sparktrain: elastic: executor {executor} (node {node}) is being "
                f"decommissioned: its rank(s) {list(ranks)} leave at the end of their step",
                self.monitor,
            )

    def cancel(self, *, force: bool) -> None:
        """Tell every node to stop its ranks; or cancel the Spark job."""
        if force:
            self.job.cancel()
        else:
            self.stop_nodes()

    def close(self) -> None:
        """Cancel the job if it still runs (Ctrl-C), wait a moment for it, close the channel.

        Not for a job with a cut-off executor: it ends when Spark times the executor out.
        """
        if self.job.thread.is_alive():
            self.stop_nodes()
            self.job.cancel()
            self.job.thread.join(2 if self.printer.silent_hosts else 30)
        super().close()
