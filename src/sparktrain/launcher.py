"""``launch``: the one core call that every front door uses.

``launch`` validates everything first (the entrypoint pickles, the plan fits this machine), and
only then starts processes. It returns a :class:`RunResult` with rank 0's value (or every rank's)
or raises one :class:`TrainingFailedError` naming the rank that failed first.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from sparktrain.backends.local import run_local
from sparktrain.entrypoint import make_entrypoint
from sparktrain.errors import ConfigError
from sparktrain.layout import make_cluster_plan, make_plan
from sparktrain.results import RunResult
from sparktrain.topology import Topology, detect_local


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
    topology: Topology | None = None,
    backend: Literal["local", "spark"] = "local",
    dataframe: Any = None,
) -> RunResult:
    """Run ``main`` on ``num_processes`` ranks on this machine and wait for them.

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
        topology: The machine's resources; detected when ``None`` (tests pass their own).
        backend: ``"local"`` (this machine) or ``"spark"`` (barrier tasks of the active
            SparkSession, classic or Connect; one rank per task, or one per GPU of a task).
        dataframe: A Spark DataFrame whose rows are shared among the ranks (see
            :mod:`sparktrain.data`).

    Returns:
        A :class:`RunResult`; ``.value`` is rank 0's return value.

    Raises:
        ConfigError: Bad input; nothing was started.
        TrainingFailedError: A rank failed; names it, its traceback and the stopped ranks.
    """
    entry = make_entrypoint(main, args, kwargs)
    if backend == "spark":
        from sparktrain.backends import spark

        session = spark.active_session()
        plan = make_cluster_plan(
            num_processes,
            facts=spark.cluster_facts(session, num_processes),
            use_gpu=use_gpu,
            timeout=timeout,
            log_ranks=log_ranks,
            return_all=return_all,
        )
        return spark.run_spark(plan, entry, session, dataframe=dataframe)
    if backend != "local":
        raise ConfigError(f"backend={backend!r} is not one of: local, spark")
    if topology is None:
        topology = detect_local(gpus=use_gpu is not False)
    plan = make_plan(
        num_processes,
        topology=topology,
        use_gpu=use_gpu,
        timeout=timeout,
        log_ranks=log_ranks,
        return_all=return_all,
    )
    if dataframe is not None:
        from sparktrain.backends.local_data import local_shares

        with local_shares(dataframe, plan.world_size) as paths:
            return run_local(plan, entry, data_paths=paths)
    return run_local(plan, entry)
