"""``run_checks``: every check in order, with or without a Spark session.

Design choices:
- No Spark session is started unless asked (``spark_master``); an active one is examined only
  when pyspark is already imported, since a process that never imported pyspark has none, and
  importing it to find out would cost a second.
- A session doctor started is stopped before returning; a session it was given is left alone.
- A session that cannot be created (no Java, a wrong master URL) is an error check with the one
  line that matters, not an exception: the report still shows everything else.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from sparktrain.doctor import checks, extras, ops, spark_checks, system
from sparktrain.doctor.verdicts import Check, DoctorReport
from sparktrain.ground.errors import ConfigError


def run_checks(
    spark: Any = None,
    *,
    processes: int | None = None,
    use_gpu: bool | None = None,
    spark_master: str | None = None,
    spark_conf: Mapping[str, str] | None = None,
    use_active_session: bool = True,
    probe: bool = False,
    checkpoint_dir: str | os.PathLike[str] | None = None,
) -> DoctorReport:
    """Check this machine, and a Spark session when there is one, for what a launch needs.

    Args:
        spark: A SparkSession (classic or Connect) to examine.
        processes: The ranks of the launch you intend (``num_processes``); with it, doctor says
            whether that launch would be accepted, locally or as a Spark barrier stage.
        use_gpu: The launch's ``use_gpu``: ``True`` (one GPU per rank), ``False`` (CPU), or
            ``None`` (GPUs when there are any, as the launcher decides).
        spark_master: Start a session on this master (``spark://...``, ``yarn``,
            ``local-cluster[2,1,1024]``, or ``sc://host:port`` for Spark Connect), examine it
            and stop it. Ignored when ``spark`` is given.
        spark_conf: Settings for the session started for ``spark_master``.
        use_active_session: Examine the active SparkSession when neither ``spark`` nor
            ``spark_master`` is given.
        probe: With a session, also run a real barrier stage of the launch's tasks (1 task
            without ``processes``) when the slots allow it, to see that the tasks start together
            and that the executors' Python has sparktrain and torch.
        checkpoint_dir: The run's checkpoint directory (a path, or an ``s3://``, ``gs://``,
            ``abfs://`` URL): check that this machine can write it, and with ``probe`` that
            every task of the probe's stage can.

    Returns:
        The report; ``report.exit_code`` is 1 when an error blocks a launch.

    Raises:
        ConfigError: ``processes`` is not a positive int, or ``use_gpu`` not a bool or None.
    """
    if processes is not None and (
        isinstance(processes, bool) or not isinstance(processes, int) or processes < 1
    ):
        raise ConfigError(f"processes={processes!r} must be a positive int, e.g. 2.")
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise ConfigError(f"use_gpu={use_gpu!r} must be True, False or None.")
    found = [
        checks.python_check(),
        checks.torch_check(),
        checks.cuda_check(),
        checks.gpus_check(use_gpu=use_gpu),
    ]
    gpus = int(found[-1].facts.get("count", 0))
    found += [
        checks.backends_check(gpus=gpus if use_gpu is not False else 0),
        system.shm_check(system.shm_size()),
        system.ports_check(),
        ops.ops_check(),
        *extras.extras_checks(),
        extras.java_check(
            needed=spark is None and bool(spark_master) and not _is_remote(spark_master)
        ),
    ]
    where = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
    if where is not None:
        from sparktrain.doctor.storage import here_check

        found.append(here_check(where))
    session, started = spark, False
    if session is None and spark_master:
        session, failure = _start_session(spark_master, spark_conf or {})
        if failure is not None:
            return DoctorReport((*found, failure))
        started = True
    elif session is None and use_active_session:
        session = _active_session()
    if session is None:
        if processes is not None:
            found.append(checks.local_launch_check(processes, use_gpu=use_gpu))
        return DoctorReport(tuple(found))
    try:
        wait = started and _waits(session)
        found += _spark(session, processes, use_gpu=use_gpu, wait=wait, probe=probe, where=where)
    finally:
        if started:
            session.stop()
    return DoctorReport(tuple(found))


def _spark(
    session: Any,
    processes: int | None,
    *,
    use_gpu: bool | None,
    wait: bool,
    probe: bool,
    where: str | None,
) -> list[Check]:
    found = [
        spark_checks.session_check(session),
        spark_checks.executors_check(session),
        spark_checks.gpu_settings_check(session, use_gpu=use_gpu),
        *spark_checks.slots_and_launch_checks(session, processes, use_gpu=use_gpu, wait=wait),
    ]
    if probe:
        from sparktrain.doctor.probe import probe_check

        if any(c.verdict == "error" for c in found):
            found.append(
                Check(
                    name="spark.probe",
                    verdict="info",
                    found="not run: the checks above found an error a barrier stage would hit",
                )
            )
        else:
            tasks = int(found[-1].facts.get("tasks", 1)) if processes else 1
            found += probe_check(session, tasks, checkpoint_dir=where)
    return found


def _is_remote(master: str | None) -> bool:
    return bool(master and master.startswith("sc://"))


def _waits(session: Any) -> bool:
    """Whether executors may still be registering (not so in local mode, or over Connect)."""
    from sparktrain.backends.spark.session import is_connect

    if is_connect(session):
        return False
    master = str(session.sparkContext.master)
    return not (master == "local" or master.startswith("local["))


def _active_session() -> Any:
    if "pyspark.sql" not in sys.modules:
        return None
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


def _start_session(master: str, conf: Mapping[str, str]) -> tuple[Any, Check | None]:
    """A new session on ``master``, or ``(None, error check)`` saying why there is none."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return None, Check(
            name="spark.session",
            verdict="error",
            found=f"--spark-master {master} needs pyspark, which is not installed",
            fix="pip install 'sparktrain[spark]'",
        )
    builder = SparkSession.builder.appName("sparktrain-doctor")
    builder = builder.remote(master) if _is_remote(master) else builder.master(master)
    if not _is_remote(master):
        builder = builder.config("spark.ui.enabled", "false")
    for key, value in conf.items():
        builder = builder.config(key, value)
    try:
        session = builder.getOrCreate()
    except Exception as exc:  # Py4J, gRPC and Java start-up errors alike
        line = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        return None, Check(
            name="spark.session",
            verdict="error",
            found=f"could not start a Spark session on {master}: {line[:300]}",
            fix="check the master URL, that the cluster is up and reachable, and Java (above)",
            facts={"master": master},
        )
    return session, None
