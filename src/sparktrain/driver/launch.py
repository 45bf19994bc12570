"""``launch``: the one core call that every front door uses.

``launch`` validates everything first (the entrypoint pickles, the plan fits this machine or the
cluster), and only then starts processes. It returns a :class:`RunResult` with rank 0's value (or
every rank's) or raises one :class:`TrainingFailedError` naming the rank that failed first. With
``max_restarts=K``, a failed group is stopped whole and started again, up to K times; inside the
ranks ``sparktrain.restart_count()`` tells which attempt runs, so that training resumes from its
last checkpoint.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

from sparktrain.driver.local import run_local
from sparktrain.driver.monitor import Monitor, OnReport
from sparktrain.driver.results import RunResult
from sparktrain.errors import ConfigError, SparkJobError, TrainingFailedError, TrainingTimeoutError
from sparktrain.plan.entrypoint import Entrypoint, make_entrypoint
from sparktrain.plan.layout import DEFAULT_EXIT_GRACE, LaunchPlan, make_cluster_plan, make_plan
from sparktrain.plan.topology import Topology, detect_local

Attempt = Callable[[int, dict[str, str] | None], RunResult]


def launch(
    main: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    num_processes: int = 1,
    use_gpu: bool | None = None,
    timeout: float | None = None,
    log_ranks: Collection[int] | None = None,
    return_all: bool = False,
    max_restarts: int = 0,
    hang_timeout: float | None = None,
    exit_grace: float = DEFAULT_EXIT_GRACE,
    topology: Topology | None = None,
    backend: Literal["local", "spark", "ray"] = "local",
    dataframe: Any = None,
    ray_address: str | None = None,
    mlflow: bool | None = None,
    mlflow_strict: bool = False,
    progress: bool | None = None,
    on_report: OnReport | Monitor | None = None,
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
        timeout: Seconds after which the ranks are stopped and
            :class:`~sparktrain.TrainingTimeoutError` is raised.
        log_ranks: Ranks whose output is shown (``None``: all). Lines are prefixed ``[rank N]``.
        return_all: Bring back every rank's return value, not only rank 0's.
        max_restarts: After a failure, stop every rank and start the whole group again, up to
            this many times (timeouts are not restarted).
        hang_timeout: Seconds without progress (output or ``sparktrain.report()``) from any
            rank after which the run is declared hung: each rank's stack is taken and
            :class:`~sparktrain.HangError` says where each one waited.
        exit_grace: Seconds a rank that has returned (or raised) gets to exit. A rank still
            running after that (a non-daemon thread or an ``atexit`` handler that never ends)
            is killed with one warning line, and what it returned stands.
        topology: The machine's resources; detected when ``None`` (tests pass their own).
        backend: ``"local"`` (this machine), ``"spark"`` (barrier tasks of the active
            SparkSession, classic or Connect; one rank per task, or one per GPU of a task) or
            ``"ray"`` (one actor per node of a Ray cluster, in a placement group).
        dataframe: A Spark DataFrame whose rows are shared among the ranks (see
            :mod:`sparktrain.data`).
        ray_address: With ``backend="ray"`` and no Ray initialised yet in this process: the
            cluster to join (``ray.init(address=...)``); ``None`` for ``RAY_ADDRESS`` or a local
            Ray started for this process, kept for later launches. An initialised Ray is used
            as it is.
        mlflow: Track the run in MLflow (``None``: when the caller has an active MLflow run).
            One run per launch, created here; ranks log to it with
            ``sparktrain.log_metrics`` etc. (rank 0 only).
        mlflow_strict: Raise instead of warning when the tracking server cannot be used.
        progress: Draw a progress bar on the caller from rank 0's ``sparktrain.report()``
            calls: ``True``, ``False``, or ``None`` for when the output is a terminal or a
            notebook.
        on_report: Called in the caller's thread with ``(rank, record)`` for every report
            (``record``: ``step``, ``total``, ``metrics``, ``time``). Returning ``True`` stops
            every rank; the result then has ``stopped=True``. An exception it raises stops
            the run and is raised by ``launch``.

    Returns:
        A :class:`RunResult`; ``.value`` is rank 0's return value.

    Raises:
        ConfigError: Bad input; nothing was started.
        TrainingFailedError: A rank failed (after the allowed restarts); names it, its
            traceback and the stopped ranks.
    """
    entry = make_entrypoint(main, args, kwargs)
    if isinstance(on_report, Monitor):  # sparktrain.tune brings its own, to stop trials
        monitor = on_report
    else:
        monitor = Monitor(progress=progress, on_report=on_report)
    try:
        result = _launch(
            entry,
            backend=backend,
            num_processes=num_processes,
            use_gpu=use_gpu,
            monitor=monitor,
            topology=topology,
            dataframe=dataframe,
            ray_address=ray_address,
            options=dict(timeout=timeout, log_ranks=log_ranks, return_all=return_all,
                         max_restarts=max_restarts, hang_timeout=hang_timeout,
                         exit_grace=exit_grace),
            mlflow=mlflow,
            mlflow_strict=mlflow_strict,
        )  # fmt: skip
    finally:
        monitor.close()
    if monitor.error is not None:
        raise monitor.error
    return result


