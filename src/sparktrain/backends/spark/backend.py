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

import time
from typing import Any, ClassVar

import cloudpickle

from sparktrain.backends.base import Attempt, Backend, Nodes, Polled, Wanted
from sparktrain.backends.remote import RemoteNodes
from sparktrain.backends.spark.conf import check_encryption
from sparktrain.backends.spark.executors import decommissioned, forget_hosts
from sparktrain.backends.spark.job import Job, summarise_job_error
from sparktrain.backends.spark.session import (
    active_session,
    channel_host,
    cluster_facts,
    is_connect,
)
from sparktrain.backends.spark.slots import ensure_slots, slot_count
from sparktrain.contract.report import NodeReport
from sparktrain.driver.monitor import say
from sparktrain.ground.errors import ClusterError, ConfigError
from sparktrain.launchplan.front import LAUNCH, FrontDoor
from sparktrain.launchplan.layout import LaunchPlan, make_cluster_plan

#: In place: how often the driver asks Spark which of the run's executors it decommissions.
DECOMMISSION_LOOK_SECONDS = 1.0


class SparkBackend(Backend):
    """One barrier task per node on the active SparkSession's executors."""

    name: ClassVar[str] = "spark"
    in_place: ClassVar[bool] = True  # notices (decommissioning); a sudden loss restarts
    barrier_context: ClassVar[bool] = True

    def __init__(self, session: Any = None, *, front: FrontDoor = LAUNCH) -> None:
        """Use ``session``, or the active SparkSession (a :class:`ConfigError` without one).

        ``front``: the front door launching (its TLS-override conf, how ranks own GPUs).
        """
        self.session = session if session is not None else active_session()
        self.front = front

    @classmethod
    def open(cls, wanted: Wanted) -> Backend:
        """The active SparkSession's backend, for ``wanted.front``."""
        return cls(front=wanted.front)

    def every_slot(self, use_gpu: object) -> int:
        """Every task slot of the cluster, times the GPUs of a task on GPU.

        Raises:
            ConfigError: A Spark Connect session, which cannot report its slots.
        """
        facts = cluster_facts(self.session, 1)
        if facts.slots is None:
            raise ConfigError(
                "np=0 uses every task slot of the cluster, but a Spark Connect session cannot "
                "report them; pass the number of processes, e.g. np=4."
            )
        gpu = use_gpu is True or (use_gpu is None and facts.task_gpus > 0)
        return facts.slots * (max(1, facts.task_gpus) if gpu else 1)

    def store_host(self) -> str:
        """The address at which executors reach this process."""
        return channel_host(self.session)

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
        :data:`~sparktrain.backends.spark.slots.GROW_WAIT_SECONDS`, with one line saying so; see
        :mod:`sparktrain.backends.spark.slots`. Spark Connect cannot be asked: nothing is checked.
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
        super().__init__(attempt, channel_host(session))
        self.session = session
        self.monitor = attempt.monitor
        self._next_look = 0.0
        try:
            plan = attempt.plan
            frame = session.range(0, plan.nodes, 1, plan.nodes)
            self.job = Job(session, frame, self.spec)
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
