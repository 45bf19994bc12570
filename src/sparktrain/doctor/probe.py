"""A real barrier stage on the cluster: do its tasks start together, and can they run ranks?

Each task reports its Python (version, executable) and whether sparktrain and torch are there.

Design choices:
- The same call as a launch, ``session.range(0, n, 1, n).mapInArrow(fn, ..., barrier=True)``,
  so the probe needs what a launch needs (pandas and pyarrow on the executors) and works on
  classic and Spark Connect sessions alike.
- The task function is a closure, so cloudpickle sends it by value: an executor without
  sparktrain still runs it and reports what is missing, instead of failing to unpickle it. It
  looks torch up without importing it (seconds per executor).
- It runs only when the slot check says the stage fits (a barrier stage with too few slots
  waits), and it is interrupted after ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from sparktrain.doctor.verdicts import Check

SCHEMA = "host string, python string, executable string, sparktrain string, torch string"
PYTHON_FIX = (
    "point the executors at a Python with sparktrain and torch: PYSPARK_PYTHON (or "
    "spark.executorEnv.PYSPARK_PYTHON / spark.pyspark.python), and pip install sparktrain on "
    "every node"
)


def _task_function() -> Any:
    def task(batches: Iterator[Any]) -> Iterator[Any]:
        import importlib.util
        import socket
        import sys
        from importlib import metadata

        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        row = {
            "host": socket.gethostname(),
            "python": ".".join(map(str, sys.version_info[:3])),
            "executable": sys.executable,
        }
        try:
            import sparktrain

            row["sparktrain"] = sparktrain.__version__
        except Exception as exc:  # any failure to import is the finding
            row["sparktrain"] = f"error: {type(exc).__name__}: {exc}"
        if importlib.util.find_spec("torch") is None:
            row["torch"] = "error: not installed"
        else:
            row["torch"] = metadata.version("torch")
        BarrierTaskContext.get().barrier()  # every task is running at the same time
        yield pa.RecordBatch.from_pylist([row])

    return task


def probe_verdict(rows: Sequence[dict[str, str]], *, driver_python: str | None = None) -> Check:
    """The verdict on the rows the probe's tasks returned (one per task)."""
    driver = driver_python or ".".join(map(str, sys.version_info[:3]))
    facts: dict[str, object] = {"tasks": len(rows), "rows": [dict(r) for r in rows]}
    broken = [
        r for r in rows if r["sparktrain"].startswith("error") or r["torch"].startswith("error")
    ]
    if broken:
        first = broken[0]
        missing = first["sparktrain"] if first["sparktrain"].startswith("error") else first["torch"]
        return Check(
            name="spark.probe",
            verdict="error",
            found=f"{len(broken)} of {len(rows)} task(s) cannot run a rank: on {first['host']}, "
            f"{first['executable']} gives sparktrain/torch {missing}",
            fix=PYTHON_FIX,
            facts=facts,
        )
    other = [r for r in rows if r["python"].split(".")[:2] != driver.split(".")[:2]]
    if other:
        return Check(
            name="spark.probe",
            verdict="error",
            found=f"executors run Python {other[0]['python']} ({other[0]['executable']}), the "
            f"driver {driver}: functions cannot be sent between Python versions",
            fix="use the same Python version on the driver and the executors; " + PYTHON_FIX,
            facts=facts,
        )
    hosts = sorted({r["host"] for r in rows})
    kinds = sorted({f"{r['executable']} (Python {r['python']})" for r in rows})
    return Check(
        name="spark.probe",
        verdict="ok",
        found=f"a barrier stage of {len(rows)} task(s) ran together on {', '.join(hosts)}: "
        f"{'; '.join(kinds)}, sparktrain {rows[0]['sparktrain']}, torch {rows[0]['torch']}",
        facts=facts,
    )


def probe_check(session: Any, tasks: int, *, timeout: float = 120.0) -> Check:
    """Run a barrier stage of ``tasks`` tasks on ``session`` and judge what they report."""
    from sparktrain.driver.spark import summarise_job_error

    tag = f"sparktrain-doctor-{uuid.uuid4().hex[:8]}"
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            with contextlib.suppress(Exception):
                session.addTag(tag)
            frame = session.range(0, tasks, 1, tasks)
            box["rows"] = frame.mapInArrow(_task_function(), SCHEMA, barrier=True).collect()
        except Exception as exc:  # the finding, summarised below
            box["error"] = exc
        finally:
            with contextlib.suppress(Exception):
                session.removeTag(tag)

    thread = threading.Thread(target=run, name="sparktrain-doctor-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        with contextlib.suppress(Exception):
            session.interruptTag(tag)
        return Check(
            name="spark.probe",
            verdict="error",
            found=f"a barrier stage of {tasks} task(s) did not finish in {timeout:g}s",
            fix="check that the cluster has that many free task slots (other jobs may hold "
            "them) and the executors' logs",
            facts={"tasks": tasks},
        )
    if "error" in box:
        return Check(
            name="spark.probe",
            verdict="error",
            found=f"a barrier stage of {tasks} task(s) failed: {summarise_job_error(box['error'])}",
            fix="pandas and pyarrow must be installed on the executors; " + PYTHON_FIX,
            facts={"tasks": tasks},
        )
    return probe_verdict([row.asDict() for row in box["rows"]])