def _launch(
    entry: Entrypoint,
    *,
    backend: str,
    num_processes: int,
    use_gpu: bool | None,
    monitor: Monitor,
    topology: Topology | None,
    dataframe: Any,
    options: dict[str, Any],
    ray_address: str | None = None,
    mlflow: bool | None,
    mlflow_strict: bool,
) -> RunResult:
    if backend == "spark":
        from sparktrain.driver import spark

        session = spark.active_session()
        plan = make_cluster_plan(
            num_processes,
            facts=spark.cluster_facts(session, num_processes),
            use_gpu=use_gpu,
            **options,
        )
        return _tracked(
            plan,
            "spark",
            lambda n, extra: spark.run_spark(
                plan,
                entry,
                session,
                dataframe=dataframe,
                attempt=n,
                extra_env=extra,
                monitor=monitor,
            ),
            enabled=mlflow,
            strict=mlflow_strict,
        )
    if backend == "ray":
        from sparktrain.driver import ray

        if dataframe is not None:
            raise ConfigError("dataframe= is for backend='spark' or 'local', not 'ray'.")
        plan = ray.plan_run(num_processes, address=ray_address, use_gpu=use_gpu, **options)
        return _tracked(
            plan,
            "ray",
            lambda n, extra: ray.run_ray(plan, entry, attempt=n, extra_env=extra, monitor=monitor),
            enabled=mlflow,
            strict=mlflow_strict,
        )
    if backend != "local":
        raise ConfigError(f"backend={backend!r} is not one of: local, spark, ray")
    if topology is None:
        topology = detect_local(gpus=use_gpu is not False)
    plan = make_plan(
        num_processes,
        topology=topology,
        use_gpu=use_gpu,
        **options,
    )
    return _tracked(
        plan,
        "local",
        _local_attempt(plan, entry, dataframe, monitor),
        enabled=mlflow,
        strict=mlflow_strict,
    )


def _local_attempt(
    plan: LaunchPlan, entry: Entrypoint, dataframe: Any, monitor: Monitor
) -> Attempt:
    if dataframe is None:
        return lambda n, extra: run_local(plan, entry, attempt=n, extra_env=extra, monitor=monitor)
    from sparktrain.driver.local_data import local_shares

    def attempt(n: int, extra: dict[str, str] | None) -> RunResult:
        with local_shares(dataframe, plan.world_size) as paths:
            return run_local(
                plan, entry, data_paths=paths, attempt=n, extra_env=extra, monitor=monitor
            )

    return attempt


def _tracked(
    plan: LaunchPlan, backend: str, attempt: Attempt, *, enabled: bool | None, strict: bool
) -> RunResult:
    """The launch inside its MLflow run, when tracking is on."""
    from sparktrain.tracking import driver

    run = driver.begin(plan, backend, enabled=enabled, strict=strict)
    extra = run.rank_env() if run else None
    try:
        result = _with_restarts(plan, lambda n: attempt(n, extra))
    except BaseException as error:
        if run is not None:
            run.failed(error)
        raise
    if run is not None:
        run.succeeded(result.attempts)
    return result


def _with_restarts(plan: LaunchPlan, attempt: Callable[[int], RunResult]) -> RunResult:
    """Run attempts until one succeeds or ``plan.max_restarts`` restarts are used up."""
    number = 0
    while True:
        try:
            return dataclasses.replace(attempt(number), attempts=number + 1)
        except TrainingTimeoutError:
            raise
        except (TrainingFailedError, SparkJobError) as error:
            if number >= plan.max_restarts:
                if isinstance(error, TrainingFailedError):
                    error.attempts = number + 1
                raise
            number += 1
            first = str(error).splitlines()[0]
            print(
                f"sparktrain: {first}; restarting every rank "
                f"(attempt {number + 1} of {plan.max_restarts + 1})",
                file=sys.stderr,
                flush=True,
            )
