"""``launch``: the one core call that every front door uses, and the launch it prepares.

A launch is prepared once (:func:`prepare`): the backend is chosen, the ranks are laid out on
what it offers (on Spark, the free task slots are counted then), the options are checked; and
only then is anything started. Front doors that take their arguments in a constructor
(``TorchDistributor``) keep the :class:`PreparedLaunch` and run it, so the plan checked is the
plan run. Each run is a sequence of attempts (:mod:`sparktrain.driver.attempts`): with
``max_restarts=K``, a failed group (a rank's failure or a lost node) is stopped whole and
started again, up to K times; with ``min_processes``, a lost node shrinks the run instead, and
returning capacity grows it back. Inside the ranks ``sparktrain.restart_count()`` tells which
attempt runs, so that training resumes from its last checkpoint. Each attempt's nodes are
followed by :func:`~sparktrain.driver.follow.follow`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import Unpack

from sparktrain.backends.base import Attempt, Backend, Wanted
from sparktrain.backends.registry import BackendName, make_backend
from sparktrain.contract.env import IN_PLACE_STORE
from sparktrain.contract.inplace import host_store
from sparktrain.driver.attempts import run_attempts
from sparktrain.driver.capacity import first_layout, watch_capacity
from sparktrain.driver.follow import Deadline, follow
from sparktrain.driver.inplace import running
from sparktrain.driver.monitor import Monitor
from sparktrain.driver.results import GrowingBack, RunResult, finish
from sparktrain.ground.errors import ConfigError, TrainingTimeoutError
from sparktrain.launchplan.entrypoint import Entrypoint, make_entrypoint
from sparktrain.launchplan.front import LAUNCH, FrontDoor
from sparktrain.launchplan.layout import LaunchPlan
from sparktrain.launchplan.option_docs import documents_options
from sparktrain.launchplan.options import RunOptions, RunOptionsArgs, run_options
from sparktrain.launchplan.topology import Topology


@dataclass(frozen=True)
class PreparedLaunch:
    """A launch checked and laid out, ready to run (as many times as wanted).

    Attributes:
        backend: Where the nodes run.
        plan: The layout of the first attempt (of every attempt, unless the run is elastic).
        options: The run's policy.
        target: The run's full size: ``plan``'s, or more when an elastic run starts short of it
            (:func:`~sparktrain.driver.capacity.first_layout`) and grows toward it.
        room_at_run: Whether every run checks first that ``plan`` fits the backend now
            (``prepare(room_at_run=True)``: the plan was laid out without asking).
        name: What the front door calls the number of ranks, for that check's message.
    """

    backend: Backend
    plan: LaunchPlan
    options: RunOptions
    target: int = 0
    room_at_run: bool = False
    name: str = "num_processes"

    def __post_init__(self) -> None:
        if not self.target:
            object.__setattr__(self, "target", self.plan.world_size)

    def run(
        self,
        main: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        dataframe: Any = None,
        monitor: Monitor | None = None,
    ) -> RunResult:
        """Run ``main`` on every rank of the plan and wait for them (see :func:`launch`).

        Args:
            main: A function or the path of a script.
            args: Positional arguments (a script's command line).
            kwargs: Keyword arguments for a function.
            dataframe: A Spark DataFrame whose rows are shared among the ranks.
            monitor: The monitor to report to (``sparktrain.tune`` brings its own, to stop
                trials); by default one is made from the options' ``progress`` and
                ``on_report``.
        """
        return self.run_entry(make_entrypoint(main, args, kwargs), dataframe, monitor)

    def run_entry(
        self, entry: Entrypoint, dataframe: Any = None, monitor: Monitor | None = None
    ) -> RunResult:
        """:meth:`run` for an entrypoint already made (and checked)."""
        if self.room_at_run:
            self.backend.check_room(self.plan, name=self.name)
        data_uri = None
        if dataframe is not None:  # Spark writes it once; every attempt's ranks read the cache
            from sparktrain.data.cache import materialise

            data_uri = materialise(dataframe, self.options.environment.data_cache_dir)
        monitor = monitor or Monitor(
            progress=self.options.output.progress, on_report=self.options.output.on_report
        )
        run_key = uuid.uuid4().hex  # what the backend keeps across this run's attempts
        deadline = Deadline.after(self.options.limits.timeout)  # the whole call's
        try:
            result = self._tracked(entry, data_uri, monitor, run_key, deadline)
        finally:
            try:
                self.backend.end_run(run_key)
            finally:
                monitor.close()
        if monitor.error is not None:
            raise monitor.error
        return result

    def _tracked(
        self,
        entry: Entrypoint,
        data_uri: str | None,
        monitor: Monitor,
        run_key: str,
        deadline: Deadline | None = None,
    ) -> RunResult:
        """The attempts inside the run's MLflow run, when tracking is on."""
        from sparktrain.driver import tracking as driver

        options = self.options
        run = driver.begin(
            self.plan,
            options,
            self.backend.name,
            enabled=options.tracking.mlflow,
            strict=options.tracking.mlflow_strict,
        )
        extra = run.rank_env() if run else None
        try:
            result = run_attempts(
                self.backend,
                self.plan,
                options,
                lambda plan, number: self._attempt(
                    entry,
                    plan,
                    number,
                    extra_env=extra,
                    data_uri=data_uri,
                    monitor=monitor,
                    run_key=run_key,
                    deadline=deadline,
                ),
                monitor,
                on_start=run.attempt_started if run else None,
                target=self.target,
            )
        except BaseException as error:
            if run is not None:
                run.failed(error)
            raise
        if run is not None:
            run.succeeded(result.attempts, result.rescales)
        return result

    def _attempt(
        self,
        entry: Entrypoint,
        plan: LaunchPlan,
        number: int,
        *,
        extra_env: dict[str, str] | None,
        data_uri: str | None,
        monitor: Monitor,
        run_key: str = "",
        deadline: Deadline | None = None,
    ) -> RunResult | GrowingBack:
        started = time.monotonic()
        options = _within(self.options, deadline)
        target = self.target if options.elastic else None
        store = None
        if (
            options.recovery.in_place
        ):  # the ranks' generations live in a store that outlives every rank
            store, address = host_store(plan.world_size, self.backend.store_host())
            extra_env = {**(extra_env or {}), IN_PLACE_STORE: address}
        attempt = Attempt(
            plan=plan, options=options, entry=entry, number=number, monitor=monitor,
            extra_env=extra_env, data_uri=data_uri, target_world_size=target, store=store,
            run=run_key,
        )  # fmt: skip
        nodes = self.backend.start(attempt)
        with running(nodes):  # sparktrain.preempt reaches it
            reports = follow(
                nodes,
                stop_grace=options.limits.stop_grace,
                monitor=monitor,
                tick=watch_capacity(self.backend, plan, self.target, options, monitor),
                in_place=options.recovery.in_place,
                deadline=deadline,
            )
        result = finish(
            reports,
            world_size=plan.world_size,
            timeout=self.options.limits.timeout,
            duration=time.monotonic() - started,
            hang_timeout=options.limits.hang_timeout,
            stopped=monitor.stop_requested(),
            timed_out=deadline is not None and deadline.passed,
        )
        kept = nodes.in_place_rescales()
        if kept and isinstance(result, RunResult):
            result = dataclasses.replace(result, rescales=kept, world_size=kept[-1].new_world_size)
        return result


def _within(options: RunOptions, deadline: Deadline | None) -> RunOptions:
    """An attempt's options: its nodes' own ``timeout`` is what is left of the call's.

    Raises:
        TrainingTimeoutError: Nothing is left (the call's ``timeout`` passed between attempts).
    """
    if deadline is None:
        return options
    left = deadline.left()
    if not left:
        raise TrainingTimeoutError(deadline.timeout, (), ())
    limits = dataclasses.replace(options.limits, timeout=left)
    return dataclasses.replace(options, limits=limits)


def prepare(
    num_processes: object,
    *,
    use_gpu: object = None,
    backend: BackendName | Backend = "local",
    ray_address: str | None = None,
    topology: Topology | None = None,
    options: RunOptions | None = None,
    name: str = "num_processes",
    front: FrontDoor = LAUNCH,
    room_at_run: bool = False,
) -> PreparedLaunch:
    """Choose the backend, lay out the ranks on it, check the options; start nothing.

    An elastic run (``min_processes``) whose full size does not fit now is laid out on the
    largest size that does, and grows toward the full size once running
    (:func:`~sparktrain.driver.capacity.first_layout`).

    Args:
        num_processes: Number of ranks.
        use_gpu: ``True``, ``False``, or ``None`` for GPUs where there are some.
        backend: A name of :mod:`sparktrain.backends.registry` (``"local"``, ``"spark"``,
            ``"ray"``), or a :class:`Backend`.
        ray_address: With ``backend="ray"``: the cluster to join when this process has no Ray
            initialised.
        topology: This machine's resources, for the local backend (detected when ``None``).
        options: The run's policy (defaults when ``None``).
        name: What the caller's front door calls ``num_processes``, for messages.
        front: The front door (the originals' differences: see :mod:`sparktrain.launchplan.front`).
        room_at_run: Lay out without asking what is free now, and check that the ranks fit at
            each run instead (:meth:`Backend.check_room`: on Spark, the task slots, waited for
            where the cluster can grow). For front doors whose constructor must not depend on
            the cluster's size now, as pyspark's ``TorchDistributor``'s does not. An elastic run
            is laid out on what fits now all the same.

    Raises:
        ConfigError: Bad input; the message names the value and the fix.
    """
    chosen = make_backend(backend, Wanted(topology=topology, address=ray_address, front=front))
    try:
        options = options or RunOptions()
        return _lay_out(chosen, num_processes, use_gpu, options, room_at_run=room_at_run, name=name)
    except BaseException:
        if chosen is not backend:  # made here: what it started is ours to stop
            chosen.close()
        raise


def _lay_out(
    chosen: Backend,
    num_processes: object,
    use_gpu: object,
    options: RunOptions,
    *,
    room_at_run: bool,
    name: str,
) -> PreparedLaunch:
    if options.recovery.in_place and not chosen.in_place:
        raise ConfigError(
            f"in_place=True: the {chosen.name!r} backend cannot keep an elastic run's survivors "
            "in place (local processes, a LocalCluster, Spark and Ray can); leave in_place out "
            "to restart the survivors from the latest checkpoint, as elastic runs do."
        )
    if room_at_run and options.recovery.min_processes is None:
        plan = chosen.layout_ahead(num_processes, use_gpu=use_gpu, name=name)
        options.check_ranks(plan.world_size, name)
        return PreparedLaunch(chosen, plan, options, room_at_run=True, name=name)
    plan, target = first_layout(chosen, num_processes, use_gpu=use_gpu, options=options, name=name)
    return PreparedLaunch(chosen, plan, options, target, name=name)


@documents_options
def launch(
    main: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    num_processes: int = 1,
    use_gpu: bool | None = None,
    backend: BackendName | Backend = "local",
    ray_address: str | None = None,
    dataframe: Any = None,
    topology: Topology | None = None,
    options: RunOptions | None = None,
    **option_args: Unpack[RunOptionsArgs],
) -> RunResult:
    """Run ``main`` on ``num_processes`` ranks and wait for them.

    Args:
        main: A function (every rank calls ``main(*args, **kwargs)``) or the path of a Python
            script (run as ``__main__`` with ``args`` as its command line, like torchrun).
        args: Positional arguments (for a script: its command-line arguments, stringified).
        kwargs: Keyword arguments for a function; an error with a script.
        num_processes: Number of ranks.
        use_gpu: ``True`` for one GPU per rank (NCCL), ``False`` for CPU (gloo), ``None`` for
            GPUs when CUDA is available.
        backend: ``"local"`` (this machine), ``"spark"`` (barrier tasks of the active
            SparkSession, classic or Connect; one rank per task, or one per GPU of a task),
            ``"ray"`` (one actor per node of a Ray cluster, in a placement group), or a
            :class:`~sparktrain.backends.base.Backend`.
        ray_address: With ``backend="ray"`` and no Ray initialised yet in this process: the
            cluster to join (``ray.init(address=...)``); ``None`` for ``RAY_ADDRESS`` or a local
            Ray started for this process, kept for later launches. An initialised Ray is used
            as it is.
        dataframe: A Spark DataFrame whose rows are shared among the ranks (see
            :mod:`sparktrain.data`).
        topology: The machine's resources; detected when ``None`` (tests pass their own).
        options: A :class:`~sparktrain.launchplan.options.RunOptions` to start from.
        **option_args: Run options by name (:class:`~sparktrain.RunOptions`):

            {run_options}

    Returns:
        A :class:`RunResult`; ``.value`` is rank 0's return value.

    Raises:
        ConfigError: Bad input; nothing was started.
        TrainingFailedError: A rank failed (after the allowed restarts); names it, its
            traceback and the stopped ranks.
        ClusterError: A node, executor, actor or fork server was lost (after the allowed
            restarts).
    """
    entry = make_entrypoint(main, args, kwargs)  # checked first: it names what will not pickle
    prepared = prepare(
        num_processes,
        use_gpu=use_gpu,
        backend=backend,
        ray_address=ray_address,
        topology=topology,
        options=run_options(options, **option_args),
    )
    try:
        return prepared.run_entry(entry, dataframe)
    finally:
        if prepared.backend is not backend:  # made for this launch (a caller's is theirs)
            prepared.backend.close()
